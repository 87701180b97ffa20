"""ddp_train.py's training step against a bare DDP loop, interleaved in the same processes.

    torchrun --standalone --nproc_per_node=2 benchmarks/overhead.py --rounds 8 --steps 50

Each round runs `--steps` steps of a bare loop (random batches straight from the in-memory
tensors: forward, backward, SGD step, nothing else) and then `--steps` steps of
ddp_train.train_one_epoch() (DataLoader, DistributedSampler, schedule, AMP scaler,
progress bar, loss sums and non-finite checks) on the same DDP model. Alternating the two
in one run cancels the drift of a shared machine, which between two separate runs is larger
than the difference measured (30% seen here). Prints one JSON line on rank 0.
"""

import functools
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ddp_train  # noqa: E402
from common import ArgumentParser, build_model, cleanup, init_distributed_mode, load_datasets  # noqa: E402


def main():
    p = ArgumentParser(description="ddp_train.py's step against a bare DDP loop")
    p.add_argument(
        "--data-dir", default="data", help="root holding FashionMNIST/raw (as ddp_train.py)"
    )
    p.add_argument(
        "--rounds", type=int, default=8, help="alternations of bare loop and script loop"
    )
    p.add_argument("--steps", type=int, default=50, help="steps of each loop per round")
    p.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if present"
    )
    opts = p.parse_args()
    if opts.rounds < 1 or opts.steps < 1:
        p.error("--rounds and --steps must be at least 1")
    args = ddp_train.get_args(
        ["--data-dir", opts.data_dir, "--device", opts.device]
    )  # the defaults
    info = init_distributed_mode(device=opts.device)
    try:
        torch.manual_seed(0)
        train_set, test_set, num_classes, in_channels = load_datasets(args.data, args.data_dir)
        sampler, loader, _ = ddp_train.build_loaders(args, train_set, test_set, info)
        fmt = torch.channels_last
        model = build_model(args.model, in_channels, num_classes).to(info.device, memory_format=fmt)
        model = ddp_train.wrap_ddp(model, info)
        opt = torch.optim.SGD(
            model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4
        )
        scheduler = ddp_train.make_scheduler(opt, args, total_steps=10 * opts.rounds * opts.steps)
        scaler = torch.amp.GradScaler(info.device.type, enabled=False)
        autocast = functools.partial(torch.autocast, info.device.type, enabled=False)
        x, y = train_set.images, train_set.labels

        def sync():
            if info.device.type == "cuda":
                torch.cuda.synchronize()

        def bare():
            t0 = time.perf_counter()
            for _ in range(opts.steps):
                idx = torch.randint(len(y), (args.batch_size,))
                images = x[idx].to(info.device, memory_format=fmt)
                loss = F.cross_entropy(model(images), y[idx].to(info.device), label_smoothing=0.1)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            sync()
            return (time.perf_counter() - t0) / opts.steps

        def script(epoch):
            sampler.set_epoch(epoch)
            batches = itertools.islice(loader, opts.steps)
            t0 = time.perf_counter()
            ddp_train.train_one_epoch(
                model, batches, opt, scheduler, scaler, autocast, args, info, 0, opts.steps
            )
            sync()
            return (time.perf_counter() - t0) / opts.steps

        bare(), script(0)  # warm-up: oneDNN primitives, DDP buckets, allocator
        rounds = [(bare(), script(r + 1)) for r in range(opts.rounds)]
        if info.rank == 0:
            b = statistics.median(r[0] for r in rounds)
            s = statistics.median(r[1] for r in rounds)
            result = {
                "world_size": info.world_size,
                "bare_ms_per_step": 1000 * b,
                "script_ms_per_step": 1000 * s,
                "ratio": s / b,
                "ratio_per_round": [r[1] / r[0] for r in rounds],
            }
            print(json.dumps(result), flush=True)
    finally:
        cleanup()


if __name__ == "__main__":
    main()
