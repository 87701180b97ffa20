"""DDP communication options (ddp_comm.py --comm-hook): step time and bytes all-reduced.

    torchrun --standalone --nproc_per_node=2 benchmarks/comm_hooks.py --model cnn
    torchrun --standalone --nproc_per_node=2 benchmarks/comm_hooks.py \\
        --model resnet18 --batch-size 16

One DDP model per option (none, fp16, bf16, powersgd), each set up by ddp_comm.py's own
register_comm_hook(), trained in alternating rounds in the same processes so that the
machine's drift cancels out. Batches are random tensors of Fashion-MNIST's shape: step time
and bytes do not depend on the pixels. Bytes are what each rank hands to all-reduce per
step: for the hooks, counted at torch.distributed.all_reduce; without a hook DDP's C++
reducer all-reduces every fp32 gradient once, so that row is the gradients' size. Prints
one JSON line on rank 0.
"""

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

HOOKS = ("none", "fp16", "bf16", "powersgd")


class ByteCounter:
    """Wraps torch.distributed.all_reduce, which the Python hooks call, to add up the bytes
    of each tensor passed to it."""

    def __init__(self):
        self.bytes = 0
        self._all_reduce = dist.all_reduce

    def __enter__(self):
        def counting(tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size()
            return self._all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._all_reduce


def main():
    p = ArgumentParser(description="DDP communication hooks: step time and bytes")
    p.add_argument(
        "--model", default="cnn", choices=sorted(MODELS), help="network, as ddp_comm.py --model"
    )
    p.add_argument("--batch-size", type=int, default=128, help="samples per process per step")
    p.add_argument("--rounds", type=int, default=5, help="alternations over the options")
    p.add_argument("--steps", type=int, default=20, help="timed steps of each option per round")
    p.add_argument("--powersgd-rank", type=int, default=4, help="as ddp_comm.py --powersgd-rank")
    p.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if present"
    )
    opts = p.parse_args()
    if min(opts.batch_size, opts.rounds, opts.steps, opts.powersgd_rank) < 1:
        p.error("--batch-size, --rounds, --steps and --powersgd-rank must be at least 1")
    info = init_distributed_mode(device=opts.device)
    if not info.distributed:
        p.error(
            "run it under torchrun with 2 or more processes: one process has nothing to all-reduce"
        )
    try:
        device, fmt = info.device, torch.channels_last
        models, opts_per_hook = {}, {}
        for hook in HOOKS:
            flags = ["--model", opts.model, "--comm-hook", hook]
            args = ddp_comm.get_args([*flags, "--powersgd-rank", str(opts.powersgd_rank)])
            torch.manual_seed(0)
            model = build_model(opts.model, 1, 10).to(device, memory_format=fmt)
            model = DDP(model, [info.device.index] if info.device.type == "cuda" else None)
            # PowerSGD compresses from the third step: the warm-up below covers the first two.
            ddp_comm.register_comm_hook(model, args, start=2, step=0)
            models[hook] = model
            opts_per_hook[hook] = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        grad_bytes = sum(
            q.numel() * q.element_size() for q in models["none"].parameters() if q.requires_grad
        )

        def sync():
            if device.type == "cuda":
                torch.cuda.synchronize()

        def run(hook, steps):
            model, opt = models[hook], opts_per_hook[hook]
            x = torch.randn(opts.batch_size, 1, 28, 28, device=device).contiguous(memory_format=fmt)
            y = torch.randint(10, (opts.batch_size,), device=device)
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()  # the all-reduce (through the hook) happens in here
                opt.step()
            sync()
            return (time.perf_counter() - t0) / steps

        for hook in HOOKS:
            run(hook, 3)  # warm-up: DDP rebuilds buckets after step 1; PowerSGD starts at step 3
        sent = {"none": grad_bytes}
        for hook in HOOKS[1:]:
            with ByteCounter() as counter:
                run(hook, 1)
            sent[hook] = counter.bytes
        times = {hook: [] for hook in HOOKS}
        for _ in range(opts.rounds):
            for hook in HOOKS:
                times[hook].append(run(hook, opts.steps))
        if info.rank == 0:
            ms = {hook: 1000 * statistics.median(t) for hook, t in times.items()}
            result = dict(
                model=opts.model,
                params=sum(q.numel() for q in models["none"].parameters()),
                world_size=info.world_size,
                batch_size=opts.batch_size,
                device=device.type,
                rounds=opts.rounds,
                steps=opts.steps,
                powersgd_rank=opts.powersgd_rank,
                ms_per_step=ms,
                bytes_per_step=sent,
                time_ratio={hook: ms[hook] / ms["none"] for hook in HOOKS},
                bytes_ratio={hook: sent[hook] / grad_bytes for hook in HOOKS},
            )
            print(json.dumps(result), flush=True)
        # Leave together (all ranks participate): a rank tearing its group down while the
        # other has gone could abort at exit.
        dist.barrier()
    finally:
        cleanup()


if __name__ == "__main__":
    main()
