"""What expert parallelism sends, and its step time, beside DDP of the same mixture of experts
and DDP of a dense ViT with the same compute per token.

    python benchmarks/expert_parallel.py                  # 2 and 4 processes; prints a table
    python benchmarks/expert_parallel.py --worlds 2 --steps 3 --batch-size 32

For each number of processes, one torchrun launch trains, in turn, in the same processes:
  - "moe ep": expert_parallel.py's MoE ViT (8 experts, top 2) with its experts spread over
    all processes (shard_experts, the two all-to-alls per block, average_gradients);
  - "moe ddp": the same model whole on every process, under DDP (no all-to-all: every expert
    is local; every expert's gradient all-reduced);
  - "dense ddp": models.py's ViT under DDP: its MLP's 4 x dim hidden features are what the MoE
    computes per token (2 experts of 2 x dim), so the compute per token is the same but for
    the routers.
Each at --batch-size samples per process, random tensors of Fashion-MNIST's shape (the bytes
do not depend on the pixels; the routing does, a little). Bytes a process sends per step:
for an all-to-all, the rows it hands to the other processes (forward, and the same exchange
reversed in backward, of the gradients); for an all-reduce of S bytes over n processes, what
a ring all-reduce sends, 2 S (n - 1) / n. Not counted: the token counts exchanged first (E
numbers per block) and the balancing loss's all-reduce (E numbers per block, one all-reduce
a step). --amp bf16: the rows travel in bf16, half the all-to-all's bytes. Step time
is the median over --steps steps after one warm-up step; with more processes than cores they
share the CPU, and the times compare runs of the same launch only.
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
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import expert_parallel  # noqa: E402
from common import cleanup, init_distributed_mode  # noqa: E402
from models import ViT  # noqa: E402

WRAPPERS = ("moe ep", "moe ddp", "dense ddp")


def ring(nbytes, world):  # what each process sends in a ring all-reduce of nbytes
    return 2 * nbytes * (world - 1) / world


def counting(sent, world):
    """Stand-ins for expert_parallel.py's collectives that add up, in sent, the bytes this
    process hands to the others; they then run the real ones."""
    real_a2a, me = expert_parallel.all_to_all_single_autograd, dist.get_rank()

    def all_to_all(h, recv, send, group):
        row = h[0].numel() * h.element_size() if len(h) else 0
        mine = dist.get_group_rank(group, me)  # this process's place in its EP group
        others = lambda sizes: sum(sizes) - sizes[mine]  # noqa: E731
        sent["all-to-all"] += (others(send) + others(recv)) * row  # forward, then backward
        return real_a2a(h, recv, send, group)

    def all_reduce(t, group=None, **kwargs):
        n = dist.get_world_size(group)
        sent["all-reduce"] += ring(t.numel() * t.element_size(), n) if n > 1 else 0
        return dist.all_reduce(t, group=group, **kwargs)

    names = ("all_to_all_single", "get_group_rank", "get_world_size", "barrier")
    fake = types.SimpleNamespace(all_reduce=all_reduce, **{n: getattr(dist, n) for n in names})
    return dict(all_to_all_single_autograd=all_to_all, dist=fake)


def measure(wrapper, args, info):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    shape = (args.dim, 4, args.experts, args.top_k, 1.25)
    model = ViT(1, 10, 28, dim=args.dim)
    if wrapper != "dense ddp":
        model = expert_parallel.with_experts(model, *shape[2:])
    net, mesh, sent = model, None, {"all-to-all": 0, "all-reduce": 0}
    if wrapper == "moe ep":
        mesh = init_device_mesh("cpu", (1, info.world_size), mesh_dim_names=("dp", "ep"))
        expert_parallel.shard_experts(model, mesh)
    else:  # DDP all-reduces every gradient once a step
        net = DDP(model)
        sent["all-reduce"] = ring(sum(p.numel() * 4 for p in model.parameters()), info.world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    images = torch.randn(args.batch_size, 1, 28, 28)
    labels = torch.randint(0, 10, (args.batch_size,))
    seconds, counted = [], dict(sent)
    saved = {k: getattr(expert_parallel, k) for k in ("all_to_all_single_autograd", "dist")}
    for step in range(args.steps + 1):
        if step == 0 and wrapper == "moe ep":  # count the first step's collectives
            vars(expert_parallel).update(counting(counted, info.world_size))
        start = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16, enabled=args.amp == "bf16"):
            loss = F.cross_entropy(net(images).float(), labels)
        if wrapper != "dense ddp":
            loss = loss + 0.01 * expert_parallel.balance_loss([b.mlp for b in model.blocks])
        loss.backward()
        if mesh is not None:
            expert_parallel.average_gradients(model, mesh, info.world_size)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()  # a step ends when the slowest process's does
        seconds.append(time.perf_counter() - start)
        vars(expert_parallel).update(saved)
    params = sum(expert_parallel.local(p).numel() * 4 for p in model.parameters())
    return dict(counted, params=params, ms_per_step=1000 * statistics.median(seconds[1:]))


def worker(args):
    info = init_distributed_mode(device="cpu", timeout_s=300)
    try:
        for wrapper in WRAPPERS:
            result = measure(wrapper, args, info)
            if info.rank == 0:
                row = dict(wrapper=wrapper, world=info.world_size, **result)
                print(json.dumps(row), flush=True)
    finally:
        cleanup()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="process counts")
    p.add_argument("--batch-size", type=int, default=128, help="samples per process per step")
    p.add_argument("--dim", type=int, default=96, help="the ViT's width")
    p.add_argument("--experts", type=int, default=8, help="experts per block")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--steps", type=int, default=5, help="timed steps per model")
    p.add_argument("--amp", default="none", choices=["none", "bf16"], help="bf16: autocast")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    rows = []
    for world in args.worlds:
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc_per_node={world}", __file__, "--worker", *sys.argv[1:]]
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    mb = lambda b: f"{b / 2**20:.3f}"  # noqa: E731
    print(
        "| processes | model | params MB | all-to-all MB/step | all-reduce MB/step |"
        " sent MB/step | ms/step | vs dense ddp |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        dense = next(d for d in rows if (d["world"], d["wrapper"]) == (r["world"], "dense ddp"))
        cells = [r["world"], r["wrapper"], mb(r["params"]), mb(r["all-to-all"])]
        cells += [mb(r["all-reduce"]), mb(r["all-to-all"] + r["all-reduce"])]
        cells += [f"{r['ms_per_step']:.0f}", f"{r['ms_per_step'] / dense['ms_per_step']:.2f}x"]
        print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main()
