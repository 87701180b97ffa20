"""What each rank holds, and the step time, for DDP, DDP with ZeRO, FSDP, HSDP, tensor,
context and expert parallelism (and 2-D: TP inside, FSDP across), side by side.

    python benchmarks/sharding.py                      # 1 to 4 processes; prints a table
    python benchmarks/sharding.py --worlds 2 --models vit --steps 3
    python benchmarks/sharding.py --worlds 4 --models vit --vit-dim 384 --json rows.json

For each number of processes, one torchrun launch trains every model under every wrapper
in turn, in the same processes, at the same global batch (--global-batch, split over the
ranks), on random tensors of Fashion-MNIST's shape: the bytes and the step time do not depend
on the pixels. The wrappers are ddp_train.py's DDP, ddp_comm.py's --zero (DDP with
ZeroRedundancyOptimizer: the optimizer state sharded) and fsdp_train.py's fully_shard per
block and then on the root, with and without resharding after forward, and, for the ViT,
tensor_parallel.py's plan over all processes (with and without --sequence-parallel) and, at 4
processes, 2 x 2 (TP 2 inside, FSDP across) and HSDP 2 x 2 (fsdp_train.py --replicate 2);
context_parallel.py's ViT (each image row a token; CP over all processes, FSDP over them too)
and expert_parallel.py's mixture of experts (8 experts a block, its own weights: more than
the ViT's) with the experts spread over all processes. DDP, FSDP and EP split the global batch
over the ranks; a TP or CP group shares its batch. The optimizer is AdamW everywhere (two
moments per weight). The bytes are counted from the tensors rank 0 holds: its parameters (the
local pieces of DTensors), its gradients after backward, its optimizer state, its parameters
between forward and backward (where FSDP without resharding still holds every block's
gathered weights), and the activations autograd saved for backward (weights not counted).
"peak" is measured: the process's peak resident memory above its level before the model was
built (Linux's VmHWM, reset through /proc/self/clear_refs), over the build and the steps.
Step time is the median over --steps steps after one warm-up step; with more processes than
cores they share the CPU.
"""

import argparse
import contextlib
import gc
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
from models import ViT, build_model  # noqa: E402

WRAPPERS = ("ddp", "ddp+zero", "fsdp", "fsdp no reshard", "hsdp", "tp", "tp+sp", "2-d", "cp", "ep")


def resident_kb(field):
    """VmRSS (now) or VmHWM (the peak since the last reset) of this process, in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def local_bytes(tensors):
    """Bytes of what this rank holds of `tensors` (a DTensor's local shard only)."""
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def saved_bytes(held):
    """Hooks that add up the bytes of the activations autograd saves for backward into
    held["activations"]: a storage once, and no weights (leaves that require grad, or views
    of them, as the transposed weight a linear layer saves)."""
    storages = held.setdefault("storages", {})

    def pack(t):
        base = t if t._base is None else t._base
        if not (base.is_leaf and base.requires_grad):
            # a DTensor's piece; the tensor inside a functional collective's result
            inner = getattr(t, "_local_tensor", None)
            s = (getattr(t, "elem", t) if inner is None else inner).untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def tensor_parallel(model, wrapper, info):
    """tensor_parallel.py's plan on the ViT: "tp" over all processes, "2-d" 2 x TP world/2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from tensor_parallel import block_plan, move

    dp = 2 if wrapper == "2-d" else 1
    mesh = init_device_mesh("cpu", (dp, info.world_size // dp), mesh_dim_names=("dp", "tp"))
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], block_plan(wrapper == "tp+sp"))
    if wrapper == "tp+sp":
        ends = {"blocks.0": move(Replicate(), Shard(1)), "norm": move(Shard(1), Replicate())}
        parallelize_module(model, mesh["tp"], ends)
    if dp > 1:
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return dp


def applies(name, wrapper, world):
    """Which (model, wrapper) pairs this world size can run: TP splits the ViT's 4 heads, CP
    its 28 rows, EP its 8 experts; HSDP and 2-D are 2 x 2."""
    if wrapper in ("tp", "tp+sp"):
        return name == "vit" and world in (2, 4)
    if wrapper in ("cp", "ep"):
        return name == "vit" and world in (2, 4)
    return wrapper not in ("2-d", "hsdp") or (name == "vit" and world == 4)


def build(name, wrapper, args):
    """The network: models.py's, the ViT --vit-dim wide; for CP and EP their scripts' ViTs."""
    if name != "vit":
        return build_model(name, 1, 10, image_size=28)
    if wrapper == "cp":  # each process its rows, attention by the ring
        import context_parallel as cp

        chunks = cp.layout(28, dist.get_world_size(), "contiguous")
        group, mine = dist.group.WORLD, chunks[dist.get_rank()]
        model = cp.LongViT(1, 10, 28, args.vit_dim, 4, 4, mine)
        cp.split_attention(model, group, "ring", chunks, causal=False)
        return model
    if wrapper == "ep":
        from expert_parallel import with_experts

        return with_experts(ViT(1, 10, 28, dim=args.vit_dim), 8, 2, 1.25)
    return ViT(1, 10, 28, dim=args.vit_dim)


def measure(name, wrapper, args, info):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    gc.collect()  # the previous wrapper's tensors go before this one's peak is measured
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = resident_kb("VmRSS")
    torch.manual_seed(0)
    model = build(name, wrapper, args)
    net, adamw, mesh = model, dict(lr=1e-3, weight_decay=0.05), None
    per_rank = args.global_batch // info.world_size
    if wrapper in ("tp", "tp+sp", "2-d"):
        per_rank = args.global_batch // tensor_parallel(model, wrapper, info)
    if wrapper == "cp":
        per_rank = args.global_batch  # the CP group shares its batch, each process its rows
    if wrapper.startswith("ddp") and info.distributed:
        net = DDP(model, gradient_as_bucket_view=True)  # .grad views DDP's buckets
    if wrapper.startswith(("fsdp", "hsdp", "cp")) and info.distributed:
        if wrapper == "hsdp":  # fsdp_train.py --replicate 2: shards within, replicas across
            names = ("replicate", "shard")
            mesh = init_device_mesh("cpu", (2, info.world_size // 2), mesh_dim_names=names)
        stages = [getattr(model, f"layer{i}", None) for i in range(1, 5)]  # as fsdp_train.py
        keep = wrapper == "fsdp no reshard"
        for block in list(getattr(model, "blocks", [])) + [s for s in stages if s is not None]:
            fully_shard(block, mesh=mesh, reshard_after_forward=not keep)
        fully_shard(model, mesh=mesh, reshard_after_forward=not keep)
    if wrapper == "ep":  # expert_parallel.py: the experts spread, the rest whole everywhere
        import expert_parallel

        mesh = init_device_mesh("cpu", (1, info.world_size), mesh_dim_names=("dp", "ep"))
        expert_parallel.shard_experts(model, mesh)
    if wrapper == "ddp+zero" and info.distributed:
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **adamw)
        local_optimizer = optimizer.optim  # the AdamW over this rank's share of the weights
    else:
        optimizer = local_optimizer = torch.optim.AdamW(model.parameters(), **adamw)
    images, labels = torch.randn(per_rank, 1, 28, 28), torch.randint(0, 10, (per_rank,))
    if wrapper == "cp":  # this process's rows of each image
        images = images[:, :, model.mine[0][0] : model.mine[0][1]]
    seconds, held = [], {}
    for step in range(args.steps + 1):
        start = time.perf_counter()
        with saved_bytes(held) if step == 0 else contextlib.nullcontext():
            loss = F.cross_entropy(net(images), labels)
            if wrapper == "ep":  # the routers' balancing loss, as expert_parallel.py's
                moes = [block.mlp for block in model.blocks]
                loss = loss + 0.01 * expert_parallel.balance_loss(moes)
        if step == 0:
            held["params in forward"] = local_bytes(model.parameters())
            held["activations"] = sum(held.pop("storages").values())
        loss.backward()
        if wrapper == "ep":
            expert_parallel.average_gradients(model, mesh, info.world_size)
        if step == 0:
            held["grads"] = local_bytes(p.grad for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if info.distributed:
            dist.barrier()  # a step ends when the slowest rank's does
        seconds.append(time.perf_counter() - start)
    held["params"] = local_bytes(model.parameters())
    states = local_optimizer.state.values()
    held["optimizer"] = local_bytes(t for s in states for t in s.values() if torch.is_tensor(t))
    peak = 1024 * (resident_kb("VmHWM") - before)
    return dict(held, peak=peak, ms_per_step=1000 * statistics.median(seconds[1:]))


def worker(args):
    info = init_distributed_mode(device="cpu", timeout_s=300)
    try:
        for name in args.models:
            wrappers = [w for w in args.wrappers if applies(name, w, info.world_size)]
            for wrapper in wrappers:
                result = measure(name, wrapper, args, info)
                if info.rank == 0:
                    print(
                        json.dumps(
                            dict(model=name, wrapper=wrapper, world=info.world_size, **result)
                        ),
                        flush=True,
                    )
    finally:
        cleanup()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 3, 4], help="process counts")
    p.add_argument("--models", nargs="+", default=["vit", "resnet18"], help="networks")
    p.add_argument("--global-batch", type=int, default=48, help="samples per step, all ranks")
    p.add_argument("--steps", type=int, default=5, help="timed steps per model and wrapper")
    p.add_argument("--vit-dim", type=int, default=96, help="the ViT's width (models.py's: 96)")
    p.add_argument("--json", help="also write the rows to this file")
    help = "these only; one a launch gives each peak its own process (memory.png)"
    p.add_argument("--wrappers", nargs="+", default=WRAPPERS, choices=WRAPPERS, help=help)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    rows = []
    for world in args.worlds:
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        # Blocks of 1 MB and more go back to the system when freed: the peak of each wrapper
        # is its own, not what glibc kept from the one before (fsdp_memory.py says more).
        env.setdefault("MALLOC_MMAP_THRESHOLD_", "1048576")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc_per_node={world}", __file__, "--worker", *sys.argv[1:]]
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    mb = lambda b: f"{b / 2**20:.3f}"  # noqa: E731
    print(
        "| model | processes | wrapper | params MB | in forward MB | grads MB | optimizer MB |"
        " activations MB | ms/step | vs DDP | peak MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        key = (r["model"], r["world"], "ddp")
        ddp = next((d for d in rows if (d["model"], d["world"], d["wrapper"]) == key), None)
        cells = [r["model"], r["world"], r["wrapper"], mb(r["params"]), mb(r["params in forward"])]
        cells += [mb(r["grads"]), mb(r["optimizer"]), mb(r["activations"])]
        cells.append(f"{r['ms_per_step']:.0f}")
        cells.append(f"{r['ms_per_step'] / ddp['ms_per_step']:.2f}x" if ddp else "-")
        cells.append(f"{r['peak'] / 2**20:.1f}")
        print("| " + " | ".join(map(str, cells)) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
