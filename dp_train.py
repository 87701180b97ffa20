"""Single-process data parallelism with nn.DataParallel.

One process drives every GPU of the machine: each forward() cuts the batch into one piece
per GPU, copies the model onto each of them, runs the pieces in threads and gathers the
outputs on GPU 0, where the loss and backward start; backward sums the replicas' gradients
back onto GPU 0's parameters. It needs no launcher and no process group, which is its one
merit.

PyTorch's documentation recommends DistributedDataParallel (ddp_train.py) instead, even on
one machine: DataParallel copies the model to every GPU at every step, funnels all outputs
and gradients through GPU 0, and its threads share one Python interpreter (the GIL). Use it
for a quick experiment on one multi-GPU box; diff this file against ddp_train.py to see what
DDP changes. On a machine without GPUs the model simply runs on the CPU.

Launch:
    python dp_train.py                                         # all visible GPUs, or the CPU
    CUDA_VISIBLE_DEVICES=0,1 python dp_train.py --batch-size 256 --amp bf16
    python dp_train.py --output-dir runs/dp                    # a rerun resumes from there

--batch-size is the whole batch, cut across the GPUs; --lr is the peak rate per 256 samples,
scaled linearly with the batch (as in ddp_train.py, whose global batch this matches).
"""

import math
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler
from tqdm import tqdm

from common import (
    DATASETS,
    MODELS,
    ArgumentParser,
    append_metrics,
    build_model,
    check_output_dir,
    collate,
    detect_launcher,
    evaluate,
    fail,
    fast_forward,
    imagefolder_size,
    init_distributed_mode,
    load_checkpoint,
    load_datasets,
    load_model_state,
    load_optimizer_state,
    rng_state,
    save_checkpoint,
    seed_everything,
    set_rng_state,
    trim_metrics,
)


def get_args(argv=None):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="fashion-mnist", choices=DATASETS, help="data set")
    p.add_argument("--data-dir", default="data", help="root holding the data set (torchvision layout)")
    p.add_argument("--download", action="store_true", help="download the data set if missing")
    p.add_argument(
        "--image-size", type=int, default=None, help="imagefolder: crop size (default: the images' own, at most 224)"
    )
    p.add_argument("--model", default="cnn", choices=sorted(MODELS), help="network")
    p.add_argument("--epochs", type=int, default=5, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=256, help="samples per step, cut across all GPUs")
    p.add_argument("--lr", type=float, default=0.2, help="peak learning rate per 256 samples of batch")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD (Nesterov) momentum")
    p.add_argument("--weight-decay", type=float, default=5e-4, help="L2 penalty")
    p.add_argument("--label-smoothing", type=float, default=0.1, help="for the training loss")
    p.add_argument("--warmup", type=float, default=0.2, help="fraction of all steps spent warming up (one-cycle)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and shuffling")
    p.add_argument("--amp", default="none", choices=["none", "bf16", "fp16"], help="mixed precision")
    p.add_argument("--no-channels-last", dest="channels_last", action="store_false", help="keep NCHW memory format")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (smoke runs); 0: no limit")
    p.add_argument("--output-dir", default=None, help="where checkpoint.pt and metrics.jsonl go; none: write nothing")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: the GPUs if present")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "image_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.lr > 0:
        fail(f"--lr must be positive, got {args.lr}")
    if args.max_steps < 0 or args.workers < 0:
        fail("--max-steps and --workers cannot be negative")
    if not 0 <= args.warmup < 1:
        fail(f"--warmup is a fraction of the run, in [0, 1); got {args.warmup}")
    return args


class Autocast(nn.Module):
    """Runs the wrapped model under autocast with the dtype asked for. DataParallel's replica
    threads do not inherit the caller's autocast: they re-enter it with `enabled` alone
    (torch/nn/parallel/parallel_apply.py), which on CUDA means fp16 even when bf16 was asked
    for, and fp16 without a GradScaler underflows. Inside forward, every thread gets the dtype."""

    def __init__(self, module, dtype):
        super().__init__()
        self.module, self.dtype = module, dtype

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            return self.module(x)


def train(args, device):
    if args.data == "imagefolder" and args.image_size is None:
        args.image_size = imagefolder_size(args.data_dir)
    seed_everything(args.seed)
    train_set, test_set, num_classes, in_channels = load_datasets(
        args.data, args.data_dir, args.download, args.image_size
    )
    if len(train_set) < args.batch_size:
        fail(f"--batch-size {args.batch_size} is larger than the training set ({len(train_set)} samples)")

    # One process sees the whole data set: no DistributedSampler. Reseeding `shuffle` with
    # (seed + epoch) every epoch gives a new order each epoch, the same permutation as
    # DistributedSampler's in ddp_train.py (so both take the same steps), and the same order
    # again after a resume.
    shuffle = torch.Generator()
    loader_args = dict(num_workers=args.workers, collate_fn=collate, pin_memory=device.type == "cuda")
    train_loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        sampler=RandomSampler(train_set, generator=shuffle),
        drop_last=True,  # full batches only: every GPU gets an equal piece
        **loader_args,
    )
    test_loader = DataLoader(test_set, batch_size=2 * args.batch_size, **loader_args)
    steps_per_epoch = len(train_loader)
    total_steps = args.epochs * steps_per_epoch

    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = build_model(args.model, in_channels, num_classes, image_size=train_set[0][0].shape[-1])
    model = model.to(device, memory_format=memory_format)  # DataParallel wants it on GPU 0
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    # The parallel wrapper. `model` itself is what gets saved and loaded: its state_dict has
    # no "module." prefixes and loads into a plain model. On CPU, DataParallel calls it directly.
    dp_model = nn.DataParallel(Autocast(model, amp_dtype))

    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    out = check_output_dir(args.output_dir, need_bytes=2 * model_bytes) if args.output_dir else None
    lr = args.lr * args.batch_size / 256  # linear scaling rule
    optimizer = torch.optim.SGD(
        model.parameters(), lr=lr, momentum=args.momentum, nesterov=True, weight_decay=args.weight_decay
    )
    # fp16 gradients can underflow to zero: the scaler multiplies the loss first and divides
    # the gradients again before the step. bf16 has fp32's range and needs none.
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    step = 0
    ckpt_path = Path(args.output_dir or "", "checkpoint.pt")
    if args.output_dir and ckpt_path.is_file():
        ckpt = load_checkpoint(ckpt_path)  # onto the CPU; load_state_dict copies to the device
        load_model_state(model, ckpt["model"], ckpt_path)
        saved = {"schedule": "onecycle", **ckpt["args"]}  # ddp_train.py's may name another schedule
        changed = [k for k in ("epochs", "schedule", "warmup") if saved[k] != getattr(args, k, "onecycle")]
        if changed:  # the schedule is a function of these: it cannot go on where it was
            was = ", ".join(f"--{k} {saved[k]}" for k in changed)
            fail(f"{ckpt_path} was trained with {was}; resume with the same, or start anew in another --output-dir")
        load_optimizer_state(optimizer, ckpt["optimizer"])  # momentum buffers; this run's flags
        if ckpt["scaler"]:  # empty when saved without fp16
            scaler.load_state_dict(ckpt["scaler"])
        # Resume at an epoch boundary: a run stopped inside an epoch (--max-steps) starts that
        # epoch again.
        step = ckpt["epoch"] * steps_per_epoch
        if ckpt["epoch_step"] == 0:
            set_rng_state(ckpt["rng"][0])
        print(f"resumed from {ckpt_path} at epoch {ckpt['epoch']}")
    # Made after the optimizer's state is loaded: OneCycleLR writes this run's peak (another
    # --batch-size scales it) into the optimizer, and is then stepped to where the resumed
    # epoch begins.
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer,
        max_lr=lr,
        total_steps=total_steps,
        pct_start=max(args.warmup, 1e-3),
        anneal_strategy="cos",
        cycle_momentum=False,  # keep Nesterov momentum fixed; only the rate cycles
    )
    fast_forward(scheduler, step)
    start_epoch = step // steps_per_epoch
    if out:
        trim_metrics(out / "metrics.jsonl", start_epoch)

    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    size = "x".join(map(str, train_set[0][0].shape[-2:]))
    print(
        f"{args.model} on {args.data} ({size} images): DataParallel over {gpus} GPU(s) ({device.type}), "
        f"batch {args.batch_size}, peak lr {lr:.3g}, {steps_per_epoch} steps/epoch"
    )
    for epoch in range(start_epoch, args.epochs):
        if args.max_steps and step >= args.max_steps:
            break
        shuffle.manual_seed(args.seed + epoch)  # the epoch's order (see the loader above)
        dp_model.train()
        # Running sums stay on the device: a .item() per step would stall a GPU every step.
        loss_sum, seen = torch.zeros((), device=device, dtype=torch.float64), 0
        t0 = time.perf_counter()
        for images, labels in tqdm(train_loader, desc=f"epoch {epoch}", leave=False, mininterval=1.0):
            # The whole batch goes to GPU 0; DataParallel scatters its pieces to the others.
            images = images.to(device, non_blocking=True).contiguous(memory_format=memory_format)
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
            if step == args.max_steps:
                break
        epoch_seconds = time.perf_counter() - t0
        train_loss = loss_sum.item() / seen
        if not math.isfinite(train_loss):
            fail(f"non-finite training loss in epoch {epoch}: lower --lr, or use --amp bf16 instead of fp16")
        test_loss, test_acc = evaluate(dp_model, test_loader, device)  # every GPU evaluates its piece
        record = dict(
            epoch=epoch,
            step=step,
            train_loss=train_loss,
            test_loss=test_loss,
            test_acc=test_acc,
            epoch_seconds=epoch_seconds,
            samples_per_second=seen / epoch_seconds,
            lr=scheduler.get_last_lr()[0],
            world_size=1,
        )
        print(
            f"epoch {epoch}: train_loss {train_loss:.4f} test_loss {test_loss:.4f} "
            f"test_acc {test_acc:.4f} {epoch_seconds:.1f}s {record['samples_per_second']:.0f} samples/s"
        )
        if out:
            append_metrics(out / "metrics.jsonl", record)  # first: a resume trims a line without weights
            epoch_step = step - epoch * steps_per_epoch
            done = epoch_step == steps_per_epoch
            state = dict(
                model=model.state_dict(),
                optimizer=optimizer.state_dict(),
                scheduler=scheduler.state_dict(),
                scaler=scaler.state_dict(),
                epoch=epoch + 1 if done else epoch,  # the epoch to continue
                epoch_step=0 if done else epoch_step,
                step=step,
                steps_per_epoch=steps_per_epoch,
                world_size=1,
                rng=[rng_state()],
                args=vars(args),
            )
            save_checkpoint(state, out / "checkpoint.pt")


def main(argv=None):
    args = get_args(argv)
    launched = detect_launcher()
    if launched and launched["world_size"] > 1:  # each process would drive all the GPUs by itself
        fail(f"dp_train.py runs as one process, not {launched['world_size']}; for several use ddp_train.py")
    info = init_distributed_mode(device=args.device)  # no process group: one process
    train(args, info.device)


if __name__ == "__main__":
    main()
