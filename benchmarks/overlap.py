"""What overlapping communication with computation buys: DDP's buckets against a blocking
all-reduce after backward, against local SGD and ZeRO; step time and bytes, 2 processes.

    torchrun --standalone --nproc_per_node=2 benchmarks/overlap.py              # markdown table
    torchrun --standalone --nproc_per_node=2 benchmarks/overlap.py --json       # one JSON line
    torchrun --standalone --nproc_per_node=2 benchmarks/overlap.py \\
        --model resnet18 --batch-size 4 --options ddp blocking local4 local16 zero

Every option trains its own copy of the same model (same seed) on the same batches (random
tensors of Fashion-MNIST's shape: time and bytes do not depend on the pixels), in alternating
rounds in the same processes (each round starting with the next option), so that the
machine's drift, and other jobs on it, hit all alike.
  ddp        DDP: each bucket's all-reduce starts while backward still computes earlier layers
  blocking   no DDP wrapper: backward, then one blocking all-reduce of all gradients flattened
             into one tensor (ddp_comm.average_replicas), then the optimizer step
  fp16, bf16, powersgd   DDP with ddp_comm.py --comm-hook (ddp_comm.register_comm_hook)
  local4, local16        local SGD, ddp_comm.py --local-sgd-period 4 / 16 --local-sgd-start 0:
             the DDP hook sends no gradients, the weights are averaged every K steps
  zero       DDP with ZeroRedundancyOptimizer around SGD (ddp_comm.py --zero)
A step's time is a round's wall time over its steps, the slowest rank's, median over rounds.

Bytes are counted, not assumed: torch.distributed's collectives are wrapped, and each adds the
bytes of the tensors handed to it, over 16 steps (a whole number of averaging periods).
DDP without a hook all-reduces in C++, out of the wrapper's reach: for ddp and zero the bytes
come from a twin whose buckets go through default_hooks.allreduce_hook, which hands the same
buckets to torch.distributed.all_reduce. The link columns are what sending those bytes would
add to a step at 10 and 1 Gbit/s if nothing hid it: a ring all-reduce sends 2(N-1)/N x its
bytes per rank, a broadcast or all-gather (N-1)/N x.
"""

import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ddp_comm  # noqa: E402
from common import ArgumentParser, cleanup, init_distributed_mode  # noqa: E402
from models import MODELS, build_model  # noqa: E402

OPTIONS = ("ddp", "blocking", "fp16", "bf16", "powersgd", "local4", "local16", "zero")
COUNTED_STEPS = 16
ALL_REDUCE = ("all_reduce",)
GATHERS = (
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "_broadcast_coalesced",
)


@contextlib.contextmanager
def count_bytes():
    """Wrap torch.distributed's collectives; yields {"all_reduce": bytes, "other": bytes}."""
    sent = {"all_reduce": 0, "other": 0}
    saved = {name: getattr(dist, name) for name in ALL_REDUCE + GATHERS}

    def wrap(name, collective):
        def counting(*args, **kwargs):
            # _broadcast_coalesced(group, tensors, ...); the others take the tensor (or list) first
            tensors = (
                args[1] if name == "_broadcast_coalesced" else args[0] if args else kwargs["tensor"]
            )
            for t in tensors if isinstance(tensors, list | tuple) else [tensors]:
                sent["all_reduce" if name in ALL_REDUCE else "other"] += (
                    t.numel() * t.element_size()
                )
            return collective(*args, **kwargs)

        return counting

    for name, collective in saved.items():
        setattr(dist, name, wrap(name, collective))
    try:
        yield sent
    finally:
        for name, collective in saved.items():
            setattr(dist, name, collective)


class Trainer:
    """One option: its model, optimizer and step."""

    def __init__(self, option, opts, info, twin=False):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.option, self.steps = option, 0
        torch.manual_seed(0)
        model = build_model(opts.model, 1, 10).to(info.device, memory_format=torch.channels_last)
        self.params = list(model.parameters())
        self.model = (
            model
            if option == "blocking"
            else DDP(model, [info.device.index] if info.device.type == "cuda" else None)
        )
        flags = ["--model", opts.model, "--powersgd-rank", str(opts.powersgd_rank)]
        if option in ("fp16", "bf16", "powersgd"):
            flags += ["--comm-hook", option]
        self.period = int(option[5:]) if option.startswith("local") else 0
        if self.period:
            flags += ["--local-sgd-period", str(self.period)]
        args = ddp_comm.get_args(flags)
        if option != "blocking" and (args.comm_hook != "none" or self.period):
            # Local SGD from the first step; PowerSGD from the third (the warm-up's two).
            start = 0 if self.period else 2
            ddp_comm.register_comm_hook(self.model, args, start, step=0)
        elif twin and option in ("ddp", "zero"):
            # The same buckets through torch.distributed.all_reduce, where they are counted.
            self.model.register_comm_hook(None, default_hooks.allreduce_hook)
        sgd = dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
        if option == "zero":
            self.optimizer = ZeroRedundancyOptimizer(self.params, torch.optim.SGD, **sgd)
        else:
            self.optimizer = torch.optim.SGD(self.params, **sgd)

    def step(self, images, labels):
        loss = F.cross_entropy(self.model(images), labels)
        loss.backward()  # DDP's all-reduce (or its hook) runs in here, bucket by bucket
        if self.option == "blocking":
            ddp_comm.average_replicas([p.grad for p in self.params])  # all of it, after backward
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        if self.period and self.steps % self.period == 0:
            ddp_comm.average_replicas(self.params)


def main():
    p = ArgumentParser(
        description="DDP's overlap, a blocking all-reduce, local SGD and ZeRO: step time and bytes"
    )
    p.add_argument(
        "--model", default="cnn", choices=sorted(MODELS), help="network, as ddp_comm.py --model"
    )
    p.add_argument("--batch-size", type=int, default=128, help="samples per process per step")
    p.add_argument("--rounds", type=int, default=10, help="alternations over the options")
    p.add_argument(
        "--steps",
        type=int,
        default=16,
        help="timed steps of each option per round (a multiple of 16)",
    )
    p.add_argument("--powersgd-rank", type=int, default=4, help="as ddp_comm.py --powersgd-rank")
    p.add_argument(
        "--options", nargs="+", default=list(OPTIONS), choices=OPTIONS, help="which to compare"
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the models run")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    opts = p.parse_args()
    if min(opts.batch_size, opts.rounds, opts.steps, opts.powersgd_rank) < 1 or opts.steps % 16:
        p.error(
            "--batch-size, --rounds, --steps and --powersgd-rank must be at least 1; --steps a "
            "multiple of 16"
        )
    info = init_distributed_mode(device=opts.device)
    if not info.distributed:
        p.error(
            "run it under torchrun with 2 or more processes: one process has nothing to communicate"
        )
    try:
        device, world = info.device, info.world_size
        torch.manual_seed(1 + info.rank)  # each rank its own batches, the same for every option
        batches = [
            (
                torch.randn(opts.batch_size, 1, 28, 28, device=device).contiguous(
                    memory_format=torch.channels_last
                ),
                torch.randint(10, (opts.batch_size,), device=device),
            )
            for _ in range(4)
        ]

        def run(trainer, steps):
            for i in range(steps):
                trainer.step(*batches[i % len(batches)])

        # Bytes: on twins (see the docstring), after 2 warm-up steps (DDP rebuilds its buckets
        # after the first; PowerSGD compresses from the third).
        sent = {}
        for option in opts.options:
            twin = Trainer(option, opts, info, twin=True)
            run(twin, 2)
            twin.steps = 0
            with count_bytes() as counted:
                run(twin, COUNTED_STEPS)
            sent[option] = {kind: n / COUNTED_STEPS for kind, n in counted.items()}
            del twin

        trainers = {option: Trainer(option, opts, info) for option in opts.options}
        for trainer in trainers.values():
            run(trainer, 2)
            trainer.steps = 0
        times = {option: [] for option in opts.options}
        order = list(trainers)
        for r in range(opts.rounds):
            for option in (
                order[r % len(order) :] + order[: r % len(order)]
            ):  # each round starts one later
                trainer = trainers[option]
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                run(trainer, opts.steps)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = torch.tensor(time.perf_counter() - t0)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
                times[option].append(elapsed.item() / opts.steps)

        if info.rank != 0:
            return
        ms = {option: 1000 * statistics.median(t) for option, t in times.items()}
        ring = {"all_reduce": 2 * (world - 1) / world, "other": (world - 1) / world}
        link_ms = {
            gbit: {
                o: 1000 * sum(ring[k] * b for k, b in sent[o].items()) * 8 / (gbit * 1e9)
                for o in opts.options
            }
            for gbit in (10, 1)
        }
        params = sum(q.numel() for q in trainers[opts.options[0]].params)
        result = dict(
            model=opts.model,
            params=params,
            world_size=world,
            batch_size=opts.batch_size,
            device=device.type,
            rounds=opts.rounds,
            steps=opts.steps,
            ms_per_step=ms,
            bytes_per_step={o: sum(sent[o].values()) for o in opts.options},
            bytes_by_kind=sent,
            link_ms_per_step={f"{gbit}gbit": v for gbit, v in link_ms.items()},
        )
        if opts.json:
            print(json.dumps(result), flush=True)
            return
        base = opts.options[0]
        print(
            f"{opts.model} ({params / 1e6:.3f} M parameters), batch {opts.batch_size} per "
            f"process, {world} processes"
        )
        print(
            "| option | ms per step | vs "
            + base
            + " | MB sent per step per rank | + at 10 Gbit/s | + at 1 Gbit/s |"
        )
        print("|---|---|---|---|---|---|")
        for o in opts.options:
            mb = result["bytes_per_step"][o] / 1e6
            link = f"{link_ms[10][o]:.2f} ms | {link_ms[1][o]:.2f} ms"
            print(f"| {o} | {ms[o]:.1f} | {ms[o] / ms[base]:.2f}x | {mb:.3f} | {link} |")
    finally:
        cleanup()


if __name__ == "__main__":
    main()
