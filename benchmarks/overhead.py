"""ddp_train.py's training step against a bare DDP loop, interleaved in the same processes.

    torchrun --standalone --nproc_per_node=2 benchmarks/overhead.py --rounds 8 --steps 50

Each round runs `--steps` steps of a bare loop (random batches straight from the in-memory
tensors: forward, backward, SGD step, nothing else) and then ddp_train.main() itself for
`--steps` + 1 steps of its first epoch, in the same process group (DataLoader,
DistributedSampler, schedule, AMP scaler, progress bar, loss sums and non-finite checks); its
step time is the time between the first and the last training forward, so its start-up and
the evaluation after the epoch stay out. Alternating the two in one run cancels the drift of
a shared machine, which between two separate runs is larger than the difference measured.
Both run ddp_train.py's defaults (model, batch size, channels_last). Prints one JSON line on
rank 0.
"""

import contextlib
import io
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ddp_train  # noqa: E402
from common import ArgumentParser, cleanup, fail, init_distributed_mode
from data import DATASETS, load_datasets
from models import build_model


def main():
    p = ArgumentParser(description="ddp_train.py's step against a bare DDP loop")
    p.add_argument("--data", default="fashion-mnist", choices=DATASETS, help="as ddp_train.py")
    p.add_argument("--data-dir", default="data", help="data root (as ddp_train.py)")
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
    data = ["--data", opts.data, "--data-dir", opts.data_dir]
    args = ddp_train.get_args(data)  # the defaults
    info = init_distributed_mode(device=opts.device)
    # ddp_train.main() runs in this process group, and leaves it up.
    ddp_train.init_distributed_mode, ddp_train.cleanup = lambda **_: info, lambda: None
    try:
        torch.manual_seed(0)
        train_set, _, num_classes, in_channels = load_datasets(args.data, args.data_dir)
        fmt = torch.channels_last
        size = train_set.images.shape[-1]
        model = build_model(args.model, in_channels, num_classes, image_size=size)
        model = model.to(info.device, memory_format=fmt)
        if info.distributed:  # DDP as ddp_train.py sets it up
            device_ids = [info.device.index] if info.device.type == "cuda" else None
            model = DDP(model, device_ids, gradient_as_bucket_view=True)
        opt = torch.optim.SGD(
            model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4, nesterov=True
        )
        x, y = train_set.images, train_set.labels
        if (epoch := len(y) // info.world_size // args.batch_size) <= opts.steps:
            fail(f"--steps {opts.steps}: at most {epoch - 1} (one epoch of ddp_train.py's)")

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

        def script(seed):
            stamps = []

            def stamp(module, inputs):  # each training step's forward of the whole model
                if module.training and type(module) is model_class:
                    sync()
                    stamps.append(time.perf_counter())

            hook = torch.nn.modules.module.register_module_forward_pre_hook(stamp)
            argv = [*data, "--device", info.device.type, "--seed", seed, "--epochs", 1]
            with contextlib.redirect_stdout(io.StringIO()):
                ddp_train.main([*map(str, argv), "--max-steps", str(opts.steps + 1)])
            hook.remove()
            return (stamps[-1] - stamps[0]) / (len(stamps) - 1)

        model_class = type(model.module if info.distributed else model)
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
