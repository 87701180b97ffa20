"""fsdp_train.py's step time with no mid-epoch checkpoints, with --save-every N written
synchronously, and with --save-every N --async-save, side by side in one run.

    python benchmarks/async_save.py                      # ResNet-18, 2 processes, a table
    python benchmarks/async_save.py --model mlp --steps 6 --save-every 2   # a quick look

Each variant is one torchrun launch of fsdp_train.py on synthetic data (CPU, gloo) for
--steps steps; the time is the training loop's (metrics.jsonl's epoch_seconds), which holds
the mid-epoch saves (a synchronous one whole; an asynchronous one its copy to CPU memory,
the writing overlapping the next steps) and not the end-of-run one. The variants take turns
--repeats times; each keeps its fastest run (the least disturbed by whatever else runs).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18", help="fsdp_train.py --model")
    p.add_argument("--nproc", type=int, default=2, help="processes")
    p.add_argument("--steps", type=int, default=20, help="training steps per variant")
    p.add_argument("--save-every", type=int, default=4, help="steps between checkpoints")
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--repeats", type=int, default=2, help="runs of each variant, in turn")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args()
    rows = {}
    for name in ("no checkpoints", "sync", "async") * args.repeats:
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            cmd += [f"--nproc_per_node={args.nproc}", str(ROOT / "fsdp_train.py")]
            cmd += ["--data", "synthetic", "--device", "cpu", "--model", args.model]
            cmd += ["--batch-size", str(args.batch_size), "--max-steps", str(args.steps)]
            cmd += ["--output-dir", out, "--log-every", str(args.steps)]
            if name != "no checkpoints":
                cmd += ["--save-every", str(args.save_every)]
            if name == "async":
                cmd.append("--async-save")
            env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
            subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
            lines = Path(out, "metrics.jsonl").read_text().splitlines()
            (record,) = [json.loads(line) for line in lines]
            size = sum(f.stat().st_size for f in Path(out, "checkpoint").iterdir())
        ms = 1000 * record["epoch_seconds"] / args.steps
        if name not in rows or ms < rows[name]["ms_per_step"]:
            rows[name] = dict(variant=name, ms_per_step=ms, checkpoint_mb=size / 2**20)
    rows = list(rows.values())
    base = rows[0]["ms_per_step"]
    print(f"{args.model}, {args.nproc} processes, a checkpoint every {args.save_every} steps")
    print("| saving | ms per step | vs no checkpoints | checkpoint MB |")
    print("|---|---|---|---|")
    for r in rows:
        cells = [r["variant"], f"{r['ms_per_step']:.0f}", f"{r['ms_per_step'] / base:.2f}x"]
        print("| " + " | ".join(cells) + f" | {r['checkpoint_mb']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
