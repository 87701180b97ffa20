"""Single-process data parallelism with nn.DataParallel.

One process drives every GPU of the machine: each forward() cuts the batch into one piece
per GPU, copies the model onto each, runs the pieces in threads and gathers the outputs on
GPU 0, where the loss and backward start; backward sums the replicas' gradients back onto
GPU 0's parameters. It needs no launcher and no process group, which is its one merit.
PyTorch recommends DistributedDataParallel (ddp_train.py) instead, even on one machine:
DataParallel copies the model to every GPU at every step, funnels all outputs and gradients
through GPU 0, and its threads share one Python interpreter. Use it for a quick experiment on
one multi-GPU box; without GPUs (or with --device cpu) the model runs on the CPU, unwrapped.

    python dp_train.py                                         # all visible GPUs, or the CPU
    CUDA_VISIBLE_DEVICES=0,1 python dp_train.py --batch-size 256 --amp bf16
    python dp_train.py --output-dir runs/dp                    # a rerun resumes from there

--batch-size is the whole batch, cut across the GPUs; --lr is the peak rate per 256 samples.
"""

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import OneCycleLR
from torch.utils.data import DataLoader, RandomSampler
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
    check_flags,
    cleanup,
    detect_launcher,
    fail,
    init_distributed_mode,
    peer_failure,
)
from data import DATASETS, collate, load_datasets
from models import MODELS, build_model, seed_everything
from profiling import Profiler, add_flags, flop_rates, step_flops
from training import amp_note, evaluate, fast_forward


def get_args(argv=None):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--data", default="fashion-mnist", choices=DATASETS, help="data set")
    add("--data-dir", default="data", help="root holding the data set (torchvision's layout)")
    add("--download", action="store_true", help="download the data set if it is missing")
    add("--image-size", type=int, help="imagefolder: crop size (default: the images', <= 224)")
    add("--model", default="cnn", choices=sorted(MODELS), help="network")
    add("--epochs", type=int, default=5, help="passes over the training set")
    add("--batch-size", type=int, default=256, help="samples per step, cut across all GPUs")
    add("--lr", type=float, default=0.2, help="peak learning rate per 256 samples of batch")
    add("--momentum", type=float, default=0.9, help="SGD (Nesterov) momentum")
    add("--weight-decay", type=float, default=5e-4, help="L2 penalty")
    add("--label-smoothing", type=float, default=0.1, help="for the training loss")
    add("--schedule", default="onecycle", choices=["onecycle"], help="lr schedule: one-cycle")
    add("--warmup", type=float, default=0.2, help="fraction of the steps warming up; 0: none")
    add("--workers", type=int, default=0, help="DataLoader worker processes")
    add("--seed", type=int, default=0, help="seed for the weights and the shuffling")
    add("--amp", default="none", choices=["none", "bf16", "fp16"], help="mixed precision")
    nhwc = "NHWC memory format: faster convolutions (oneDNN on CPU, tensor cores on GPU)"
    add("--channels-last", action=argparse.BooleanOptionalAction, default=True, help=nhwc)
    add("--max-steps", type=int, default=0, help="stop after this many steps; 0: no limit")
    add("--output-dir", help="where checkpoint.pt and metrics.jsonl go; none: write nothing")
    add("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: the GPUs if any")
    add("--dist-timeout", type=float, default=300, help="seconds before a lost peer ends the job")
    add_flags(p)  # --profile DIR, --peak-tflops (profiling.py)
    args = p.parse_args(argv)
    at_least_1 = ("epochs", "batch_size", "image_size")
    check_flags(args, at_least_1, ("max_steps", "workers"), ("lr", "dist_timeout", "peak_tflops"))
    if not 0 <= args.warmup < 1:
        fail(f"--warmup is a fraction of the run, in [0, 1); got {args.warmup}")
    return args


class Autocast(nn.Module):
    """Runs the wrapped model under autocast with the dtype asked for, on input in the memory
    format asked for, inside each replica. DataParallel's replica threads do not inherit the
    caller's autocast: they re-enter it with `enabled` alone (see its parallel_apply.py), which
    on CUDA means fp16 even when bf16 was asked for. And replicate() gives the other GPUs
    contiguous (NCHW) copies of the weights: an NHWC input is what keeps their convolutions
    NHWC (cuDNN and oneDNN follow the input's format)."""

    def __init__(self, module, dtype, memory_format=torch.preserve_format):
        super().__init__()
        self.module, self.dtype, self.memory_format = module, dtype, memory_format

    def forward(self, x):
        # .to, not .contiguous: a 1-channel NCHW batch already counts as NHWC-contiguous, and
        # .contiguous would hand it on unchanged, in strides that convolutions read as NCHW.
        x = x.to(memory_format=self.memory_format)
        with torch.autocast(x.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            return self.module(x)


def rng_states(device):
    """checkpoint.rng_state plus, on CUDA, every GPU's generator: each replica draws from its own
    GPU's, so GPU 0's alone would resume the others elsewhere."""
    state = rng_state(device)
    if device.type == "cuda":
        state["cuda_all"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_states(state, device):
    set_rng_state(state, device)
    if device.type == "cuda" and "cuda_all" in state:  # not in ddp_train.py's checkpoints
        # As many GPUs as are visible now (CUDA_VISIBLE_DEVICES may name fewer than before).
        torch.cuda.set_rng_state_all(state["cuda_all"][: torch.cuda.device_count()])


def train(args, device):
    amp_note(args.amp, device)  # fp16 on a CPU, bf16 on a GPU before Ampere: slow
    seed_everything(args.seed)
    train_set, test_set, num_classes, in_channels = load_datasets(
        args.data, args.data_dir, args.download, args.image_size
    )
    if len(train_set) < args.batch_size:
        fail(f"--batch-size {args.batch_size} is larger than the {len(train_set)} training samples")
    # On a GPU an in-memory data set moves there (GPU 0) once: a batch is one indexing there, in
    # the sampler's order, no copy a step. Not with --workers: they cannot share CUDA tensors.
    on_gpu = device.type == "cuda" and args.workers == 0 and hasattr(train_set, "to")
    if on_gpu:
        train_set, test_set = train_set.to(device), test_set.to(device)

    # One process sees the whole data set: no DistributedSampler. Reseeding `shuffle` with
    # (seed + epoch) every epoch gives a new order each epoch, the same permutation as
    # DistributedSampler's in ddp_train.py (so both take the same steps), and the same order
    # again after a resume.
    shuffle = torch.Generator()
    loader_args = dict(num_workers=args.workers, collate_fn=collate)
    loader_args.update(pin_memory=device.type == "cuda" and not on_gpu)
    sampler = RandomSampler(train_set, generator=shuffle)
    # drop_last: full batches only, so every GPU gets an equal piece.
    train_loader = DataLoader(
        train_set, args.batch_size, sampler=sampler, drop_last=True, **loader_args
    )
    test_loader = DataLoader(test_set, batch_size=2 * args.batch_size, **loader_args)
    steps_per_epoch = len(train_loader)
    total_steps = args.epochs * steps_per_epoch

    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = build_model(args.model, in_channels, num_classes, image_size=train_set[0][0].shape[-1])
    model = model.to(device, memory_format=memory_format)  # DataParallel wants it on GPU 0
    # cuDNN times its algorithms on a shape's first batch and keeps the fastest; its pick can
    # vary between runs, and the rounding with it, unless deterministic algorithms are on.
    torch.backends.cudnn.benchmark = device.type == "cuda"
    flops = step_flops(model, (1, *train_set[0][0].shape))  # a sample's, forward and backward
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    # The parallel wrapper, on CUDA only: DataParallel takes every visible GPU whatever the
    # model's device, so --device cpu on a GPU machine would move it to cuda:0 anyway. `model`
    # itself is what gets saved and loaded: its state_dict has no "module." prefixes.
    dp_model = Autocast(model, amp_dtype, memory_format)
    if device.type == "cuda":
        dp_model = nn.DataParallel(dp_model)

    profiler = Profiler(args.profile, 0, device)  # a trace of a few steps
    out = check_output_dir(args.output_dir) if args.output_dir else None
    lr = args.lr * args.batch_size / 256  # linear scaling rule
    optimizer = torch.optim.SGD(
        model.parameters(), lr, args.momentum, weight_decay=args.weight_decay, nesterov=True
    )
    # fp16 gradients can underflow to zero: the scaler multiplies the loss first and divides
    # the gradients again before the step. bf16 has fp32's range and needs none.
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    step = 0
    ckpt_path = Path(args.output_dir or "", "checkpoint.pt")
    if args.output_dir and ckpt_path.is_file():
        ckpt = load_checkpoint(ckpt_path)  # onto the CPU; load_state_dict copies to the device
        load_model_state(model, ckpt["model"], ckpt_path)
        saved = {"schedule": "onecycle", **ckpt["args"]}  # ddp_train.py's may be cosine
        changed = [k for k in ("epochs", "schedule", "warmup") if saved[k] != getattr(args, k)]
        if changed:  # the schedule is a function of these: it cannot go on where it was
            was = ", ".join(f"--{k} {saved[k]}" for k in changed)
            again = "resume with the same, or start anew in another --output-dir"
            fail(f"{ckpt_path} was trained with {was}; {again}")
        load_optimizer_state(optimizer, ckpt["optimizer"])  # momentum buffers; this run's flags
        if ckpt["scaler"]:  # empty when saved without fp16
            scaler.load_state_dict(ckpt["scaler"])
        # Resume at an epoch boundary: a run stopped inside an epoch (--max-steps) starts that
        # epoch again.
        step = ckpt["epoch"] * steps_per_epoch
        if ckpt["epoch_step"] == 0:
            set_rng_states(ckpt["rng"][0], device)
        print(f"resumed from {ckpt_path} at epoch {ckpt['epoch']}")
    # Made after the optimizer's state is loaded: OneCycleLR writes this run's peak (another
    # --batch-size scales it) into the optimizer, and is then stepped to where the resumed
    # epoch begins.
    # Cosine warm-up and decay; cycle_momentum=False keeps Nesterov's momentum fixed. A warm-up
    # of one step or less is none (the first step at the peak): OneCycleLR divides by zero at
    # exactly one, and below it would start one step at 1/25 of the peak.
    warmup = args.warmup if args.warmup * total_steps > 1 else 0.0
    scheduler = OneCycleLR(optimizer, lr, total_steps, pct_start=warmup, cycle_momentum=False)
    fast_forward(scheduler, step)
    start_epoch = step // steps_per_epoch
    if out:
        trim_metrics(out / "metrics.jsonl", start_epoch)

    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    how = f"DataParallel over {gpus} GPU(s)" if gpus else "the CPU, no DataParallel"
    size = "x".join(map(str, train_set[0][0].shape[-2:]))
    print(
        f"{args.model} on {args.data} ({size} images): {how}, batch {args.batch_size}, "
        f"peak lr {lr:.3g}, {steps_per_epoch} steps/epoch"
    )
    for epoch in range(start_epoch, args.epochs):
        if args.max_steps and step >= args.max_steps:
            break
        shuffle.manual_seed(args.seed + epoch)  # the epoch's order (see the loader above)
        dp_model.train()
        # Running sums stay on the device: a .item() per step would stall a GPU every step.
        loss_sum, seen = torch.zeros((), device=device, dtype=torch.float64), 0
        t0 = time.perf_counter()
        bar = tqdm(train_loader, desc=f"epoch {epoch}", leave=False, mininterval=1)
        for images, labels in bar:
            # The whole batch goes to GPU 0; DataParallel scatters its pieces to the others,
            # where Autocast gives each replica its piece in --channels-last's format.
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            logits = dp_model(images)  # gathered on GPU 0
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=args.label_smoothing)
            scaler.scale(loss).backward()  # the replicas' gradients add up on GPU 0's model
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
        epoch_seconds = time.perf_counter() - t0
        train_loss = loss_sum.item() / seen
        if not math.isfinite(train_loss):
            fix = "lower --lr, or use --amp bf16 instead of fp16"
            fail(f"non-finite training loss in epoch {epoch}: {fix}")
        test_loss, test_acc = evaluate(dp_model, test_loader, device)  # each GPU its piece
        speed = seen / epoch_seconds
        record = dict(epoch=epoch, step=step, train_loss=train_loss, test_loss=test_loss)
        record.update(test_acc=test_acc, epoch_seconds=epoch_seconds, samples_per_second=speed)
        rates = flop_rates(
            flops * seen, epoch_seconds, device, amp_dtype, args.peak_tflops, max(gpus, 1)
        )
        record.update(lr=scheduler.get_last_lr()[0], world_size=1, **rates)
        losses = f"train_loss {train_loss:.4f} test_loss {test_loss:.4f} test_acc {test_acc:.4f}"
        print(f"epoch {epoch}: {losses} {epoch_seconds:.1f}s {speed:.0f} samples/s")
        if out:
            append_metrics(out / "metrics.jsonl", record)  # first: a resume trims its line
            epoch, epoch_step = divmod(step, steps_per_epoch)  # the epoch to go on with
            state = dict(model=model.state_dict(), optimizer=optimizer.state_dict())
            state.update(scaler=scaler.state_dict(), scheduler=scheduler.state_dict())
            state.update(epoch=epoch, epoch_step=epoch_step, step=step, rng=[rng_states(device)])
            state.update(steps_per_epoch=steps_per_epoch, world_size=1, args=vars(args))
            save_checkpoint(state, out / "checkpoint.pt")
    profiler.stop()


def main(argv=None):
    args = get_args(argv)
    launched = detect_launcher()
    if launched and launched["world_size"] > 1:  # each process would drive all the GPUs by itself
        n = launched["world_size"]
        fail(f"dp_train.py runs as one process, not {n}; for several use ddp_train.py")
    # A plain process has no group; torchrun forms one even for one process. DataParallel
    # uses none, but the group is torn down like every other, also on an error.
    info = init_distributed_mode(device=args.device, timeout_s=args.dist_timeout)
    try:
        train(args, info.device)
    except RuntimeError as e:
        raise peer_failure(e, info) from None
    finally:
        cleanup()


if __name__ == "__main__":
    main()
