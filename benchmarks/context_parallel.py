"""Step time and activations of context parallelism beside one process and FSDP, on the same
long-sequence ViT (context_parallel.py's: each image row a token, 28 tokens).

    python benchmarks/context_parallel.py                    # prints JSON lines, then a table
    python benchmarks/context_parallel.py --global-batch 8 --steps 1

Layouts, each at the same global batch (--global-batch) of random tensors of Fashion-MNIST's
shape, in turn in one torchrun launch of 2 processes of one thread each: one process alone
(rank 0, the whole batch, every token, while rank 1 waits), FSDP as fsdp_train.py (each
process half the batch, every token) and CP 2 with the ring and with the all-gather (each
process the whole batch, half the tokens; FSDP over both, as context_parallel.py). Per
layout: the median step time (forward, backward, AdamW step) over --steps steps after one
warm-up step, and the bytes one process saves for backward (weights not counted). Compare
the ratios of one run, on an otherwise idle machine with at least 2 cores.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from common import cleanup, init_distributed_mode  # noqa: E402
from context_parallel import LongViT, layout, own, split_attention  # noqa: E402


def saved_bytes(storages):
    """Hooks that record the storages autograd saves for backward: each once, no weights
    (leaves that require grad, or views of them)."""

    def pack(t):
        base = t if t._base is None else t._base
        if not (base.is_leaf and base.requires_grad):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def measure(name, global_batch, steps, world):
    from torch.distributed.fsdp import fully_shard

    cp = "cp" in name
    torch.manual_seed(0)
    group = dist.group.WORLD if cp else None
    chunks = layout(28, world, "contiguous")  # each process its rows
    mine = chunks[dist.get_rank()] if cp else None
    model = LongViT(1, 10, 28, 96, 4, 4, mine)
    if cp:
        split_attention(model, group, name.split()[-1], chunks, causal=False)
    if world > 1:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    batch = global_batch if cp else global_batch // world  # a CP group shares its batch
    images, labels = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    images = own(images, mine, 2) if cp else images  # this process's rows
    seconds, storages = [], {}
    for step in range(steps + 1):
        start = time.perf_counter()
        with saved_bytes(storages if step == 0 else {}):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if world > 1:
            dist.barrier()  # a step ends when the slowest rank's does
        seconds.append(time.perf_counter() - start)
    activations = sum(storages.values())
    return dict(ms_per_step=1000 * statistics.median(seconds[1:]), activations=activations)


def worker(args):
    info = init_distributed_mode(device="cpu", timeout_s=300)
    try:
        for name in ("1 process", "fsdp 2", "cp 2 ring", "cp 2 allgather"):
            if name == "1 process":  # rank 0 alone, as many threads as each process after
                alone = info.rank == 0
                result = measure(name, args.global_batch, args.steps, 1) if alone else None
                dist.barrier()
            else:
                result = measure(name, args.global_batch, args.steps, info.world_size)
            if info.rank == 0:
                print(json.dumps(dict(layout=name, **result)), flush=True)
    finally:
        cleanup()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--global-batch", type=int, default=128, help="samples per step, all ranks")
    p.add_argument("--steps", type=int, default=10, help="timed steps per layout")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [__file__, "--worker", *sys.argv[1:]]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for row in rows:
        print(json.dumps(row))
    one, fsdp = rows[0], next(r for r in rows if r["layout"] == "fsdp 2")
    print("| layout | ms/step | vs 1 process | vs FSDP 2 | activations MB per process |")
    print("|---|---|---|---|---|")
    for r in rows:
        ms = r["ms_per_step"]
        cells = [r["layout"], f"{ms:.0f}", f"{ms / one['ms_per_step']:.2f}x"]
        cells += [f"{ms / fsdp['ms_per_step']:.2f}x", f"{r['activations'] / 2**20:.3f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
