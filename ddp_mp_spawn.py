"""DistributedDataParallel started by torch.multiprocessing.spawn instead of torchrun.

The training is ddp_train.py's without its advanced options (mid-epoch checkpoints,
--eval-only, accumulation); only the launch differs, so a diff of the two files shows what a
launcher changes. One parent process starts --nprocs children on this node, each running
worker() with its rank; they meet at MASTER_ADDR:MASTER_PORT (this machine and a free port,
unless set). Use it where torchrun is not at hand (a notebook, an IDE's run button); use
torchrun for several nodes and for restarts: when one child dies, mp.spawn stops the others
and exits, and a rerun with the same --output-dir resumes from the last epoch's checkpoint.

    python ddp_mp_spawn.py --nprocs 2                     # 2 processes (CPU: gloo)
    python ddp_mp_spawn.py --epochs 10                    # one per GPU (NCCL), or 2 on CPU
    MASTER_PORT=29600 python ddp_mp_spawn.py --nprocs 2   # a fixed port instead of a free one
"""

import argparse
import functools
import math
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
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
    detect_launcher,
    fail,
    init_distributed_mode,
    is_main_process,
    peer_failure,
    print0,
    reduce_value,
    together,
)
from data import DATASETS, collate, eval_shard, load_datasets
from models import MODELS, build_model, seed_everything
from profiling import Profiler, add_flags, flop_rates, step_flops
from training import amp_note, evaluate, fast_forward


def get_args(argv=None):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--nprocs", type=int, help="processes to start (default: the GPUs, or 2 on CPU)")
    add("--data", default="fashion-mnist", choices=DATASETS, help="data set")
    add("--data-dir", default="data", help="root holding the data set (torchvision's layout)")
    add("--download", action="store_true", help="download the data set if it is missing")
    add("--image-size", type=int, help="imagefolder: crop size (default: the images', <= 224)")
    add("--model", default="cnn", choices=sorted(MODELS), help="network")
    add("--epochs", type=int, default=5, help="passes over the training set")
    add("--batch-size", type=int, default=128, help="samples per process per step")
    add("--lr", type=float, default=0.2, help="peak learning rate per 256 samples of global batch")
    add("--momentum", type=float, default=0.9, help="SGD (Nesterov) momentum")
    add("--weight-decay", type=float, default=5e-4, help="L2 penalty")
    add("--label-smoothing", type=float, default=0.1, help="for the training loss")
    add("--schedule", default="onecycle", choices=["onecycle"], help="lr schedule: one-cycle")
    add("--warmup", type=float, default=0.2, help="fraction of the steps warming up; 0: none")
    add("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    add("--seed", type=int, default=0, help="seed for the weights and the shuffling")
    add("--amp", default="none", choices=["none", "bf16", "fp16"], help="mixed precision")
    nhwc = "NHWC memory format: faster convolutions (oneDNN on CPU, tensor cores on GPU)"
    add("--channels-last", action=argparse.BooleanOptionalAction, default=True, help=nhwc)
    add("--max-steps", type=int, default=0, help="stop after this many steps; 0: no limit")
    add("--output-dir", help="where checkpoint.pt and metrics.jsonl go; none: write nothing")
    add("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if any")
    add("--dist-timeout", type=float, default=300, help="seconds before a lost peer ends the job")
    add_flags(p)  # --profile DIR, --peak-tflops (profiling.py)
    args = p.parse_args(argv)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda was asked for, but this machine has no usable CUDA device")
    if args.nprocs is None:
        args.nprocs = torch.cuda.device_count() if use_cuda else 2
    at_least_1 = ("nprocs", "epochs", "batch_size", "image_size")
    check_flags(args, at_least_1, ("max_steps", "workers"), ("lr", "dist_timeout", "peak_tflops"))
    if use_cuda and args.nprocs > torch.cuda.device_count():
        fail(f"--nprocs {args.nprocs} is more than the {torch.cuda.device_count()} GPU(s) here")
    if not 0 <= args.warmup < 1:
        fail(f"--warmup is a fraction of the run, in [0, 1); got {args.warmup}")
    return args


def train(args, info):
    device, rank, world = info.device, info.rank, info.world_size
    is_main = is_main_process()  # global rank 0: the one that writes
    amp_note(args.amp, device)  # fp16 on a CPU, bf16 on a GPU before Ampere: slow
    seed_everything(args.seed)  # the same on every rank: identical initial weights
    train_set, test_set, num_classes, in_channels = load_datasets(
        args.data, args.data_dir, args.download, args.image_size, info.local_rank
    )
    if (shard := len(train_set) // world) < args.batch_size:
        fail(f"--batch-size {args.batch_size} is larger than one rank's shard ({shard} samples)")
    # On a GPU an in-memory data set moves there once: a batch is one indexing there, in the
    # sampler's order, no copy a step. Not with --workers: they cannot share CUDA tensors.
    on_gpu = device.type == "cuda" and args.workers == 0 and hasattr(train_set, "to")
    if on_gpu:
        train_set, test_set = train_set.to(device), test_set.to(device)

    # Each rank trains on a disjoint 1/world of a permutation of (seed, epoch). drop_last
    # trims the set to a multiple of world instead of padding it with repeats.
    sampler = DistributedSampler(train_set, world, rank, seed=args.seed, drop_last=True)
    loader_args = dict(num_workers=args.workers, collate_fn=collate)
    loader_args.update(pin_memory=device.type == "cuda" and not on_gpu)
    train_loader = DataLoader(
        train_set, args.batch_size, sampler=sampler, drop_last=True, **loader_args
    )
    # The test set is split without padding: every sample evaluated exactly once.
    test_shard = eval_shard(test_set, rank, world)
    test_loader = DataLoader(test_shard, 2 * args.batch_size, **loader_args)
    steps_per_epoch = len(train_loader)
    total_steps = args.epochs * steps_per_epoch

    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = build_model(args.model, in_channels, num_classes, image_size=train_set[0][0].shape[-1])
    model = model.to(device, memory_format=memory_format)  # `model`: saved and evaluated unwrapped
    # cuDNN times its algorithms per shape, keeps the fastest: runs differ unless deterministic
    torch.backends.cudnn.benchmark = device.type == "cuda"
    flops = step_flops(model, (1, *train_set[0][0].shape))  # a sample's, forward and backward

    # Rank 0 checks the output directory; a refusal stops every rank at once with its cause.
    profiler = Profiler(args.profile, rank, device)  # a trace of a few steps per rank
    check = lambda: check_output_dir(args.output_dir)  # noqa: E731
    out = together(check, run=bool(args.output_dir) and is_main)
    global_batch = args.batch_size * world
    lr = args.lr * global_batch / 256  # linear scaling rule
    optimizer = torch.optim.SGD(
        model.parameters(), lr, args.momentum, weight_decay=args.weight_decay, nesterov=True
    )
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    autocast = functools.partial(torch.autocast, device.type, amp_dtype, amp_dtype is not None)

    # Rank 0 alone looks for a checkpoint and reads it; the others get its copy (all ranks
    # participate), so all resume from the same step even where they would see other files.
    path = Path(args.output_dir or "", "checkpoint.pt")
    load = lambda: path.is_file() and load_checkpoint(path)  # noqa: E731
    ckpt = broadcast_object(together(load, run=bool(args.output_dir) and is_main))
    step = 0
    if ckpt:
        load_model_state(model, ckpt["model"], path)  # onto this rank's device
        saved = {"schedule": "onecycle", **ckpt["args"]}  # ddp_train.py's may be cosine
        changed = [k for k in ("epochs", "schedule", "warmup") if saved[k] != getattr(args, k)]
        if changed:  # the schedule is a function of these: it cannot go on where it was
            was = ", ".join(f"--{k} {saved[k]}" for k in changed)
            again = "resume with the same, or start anew in another --output-dir"
            fail(f"{path} was trained with {was}; {again}")
        load_optimizer_state(optimizer, ckpt["optimizer"])  # momentum buffers; this run's flags
        if ckpt["scaler"]:  # empty when saved without fp16
            scaler.load_state_dict(ckpt["scaler"])
        # Resume at an epoch boundary (a run stopped inside an epoch starts it again), also
        # with another --nprocs: the schedule's place is the same, its peak this run's.
        step = ckpt["epoch"] * steps_per_epoch
        if ckpt["epoch_step"] == 0 and ckpt["world_size"] == world:
            set_rng_state(ckpt["rng"][rank], device)
        print0(f"resumed from {path} at epoch {ckpt['epoch']}")
    # Made after the optimizer's state is loaded: OneCycleLR writes this run's peak (another
    # --nprocs scales it) into the optimizer. cycle_momentum=False keeps the momentum fixed.
    warmup = args.warmup if args.warmup * total_steps > 1 else 0.0  # a step or less: none
    scheduler = OneCycleLR(optimizer, lr, total_steps, pct_start=warmup, cycle_momentum=False)
    fast_forward(scheduler, step)
    start_epoch = step // steps_per_epoch
    if out:
        trim_metrics(out / "metrics.jsonl", start_epoch)

    # After loading: DDP broadcasts rank 0's parameters and buffers here, then all-reduces
    # (averages) gradients in buckets while backward() is still running.
    ddp_model = model
    if info.distributed:  # --nprocs 1 has no process group, and nothing to average
        ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    size = "x".join(map(str, train_set[0][0].shape[-2:]))
    print0(
        f"{args.model} on {args.data} ({size} images): {world} process(es) from mp.spawn on"
        f" {device.type}, global batch {global_batch}, peak lr {lr:.3g},"
        f" {steps_per_epoch} steps/epoch"
    )
    for epoch in range(start_epoch, args.epochs):
        if args.max_steps and step >= args.max_steps:
            break
        sampler.set_epoch(epoch)  # without it every epoch repeats epoch 0's order
        ddp_model.train()
        # Sums stay on the device: .item() would stall a GPU every step.
        loss_sum, seen = torch.zeros(2, device=device, dtype=torch.float64)
        t0 = time.perf_counter()
        bar = tqdm(train_loader, desc=f"epoch {epoch}", disable=not is_main, leave=False)
        for images, labels in bar:
            images = images.to(device, non_blocking=True).contiguous(memory_format=memory_format)
            labels = labels.to(device, non_blocking=True)
            with autocast():
                logits = ddp_model(images)
                loss = F.cross_entropy(logits, labels, label_smoothing=args.label_smoothing)
            scaler.scale(loss).backward()  # DDP averages the gradients over all ranks here
            scaler.step(optimizer)  # skips the step if fp16 gradients overflowed
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            loss_sum += loss.detach() * labels.numel()
            seen += labels.numel()
            step += 1
            profiler.step(step == args.max_steps or step % steps_per_epoch == 0)  # last: eval next
            if step == args.max_steps:
                break
        # One all-reduce per epoch for the log line (all ranks participate): every rank sees
        # the same sum, so a non-finite loss stops them all together.
        totals = reduce_value(torch.stack([loss_sum, seen]))
        epoch_seconds = time.perf_counter() - t0
        train_loss = (totals[0] / totals[1]).item()
        if not math.isfinite(train_loss):
            fix = "lower --lr, or use --amp bf16 instead of fp16"
            fail(f"non-finite training loss in epoch {epoch}: {fix}")
        # BatchNorm's running statistics are per rank: take rank 0's, so that every rank
        # evaluates (and rank 0 saves) the same model.
        for buffer in model.buffers() if info.distributed else []:
            dist.broadcast(buffer, src=0)  # all ranks participate
        test_loss, test_acc = evaluate(model, test_loader, device, autocast())  # all participate
        speed = totals[1].item() / epoch_seconds
        record = dict(epoch=epoch, step=step, train_loss=train_loss, test_loss=test_loss)
        record.update(test_acc=test_acc, epoch_seconds=epoch_seconds, samples_per_second=speed)
        rates = flop_rates(
            flops * totals[1].item(), epoch_seconds, device, amp_dtype, args.peak_tflops, world
        )
        record.update(lr=scheduler.get_last_lr()[0], world_size=world, **rates)
        losses = f"train_loss {train_loss:.4f} test_loss {test_loss:.4f} test_acc {test_acc:.4f}"
        print0(f"epoch {epoch}: {losses} {epoch_seconds:.1f}s {speed:.0f} samples/s")
        rngs = [rng_state(device)]
        if info.distributed:
            rngs = [None] * world
            dist.all_gather_object(rngs, rng_state(device))  # every rank's, for an exact resume
        if out:  # global rank 0
            append_metrics(out / "metrics.jsonl", record)  # first: a resume trims its line
            epoch, epoch_step = divmod(step, steps_per_epoch)  # the epoch to go on with
            state = dict(model=model.state_dict(), optimizer=optimizer.state_dict())
            state.update(scaler=scaler.state_dict(), scheduler=scheduler.state_dict())
            state.update(epoch=epoch, epoch_step=epoch_step, step=step, rng=rngs)
            state.update(steps_per_epoch=steps_per_epoch, world_size=world, args=vars(args))
            save_checkpoint(state, out / "checkpoint.pt")
    profiler.stop()


def worker(rank, args):
    """Runs in each child: mp.spawn passes the rank first. spawn re-imports this file in the
    child, hence the __main__ guard below."""
    info = init_distributed_mode(rank, args.nprocs, device=args.device, timeout_s=args.dist_timeout)
    try:
        train(args, info)
        if info.distributed:
            dist.barrier()  # leave together (all ranks participate)
    except RuntimeError as e:
        raise peer_failure(e, info) from None
    finally:
        cleanup()  # also when training raised: peers are not left waiting on a dead group


def main(argv=None):
    args = get_args(argv)  # bad flags fail here, before any child starts
    # Under torchrun (even with one worker: its store holds MASTER_PORT), or as one of several
    # srun/mpirun tasks, each copy would spawn a group of its own.
    launched = detect_launcher()
    if launched and (launched["launcher"] == "torchrun" or launched["world_size"] > 1):
        how = f"run it with plain python, not {launched['launcher']}"
        fail(f"ddp_mp_spawn.py starts its own processes: {how}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # one node: the children meet here
    with socket.socket() as s:
        try:  # the given port must be free; port 0 asks the OS for a free one
            s.bind((os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", 0))))
        except OSError as e:
            port = os.environ["MASTER_PORT"]
            fail(f"MASTER_PORT {port} is busy ({e.strerror}); choose another or unset it")
        # Released when the block ends; another program could take it before rank 0 binds it
        # (a small race): set MASTER_PORT to choose one yourself.
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    try:
        # join=True: wait for all; if one child fails, spawn terminates the others.
        mp.spawn(worker, args=(args,), nprocs=args.nprocs, join=True)
    except mp.ProcessExitedException as e:
        if not e.signal_name:  # the child printed why ("error: ..."): not again, only its code
            raise SystemExit(e.exit_code) from None
        # Killed (out of memory, pre-empted): mp.spawn never restarts a process (torchrun
        # --max-restarts does), but a rerun picks up the last checkpoint.
        again = f"; rerun to resume from {args.output_dir}" if args.output_dir else ""
        which = f"process {e.error_index} of {args.nprocs} was killed by {e.signal_name}"
        fail(f"{which}; the others were stopped{again}")
    except mp.ProcessRaisedException as e:
        fail(f"process {e.error_index} of {args.nprocs} raised {str(e).strip().splitlines()[-1]}")


if __name__ == "__main__":
    main()
