"""Single-process data parallelism with nn.DataParallel.

One process drives every GPU of the machine: each forward() splits the batch across the
GPUs, copies the model to each of them, runs the pieces in threads and gathers the outputs
on GPU 0, where the loss and backward start. It needs no launcher, which is its one merit.

PyTorch's documentation recommends DistributedDataParallel instead, even on one machine:
DataParallel re-copies the model every step, funnels all outputs and gradients through
GPU 0, and is limited by Python's GIL. Use ddp_train.py (torchrun) for real work; this file
is here to show the difference, and for quick experiments on one multi-GPU box.

Launch:
    python dp_train.py                     # all visible GPUs; on CPU the model simply runs
    CUDA_VISIBLE_DEVICES=0,1 python dp_train.py --batch-size 256

Everything else (data, model, schedule, evaluation, checkpoints, flags) is ddp_train.py's,
imported rather than copied. Here --batch-size is the whole batch, split across the GPUs.
"""

import os

from torch import nn

import ddp_train
from common import cleanup, fail, init_distributed_mode


def wrap_data_parallel(model, info):
    # On CPU (no GPUs), DataParallel calls the module directly. The model stays reachable as
    # .module; common.unwrap() strips it, so checkpoints hold plain keys (no "module.").
    return nn.DataParallel(model)


def main(argv=None):
    args = ddp_train.get_args(argv, description=__doc__.splitlines()[0])
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        fail("dp_train.py runs as one process; for several processes use ddp_train.py with torchrun")
    if args.sync_bn:
        fail("--sync-bn is for DistributedDataParallel; DataParallel computes BatchNorm per GPU")
    if args.comm_hook != "none":
        fail("--comm-hook is for DistributedDataParallel; DataParallel has no all-reduce to compress")
    if args.backend:
        fail("--backend has no meaning for DataParallel (one process, no process group)")
    info = init_distributed_mode(device=args.device)
    try:
        ddp_train.train(args, info, wrap=wrap_data_parallel)
    finally:
        cleanup()


if __name__ == "__main__":
    main()
