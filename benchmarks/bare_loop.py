"""The limit for ddp_train.py: a bare DDP loop over the same model and in-memory batches,
without the script's extras (no DataLoader, sampler, schedule, progress bar or checks).

    torchrun --standalone --nproc_per_node=2 benchmarks/bare_loop.py --steps 200
    python benchmarks/bare_loop.py --device cuda --model resnet18 --batch-size 256 \\
        --amp bf16 --augment

Prints one JSON line (rank 0): ms_per_step, the median time of forward, backward and
optimizer step alone; and ms_per_step_wall, the mean wall time per step over the whole timed
window including taking the batch from the in-memory tensors, which is what ddp_train.py's
epoch_seconds / steps measures (benchmarks/run_all.py compares against that one).

On CUDA the data set sits on the GPU (one tensor, as in airbench), nothing waits for the GPU
inside the timed window (a synchronize per step would stop the CPU from queueing the next
step while the GPU works), and ms_per_step is the median GPU time of a step (CUDA events).
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import ArgumentParser, cleanup, init_distributed_mode
from data import load_datasets
from models import build_model


def main():
    p = ArgumentParser(description="bare DDP training loop (the speed limit)")
    p.add_argument("--data", default="fashion-mnist", help="data set (as ddp_train.py)")
    p.add_argument("--data-dir", default="data", help="data root (as ddp_train.py)")
    p.add_argument("--model", default="cnn", help="network (as ddp_train.py)")
    p.add_argument("--batch-size", type=int, default=128, help="samples per process per step")
    p.add_argument("--steps", type=int, default=200, help="timed steps (after 20 warm-up steps)")
    p.add_argument(
        "--no-ddp", action="store_true", help="skip the DDP wrapper: no gradient all-reduce"
    )
    p.add_argument("--no-channels-last", action="store_true", help="NCHW instead of NHWC")
    p.add_argument(
        "--amp", default="none", choices=["none", "bf16"], help="autocast dtype (as ddp_train.py)"
    )
    p.add_argument(
        "--compile", action="store_true", help="torch.compile the model (compiled during warm-up)"
    )
    p.add_argument(
        "--augment", action="store_true", help="ddp_train.py's random crop and flip of each batch"
    )
    p.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if present"
    )
    args = p.parse_args()
    if args.steps < 1 or args.batch_size < 1:
        p.error("--steps and --batch-size must be at least 1")
    augment = None
    if args.augment:
        from ddp_train import random_crop_flip as augment  # the very same operation, not a copy
    info = init_distributed_mode(device=args.device)
    cuda = info.device.type == "cuda"
    # As ddp_train.py: cuDNN times its algorithms for each shape once and keeps the fastest.
    torch.backends.cudnn.benchmark = cuda
    try:
        torch.manual_seed(0)
        train_set, _, num_classes, in_channels = load_datasets(args.data, args.data_dir)
        fmt = torch.contiguous_format if args.no_channels_last else torch.channels_last
        size = train_set.images.shape[-1]
        model = build_model(args.model, in_channels, num_classes, image_size=size).to(
            info.device, memory_format=fmt
        )
        if info.distributed and not args.no_ddp:
            model = DDP(
                model,
                device_ids=[info.device.index] if cuda else None,
                gradient_as_bucket_view=True,
            )
        if args.compile:
            model = torch.compile(model)
        opt = torch.optim.SGD(
            model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4
        )
        x, y = train_set.images.to(info.device), train_set.labels.to(info.device)

        def autocast():
            return torch.autocast(
                info.device.type, dtype=torch.bfloat16, enabled=args.amp == "bf16"
            )

        def step():
            """One training step on a random in-memory batch; returns the seconds of forward,
            backward and optimizer step (the batch gather excluded), or on CUDA a pair of
            events around them, read after the window."""
            idx = torch.randint(len(y), (args.batch_size,), device=info.device)
            images = x[idx]
            if augment:
                images = augment(images)
            images = images.contiguous(memory_format=fmt)
            if cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
            t0 = time.perf_counter()
            with autocast():
                loss = F.cross_entropy(model(images), y[idx], label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if cuda:
                end.record()
                return start, end
            return time.perf_counter() - t0

        for _ in range(20):  # warm-up: oneDNN primitives / cuDNN kernels, DDP buckets, compile
            step()
        if cuda:
            torch.cuda.synchronize()
        window_start = time.perf_counter()
        times = [step() for _ in range(args.steps)]
        if cuda:
            torch.cuda.synchronize()
            times = [start.elapsed_time(end) / 1000 for start, end in times]
        window = time.perf_counter() - window_start
        if info.rank == 0:
            result = {"world_size": info.world_size, "ddp": info.distributed and not args.no_ddp}
            result.update(
                device=info.device.type, model=args.model, batch_size=args.batch_size, amp=args.amp
            )
            result.update(compile=args.compile, augment=args.augment)
            result["cudnn_benchmark"] = torch.backends.cudnn.benchmark
            result["ms_per_step"] = 1000 * statistics.median(times)
            result["ms_per_step_wall"] = 1000 * window / args.steps
            result["samples_per_second"] = args.steps * args.batch_size * info.world_size / window
            print(json.dumps(result), flush=True)
    finally:
        cleanup()


if __name__ == "__main__":
    main()
