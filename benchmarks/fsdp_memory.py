"""Each rank's measured peak memory for DDP, FSDP and HSDP on a ViT wide enough that its
weights, gradients and AdamW state dominate (about 100 M parameters), beside the bytes counted
from the tensors each rank holds.

    python benchmarks/fsdp_memory.py                           # 2 and 4 processes; a table
    python benchmarks/fsdp_memory.py --worlds 2 --dim 128 --depth 2 --steps 1   # a quick look

Each (layout, processes) pair is its own torchrun launch on CPU with gloo, so that memory one
layout freed is not another's. Each rank resets its peak resident set size (Linux's VmHWM,
through /proc/self/clear_refs) just before the model is built, and reports the peak above
that level twice: once the model is built and sharded ("build"), and after --steps AdamW steps
on random images of Fashion-MNIST's shape ("peak"). The layouts: "ddp" (ddp_train.py: the
whole model, DDP), "fsdp" (fsdp_train.py: built on the meta device, each rank's pieces filled
one whole tensor at a time, each drawn from its name), "fsdp built whole" (the model built on
every rank, then sharded) and "hsdp" (fsdp_train.py --replicate 2: two replicas, each sharded
over half the processes; at 4 processes and more).
On a CPU the device's memory and the host's are one: the whole tensor a rank draws before it
keeps its piece counts in its "build" figure (on a GPU it is host memory). Blocks of
1 MB and more are returned to the system when freed (MALLOC_MMAP_THRESHOLD_), so the peaks
are what the tensors needed, not what glibc kept for reuse.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from sharding import local_bytes  # noqa: E402

from checkpoint import fill_initial  # noqa: E402
from common import cleanup, init_distributed_mode  # noqa: E402
from models import ViT, initial_weights  # noqa: E402

LAYOUTS = ("ddp", "fsdp", "fsdp built whole", "hsdp")


def resident_kb(field):
    """VmRSS (now) or VmHWM (the peak since the last reset) of this process, in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(args):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    info = init_distributed_mode(device="cpu", timeout_s=600)
    world = info.world_size
    try:

        def build():
            return ViT(1, 10, 28, dim=args.dim, depth=args.depth, heads=args.heads)

        def shard(model):
            mesh = init_device_mesh("cpu", (world,))
            if args.layout == "hsdp":
                names = ("replicate", "shard")
                mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=names)
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)

        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = resident_kb("VmRSS")
        if args.layout == "ddp":
            torch.manual_seed(0)
            model = net = DDP(build(), gradient_as_bucket_view=True)
        elif args.layout == "fsdp built whole":
            torch.manual_seed(0)
            model = net = build()
            shard(model)
        else:
            # fsdp_train.py's build: meta, shard, memory for the shards, filled a tensor at a time
            with torch.device("meta"):
                model = net = build()
            shard(model)
            model.to_empty(device="cpu")
            fill_initial(model, initial_weights(build, 0))
        build_peak = resident_kb("VmHWM") - before
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        per_rank = args.global_batch // world
        images, labels = torch.randn(per_rank, 1, 28, 28), torch.randint(0, 10, (per_rank,))
        for _ in range(args.steps):
            F.cross_entropy(net(images), labels).backward()
            grads = local_bytes(p.grad for p in model.parameters())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        states = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
        result = dict(layout=args.layout, world=world, rank=info.rank, build_kb=build_peak)
        result.update(peak_kb=resident_kb("VmHWM") - before, params=local_bytes(net.parameters()))
        result.update(grads=grads, optimizer=local_bytes(states))
        result.update(n_params=sum(p.numel() for p in build().parameters()))
        Path(args.reports, f"rank{info.rank}.json").write_text(json.dumps(result))
    finally:
        cleanup()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="process counts")
    p.add_argument("--dim", type=int, default=768, help="the ViT's width (ViT-Base's)")
    p.add_argument("--depth", type=int, default=14, help="the ViT's blocks")
    p.add_argument("--heads", type=int, default=12, help="the ViT's heads")
    p.add_argument("--global-batch", type=int, default=8, help="images per step, all ranks")
    p.add_argument("--steps", type=int, default=2, help="AdamW steps (the first makes the state)")
    p.add_argument("--layouts", nargs="+", default=LAYOUTS, choices=LAYOUTS, help="what to run")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--layout", help=argparse.SUPPRESS)
    p.add_argument("--reports", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.layout:
        return worker(args)
    rows, mb = [], lambda kb: kb / 1024
    for world in args.worlds:
        for layout in args.layouts:
            if layout == "hsdp" and (world % 2 or world < 4):  # at 2: two whole replicas, DDP
                continue
            with tempfile.TemporaryDirectory() as reports:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
                cmd += [f"--nproc_per_node={world}", __file__, "--layout", layout]
                cmd += ["--reports", reports, *sys.argv[1:]]
                env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
                # glibc keeps freed blocks below its (self-raising) mmap threshold for reuse:
                # FSDP's per-unit buffers, freed and made again, would count several times.
                env.update(MALLOC_MMAP_THRESHOLD_="1048576")  # tensors of 1 MB or more
                subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
                ranks = [json.loads(f.read_text()) for f in sorted(Path(reports).glob("*.json"))]
            rows.append(dict(ranks[0], ranks=ranks))
    n = rows[0]["n_params"]
    print(f"ViT of {n / 1e6:.1f} M parameters ({4 * n / 2**20:.0f} MB in fp32); MB per rank")
    head = "| processes | layout | built: rank 0 / others | peak: rank 0 / others | peak vs DDP |"
    print(head + " counted: weights + grads + AdamW |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ddp = next(d for d in rows if d["world"] == r["world"] and d["layout"] == "ddp")
        top = lambda key, rows: max(x[key] for x in rows)  # noqa: E731
        others = r["ranks"][1:]
        build = f"{mb(r['build_kb']):.0f} / {mb(top('build_kb', others)):.0f}"
        peak = f"{mb(r['peak_kb']):.0f} / {mb(top('peak_kb', others)):.0f}"
        ratio = top("peak_kb", r["ranks"]) / top("peak_kb", ddp["ranks"])
        counted = sum(r[k] for k in ("params", "grads", "optimizer")) / 2**20
        print(f"| {r['world']} | {r['layout']} | {build} | {peak} | {ratio:.2f}x | {counted:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
