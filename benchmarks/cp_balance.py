"""Causal context parallelism's load balance: each process's attention time with contiguous
chunks and with zigzag (context_parallel.py --cp-balance), at CP 2 and 4.

    python benchmarks/cp_balance.py                    # sequences of 2048, prints a table
    python benchmarks/cp_balance.py --seq-len 512 --repeats 1

replay: each rank's forward and backward of context_parallel.RingAttention (causal) run in
this one process, rank after rank, the ring's transfers replaced by the block at hand: the
same blocks computed, skipped and masked as on that rank, timed alone on one thread (a
process's own core), without the waits for the others. Per rank the median of --repeats,
and the slowest against the mean: the group's pace, each step waiting for its slowest.
ring: CP 2 for real, 2 processes of one thread under torchrun, the same attention with its
transfers: each process's time for forward and backward, which the slowest one sets.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import context_parallel as cp  # noqa: E402


def attention_seconds(shape, group, chunks, repeats):
    """The median time of one causal RingAttention forward and backward on q, k, v of
    `shape` (this rank's tokens), and its FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(shape) for _ in range(4))
    times, flops = [], 0
    for repeat in range(repeats + 1):  # the first: a warm-up, FLOPs counted
        mine = [t.clone().requires_grad_() for t in (q, k, v)]
        counter = FlopCounterMode(display=False) if repeat == 0 else None
        start = time.perf_counter()
        with counter or torch.enable_grad():
            cp.RingAttention.apply(*mine, group, chunks, True).backward(dout)
        times.append(time.perf_counter() - start)
        flops = counter.get_total_flops() if counter else flops
    return statistics.median(times[1:]), flops


def replay(args):
    torch.set_num_threads(1)
    rows = []
    for size in (2, 4):
        shape = (args.batch_size, args.heads, args.seq_len // size, args.head_dim)
        for balance in ("contiguous", "zigzag"):
            chunks = cp.layout(args.seq_len, size, balance)
            seconds, flops = [], []
            for rank in range(size):
                one = dict(get_rank=lambda group, r=rank: r, get_world_size=lambda group, n=size: n)
                cp.dist = types.SimpleNamespace(**one)  # this rank of the group, alone
                cp.ring_pass = lambda tensor, group: (tensor, [])  # the block at hand
                took, count = attention_seconds(shape, None, chunks, args.repeats)
                seconds.append(took)
                flops.append(count)
            rows.append(dict(mode="replay", cp=size, balance=balance, seconds=seconds, flops=flops))
    cp.dist = dist
    return rows


def ring_worker(args):
    dist.init_process_group("gloo")
    try:
        shape = (args.batch_size, args.heads, args.seq_len // 2, args.head_dim)
        for balance in ("contiguous", "zigzag"):
            chunks = cp.layout(args.seq_len, 2, balance)
            took, flops = attention_seconds(shape, dist.group.WORLD, chunks, args.repeats)
            seconds = [None, None]
            dist.all_gather_object(seconds, took)
            counts = [None, None]
            dist.all_gather_object(counts, flops)
            row = dict(mode="ring", cp=2, balance=balance, seconds=seconds, flops=counts)
            if dist.get_rank() == 0:
                print(json.dumps(row), flush=True)
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=4, help="sequences")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--head-dim", type=int, default=24, help="numbers per head")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per rank")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return ring_worker(args)
    rows = replay(args)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    out = subprocess.run(
        [*cmd, __file__, "--worker", *sys.argv[1:]], env=env, check=True, capture_output=True
    )
    rows += [json.loads(ln) for ln in out.stdout.decode().splitlines() if ln.startswith("{")]
    print("| how | CP | balance | ms per rank | slowest / mean | GFLOP per rank |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(json.dumps(r), file=sys.stderr)
        ms = " / ".join(f"{1000 * s:.0f}" for s in r["seconds"])
        ratio = max(r["seconds"]) / statistics.mean(r["seconds"])
        gflop = " / ".join(f"{f / 1e9:.2f}" for f in r["flops"])
        print(f"| {r['mode']} | {r['cp']} | {r['balance']} | {ms} | {ratio:.2f}x | {gflop} |")


if __name__ == "__main__":
    main()
