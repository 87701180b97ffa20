"""Data-parallel training with DistributedDataParallel (DDP), launched by torchrun.

Every process holds a whole copy of the model and trains on its own shard of each global
batch; during backward() DDP averages the gradients over all processes, so every copy takes
the same optimizer step: the result equals one process training on the whole batch. This is
the recommended way to use several GPUs or machines whenever the model fits on one device.

Launch (the same file, nothing to edit; see README.md for SLURM and mpirun):
    python ddp_train.py                                     # one process, CPU or one GPU
    torchrun --standalone --nproc_per_node=2 ddp_train.py   # one node, 2 processes
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 --rdzv-id=myjob ddp_train.py   # on every node
    torchrun --standalone --nproc_per_node=2 --max-restarts=3 \\
        ddp_train.py --output-dir runs/ddp --save-every 200     # restarts after a failure

A restart (or a rerun with the same --output-dir) resumes from the last snapshot, in the
middle of an epoch where --save-every wrote one. dp_train.py (nn.DataParallel) and
ddp_mp_spawn.py (the same DDP, started by mp.spawn) are shorter copies of this file without
its advanced options (gradient compression, mid-epoch snapshots, --eval-only): diff them
against it to see what a strategy or a launcher changes. torchrun hands restarted workers the
failed attempt's store, which still holds the dead workers' addresses; the process group of
each attempt therefore starts under keys of its own (common.process_group_store).

Learning rate: --batch-size is per process (global batch: batch_size x world_size x
accum_steps); --lr is the peak rate per 256 samples of global batch, scaled linearly (Goyal et
al., 2017: "Accurate, Large Minibatch SGD"); the warm-up keeps large scaled rates stable.

Communication (benchmarks/overlap.py, 2 processes on this 2-core machine). DDP sends each
bucket of gradients (25 MB) while backward still computes earlier layers: for ResNet-18 with 4
images per process (45 MB of gradients, 340 ms a step) one blocking all-reduce after backward
is 1.3x slower. The options below send or keep less; they pay where the network or memory
bounds the step (many nodes, slow links: at 1 Gbit/s those 45 MB take 0.36 s), not for the
small CNN (0.1 MB) here. --comm-hook: fp16/bf16 halve the bytes, PowerSGD sends 6-72x fewer.
--local-sgd-period K (post-local SGD, Lin et al., 2018): after --local-sgd-start plain steps
each rank steps alone, and the weights are averaged every K steps: 1/K of the bytes (K = 16:
ResNet-18's step 0.7-0.9x). --zero (ZeRO stage 1, Rajbhandari et al., 2020): each rank keeps
the momentum of its share of the parameters, and sends twice DDP's bytes (ResNet-18: 1.13x).
On Fashion-MNIST (small CNN, 3 epochs) all reach 91.2-91.4% test accuracy, as DDP does.
"""

import argparse
import contextlib
import functools
import itertools
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import LambdaLR, OneCycleLR
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm

from common import (
    DATASETS,
    MODELS,
    ArgumentParser,
    append_metrics,
    broadcast_object,
    build_model,
    check_output_dir,
    cleanup,
    collate,
    eval_shard,
    evaluate,
    fail,
    fast_forward,
    first_line,
    imagefolder_size,
    init_distributed_mode,
    load_checkpoint,
    load_datasets,
    load_model_state,
    load_optimizer_state,
    peer_failed,
    print0,
    reduce_value,
    rng_state,
    save_checkpoint,
    seed_everything,
    set_rng_state,
    together,
    trim_metrics,
)


def get_args(argv=None):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="fashion-mnist", choices=DATASETS, help="data set")
    p.add_argument("--data-dir", default="data", help="root holding the data set (torchvision layout)")
    p.add_argument("--download", action="store_true", help="download the data set if missing")
    p.add_argument("--image-size", type=int, help="imagefolder: crop size (default: the images', at most 224)")
    p.add_argument("--model", default="cnn", choices=sorted(MODELS), help="network")
    p.add_argument("--epochs", type=int, default=5, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=128, help="samples per process per step")
    p.add_argument("--lr", type=float, default=0.2, help="peak learning rate per 256 samples of global batch")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD (Nesterov) momentum")
    p.add_argument("--weight-decay", type=float, default=5e-4, help="L2 penalty")
    p.add_argument("--label-smoothing", type=float, default=0.1, help="for the training loss")
    p.add_argument("--schedule", default="onecycle", choices=["onecycle", "cosine"], help="lr schedule")
    p.add_argument("--warmup", type=float, default=0.2, help="fraction of all steps spent warming up")
    p.add_argument("--augment", action="store_true", help="random crop and flip of each batch (use for CIFAR-10)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and shuffling")
    p.add_argument("--amp", default="none", choices=["none", "bf16", "fp16"], help="mixed precision")
    p.add_argument("--accum-steps", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    nhwc = "NHWC memory format: 1.8x faster convolutions on this CPU (oneDNN), tensor cores on GPUs"
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True, help=nhwc)
    p.add_argument("--sync-bn", action="store_true", help="BatchNorm statistics over all ranks (CUDA)")
    hooks = ["none", "fp16", "bf16", "powersgd"]
    p.add_argument("--comm-hook", default="none", choices=hooks, help="compress the gradients' all-reduce")
    p.add_argument("--powersgd-rank", type=int, default=4, help="powersgd: rank of the approximation per matrix")
    p.add_argument("--powersgd-start", type=int, help="powersgd: plain steps first (default: the lr warm-up's)")
    p.add_argument("--local-sgd-period", type=int, help="local SGD: average the weights every K steps")
    p.add_argument("--local-sgd-start", type=int, help="local SGD: plain DDP steps first (default: the warm-up's)")
    p.add_argument("--zero", action="store_true", help="shard SGD's momentum over the ranks (ZeRO stage 1)")
    p.add_argument("--clip-grad", type=float, default=0.0, help="max gradient norm; 0 turns clipping off")
    p.add_argument("--resume", help="checkpoint to resume from (default: OUTPUT_DIR/checkpoint.pt if present)")
    p.add_argument("--eval-only", action="store_true", help="only evaluate the model given by --resume")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps; 0: no limit")
    p.add_argument("--output-dir", help="where checkpoint.pt and metrics.jsonl go; none: write nothing")
    p.add_argument("--save-every", type=int, default=0, help="steps between mid-epoch snapshots; 0: epoch ends only")
    p.add_argument("--log-every", type=int, default=50, help="steps between progress updates (and non-finite checks)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if present")
    p.add_argument("--backend", choices=["gloo", "nccl", "mpi"], help="default: nccl on CUDA, else gloo")
    p.add_argument("--dist-timeout", type=float, default=300, help="seconds before a missing peer ends the job")
    args = p.parse_args(argv)
    a = vars(args)
    for name in ("epochs", "batch_size", "accum_steps", "log_every", "image_size", "powersgd_rank", "local_sgd_period"):
        if a[name] is not None and a[name] < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {a[name]}")
    for name in ("max_steps", "clip_grad", "workers", "save_every", "powersgd_start", "local_sgd_start"):
        if (a[name] or 0) < 0:
            fail(f"--{name.replace('_', '-')} cannot be negative, got {a[name]}")
    for name in ("lr", "dist_timeout"):
        if not a[name] > 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {a[name]}")
    if not 0 <= args.warmup < 1:
        fail(f"--warmup is a fraction of the run, in [0, 1); got {args.warmup}")
    if args.save_every and not args.output_dir:
        fail("--save-every needs --output-dir (where the snapshots go)")
    if args.eval_only and not args.resume:
        fail("--eval-only needs --resume PATH (the checkpoint to evaluate)")
    if args.comm_hook == "powersgd" and args.amp == "fp16":
        # One fp16 overflow puts inf into PowerSGD's error feedback, which it then adds to every
        # later gradient: every step after is skipped by the GradScaler, the loss looks fine.
        fail("--comm-hook powersgd cannot take --amp fp16 (an overflow poisons its error feedback); use --amp bf16")
    if args.local_sgd_start is not None and not args.local_sgd_period:
        fail("--local-sgd-start needs --local-sgd-period")
    if args.local_sgd_period and (args.comm_hook != "none" or args.zero):
        # No gradients to compress; and ZeRO steps each rank's shard with the averaged gradients.
        fail("--local-sgd-period all-reduces no gradients: it cannot take --comm-hook or --zero")
    return args


def make_scheduler(optimizer, args, total_steps):
    if args.schedule == "onecycle":
        # Cosine warm-up and decay; cycle_momentum=False keeps Nesterov momentum fixed.
        peaks = [g["lr"] for g in optimizer.param_groups]
        pct_start = max(args.warmup, 1e-3)
        return OneCycleLR(optimizer, peaks, total_steps, pct_start=pct_start, cycle_momentum=False)
    warmup = max(1, int(args.warmup * total_steps))

    def factor(step):  # linear warm-up to the peak, then cosine decay to zero
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total_steps - warmup))))

    return LambdaLR(optimizer, factor)


def check_finite(totals, first_bad_step, info):
    """Stop every rank together if any rank saw a non-finite loss. All ranks participate:
    `totals` was all-reduced, so all see the same NaN and take the same branch here."""
    if torch.isfinite(totals).all():
        return
    if info.distributed:
        dist.all_reduce(first_bad_step, op=dist.ReduceOp.MIN)
    at = int(first_bad_step.item())
    fail(f"non-finite loss at step {at}: lower --lr, add --clip-grad, or use --amp bf16 instead of fp16")


def random_crop_flip(images, pad=4):
    """The standard CIFAR augmentation, a whole batch on its device in one indexing operation: each image
    shifted by up to `pad` pixels (a crop of the zero-padded image) and flipped left-right with p = 1/2."""
    n, _, h, w = images.shape
    dev = images.device
    padded = F.pad(images, (pad, pad, pad, pad)).permute(0, 2, 3, 1)  # (N, H+2p, W+2p, C)
    dy = torch.randint(0, 2 * pad + 1, (n, 1, 1), device=dev)
    dx = torch.randint(0, 2 * pad + 1, (n, 1, 1), device=dev)
    flip = torch.rand(n, 1, 1, device=dev) < 0.5
    y, x = torch.arange(h, device=dev).view(1, h, 1), torch.arange(w, device=dev).view(1, 1, w)
    rows = (dy + y).expand(n, h, w)
    cols = (dx + torch.where(flip, w - 1 - x, x)).expand(n, h, w)
    batch = torch.arange(n, device=dev).view(n, 1, 1).expand(n, h, w)
    return padded[batch, rows, cols].permute(0, 3, 1, 2)  # back to (N, C, H, W), NHWC in memory


def train_one_epoch(model, loader, optimizer, scheduler, scaler, autocast, args, info, step, steps, snapshot=None):
    """One pass over this rank's shard (or its rest after a mid-epoch resume); returns (mean train
    loss over all ranks, step, steps done). snapshot(step) saves a checkpoint every --save-every steps."""
    model.train()
    device = info.device
    # Loss and sample sums, and the first non-finite step, stay on the device: .item() stalls a GPU.
    loss_sum, count, first_bad_step = torch.tensor([0, 0, math.inf], device=device, dtype=torch.float64)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    done = 0
    # `with` closes the bar also when a non-finite loss stops the run, so the error is a line of its own.
    with tqdm(total=steps, desc=f"step {step}", disable=info.rank != 0, mininterval=1.0, leave=False) as bar:
        for i, (images, labels) in enumerate(loader):
            images = images.to(device, non_blocking=True)
            if args.augment:
                images = random_crop_flip(images)  # on the device, the whole batch at once
            images = images.contiguous(memory_format=memory_format)
            labels = labels.to(device, non_blocking=True)
            # Gradient accumulation: no_sync() keeps all but the last micro-batch's gradients
            # local, where they add up in .grad: one all-reduce per step.
            last_micro = (i + 1) % args.accum_steps == 0
            sync = contextlib.nullcontext() if last_micro or not info.distributed else model.no_sync()
            with sync:
                with autocast():
                    loss = F.cross_entropy(model(images), labels, label_smoothing=args.label_smoothing)
                # Mean over micro-batches: each contributes 1/accum of the step's gradient.
                scaler.scale(loss / args.accum_steps).backward()
            loss = loss.detach()
            loss_sum += loss * labels.numel()
            count += labels.numel()
            first_bad_step = torch.where(torch.isfinite(loss), first_bad_step, torch.clamp(first_bad_step, max=step))
            if not last_micro:
                continue
            if args.clip_grad > 0:
                scaler.unscale_(optimizer)  # clip the true gradients, not the fp16-scaled ones
                nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            scaler.step(optimizer)  # skips the step if fp16 gradients overflowed
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step, done = step + 1, done + 1
            bar.update()
            last = done == steps or step == args.max_steps
            save = snapshot and args.save_every and step % args.save_every == 0 and not last
            if args.local_sgd_period and step > args.local_sgd_start:
                # Local SGD (the hook sent no gradients): average the weights every K steps, and before
                # an evaluation or a snapshot the momentum too: one model is evaluated and saved, and a
                # resume goes on exactly (all ranks participate).
                tensors = list(model.parameters())
                if last or save:
                    tensors += [m for s in optimizer.state.values() if (m := s.get("momentum_buffer")) is not None]
                if last or save or (step - args.local_sgd_start) % args.local_sgd_period == 0:
                    average_replicas(tensors)
            if step % args.log_every == 0 or last or save:
                # One all-reduce every log_every steps and before a snapshot (all ranks participate) feeds
                # the bar, and all ranks agree to stop on a NaN loss before it replaces a good checkpoint.
                totals = reduce_value(torch.stack([loss_sum, count]))
                check_finite(totals, first_bad_step, info)
                bar.set_description(f"step {step}")
                loss_now = totals[0].item() / totals[1].item()
                bar.set_postfix(loss=f"{loss_now:.4f}", lr=f"{scheduler.get_last_lr()[0]:.3g}")
            if save:
                snapshot(step)  # a mid-epoch checkpoint; all ranks participate
            if last:
                break
    return loss_now, step, done  # the last step's all-reduce summed the whole epoch


@torch.no_grad()
def average_replicas(tensors):
    """Average `tensors` over all ranks in place: one all-reduce of a flat copy (all ranks participate).
    Not PyTorch's model_averaging: it points each parameter at a slice of its flat buffer, which turns
    channels-last weights NCHW, and DDP warns "Grad strides do not match bucket view strides"."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for t, mean in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        t.copy_(mean.view(t.shape))


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that starts part-way into an epoch: its order depends only on (seed, epoch),
    so leaving out the first `skip` indices continues a mid-epoch snapshot exactly, none loaded for nothing."""

    skip = 0  # indices to leave out, in the current epoch

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self):
        return super().__len__() - self.skip


def build_loaders(args, train_set, test_set, info):
    """This rank's training sampler and loader, and its exact share of the test set."""
    rank, world = info.rank, info.world_size
    # A disjoint 1/world of a permutation of (seed, epoch) per rank; drop_last trims the set to
    # a multiple of world instead of padding it with repeats.
    train_sampler = ResumableSampler(train_set, num_replicas=world, rank=rank, seed=args.seed, drop_last=True)
    # The loaders' own generator: a loader draws a seed each time it starts an epoch, and from
    # the global RNG that draw would shift every later --augment crop after a resume.
    generator = torch.Generator().manual_seed(args.seed)
    loader_args = dict(num_workers=args.workers, collate_fn=collate, persistent_workers=args.workers > 0)
    loader_args.update(generator=generator, pin_memory=info.device.type == "cuda")  # pinned: copies overlap compute
    # drop_last: every step sees a full batch (steady BatchNorm statistics, one compiled shape).
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, drop_last=True, **loader_args)
    test_loader = DataLoader(eval_shard(test_set, rank, world), 2 * args.batch_size, **loader_args)
    return train_sampler, train_loader, test_loader


def wrap_ddp(model, info):
    """The one line that makes this data-parallel: DDP broadcasts rank 0's parameters and
    buffers here, so every copy starts equal."""
    if not info.distributed:
        return model
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)  # gradients live in the buckets: no copy


def register_comm_hook(model, args, step, total_steps):
    """Replace DDP's all-reduce of fp32 gradient buckets; returns the hook's state. fp16/bf16: each bucket
    is cast down, all-reduced, cast back: half the bytes, 3 (fp16) or 2 (bf16) significant digits, and
    fp16 overflows past 65504. PowerSGD (Vogels et al., 2019) sends two rank-r factors per gradient matrix
    (n, m): r(n + m) numbers instead of nm; error feedback adds what it dropped to the next step's
    gradient; vectors go as they are. Local SGD: nothing is sent, train_one_epoch averages the weights.
    Both begin with plain steps (the warm-up's by default): early training is the most sensitive."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook

    if args.comm_hook in ("fp16", "bf16"):
        model.register_comm_hook(None, getattr(default_hooks, f"{args.comm_hook}_compress_hook"))
        return None
    start = args.local_sgd_start if args.local_sgd_period else args.powersgd_start
    start = int(args.warmup * total_steps) if start is None else start
    if args.local_sgd_period:
        # No subgroup all-reduce either (post_local_gradient_allreduce): each rank keeps its own.
        state = post_localSGD_hook.PostLocalSGDState(None, None, start, post_local_gradient_allreduce=False)
        state.iter = step  # it counts steps: go on from the checkpoint's
        model.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
        return state
    # It counts steps from 0, also after a resume, and its error feedback (per rank, not saved) restarts
    # at zero; two plain steps first (DDP rebuilds its buckets after one); one seed: the factors must agree.
    first = max(2, start - step)
    state = powerSGD_hook.PowerSGDState(None, args.powersgd_rank, start_powerSGD_iter=first, random_seed=args.seed)
    hook = powerSGD_hook.powerSGD_hook
    model.register_comm_hook(state, in_bucket_order(hook) if dist.get_backend() == "gloo" else hook)
    return state


def in_bucket_order(hook):
    """Start a bucket's hook only when the previous bucket's has finished (gloo only). PowerSGD issues
    its 2nd and 3rd all-reduce from callbacks on gloo's threads while backward() goes on to the next
    bucket: two ranks could start different buckets' all-reduces at once, which kills the job ("Received
    data size doesn't match"; 2 of 3 ResNet-18 runs here). NCCL orders them on its stream."""

    def hook_in_order(state, bucket):
        if hook_in_order.previous is not None:
            hook_in_order.previous.wait()
        future = hook(state, bucket)
        hook_in_order.previous = None if bucket.is_last() else future
        return future

    hook_in_order.previous = None
    return hook_in_order


def train(args, info):
    device, rank, world = info.device, info.rank, info.world_size
    if args.sync_bn and device.type != "cuda":
        fail("--sync-bn needs CUDA: SyncBatchNorm has no CPU implementation")
    if args.local_sgd_period and not info.distributed:
        fail("--local-sgd-period needs 2 or more processes (torchrun): one process has no replicas to average")
    if args.amp == "fp16" and device.type == "cpu":
        print0("note: --amp fp16 on CPU is slow; bf16 is the CPU's mixed-precision type")
    unused = " and ".join(f for f, on in (("--comm-hook", args.comm_hook != "none"), ("--zero", args.zero)) if on)
    if unused and not info.distributed:
        print0(f"note: {unused} has no effect with one process (nothing to all-reduce or shard)")

    # Same seed on every rank: identical initial weights (DDP also broadcasts rank 0's).
    seed_everything(args.seed)
    if args.data == "imagefolder" and args.image_size is None:
        args.image_size = imagefolder_size(args.data_dir)
    train_set, test_set, num_classes, in_channels = load_datasets(
        args.data, args.data_dir, args.download, args.image_size, info.local_rank
    )
    if (shard := len(train_set) // world) < args.batch_size * args.accum_steps:
        sizes = f"--batch-size {args.batch_size} x --accum-steps {args.accum_steps}"
        fail(f"{sizes} is larger than one rank's shard ({shard} of {len(train_set)} samples)")

    train_sampler, train_loader, test_loader = build_loaders(args, train_set, test_set, info)
    steps_per_epoch = len(train_loader) // args.accum_steps
    total_steps = args.epochs * steps_per_epoch
    if args.local_sgd_period and args.local_sgd_start is None:
        args.local_sgd_start = int(args.warmup * total_steps)  # plain DDP through the lr warm-up

    model = build_model(args.model, in_channels, num_classes, image_size=train_set[0][0].shape[-1])
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device, memory_format=torch.channels_last if args.channels_last else torch.preserve_format)
    raw_model = model  # the bare module: saved, loaded and evaluated without wrappers

    # Only now, with data and flags found good, is anything written. Rank 0 checks for room (weights
    # and momentum) and every rank learns the outcome (all ranks participate), so all stop at once.
    model_bytes = sum(t.numel() * t.element_size() for t in raw_model.state_dict().values())
    out = together(lambda: check_output_dir(args.output_dir, 2 * model_bytes), run=bool(args.output_dir) and rank == 0)

    global_batch = args.batch_size * world * args.accum_steps
    lr = args.lr * global_batch / 256  # linear scaling rule
    sgd = dict(lr=lr, momentum=args.momentum, nesterov=True, weight_decay=args.weight_decay)
    zero = args.zero and info.distributed
    if zero:
        # Each rank steps its share of the parameters (whole tensors, largest first) and broadcasts it;
        # the checkpoint gathers the whole state, which loads into either optimizer at any world size.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, **sgd)
    else:
        optimizer = torch.optim.SGD(model.parameters(), **sgd)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    autocast = functools.partial(torch.autocast, device.type, dtype=amp_dtype, enabled=amp_dtype is not None)

    step = 0  # optimizer steps so far; the position in the data is divmod(step, steps_per_epoch)
    # Rank 0 alone finds and reads the checkpoint and sends it to all (all ranks participate): ranks
    # looking for themselves could see different files (a directory not shared between nodes, a stale
    # network file system), resume at different steps and deadlock.
    auto = Path(args.output_dir or "", "checkpoint.pt")
    resume = args.resume or (auto if args.output_dir and auto.is_file() else None)
    resume, ckpt = broadcast_object(together(lambda: (resume, resume and load_checkpoint(resume)), run=rank == 0))
    if resume:
        load_model_state(raw_model, ckpt["model"], resume)
        if not args.eval_only:
            saved = {"schedule": "onecycle", **ckpt["args"]}  # dp_train.py and ddp_mp_spawn.py: onecycle
            changed = [k for k in ("epochs", "schedule", "warmup") if saved[k] != getattr(args, k)]
            if changed:  # the schedule is a function of these: it cannot go on where it was
                was = ", ".join(f"--{k} {saved[k]}" for k in changed)
                fail(f"{resume} was trained with {was}; resume with the same, or start anew in another --output-dir")
            load_optimizer_state(optimizer, ckpt["optimizer"])  # ZeRO keeps this rank's share of it
            if ckpt["scaler"]:  # empty when saved without fp16: a new --amp fp16 starts a fresh scaler
                scaler.load_state_dict(ckpt["scaler"])
            # The same samples in the same order: go on after the last step saved, exactly.
            same_order = all(saved.get(k) == getattr(args, k) for k in ("batch_size", "accum_steps", "seed"))
            if same_order and ckpt["world_size"] == world and ckpt["steps_per_epoch"] == steps_per_epoch:
                step = ckpt["step"]
                set_rng_state(ckpt["rng"][rank])
            else:
                # Another world size or batch shards each epoch differently: a half-done epoch starts
                # again (its first part trained twice), while the schedule resumes at the same point.
                step = ckpt["epoch"] * steps_per_epoch
            epoch, epoch_step = divmod(step, steps_per_epoch)
            print0(f"resumed from {resume} at epoch {epoch}, step {epoch_step} of {steps_per_epoch}")

    # Made after the optimizer's state is loaded, with this run's rates, and moved to the step
    # the run goes on from (a function of the step alone).
    scheduler = make_scheduler(optimizer, args, total_steps)
    fast_forward(scheduler, step)

    if args.eval_only:
        test_loss, test_acc = evaluate(raw_model, test_loader, device, autocast())
        print0(f"eval {resume}: test_loss {test_loss:.4f} test_acc {test_acc:.4f} ({len(test_set)} samples)")
        return

    model = wrap_ddp(model, info)
    hooked = info.distributed and (args.comm_hook != "none" or args.local_sgd_period)
    hook_state = register_comm_hook(model, args, step, total_steps) if hooked else None
    if args.compile:
        model = torch.compile(model)  # compiled around DDP, so graph breaks follow its buckets

    start_epoch = step // steps_per_epoch
    metrics_path = out / "metrics.jsonl" if out else None
    if metrics_path and not (args.max_steps and step >= args.max_steps):  # a rerun with nothing to do keeps them
        trim_metrics(metrics_path, start_epoch)

    def snapshot(step):
        """Save what it takes to continue after `step` steps exactly (all ranks participate):
        with every rank's RNG state, a resume at the same world size goes on as if never stopped."""
        rngs = [rng_state()]
        if info.distributed:
            rngs = [None] * world
            dist.all_gather_object(rngs, rng_state())
        if zero:
            optimizer.consolidate_state_dict(to=0)  # rank 0 gathers every rank's share
        if out:  # global rank 0
            state = dict(model=raw_model.state_dict(), optimizer=optimizer.state_dict(), scaler=scaler.state_dict())
            # epoch: the one to continue (the next after an epoch's end); epoch_step: its steps already done
            epoch, epoch_step = divmod(step, steps_per_epoch)
            state.update(scheduler=scheduler.state_dict(), epoch=epoch, epoch_step=epoch_step, step=step)
            state.update(steps_per_epoch=steps_per_epoch, world_size=world, rng=rngs, args=vars(args))
            save_checkpoint(state, out / "checkpoint.pt")

    size = "x".join(map(str, train_set[0][0].shape[-2:]))
    print0(
        f"{args.model} on {args.data} ({size} images): {world} process(es) on {device.type}, "
        f"global batch {global_batch}, peak lr {lr:.3g}, {steps_per_epoch} steps/epoch"
    )
    if start_epoch >= args.epochs:
        print0(f"{resume} already holds all {args.epochs} epochs: nothing to train")
    for epoch in range(start_epoch, args.epochs):
        if args.max_steps and step >= args.max_steps:
            break
        train_sampler.set_epoch(epoch)  # without it every epoch repeats epoch 0's order
        # After a mid-epoch resume, leave out the samples of the steps already trained.
        epoch_step = step - epoch * steps_per_epoch
        train_sampler.skip = epoch_step * args.accum_steps * args.batch_size
        steps_left = steps_per_epoch - epoch_step
        t0 = time.perf_counter()
        train_loss, step, done = train_one_epoch(
            model, train_loader, optimizer, scheduler, scaler, autocast, args, info, step, steps_left, snapshot
        )
        epoch_seconds = time.perf_counter() - t0  # the loss all-reduce above synchronised
        if info.distributed:
            # BatchNorm's running statistics are per rank until DDP copies rank 0's at the next
            # forward; copy them now, so that every rank evaluates (and saves) the same model.
            for buffer in raw_model.buffers():
                dist.broadcast(buffer, src=0)  # all ranks participate
        test_loss, test_acc = evaluate(raw_model, test_loader, device, autocast())
        speed, lr_now = done * global_batch / epoch_seconds, scheduler.get_last_lr()[0]
        record = dict(epoch=epoch, step=step, train_loss=train_loss, test_loss=test_loss, test_acc=test_acc)
        record.update(epoch_seconds=epoch_seconds, samples_per_second=speed, lr=lr_now, world_size=world)
        losses = f"train_loss {train_loss:.4f} test_loss {test_loss:.4f} test_acc {test_acc:.4f}"
        print0(f"epoch {epoch}: {losses} {epoch_seconds:.1f}s {speed:.0f} samples/s")
        if not args.output_dir:
            continue
        # Metrics first: a crash before the checkpoint re-runs this epoch (or its rest) and the resume
        # trims its line: every epoch appears once, a resumed one with the figures of its rest.
        if out:
            append_metrics(metrics_path, record)
        snapshot(step)  # all ranks participate

    if args.comm_hook == "powersgd" and hook_state and hook_state.total_numel_after_compression:
        rate, start = hook_state.compression_stats()[0], hook_state.start_powerSGD_iter
        print0(f"powersgd: {rate:.1f}x fewer gradient numbers all-reduced than plain DDP after the first {start} steps")


def main(argv=None):
    args = get_args(argv)
    info = init_distributed_mode(backend=args.backend, device=args.device, timeout_s=args.dist_timeout)
    try:
        train(args, info)
        if info.distributed:
            # Leave together (all ranks participate): rank 0 hosts the rendezvous store, and a
            # rank still tearing its group down when rank 0's process is gone can abort at exit.
            dist.barrier()
    except RuntimeError as e:
        # A peer that died (killed, out of memory) or hung for --dist-timeout breaks the others'
        # collectives; gloo says so in a RuntimeError. Say it in one line.
        if not info.distributed or not peer_failed(e):
            raise
        detail = first_line(e).split(". ")[0]  # gloo adds a paragraph of general advice
        why = f"another process died or stopped responding ({detail}); the first error of the job is the cause"
        fail(f"rank {info.rank}: {why}; rerun with the same --output-dir to resume from its last checkpoint")
    finally:
        cleanup()  # also when training raised: peers are not left waiting on a dead group


if __name__ == "__main__":
    main()
