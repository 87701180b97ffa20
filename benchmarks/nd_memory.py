"""Each rank's peak memory in nd_parallel.py at 8 processes on a GPT of 151 M parameters (12
blocks of 1024, 604 MB of fp32 weights), one step, a checkpoint and model.pt at the end: the
proof that no process builds, fills or exports the whole model.

    python benchmarks/nd_memory.py                     # --dp 8 and --pp 2 --dp 2 --tp 2; a table
    python benchmarks/nd_memory.py --nproc 2 --dim 128 --depth 2 --layouts "--dp 2"   # quick

Each layout is its own torchrun launch on CPU with gloo; each rank reports its peak resident
set size (getrusage's ru_maxrss) as it exits, and the most bytes autograd held for backward.
The idle row: one process that has imported torch and nd_parallel.py and loaded the same data.
A rank's share: its 1/world of the weights, gradients and AdamW's two moments (16 bytes a
parameter), plus one block's gathered weights.
The text: the first 256 KB of the standard library's sources (a test set of 13 KB, so the
evaluation at the end takes seconds, not hours, at this width). Blocks of 1 MB and more go
back to the system when freed (MALLOC_MMAP_THRESHOLD_): a peak is what the tensors needed.
"""

import argparse
import json
import os
import resource
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = ["--dp 8", "--pp 2 --dp 2 --tp 2"]
MB = 1e6


def peak_rss():  # bytes (Linux reports kilobytes)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rank_main(report, argv):
    """Run nd_parallel.py as torchrun started it, then write this rank's peak to REPORT.RANK,
    and the most bytes autograd held for backward at once (nd_costs.py's count)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.nd_costs import Saved

    sys.argv, saved = [str(ROOT / "nd_parallel.py"), *argv], Saved()
    try:
        with saved.hooks():
            runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        Path(f"{report}.{os.environ.get('RANK', '0')}").write_text(f"{peak_rss()} {saved.peak}")


def idle_main(text, seq_len):
    """An idle process: torch and nd_parallel.py imported, the data loaded."""
    sys.path.insert(0, str(ROOT))
    import data
    import nd_parallel  # noqa: F401 - its imports (torch.distributed, pipelining) count

    train, test = data.load_text(text, seq_len)
    print(peak_rss(), len(train), len(test))


def run(cmd, env):
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return proc.stdout


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=8, help="processes of each launch")
    p.add_argument("--dim", type=int, default=1024, help="the GPT's width")
    p.add_argument("--depth", type=int, default=12, help="the GPT's blocks")
    p.add_argument("--heads", type=int, default=16, help="attention heads")
    p.add_argument("--seq-len", type=int, default=64, help="bytes a sequence")
    p.add_argument("--layouts", nargs="+", default=LAYOUTS, help="nd_parallel.py's layout flags")
    p.add_argument("--text-kb", type=int, default=256, help="KB of text (5%%: the test set)")
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--rank", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # REPORT ARGS
    p.add_argument("--idle", nargs=2, help=argparse.SUPPRESS)  # TEXT SEQ_LEN
    args = p.parse_args()
    if args.rank:
        return rank_main(args.rank[0], args.rank[1:])
    if args.idle:
        return idle_main(args.idle[0], int(args.idle[1]))

    sys.path.insert(0, str(ROOT))
    import data

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576", OMP_NUM_THREADS="1")
    tmp = Path(tempfile.mkdtemp(prefix="nd_memory_"))
    text = tmp / "text.txt"
    text.write_bytes(b"".join(f.read_bytes() for f in data.stdlib_sources())[: args.text_kb * 1024])
    shape = dict(dim=args.dim, depth=args.depth, heads=args.heads)
    import torch

    import models

    with torch.device("meta"):  # counted, not built
        gpt = models.GPT(256, args.seq_len, args.dim, args.depth, args.heads)
    params = sum(p.numel() for p in gpt.parameters())
    block = sum(p.numel() for p in gpt.blocks[0].parameters())
    idle = [sys.executable, __file__, "--idle", str(text), str(args.seq_len)]
    idle = int(run(idle, env).split()[0])
    rows, ranks = [], range(args.nproc)
    for i, layout in enumerate(args.layouts):
        report, out = tmp / f"peak{i}", tmp / f"out{i}"  # a layout resumes from no other
        flags = ["--data", "text", "--data-dir", str(text), "--model", "gpt", "--max-steps", "1"]
        flags += ["--dist-timeout", "3600"]  # a loaded machine: no collective given up on
        flags += [f"--{k.replace('_', '-')}={v}" for k, v in shape.items()]
        flags += ["--seq-len", str(args.seq_len), "--output-dir", str(out), *layout.split()]
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        launch += [f"--nproc_per_node={args.nproc}", __file__, "--rank", str(report), *flags]
        run(launch, env)
        peaks, held = [], []  # each rank's peak RSS; the most it held for backward at once
        for r in ranks:
            peak, most = map(int, Path(f"{report}.{r}").read_text().split())
            peaks, held = [*peaks, peak], [*held, most]
        rows.append(dict(layout=layout, peaks=peaks, median=statistics.median(peaks), held=held))
        shutil.rmtree(out)  # its checkpoint and model.pt: 2.4 GB at 151 M parameters
    share = 16 * params / args.nproc + 4 * block  # its pieces and AdamW's, one block gathered
    print(f"GPT of {params / 1e6:.1f} M parameters ({4 * params / MB:.0f} MB fp32), {shape}")
    print(f"idle process (torch, nd_parallel.py, the data): {idle / MB:.0f} MB")
    print(f"a rank's share (16 bytes a parameter / {args.nproc}, one block): {share / MB:.0f} MB")
    print("| layout | " + " | ".join(f"rank {r}" for r in range(args.nproc)) + " | median |")
    print("|---" * (args.nproc + 2) + "|")
    for row in rows:
        cells = " | ".join(f"{p / MB:.0f}" for p in [*row["peaks"], row["median"]])
        print(f"| `{row['layout']}` | {cells} |")
        excess = (max(row["peaks"]) - row["median"]) / (4 * params)
        over = [p - idle - share for p in row["peaks"]]
        beyond = [o - h for o, h in zip(over, row["held"], strict=True)]
        print(f"  highest rank above the median: {excess:.2f} of the fp32 weights (bound 0.25);")
        print(f"  highest rank above idle + its share: {max(over) / MB:.0f} MB;")
        held = " ".join(f"{h / MB:.0f}" for h in row["held"])
        print(f"  held for backward at most, by rank: {held} MB; each rank above idle + its share")
        print("  + what it held: " + " ".join(f"{b / MB:.0f}" for b in beyond))
    if args.json:
        figures = dict(params=params, idle=idle, share=share, rows=rows, **shape)
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
