"""Model parallelism: ONE model cut into stages on several devices, in three ways.

The model is a flat nn.Sequential cut into S contiguous stages of about equal FLOPs (the
slowest sets the pace). A batch goes through stage 1, its activations move to stage 2's device,
and so on; the loss is taken on the last stage, and backward() runs the way back. Use it when
the model does not fit on one device; when it does, ddp_train.py is simpler and faster.

The launch picks the mode: plain `python model_parallel.py` is ONE process driving every device
in --devices (modes 1 and 2); under torchrun with several processes each holds ONE stage on its
own --device (mode 3; --devices is refused). The "mode N:" line printed says which.
1. Naive (one process, --microbatches 1, its default there): stage s sits on devices[s], forward
   moves the activations on with .to(), one optimizer holds every parameter. No faster than one
   device: stage 2 waits for stage 1's output, stage 1 for stage 2's backward, so one device
   works at a time, each idle (S-1)/S of a step (50% for S=2). It buys memory, not speed.
2. Micro-batches (one process, --microbatches M): at tick t stage s works on piece t-s of the
   batch, so stage 1 computes piece k+1 while stage 2 computes piece k. CUDA ops only queue
   kernels and the loop queues every stage's work of a tick before anything waits, so the GPUs
   run at once (PyTorch tutorial "Single-Machine Model Parallel Best Practices"). Each stage
   still idles S-1 of M+S-1 ticks: the bubble (S-1)/(M+S-1), 20% for S=2 and M=4, 11% for M=8
   (GPipe, Huang et al. 2019). Autograd follows the .to() copies back, each GPU's part on a
   thread of its own. On CPU every op blocks: the mechanics, without the overlap.
3. One process per stage (torchrun; --schedule gpipe or 1f1b, torch.distributed.pipelining):
   activations go by send/recv, so stages can sit on other machines. GPipe runs all forwards,
   then all backwards (M micro-batches of activations held); 1F1B alternates once the pipe is
   full (at most S held), with the same bubble. Default there: 1F1B, M=8.
Which: the model fits on one machine's GPUs together: mode 2 (no process group, one optimizer);
mode 1 to learn from; more stages than a machine has GPUs, or a cluster's launchers: mode 3.
Gradients are the whole batch's mean in every mode, so a step is one device's on the whole
batch: GroupNorm is per sample, where BatchNorm would normalise each micro-batch apart (the
GPipe caveat) and make M change the result.

Launch (SLURM and mpirun as for ddp_train.py, see README.md):
    python model_parallel.py --devices cpu                            # one device: the reference
    python model_parallel.py --devices cuda:0,cuda:1                  # 1 (default: 2 GPUs, else cpu,cpu)
    python model_parallel.py --devices cuda:0,cuda:1 --microbatches 8   # 2
    torchrun --standalone --nproc_per_node=2 model_parallel.py        # 3: 2 stages, 1F1B, M=8
    torchrun --nnodes=2 --nproc_per_node=4 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 --rdzv-id=myjob model_parallel.py   # 8 stages, on every node
A rerun with the same --output-dir resumes at the start of the epoch it stopped in, in any mode
and split (weights and momentum are saved in the unsplit model's names). On 2 CPU cores no mode
beats one process using both (benchmarks/model_parallel_modes.py): it pays with a GPU per stage.
"""

import itertools
import math
import time
from collections import OrderedDict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode
from tqdm import tqdm

from common import (
    DATASETS,
    ArgumentParser,
    append_metrics,
    check_output_dir,
    cleanup,
    collate,
    fail,
    first_line,
    init_distributed_mode,
    load_checkpoint,
    load_datasets,
    load_model_state,
    peer_failed,
    print0,
    rng_state,
    save_checkpoint,
    seed_everything,
    set_rng_state,
    trim_metrics,
)

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def get_args(argv=None):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="fashion-mnist", choices=DATASETS, help="data set")
    p.add_argument("--data-dir", default="data", help="root holding the data set (torchvision layout)")
    p.add_argument("--download", action="store_true", help="download the data set if missing")
    p.add_argument("--epochs", type=int, default=5, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=128, help="samples per step, the whole batch (all stages)")
    p.add_argument("--devices", help="one process: a stage on each, e.g. cuda:0,cuda:1 (default: 2 GPUs, else cpu,cpu)")
    p.add_argument("--microbatches", type=int, help="pieces per batch (default: 1, naive; under torchrun 8)")
    p.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES), help="pipeline schedule under torchrun")
    p.add_argument("--lr", type=float, default=0.1, help="peak learning rate (SGD, warm-up then cosine decay)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and shuffling")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (smoke runs); 0: no limit")
    p.add_argument("--log-every", type=int, default=50, help="steps between progress updates (and non-finite checks)")
    p.add_argument("--output-dir", default=None, help="checkpoint.pt and metrics.jsonl go (and resume from) here")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if present")
    p.add_argument("--backend", default=None, choices=["gloo", "nccl", "mpi"], help="default: nccl on CUDA, else gloo")
    p.add_argument("--dist-timeout", type=float, default=300, help="seconds before a missing peer ends the job")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "microbatches", "log_every"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not (args.lr > 0 and args.dist_timeout > 0) or args.max_steps < 0:
        fail("--lr and --dist-timeout must be positive and --max-steps not negative")
    return args


def parse_devices(text, device_flag):
    """--devices as torch.devices, one per stage, each checked to exist on this machine."""
    gpus = torch.cuda.device_count() if device_flag != "cpu" else 0
    text = text or (f"cuda:0,cuda:{min(1, gpus - 1)}" if gpus else "cpu,cpu")  # 2 GPUs (or 1 twice), else CPU
    devices = []
    for name in text.split(","):
        kind, _, index = name.partition(":")
        if name != "cpu" and not (kind == "cuda" and (index or "0").isdigit()):
            fail(f"--devices: {name!r} is not a device (cpu, cuda or cuda:N)")
        if kind == "cuda" and int(index or 0) >= gpus:
            fail(f"--devices: {name} does not exist here ({gpus} GPUs usable with --device {device_flag})")
        devices.append(torch.device("cuda", int(index or 0)) if kind == "cuda" else torch.device("cpu"))
    return devices


def build_model(in_channels, num_classes, widths=(32, 64, 128), hidden=128):
    """A small CNN as a flat nn.Sequential of 5 layers (blocks), the units a stage is cut from.
    GroupNorm, not BatchNorm: its statistics are per sample, so micro-batches change nothing.
    Stride-2 convolutions, not max-pooling: on flat image regions max-pooling has ties, and
    which input wins (and gets the gradient) flips with float rounding, so runs that differ
    only in summation order (micro-batches) drift apart after a few steps. No in-place ReLU:
    a stage's input is a received buffer that autograd must keep intact."""
    layers, c = [], in_channels
    for w in widths:
        layers.append(nn.Sequential(nn.Conv2d(c, w, 3, stride=2, padding=1, bias=False), nn.GroupNorm(8, w), nn.ReLU()))
        c = w
    layers.append(nn.Sequential(nn.AdaptiveAvgPool2d(3), nn.Flatten(), nn.Linear(c * 9, hidden), nn.ReLU()))
    layers.append(nn.Linear(hidden, num_classes))
    return nn.Sequential(*layers)


def layer_costs(model, sample):
    """Forward FLOPs per sample of each layer (convolutions and matmuls, which dominate)."""
    costs, x = [], sample
    with torch.no_grad():
        for layer in model:
            with FlopCounterMode(display=False) as counter:
                x = layer(x)
            costs.append(max(1, counter.get_total_flops()))
    return costs


def balanced_split(costs, stages):
    """Cut the layers into `stages` contiguous runs whose most expensive one is as cheap as
    possible (the pipeline moves at its slowest stage's pace). Brute force over all cuts, a handful
    here (hundreds of layers would want dynamic programming); deterministic: every rank agrees."""
    prefix = [0, *itertools.accumulate(costs)]
    cuts = min(
        itertools.combinations(range(1, len(costs)), stages - 1),
        key=lambda c: max(prefix[b] - prefix[a] for a, b in itertools.pairwise((0, *c, len(costs)))),
    )
    return list(itertools.pairwise((0, *cuts, len(costs))))  # [(first layer, end), ...] per stage


def make_stage(model, first, end):
    """The layers [first, end) as a module of their own, shared with `model`. The OrderedDict keeps
    the full model's names ("2.0.weight", not "0.0.weight"): the stages' state dicts make the full one."""
    return nn.Sequential(OrderedDict(itertools.islice(model.named_children(), first, end)))


def pipeline_forward(stages, devices, images, microbatches):
    """Modes 1 and 2: the logits of a batch (on the last device) over `microbatches` pieces,
    as a wavefront: at tick t, stage s works on piece t-s; one piece is naive model parallelism.
    Nothing here waits for a GPU, so the GPUs work on a tick's stages at the same time."""
    pieces = images.to(devices[0], non_blocking=True).chunk(microbatches)
    inputs, outputs = [None] * len(stages), []
    for tick in range(microbatches + len(stages) - 1):
        inputs[0] = pieces[tick] if tick < microbatches else None
        # A GPU stage only queues its kernels: the next stage starts at once (cuda:0,cpu overlaps too).
        results = [None if x is None else stage(x) for stage, x in zip(stages, inputs, strict=True)]
        # Only then move each result on, for the next tick: a GPU-to-GPU copy waits for the work
        # queued on both GPUs. A copy to the CPU must block, or the CPU could read it before it lands.
        moves = zip(results[:-1], devices[1:], strict=True)
        inputs = [None] + [None if x is None else x.to(d, non_blocking=d.type == "cuda") for x, d in moves]
        if results[-1] is not None:
            outputs.append(results[-1])
    return torch.cat(outputs)  # autograd recorded the .to() copies: backward goes back over them


@torch.no_grad()
def evaluate_stages(run_batch, module, loader, batch_size, device, last_rank):
    """Loss and accuracy over the whole test set, each sample once. run_batch gives the logits
    where the last stage is, None elsewhere; that rank broadcasts the sums."""
    module.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for images, labels in loader:
        n = len(labels)
        # Mode 3's receive buffers have the shape of the first batch: pad the last, smaller one
        # with zeros (GroupNorm is per sample, so padding changes no real sample's logits).
        if n < batch_size:
            images = torch.cat([images, images.new_zeros(batch_size - n, *images.shape[1:])])
            labels = torch.cat([labels, labels.new_zeros(batch_size - n)])
        logits = run_batch(images, labels, training=False)
        if logits is not None:
            logits, labels = logits[:n].float(), labels[:n].to(device)
            loss_sum = F.cross_entropy(logits, labels, reduction="sum")
            totals += torch.stack([loss_sum, (logits.argmax(1) == labels).sum(), totals.new_tensor(n)])
    if dist.is_initialized():
        dist.broadcast(totals, src=last_rank)  # all ranks participate
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def train(args, info):
    device, rank, world = info.device, info.rank, info.world_size
    per_process = world > 1  # mode 3: one stage per process; otherwise modes 1-2 over --devices
    if per_process and args.devices:
        fail("--devices is for one process; under torchrun each process holds one stage on its own --device")
    devices = [device] if per_process else parse_devices(args.devices, args.device)
    stages_count, micro = world if per_process else len(devices), args.microbatches or (8 if per_process else 1)
    if args.batch_size % micro:
        fail(f"--microbatches {micro} does not divide --batch-size {args.batch_size} into equal pieces")
    if per_process and args.schedule == "1f1b" and micro < world:
        fail(f"1f1b needs --microbatches >= stages ({world}); got {micro} (use --schedule gpipe)")

    # Every rank builds the WHOLE model with the same seed: the one-process run's weights. (Too
    # large for a host, it would be built on the "meta" device and each stage initialised alone.)
    seed_everything(args.seed)
    train_set, test_set, num_classes, in_channels = load_datasets(args.data, args.data_dir, args.download)
    if len(train_set) < args.batch_size:
        fail(f"--batch-size {args.batch_size} is larger than the training set ({len(train_set)} samples)")
    model = build_model(in_channels, num_classes)
    full_keys = list(model.state_dict())
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    costs = layer_costs(model, train_set[0][0].unsqueeze(0))
    if stages_count > len(model):
        fail(f"{stages_count} stages for a model of {len(model)} layers: at most {len(model)} --devices or processes")
    split = balanced_split(costs, stages_count)

    if per_process:
        # This process trains only its own stage. PipelineStage learns the shapes it receives and
        # sends at the first step. The schedule cuts each batch into M micro-batches, takes a
        # mean loss per micro-batch, and divides the summed gradients by M (scale_grads).
        module = make_stage(model, *split[rank]).to(device)
        schedule = SCHEDULES[args.schedule](PipelineStage(module, rank, world, device), micro, F.cross_entropy)
        is_first, is_last = rank == 0, rank == world - 1

        def run_batch(images, labels, training):
            # The first stage feeds the images, the last one the labels (eval() computes the
            # loss too, unused); only the last stage gets logits back, the others None.
            inputs = (images.to(device),) if is_first else ()
            target, losses = (labels.to(device) if is_last else None), []
            logits = (schedule.step if training else schedule.eval)(*inputs, target=target, losses=losses)
            if not training or logits is None:
                return logits
            # Each loss is its micro-batch's mean; the micro-batches are of equal size.
            return torch.stack(losses).detach().sum() * len(labels) / micro, logits
    else:
        # Each stage's layers move to its device. `module` is still the whole model, now over
        # several devices: one optimizer, and a state dict in the unsplit model's keys.
        stages = [make_stage(model, a, b).to(d) for (a, b), d in zip(split, devices, strict=True)]
        module = model

        def run_batch(images, labels, training):
            logits = pipeline_forward(stages, devices, images, micro)
            if not training:
                return logits
            # One loss over all the pieces' logits: the whole batch's mean, so the gradients are
            # the unsplit model's whatever --microbatches.
            loss = F.cross_entropy(logits, labels.to(devices[-1], non_blocking=True))
            loss.backward()
            return loss.detach() * len(labels), logits.detach()

    # Every stage reads the same batches in the same order (same seed): the first stage uses
    # the images, the last one the labels. drop_last: every step has whole micro-batches.
    generator = torch.Generator()
    loader_args = dict(collate_fn=collate, pin_memory=devices[0].type == "cuda")
    train_loader = DataLoader(train_set, args.batch_size, True, generator=generator, drop_last=True, **loader_args)
    test_loader = DataLoader(test_set, args.batch_size, **loader_args)
    steps_per_epoch = len(train_loader)
    total_steps = args.epochs * steps_per_epoch  # not cut by --max-steps: a stopped run resumes exactly
    warmup = max(1, total_steps // 5)

    def lr_at(step):  # linear warm-up over the first fifth of the steps, then cosine decay to 0
        if step < warmup:
            return args.lr * (step + 1) / warmup
        return args.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))

    # In mode 3 each stage's optimizer steps its own parameters: SGD is per element, so S
    # optimizers take together the step one optimizer over the whole model would take.
    optimizer = torch.optim.SGD(module.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    # Resume at the start of the epoch the checkpoint stopped in (after --max-steps, that epoch's
    # first part is trained twice). It holds the unsplit model, and SGD's only state, each
    # parameter's momentum, by the unsplit model's names: any mode and split can take it.
    ckpt_path, step = Path(args.output_dir or "", "checkpoint.pt"), 0
    ckpt = load_checkpoint(ckpt_path) if args.output_dir and ckpt_path.is_file() else None  # onto the CPU
    if ckpt:
        if "momentum" not in ckpt:
            fail(f"{ckpt_path} holds no optimizer state to resume from; use another --output-dir")
        load_model_state(model, ckpt["model"], ckpt_path)  # `model` still holds every stage's layers
        step = ckpt["epoch"] * steps_per_epoch
        for name, param in module.named_parameters():
            optimizer.state[param]["momentum_buffer"] = ckpt["momentum"][name].to(param.device)
        if len(ckpt["rng"]) == world:  # unused here (each epoch's order has its own seed), not by dropout
            set_rng_state(ckpt["rng"][rank])
        print0(f"resumed from {ckpt_path} at epoch {ckpt['epoch']} of {args.epochs}")

    # Only now, with data and flags found good, is anything written (rank 0 alone writes).
    out = check_output_dir(args.output_dir, need_bytes=2 * model_bytes) if args.output_dir and rank == 0 else None
    if out:
        trim_metrics(out / "metrics.jsonl", step // steps_per_epoch)  # each epoch appears once
    how = f"3: {world} processes (torchrun), {args.schedule}" if per_process else f"{min(micro, 2)}: one process"
    bubble = (stages_count - 1) / (micro + stages_count - 1)
    print0(f"mode {how}, {stages_count} stage(s), {micro} micro-batch(es) per batch, bubble {bubble:.0%}")
    for r, (a, b) in enumerate(split):
        where = f"rank {r}, {device.type}" if per_process else devices[r]
        print0(f"stage {r}: layers {a}-{b - 1} on {where}, {sum(costs[a:b]) / 1e6:.2f} MFLOPs per sample forward")

    last_device, last_rank = devices[-1], world - 1  # where the loss lives; stage i runs on rank i
    for epoch in range(step // steps_per_epoch, args.epochs):
        if args.max_steps and step >= args.max_steps:
            break
        generator.manual_seed(args.seed + epoch)  # the same new order on every rank
        module.train()
        sums = torch.zeros(3, dtype=torch.float64, device=last_device)  # loss sum, correct, count
        t0, done = time.perf_counter(), 0
        with tqdm(total=steps_per_epoch, desc=f"epoch {epoch}", disable=rank != 0, leave=False) as bar:
            for images, labels in train_loader:
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(step)
                result = run_batch(images, labels, training=True)  # forward and backward of every piece
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step, done = step + 1, done + 1
                bar.update()
                if result is not None:  # this process has the last stage
                    loss_sum, logits = result
                    labels = labels.to(last_device)
                    sums += torch.stack([loss_sum, (logits.argmax(1) == labels).sum(), sums.new_tensor(len(labels))])
                last = done == steps_per_epoch or step == args.max_steps
                if step % args.log_every == 0 or last:
                    # The loss lives on the last stage: broadcast its sums (all ranks participate) so that
                    # rank 0 shows them and all stop together on a NaN; .item() waits for queued GPU work.
                    if per_process:
                        dist.broadcast(sums, src=last_rank)
                    if not torch.isfinite(sums).all():
                        fail(f"non-finite loss by step {step}: lower --lr")
                    bar.set_postfix(loss=f"{sums[0].item() / sums[2].item():.4f}")
                if last:
                    break
        epoch_seconds = time.perf_counter() - t0
        train_loss, train_acc = (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()
        test_loss, test_acc = evaluate_stages(run_batch, module, test_loader, args.batch_size, last_device, last_rank)
        speed, lr = done * args.batch_size / epoch_seconds, optimizer.param_groups[0]["lr"]
        record = dict(epoch=epoch, step=step, train_loss=train_loss, train_acc=train_acc, test_loss=test_loss)
        record |= dict(test_acc=test_acc, epoch_seconds=epoch_seconds, samples_per_second=speed, lr=lr)
        record |= dict(world_size=world, stages=stages_count, microbatches=micro)
        print0(
            f"epoch {epoch}: train_loss {train_loss:.4f} train_acc {train_acc:.4f} test_loss {test_loss:.4f} "
            f"test_acc {test_acc:.4f} {epoch_seconds:.1f}s {speed:.0f} samples/s"
        )
        if args.output_dir:
            progress = dict(epoch=step // steps_per_epoch, step=step, args=vars(args))
            save_full_model(module, optimizer, full_keys, out, progress, record, info)  # all ranks participate


def save_full_model(module, optimizer, full_keys, out, progress, record, info):
    """Gather every stage's weights and momentum to rank 0 and save ONE checkpoint in the
    unsplit model's names, which any mode resumes from. All ranks participate. (A model too
    large for rank 0's memory would save one file per stage: torch.distributed.checkpoint.)"""
    momentum = {name: optimizer.state[p]["momentum_buffer"].cpu() for name, p in module.named_parameters()}
    state = dict(model={k: v.detach().cpu() for k, v in module.state_dict().items()}, momentum=momentum)
    parts = [dict(state, rng=rng_state())]
    if info.distributed:
        parts = [None] * info.world_size if info.rank == 0 else None
        dist.gather_object(dict(state, rng=rng_state()), parts, dst=0)
    if out:  # global rank 0
        merged = {key: {k: v for part in parts for k, v in part[key].items()} for key in ("model", "momentum")}
        merged["model"] = {k: merged["model"][k] for k in full_keys}  # the unsplit order; a KeyError if one is missing
        save_checkpoint(dict(merged, rng=[part["rng"] for part in parts], **progress), out / "checkpoint.pt")
        append_metrics(out / "metrics.jsonl", record)  # after the checkpoint: every line has its weights


def main(argv=None):
    args = get_args(argv)
    info = init_distributed_mode(backend=args.backend, device=args.device, timeout_s=args.dist_timeout)
    try:
        train(args, info)
        if info.distributed:
            dist.barrier()  # leave together (all ranks participate); rank 0 hosts the store
    except RuntimeError as e:
        # A stage that died breaks the send/recv of its neighbours; gloo says so in a RuntimeError.
        if not info.distributed or not peer_failed(e):
            raise
        fail(f"rank {info.rank}: another stage died or stopped responding ({first_line(e).split('. ')[0]})")
    finally:
        cleanup()  # also when training raised: peers are not left waiting on a dead group


if __name__ == "__main__":
    main()
