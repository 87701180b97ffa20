"""Does transfer pay? finetune.py from its own run on Fashion-MNIST's classes 0-4, vs scratch.

A ResNet-18 learns classes 0-4 from random weights (one epoch over all their training images),
then classes 5-9 from a few labels each, starting from those weights or from random ones, with
the same flags and the same number of steps. One process on CPU, every run one after another
in this one invocation.

    python benchmarks/transfer.py                     # 64 pixels, 5 seeds: 11 runs in a row
    python benchmarks/transfer.py --image-size 32     # less to gain (see README.md, Transfer)

The seed picks the labelled images, the new head and the order of the batches. Prints a
markdown table (test accuracy on classes 5-9, training seconds) and keeps each run's
checkpoint and metrics under benchmarks/runs/transfer/ (git-ignored).
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def finetune(flags, out):
    """Run finetune.py; return its last metrics record with the training seconds (the sum of
    its epochs') and the whole command's wall seconds."""
    cmd = [sys.executable, "finetune.py", "--device", "cpu", *map(str, flags)]
    cmd += ["--output-dir", str(out)]
    print("$", " ".join(cmd[1:]), flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0:  # the last line says why (progress bars fill the rest of stderr)
        lines = proc.stderr.replace("\r", "\n").splitlines()
        last = [line for line in lines if line.strip()] or ["no output"]
        sys.exit(f"finetune.py failed (exit {proc.returncode}): {last[-1]}")
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_seconds = sum(r["epoch_seconds"] for r in records)
    return records[-1] | dict(train_seconds=train_seconds, wall_seconds=wall)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--image-size", type=int, default=64, help="finetune.py --image-size")
    p.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 for the few-label runs")
    p.add_argument("--per-class", type=int, default=50, help="labelled images per class of 5-9")
    p.add_argument("--epochs", type=int, default=2, help="epochs of the few-label runs")
    p.add_argument("--batch-size", type=int, default=25, help="batch of the few-label runs")
    p.add_argument("--lr", type=float, default=0.2, help="finetune.py --lr of the few-label runs")
    wd = "finetune.py --weight-decay of every run (README's figures: 1e-4)"
    p.add_argument("--weight-decay", type=float, default=1e-4, help=wd)
    p.add_argument("--data-dir", default="data", help="where Fashion-MNIST is (as for finetune.py)")
    p.add_argument("--download", action="store_true", help="download Fashion-MNIST if missing")
    args = p.parse_args()
    # Checked here, not by the few-label runs: those start only after the minutes of the base run.
    if min(args.seeds, args.per_class, args.epochs, args.batch_size) < 1 or not args.lr > 0:
        p.error("--seeds, --per-class, --epochs, --batch-size and --lr must be positive")
    if args.per_class > 6000 or args.batch_size > 5 * args.per_class:
        p.error("--per-class: at most 6000 (Fashion-MNIST); --batch-size: at most 5 x --per-class")

    work = ROOT / "benchmarks" / "runs" / "transfer"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    size = ["--image-size", args.image_size, "--data-dir", args.data_dir]
    size += ["--weight-decay", args.weight_decay]
    download = ["--download"] if args.download else []
    base_flags = [*size, *download, "--weights", "none", "--classes", "0-4", "--epochs", 1]
    base = finetune(base_flags, work / "base")
    few = [*size, "--classes", "5-9", "--train-per-class", args.per_class]
    few += ["--batch-size", args.batch_size, "--lr", args.lr, "--epochs", args.epochs]
    few += ["--trainable-layers", 5, "--backbone-lr-scale", 1]
    rows, start = [], work / "base" / "checkpoint.pt"
    for seed in range(args.seeds):
        tuned = finetune([*few, "--seed", seed, "--weights-file", start], work / f"tuned{seed}")
        scratch = finetune([*few, "--seed", seed, "--weights", "none"], work / f"scratch{seed}")
        rows.append((seed, tuned, scratch))

    print(
        f"\nbase: classes 0-4, {base['step']} steps, test accuracy {base['test_acc']:.3f}, "
        f"{base['train_seconds']:.0f} s training\n"
    )
    print("| seed | steps | fine-tuned | from scratch | difference | seconds (tuned, scratch) |")
    print("|---|---|---|---|---|---|")
    for seed, tuned, scratch in rows:
        gap = tuned["test_acc"] - scratch["test_acc"]
        print(
            f"| {seed} | {tuned['step']} | {tuned['test_acc']:.3f} | {scratch['test_acc']:.3f} "
            f"| {gap:+.3f} "
            f"| {tuned['train_seconds']:.1f}, {scratch['train_seconds']:.1f} |"
        )
    gaps = [t["test_acc"] - s["test_acc"] for _, t, s in rows]
    means = [statistics.mean(r[i]["test_acc"] for r in rows) for i in (1, 2)]
    gap = f"{statistics.mean(gaps):+.3f} (smallest {min(gaps):+.3f})"
    print(f"| mean | | {means[0]:.3f} | {means[1]:.3f} | {gap} | |")


if __name__ == "__main__":
    main()
