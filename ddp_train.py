"""Data-parallel training with DistributedDataParallel (DDP), launched by torchrun.

Every process holds a whole copy of the model and trains on its own shard of each global
batch; during backward() DDP averages the gradients over all processes, so every copy takes
the step that one process would take on the whole batch. Use it whenever the model fits on
one device: it is the recommended way to train on several GPUs or machines.

Launch (the same file, nothing to edit; README.md has SLURM and mpirun):
    python ddp_train.py                                     # one process, CPU or one GPU
    torchrun --standalone --nproc_per_node=N ddp_train.py   # N: this machine's GPUs
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 --rdzv-id=myjob ddp_train.py   # on every node
    torchrun --standalone --nproc_per_node=2 --max-restarts=3 \\
        ddp_train.py --output-dir runs/ddp --save-every 200     # restarts after a failure

A restart, or a rerun with the same --output-dir, resumes from the last checkpoint (in the
middle of an epoch where --save-every wrote one) and goes on as if never stopped.
--batch-size is per process; --lr is the peak rate per 256 samples of the global batch,
scaled linearly and warmed up (Goyal et al., 2017, "Accurate, Large Minibatch SGD").
ddp_comm.py is this script plus ways to send less (gradient compression, local SGD, ZeRO);
dp_train.py (nn.DataParallel) and ddp_mp_spawn.py (mp.spawn) are shorter copies of it.
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
from torch.optim.lr_scheduler import OneCycleLR
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm

from checkpoint import (
    append_metrics,
    check_output_dir,
    load_checkpoint,
    load_model_state,
    load_optimizer_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
    trim_metrics,
)
from common import (
    ArgumentParser,
    broadcast_object,
    check_flags,
    cleanup,
    fail,
    init_distributed_mode,
    peer_failure,
    print0,
    reduce_value,
    together,
)
from data import DATASETS, collate, eval_shard, load_datasets
from models import MODELS, MirrorAveraged, build_model, seed_everything
from profiling import Profiler, add_flags, flop_rates, step_flops
from training import amp_note, evaluate, fast_forward, warmup_decay


def get_args(argv=None):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--data", default="fashion-mnist", choices=DATASETS, help="data set")
    add("--data-dir", default="data", help="root holding the data set (torchvision's layout)")
    add("--download", action="store_true", help="download the data set if it is missing")
    add("--image-size", type=int, help="imagefolder: crop size (default: the images', <= 224)")
    add("--model", default="cnn", choices=sorted(MODELS), help="network")
    add("--epochs", type=int, default=5, help="passes over the training set")
    add("--batch-size", type=int, default=128, help="samples per process per micro-batch")
    add("--accum-steps", type=int, default=1, help="micro-batches per optimizer step")
    add("--lr", type=float, default=0.2, help="peak learning rate per 256 samples of global batch")
    add("--momentum", type=float, default=0.9, help="SGD (Nesterov) momentum")
    add("--weight-decay", type=float, default=5e-4, help="L2 penalty")
    add("--label-smoothing", type=float, default=0.1, help="for the training loss")
    add("--schedule", default="onecycle", choices=["onecycle", "cosine"], help="lr schedule")
    add("--warmup", type=float, default=0.2, help="fraction of the steps warming up; 0: none")
    add("--augment", action="store_true", help="random crop and flip (use it for CIFAR-10)")
    add("--tta", action="store_true", help="evaluate on each image and its mirror (with --augment)")
    add("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    add("--seed", type=int, default=0, help="seed for the weights and the shuffling")
    add("--amp", default="none", choices=["none", "bf16", "fp16"], help="mixed precision")
    add("--compile", action="store_true", help="torch.compile the model")
    nhwc = "NHWC memory format: faster convolutions (oneDNN on CPU, tensor cores on GPU)"
    add("--channels-last", action=argparse.BooleanOptionalAction, default=True, help=nhwc)
    add("--sync-bn", action="store_true", help="BatchNorm statistics over all ranks (CUDA)")
    add("--clip-grad", type=float, default=0.0, help="max gradient norm; 0: no clipping")
    add("--resume", help="checkpoint to resume from (default: OUTPUT_DIR/checkpoint.pt if any)")
    add("--eval-only", action="store_true", help="only evaluate the model given by --resume")
    add("--max-steps", type=int, default=0, help="stop after this many steps; 0: no limit")
    add("--output-dir", help="where checkpoint.pt and metrics.jsonl go; none: write nothing")
    add("--save-every", type=int, default=0, help="steps between mid-epoch checkpoints; 0: none")
    add("--log-every", type=int, default=50, help="steps between progress and NaN checks")
    add("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if any")
    add("--backend", choices=["gloo", "nccl", "mpi"], help="default: nccl on CUDA, else gloo")
    add("--dist-timeout", type=float, default=300, help="seconds before a lost peer ends the job")
    add_flags(p)  # --profile DIR, --peak-tflops (profiling.py)
    args = p.parse_args(argv)
    at_least_1 = ("epochs", "batch_size", "accum_steps", "log_every", "image_size")
    not_negative = ("max_steps", "clip_grad", "workers", "save_every")
    check_flags(args, at_least_1, not_negative, positive=("lr", "dist_timeout", "peak_tflops"))
    if not 0 <= args.warmup < 1:
        fail(f"--warmup is a fraction of the run, in [0, 1); got {args.warmup}")
    if args.save_every and not args.output_dir:
        fail("--save-every needs --output-dir (where the checkpoints go)")
    if args.eval_only and not args.resume:
        fail("--eval-only needs --resume PATH (the checkpoint to evaluate)")
    return args


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start part-way into an epoch: its order depends only on
    (seed, epoch), so leaving out the first `skip` indices goes on exactly where a checkpoint
    was taken, without loading the skipped samples."""

    skip = 0

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self):
        return super().__len__() - self.skip


def random_crop_flip(images, pad=4):
    """The standard CIFAR augmentation on the device, for a whole batch in one indexing:
    each image shifted by up to `pad` pixels (a crop of the zero-padded image), and flipped
    left-right with probability 1/2."""
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
    return padded[batch, rows, cols].permute(0, 3, 1, 2)  # (N, C, H, W), NHWC in memory


def make_scheduler(optimizer, args, total_steps):
    if args.schedule == "cosine":  # linear warm-up, then cosine decay to zero
        return warmup_decay(optimizer, args.warmup, total_steps)
    # One-cycle: cosine warm-up from 1/25 of the peak, then cosine decay; cycle_momentum=False
    # keeps Nesterov's momentum fixed. A warm-up of a step or less is none, the first step at
    # the peak (OneCycleLR divides by zero at one step, and below it starts at 1/25 of it).
    peaks = [g["lr"] for g in optimizer.param_groups]
    warmup = args.warmup if args.warmup * total_steps > 1 else 0.0
    return OneCycleLR(optimizer, peaks, total_steps, pct_start=warmup, cycle_momentum=False)


def main(argv=None):
    args = get_args(argv)
    # The process group: rank, world size and device from whichever launcher started us.
    info = init_distributed_mode(
        backend=args.backend, device=args.device, timeout_s=args.dist_timeout
    )
    device, rank, world = info.device, info.rank, info.world_size
    try:
        if args.sync_bn and device.type != "cuda":
            fail("--sync-bn needs CUDA: SyncBatchNorm has no CPU implementation")
        amp_note(args.amp, device)  # fp16 on a CPU, bf16 on a GPU before Ampere: slow
        seed_everything(args.seed)  # the same initial weights on every rank

        # Data: each rank trains on a disjoint 1/world of a permutation of (seed, epoch).
        # drop_last trims the set to a multiple of world instead of padding it with repeats.
        train_set, test_set, num_classes, in_channels = load_datasets(
            args.data, args.data_dir, args.download, args.image_size, info.local_rank
        )
        if (shard := len(train_set) // world) < args.batch_size * args.accum_steps:
            sizes = f"--batch-size {args.batch_size} x --accum-steps {args.accum_steps}"
            fail(f"{sizes} is larger than one rank's shard ({shard} of {len(train_set)} samples)")
        # On a GPU an in-memory data set moves there once: a batch is one indexing there, in the
        # sampler's order, no copy a step. Not with --workers: they cannot share CUDA tensors.
        on_gpu = device.type == "cuda" and args.workers == 0 and hasattr(train_set, "to")
        if on_gpu:
            train_set, test_set = train_set.to(device), test_set.to(device)
        sampler = ResumableSampler(train_set, world, rank, seed=args.seed, drop_last=True)
        # The loader's own generator: from the global RNG, the seed a loader draws at each
        # epoch would shift every later --augment crop after a resume.
        generator = torch.Generator().manual_seed(args.seed)
        loader_args = dict(num_workers=args.workers, collate_fn=collate, generator=generator)
        # Pinned memory: host-to-GPU copies overlap compute.
        pin = device.type == "cuda" and not on_gpu
        loader_args.update(persistent_workers=args.workers > 0, pin_memory=pin)
        # drop_last: every step a full batch (steady BatchNorm statistics, one compiled shape).
        train_loader = DataLoader(
            train_set, args.batch_size, sampler=sampler, drop_last=True, **loader_args
        )
        # Exact evaluation: every test sample once over all ranks, none padded in.
        test_shard = eval_shard(test_set, rank, world)
        test_loader = DataLoader(test_shard, 2 * args.batch_size, **loader_args)
        steps_per_epoch = len(train_loader) // args.accum_steps
        total_steps = args.epochs * steps_per_epoch

        # The model, on this rank's device. DDP wraps it after the resume below has loaded
        # the weights; it then broadcasts rank 0's, so every copy starts equal.
        image_size = train_set[0][0].shape[-1]
        model = build_model(args.model, in_channels, num_classes, image_size=image_size)
        if args.sync_bn:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
        model = model.to(device, memory_format=memory_format)
        # cuDNN times its algorithms on a shape's first batch and keeps the fastest; its pick can
        # vary between runs, and the rounding with it, unless deterministic algorithms are on.
        torch.backends.cudnn.benchmark = device.type == "cuda"
        raw_model = model  # the bare module: saved, loaded and evaluated without wrappers
        tta_model = MirrorAveraged(raw_model) if args.tta else raw_model  # what is evaluated

        # Only now, with data and flags found good, is anything written (all ranks participate):
        # --profile's directory, and the output directory, which rank 0 checks for all.
        profiler = Profiler(args.profile, rank, device)  # a trace of a few steps per rank
        check = lambda: check_output_dir(args.output_dir)  # noqa: E731
        out = together(check, run=bool(args.output_dir) and rank == 0)  # a Path on rank 0

        # Optimizer, schedule, scaler. Linear scaling: the peak rate grows with the batch.
        global_batch = args.batch_size * world * args.accum_steps
        lr = args.lr * global_batch / 256
        flops = step_flops(raw_model, (global_batch, *train_set[0][0].shape))  # a step, all ranks
        optimizer = torch.optim.SGD(
            model.parameters(), lr, args.momentum, weight_decay=args.weight_decay, nesterov=True
        )
        scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
        amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
        autocast = functools.partial(torch.autocast, device.type, amp_dtype, amp_dtype is not None)

        # Resume. Rank 0 alone finds and reads the checkpoint and sends it to all (all ranks
        # participate): ranks looking for themselves could see different files (a directory
        # not shared between nodes), resume at different steps and deadlock.
        step = 0  # optimizer steps so far; the place in the data is divmod(step, steps_per_epoch)
        auto = Path(args.output_dir or "", "checkpoint.pt")
        resume = args.resume or (auto if args.output_dir and auto.is_file() else None)
        load = lambda: (resume, resume and load_checkpoint(resume))  # noqa: E731
        resume, ckpt = broadcast_object(together(load, run=rank == 0))
        if resume:
            load_model_state(raw_model, ckpt["model"], resume)
        if resume and not args.eval_only:
            saved = {"schedule": "onecycle", **ckpt["args"]}  # the shorter copies: onecycle
            changed = [k for k in ("epochs", "schedule", "warmup") if saved[k] != getattr(args, k)]
            if changed:  # the schedule is a function of these: it cannot go on where it was
                was = ", ".join(f"--{k} {saved[k]}" for k in changed)
                again = "resume with the same, or start anew in another --output-dir"
                fail(f"{resume} was trained with {was}; {again}")
            load_optimizer_state(optimizer, ckpt["optimizer"])  # with this run's --lr
            if ckpt["scaler"]:  # empty when saved without fp16
                scaler.load_state_dict(ckpt["scaler"])
            # The same samples in the same order: go on after the last step saved, exactly.
            same = ("batch_size", "accum_steps", "seed")
            same_order = all(saved.get(k) == getattr(args, k) for k in same)
            same_shards = (ckpt["world_size"], ckpt["steps_per_epoch"]) == (world, steps_per_epoch)
            if same_order and same_shards:
                step = ckpt["step"]
                set_rng_state(ckpt["rng"][rank], device)
            else:
                # Another world size or batch shards each epoch differently: a half-done
                # epoch starts again, while the schedule resumes at the same point.
                step = ckpt["epoch"] * steps_per_epoch
            epoch, epoch_step = divmod(step, steps_per_epoch)
            print0(
                f"resumed from {resume} at epoch {epoch}, step {epoch_step} of {steps_per_epoch}"
            )
        # Made after the optimizer's state is loaded, with this run's rates, and moved to the
        # step the run goes on from (the rate is a function of the step alone).
        scheduler = make_scheduler(optimizer, args, total_steps)
        fast_forward(scheduler, step)

        if args.eval_only:
            loss, acc = evaluate(tta_model, test_loader, device, autocast())
            print0(
                f"eval {resume}: test_loss {loss:.4f} test_acc {acc:.4f} ({len(test_set)} samples)"
            )
            return

        # The one line that makes this data-parallel. Gradients live in DDP's buckets
        # (gradient_as_bucket_view): no copy between them and .grad.
        if info.distributed:
            device_ids = [device.index] if device.type == "cuda" else None
            model = DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)
        if args.compile:
            model = torch.compile(model)  # around DDP, so graph breaks follow its buckets

        def save(step):
            """A checkpoint that goes on after `step` steps exactly (all ranks participate):
            with every rank's RNG state, a resume at the same world size is as if never stopped."""
            rngs = [rng_state(device)]
            if info.distributed:
                rngs = [None] * world
                dist.all_gather_object(rngs, rng_state(device))
            if out:  # global rank 0
                epoch, epoch_step = divmod(step, steps_per_epoch)  # the epoch to go on with
                state = dict(model=raw_model.state_dict(), optimizer=optimizer.state_dict())
                state.update(scaler=scaler.state_dict(), scheduler=scheduler.state_dict())
                state.update(epoch=epoch, epoch_step=epoch_step, step=step, rng=rngs)
                state.update(steps_per_epoch=steps_per_epoch, world_size=world, args=vars(args))
                save_checkpoint(state, out / "checkpoint.pt")

        start_epoch = step // steps_per_epoch
        metrics = out / "metrics.jsonl" if out else None
        if metrics and not (args.max_steps and step >= args.max_steps):  # else nothing to do
            trim_metrics(metrics, start_epoch)  # epochs that run again lose their old lines
        size = "x".join(map(str, train_set[0][0].shape[-2:]))
        print0(
            f"{args.model} on {args.data} ({size} images): {world} process(es) on {device.type},"
            f" global batch {global_batch}, peak lr {lr:.3g}, {steps_per_epoch} steps/epoch"
        )
        if start_epoch >= args.epochs:
            print0(f"{resume} already holds all {args.epochs} epochs: nothing to train")
        for epoch in range(start_epoch, args.epochs):
            if args.max_steps and step >= args.max_steps:
                break
            sampler.set_epoch(epoch)  # without it every epoch repeats epoch 0's order
            epoch_step = step - epoch * steps_per_epoch
            sampler.skip = epoch_step * args.accum_steps * args.batch_size  # a mid-epoch resume
            steps, done = steps_per_epoch - epoch_step, 0
            # Sums stay on the device until a log step: .item() would stall a GPU every step.
            loss_sum, count, first_bad = torch.tensor([0, 0, math.inf], device=device).double()
            model.train()
            t0 = time.perf_counter()
            # `with`: the bar is closed also when an error ends the epoch, so the error's
            # line is a line of its own.
            bar = tqdm(total=steps, desc=f"epoch {epoch}", disable=rank != 0, leave=False)
            with bar:
                for i, (images, labels) in enumerate(train_loader):
                    images = images.to(device, non_blocking=True)
                    if args.augment:
                        images = random_crop_flip(images)
                    images = images.contiguous(memory_format=memory_format)
                    labels = labels.to(device, non_blocking=True)
                    # Gradient accumulation: no_sync() keeps all but the last micro-batch's
                    # gradients local, where they add up in .grad: one all-reduce per step.
                    last_micro = (i + 1) % args.accum_steps == 0
                    sync = last_micro or not info.distributed
                    with contextlib.nullcontext() if sync else model.no_sync():
                        with autocast():
                            logits = model(images)
                            loss = F.cross_entropy(
                                logits, labels, label_smoothing=args.label_smoothing
                            )
                        # The step's gradient is the mean over its micro-batches.
                        scaler.scale(loss / args.accum_steps).backward()
                    loss = loss.detach()
                    loss_sum += loss * labels.numel()
                    count += labels.numel()
                    first_bad = torch.where(loss.isfinite(), first_bad, first_bad.clamp(max=step))
                    if not last_micro:
                        continue
                    if args.clip_grad > 0:
                        scaler.unscale_(optimizer)  # clip the true gradients, not fp16-scaled ones
                        nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
                    scaler.step(optimizer)  # skipped if fp16 gradients overflowed
                    scaler.update()
                    optimizer.zero_grad(set_to_none=True)
                    scheduler.step()
                    step, done = step + 1, done + 1
                    bar.update()
                    last = done == steps or step == args.max_steps
                    snapshot = args.save_every and step % args.save_every == 0 and not last
                    profiler.step(last or snapshot)  # evaluation, saving: no training step
                    if step % args.log_every == 0 or last or snapshot:
                        # One all-reduce per log step (all ranks participate) feeds the bar,
                        # and every rank sees the same NaN: all stop before it can replace a
                        # good checkpoint.
                        totals = reduce_value(torch.stack([loss_sum, count]))
                        if not totals.isfinite().all():
                            if info.distributed:
                                dist.all_reduce(first_bad, dist.ReduceOp.MIN)
                            fix = "lower --lr, add --clip-grad, or use --amp bf16 instead of fp16"
                            fail(f"non-finite loss at step {int(first_bad)}: {fix}")
                        train_loss = (totals[0] / totals[1]).item()
                        bar.set_postfix(
                            loss=f"{train_loss:.4f}", lr=f"{scheduler.get_last_lr()[0]:.3g}"
                        )
                    if snapshot:
                        save(step)  # a mid-epoch checkpoint; all ranks participate
                    if last:
                        break
            seconds = time.perf_counter() - t0  # the loss all-reduce above synchronised

            # BatchNorm's running statistics are per rank until DDP copies rank 0's at the
            # next forward: copy them now, so every rank evaluates (and saves) one model.
            for buffer in raw_model.buffers() if info.distributed else ():
                dist.broadcast(buffer, src=0)  # all ranks participate
            test_loss, test_acc = evaluate(tta_model, test_loader, device, autocast())
            speed, lr_now = done * global_batch / seconds, scheduler.get_last_lr()[0]
            record = dict(epoch=epoch, step=step, train_loss=train_loss, test_loss=test_loss)
            record.update(test_acc=test_acc, epoch_seconds=seconds, samples_per_second=speed)
            rates = flop_rates(flops * done, seconds, device, amp_dtype, args.peak_tflops, world)
            record.update(lr=lr_now, world_size=world, **rates)
            losses = (
                f"train_loss {train_loss:.4f} test_loss {test_loss:.4f} test_acc {test_acc:.4f}"
            )
            print0(f"epoch {epoch}: {losses} {seconds:.1f}s {speed:.0f} samples/s")
            # Metrics first: a crash before the checkpoint reruns this epoch (or its rest) and
            # the resume trims its line, so every epoch appears once.
            if out:
                append_metrics(metrics, record)
            if args.output_dir:
                save(step)  # all ranks participate
        profiler.stop()
        if info.distributed:
            # Leave together (all ranks participate): rank 0 hosts the store, and a rank still
            # tearing its group down when rank 0 has gone can abort at exit.
            dist.barrier()
    except RuntimeError as e:
        # A peer that died or hung for --dist-timeout breaks the others' collectives.
        raise peer_failure(e, info) from None
    finally:
        cleanup()  # also on an error: the peers are not left waiting on a dead group


if __name__ == "__main__":
    main()
