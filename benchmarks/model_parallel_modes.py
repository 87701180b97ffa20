"""model_parallel.py's three modes against the unsplit model on one device: samples/s and ratios.

    python benchmarks/model_parallel_modes.py                    # CPU: stages on cpu,cpu
    python benchmarks/model_parallel_modes.py --device cuda      # 2 GPUs: cuda:0,cuda:1
    python benchmarks/model_parallel_modes.py --rounds 5 \\
        --json benchmarks/runs/model_parallel_modes.json

Every row is a real run of model_parallel.py on synthetic data of Fashion-MNIST's shape
(global batch 128): one device holding the whole model; mode 1, naive, 2 stages; mode 2,
2 stages fed 4 or 8 micro-batches, in one process; mode 3, 2 processes under torchrun, one
stage each, GPipe with 8 micro-batches. The rounds take the rows in turn, so drift in the
machine's load falls on all of them alike. A row's samples/s is the median over its runs'
epochs after the first (the first holds start-up: PipelineStage's shape exchange, allocator
warm-up), training only; the ratio is against the one-device row. Threads: the shell's
OMP_NUM_THREADS is removed, so a single process uses every core (or --threads N) and each
torchrun worker one. On a busy machine use --threads 1: two OpenMP threads that share their
cores with other work wait on each other at every barrier, and the one-process rows then
measure that waiting, not the model.

With one GPU, --device cuda runs the stages on cuda:0,cuda:0 (both on the GPU: no copies,
one stream) and on cuda:0,cpu (a copy to the host every tick, the CPU stage computing while
the GPU works); mode 3 then needs a second GPU and is left out.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def configurations(device, gpus):
    """(label, processes, model_parallel.py flags) per row; the first row is the reference."""
    if device == "cpu":
        one, pairs = "cpu", ["cpu,cpu"]
    else:
        one, pairs = "cuda:0", ["cuda:0,cuda:1"] if gpus >= 2 else ["cuda:0,cuda:0", "cuda:0,cpu"]
    rows = [(f"one device ({one}), unsplit", 1, ["--devices", one, "--microbatches", "1"])]
    for pair in pairs:
        for m in (1, 4, 8):
            label = f"mode 2: 2 stages ({pair}), {m} micro-batches"
            label = label if m > 1 else f"mode 1: naive, 2 stages ({pair})"
            rows.append((label, 1, ["--devices", pair, "--microbatches", str(m)]))
    if device == "cpu" or gpus >= 2:
        flags = ["--pipeline-schedule", "gpipe", "--microbatches", "8"]
        rows.append(("mode 3: 2 processes (torchrun), GPipe, 8 micro-batches", 2, flags))
    return rows


def run(nproc, flags, args):
    """One model_parallel.py run; returns its per-epoch samples/s after the first epoch."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if nproc == 1 and args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, *(launcher if nproc > 1 else []), "model_parallel.py"]
        cmd += ["--data", "synthetic", "--device", args.device, "--batch-size", "128"]
        cmd += ["--epochs", str(args.epochs), *flags, "--output-dir", out]
        opts = dict(cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        proc = subprocess.run(cmd, **opts)
        if proc.returncode != 0:
            sys.exit(f"error: {' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        lines = Path(out, "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["samples_per_second"] for line in lines[1:]]


def loadavg():
    try:
        return Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        return None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the stages run")
    p.add_argument("--rounds", type=int, default=3, help="passes over all rows, interleaved")
    p.add_argument(
        "--epochs",
        type=int,
        default=4,
        help="epochs per run (15 steps each); the first is not timed",
    )
    p.add_argument(
        "--threads", type=int, default=0, help="threads of a single process; 0: every core"
    )
    p.add_argument(
        "--timeout", type=float, default=600, help="seconds before one run counts as hung"
    )
    p.add_argument("--json", default=None, help="also write the table's figures to this JSON file")
    args = p.parse_args()
    if args.rounds < 1 or args.epochs < 2 or args.threads < 0:
        p.error(
            "--rounds must be at least 1, --epochs at least 2 (the first is not timed), "
            "--threads not negative"
        )
    gpus = 0
    if args.device == "cuda":
        import torch  # only here: the CPU path needs no torch import in this process

        gpus = torch.cuda.device_count()
        if not gpus:
            p.error("--device cuda: no CUDA device here")

    rows = configurations(args.device, gpus)
    speeds = {label: [] for label, _, _ in rows}
    load_before, t0 = loadavg(), time.time()
    for r in range(args.rounds):
        for label, nproc, flags in rows:
            speeds[label] += run(nproc, flags, args)
            sps = statistics.median(speeds[label])
            print(f"round {r + 1}/{args.rounds}: {label}: {sps:.0f} samples/s", file=sys.stderr)
    load_after = loadavg()

    base = statistics.median(speeds[rows[0][0]])
    results = []
    print("| configuration | processes | samples/s | vs one device |")
    print("|---|---|---|---|")
    for label, nproc, flags in rows:
        sps = statistics.median(speeds[label])
        results.append(
            dict(
                configuration=label,
                processes=nproc,
                flags=flags,
                samples_per_second=sps,
                ratio=sps / base,
                epochs=speeds[label],  # samples/s of every timed epoch, in run order
            )
        )
        print(f"| {label} | {nproc} | {sps:.0f} | {sps / base:.2f}x |")
    threads = args.threads or "every core"
    print(
        f"\nglobal batch 128, {args.rounds} rounds x {args.epochs - 1} timed epochs per row; "
        f"threads of one process: {threads}, of a torchrun worker: 1; "
        f"load average before {load_before}, after {load_after}; {time.time() - t0:.0f} s"
    )
    if args.json:
        report = dict(
            device=args.device,
            gpus=gpus,
            threads=args.threads,
            rounds=args.rounds,
            epochs=args.epochs,
            batch_size=128,
            loadavg_before=load_before,
            loadavg_after=load_after,
            cpu_count=os.cpu_count(),
            rows=results,
        )
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
