"""The input pipeline alone: one rank's pass over ddp_train.py's training loader (the very
loader its main() builds, with its defaults and sampler), with the copy to the device and the
channels_last layout the training loop applies, but no model.

    python benchmarks/input_pipeline.py --world-size 2

Prints one JSON line with the mean milliseconds per batch. --threads 1 (the default) matches
a worker under torchrun with 2 processes, which gets OMP_NUM_THREADS=1.
"""

import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ddp_train  # noqa: E402 - the repository root is on the path only now
from common import ArgumentParser, DistInfo  # noqa: E402


class Built(Exception):
    pass


def ddp_train_loader(argv, world_size):
    """The training loader ddp_train.main(argv) builds on rank 0 of world_size processes: main
    runs under a stand-in launcher until it has made its loaders (no process group needed)."""
    made = []

    def record(*args, **kwargs):
        made.append(torch.utils.data.DataLoader(*args, **kwargs))
        if len(made) == 2:  # the training loader, then the test loader
            raise Built
        return made[-1]

    info = DistInfo(False, 0, 0, world_size, world_size, torch.device("cpu"))
    ddp_train.DataLoader, ddp_train.init_distributed_mode = record, lambda **_: info
    with contextlib.suppress(Built):
        ddp_train.main(argv)
    return made[0]


def main():
    p = ArgumentParser(description="time ddp_train.py's training loader without a model")
    p.add_argument(
        "--world-size", type=int, default=2, help="shard the data as for this many processes"
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (torchrun gives 1 each)"
    )
    p.add_argument(
        "--max-batches", type=int, default=0, help="stop after this many batches; 0: one epoch"
    )
    args, rest = p.parse_known_args()
    if args.world_size < 1 or args.threads < 1 or args.max_batches < 0:
        p.error("--world-size and --threads must be at least 1; --max-batches cannot be negative")
    # Every other flag is ddp_train.py's (--batch-size, --workers, ...).
    train_args = ddp_train.get_args(rest)
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    loader = ddp_train_loader(rest, args.world_size)
    sampler = loader.sampler
    fmt = torch.channels_last if train_args.channels_last else torch.preserve_format

    sampler.set_epoch(0)
    batches = 0
    t0 = time.perf_counter()
    for images, labels in loader:
        images = images.to(device, non_blocking=True, memory_format=fmt)
        labels = labels.to(device, non_blocking=True)
        batches += 1
        if batches == args.max_batches:
            break
    seconds = time.perf_counter() - t0
    result = dict(
        world_size=args.world_size,
        threads=args.threads,
        batch_size=train_args.batch_size,
        batches=batches,
        seconds=seconds,
        ms_per_batch=1000 * seconds / max(batches, 1),
    )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
