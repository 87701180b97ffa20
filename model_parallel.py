"""Pipeline parallelism: ONE model split over several devices, fed with micro-batches.

Each process holds one stage: a contiguous slice of the layers of an nn.Sequential. A batch
enters stage 0, whose output activations go to stage 1 (point-to-point send/recv), and so on;
the last stage computes the loss, and gradients flow back the same way. Use it when the model
does not fit on one device; when it does, ddp_train.py is simpler and faster. There are as many
stages as processes, and every process trains on the same, whole batch (--batch-size is global).

Naively (--microbatches 1) only one stage works at a time while the others wait: the
"bubble". Cut the batch into M micro-batches and stage 0 starts micro-batch 2 while stage 1
works on micro-batch 1. With S stages each stage still idles for S-1 of the M+S-1 slots of a
step: the bubble fraction is (S-1)/(M+S-1) (GPipe, Huang et al. 2019), 50% for S=2, M=1 and
11% for S=2, M=8. GPipe runs all forwards, then all backwards (holding M micro-batches of
activations); 1F1B (PipeDream-flush) alternates one forward and one backward once the pipe is
full, so a stage holds at most S micro-batches of activations, with the same bubble. Both come
from torch.distributed.pipelining. Gradients are the mean over the micro-batches, so a step
equals one process training on the whole batch: the model has GroupNorm, which normalises
each sample on its own, instead of BatchNorm, which would normalise each micro-batch
separately (the GPipe caveat) and make the result depend on --microbatches.

Launch (the same file; SLURM and mpirun as for ddp_train.py, see README.md):
    python model_parallel.py                                     # one device: the reference
    torchrun --standalone --nproc_per_node=2 model_parallel.py   # 2 stages, 1F1B, 8 micro-batches
    torchrun --standalone --nproc_per_node=2 model_parallel.py --microbatches 1 --schedule gpipe  # naive
    torchrun --nnodes=2 --nproc_per_node=4 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 --rdzv-id=myjob model_parallel.py   # 8 stages, on every node

On 2 CPU cores one process already uses both cores, so 2 stages have nothing to gain there
(benchmarks/run_all.py, section d2, measures it); the strategy pays off with one GPU per stage.
Without resume: a rerun with the same --output-dir starts afresh and replaces its files.
"""

import itertools
import math
import time
from collections import OrderedDict

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
    evaluate,
    fail,
    first_line,
    init_distributed_mode,
    load_datasets,
    peer_failed,
    print0,
    save_checkpoint,
    seed_everything,
)

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def get_args(argv=None):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="fashion-mnist", choices=DATASETS, help="data set")
    p.add_argument("--data-dir", default="data", help="root holding the data set (torchvision layout)")
    p.add_argument("--download", action="store_true", help="download the data set if missing")
    p.add_argument("--epochs", type=int, default=5, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=128, help="samples per step, over all stages (global)")
    p.add_argument("--microbatches", type=int, default=8, help="pieces each batch is cut into; 1: naive")
    p.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES), help="pipeline schedule")
    p.add_argument("--lr", type=float, default=0.1, help="peak learning rate (SGD, warm-up then cosine decay)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and shuffling")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (smoke runs); 0: no limit")
    p.add_argument("--log-every", type=int, default=50, help="steps between progress updates (and non-finite checks)")
    p.add_argument("--output-dir", default=None, help="where checkpoint.pt and metrics.jsonl go; none: write nothing")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if present")
    p.add_argument("--backend", default=None, choices=["gloo", "nccl", "mpi"], help="default: nccl on CUDA, else gloo")
    p.add_argument("--dist-timeout", type=float, default=300, help="seconds before a missing peer ends the job")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "microbatches", "log_every"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not (args.lr > 0 and args.dist_timeout > 0) or args.max_steps < 0:
        fail("--lr and --dist-timeout must be positive and --max-steps not negative")
    if args.batch_size % args.microbatches:
        fail(f"--microbatches {args.microbatches} does not divide --batch-size {args.batch_size} into equal pieces")
    return args


def build_model(in_channels, num_classes, widths=(32, 64, 128), hidden=128):
    """A small CNN as a flat nn.Sequential of 5 layers (blocks), the units a stage is cut from.

    GroupNorm, not BatchNorm: its statistics are per sample, so micro-batches change nothing.
    Stride-2 convolutions, not max-pooling: on images with flat regions max-pooling has ties,
    and which input wins (and gets the gradient) then flips with float rounding, so runs
    that differ only in summation order (micro-batches) drift apart after a few steps.
    No in-place ReLU: a stage's input is a received buffer that autograd must keep intact."""
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
    """Cut the layers into `stages` contiguous runs so that the most expensive stage is as
    cheap as possible: the pipeline moves at the pace of its slowest stage. Brute force over
    all cut positions (C(layers-1, stages-1) tries, a handful here; a model with hundreds of
    layers would use dynamic programming). Deterministic, so every rank finds the same cuts."""
    prefix = [0, *itertools.accumulate(costs)]
    cuts = min(
        itertools.combinations(range(1, len(costs)), stages - 1),
        key=lambda c: max(prefix[b] - prefix[a] for a, b in itertools.pairwise((0, *c, len(costs)))),
    )
    return list(itertools.pairwise((0, *cuts, len(costs))))  # [(first layer, end), ...] per stage


def make_stage(model, first, end):
    """The layers [first, end) as a module of their own. The OrderedDict keeps the full model's
    names ("2.0.weight", not "0.0.weight"), so the stages' state dicts together are the full one."""
    return nn.Sequential(OrderedDict(itertools.islice(model.named_children(), first, end)))


@torch.no_grad()
def evaluate_pipeline(schedule, stage, module, loader, batch_size, device, last_rank):
    """Loss and accuracy over the whole test set through the pipeline (forward only); the
    last stage holds the logits and broadcasts the sums. All ranks participate."""
    module.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for images, labels in loader:
        n = len(labels)
        # The stages' receive buffers have the shape of the first batch: pad the last, smaller
        # batch with zeros (GroupNorm is per sample, so padding changes no real sample's logits).
        if n < batch_size:
            images = torch.cat([images, images.new_zeros(batch_size - n, *images.shape[1:])])
            labels = torch.cat([labels, labels.new_zeros(batch_size - n)])
        if stage.is_first:
            logits = schedule.eval(images.to(device))
        elif stage.is_last:  # the schedule computes its loss_fn too (unused here): it wants targets
            logits = schedule.eval(target=labels.to(device))
        else:
            schedule.eval()
        if stage.is_last:
            logits, labels = logits[:n].float(), labels[:n].to(device)
            totals += torch.stack(
                [
                    F.cross_entropy(logits, labels, reduction="sum"),
                    (logits.argmax(1) == labels).sum(),
                    totals.new_tensor(n),
                ]
            )
    dist.broadcast(totals, src=last_rank)  # all ranks participate
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def train(args, info):
    device, rank, world = info.device, info.rank, info.world_size
    pipelined = world > 1
    last_rank = world - 1  # stage i runs on global rank i
    if pipelined and args.schedule == "1f1b" and args.microbatches < world:
        fail(f"1f1b needs --microbatches >= stages ({world}); got {args.microbatches} (use --schedule gpipe)")

    # Every rank loads the data and builds the WHOLE model with the same seed, so the weights
    # equal the one-process run's; each then keeps its own slice. (A model too large for one
    # host's memory would be built on the "meta" device and each stage initialised on its own.)
    seed_everything(args.seed)
    train_set, test_set, num_classes, in_channels = load_datasets(args.data, args.data_dir, args.download)
    if len(train_set) < args.batch_size:
        fail(f"--batch-size {args.batch_size} is larger than the training set ({len(train_set)} samples)")
    model = build_model(in_channels, num_classes)
    full_keys = list(model.state_dict())
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    costs = layer_costs(model, train_set[0][0].unsqueeze(0))
    if world > len(model):
        fail(f"{world} stages for a model of {len(model)} layers: start at most {len(model)} processes")
    split = balanced_split(costs, world)
    first, end = split[rank]
    module = (make_stage(model, first, end) if pipelined else model).to(device)
    del model  # this rank keeps only its stage

    # Every stage reads the same batches in the same order (same seed): the first stage uses
    # the images, the last one the labels. drop_last: every step has whole micro-batches.
    generator = torch.Generator()
    loader_args = dict(collate_fn=collate, pin_memory=device.type == "cuda")
    train_loader = DataLoader(
        train_set, args.batch_size, shuffle=True, generator=generator, drop_last=True, **loader_args
    )
    test_loader = DataLoader(test_set, args.batch_size, **loader_args)
    steps_per_epoch = len(train_loader)
    total_steps = min(args.epochs * steps_per_epoch, args.max_steps or math.inf)

    # Only now, with data and flags found good, is anything written (rank 0 alone writes).
    out = check_output_dir(args.output_dir, need_bytes=model_bytes) if args.output_dir and rank == 0 else None
    if out:
        (out / "metrics.jsonl").unlink(missing_ok=True)  # no resume: this run's epochs only

    # Each stage's optimizer steps its own parameters: SGD is per element, so S optimizers
    # take together the step one optimizer over the whole model would take.
    optimizer = torch.optim.SGD(module.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    warmup = max(1, total_steps // 5)

    def lr_factor(step):  # linear warm-up over the first fifth of the steps, then cosine decay to 0
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    schedule = stage = None
    if pipelined:
        # PipelineStage finds the shapes of the activations it receives and sends by sending
        # metadata through the pipe at the first step. The schedule cuts each batch into
        # micro-batches; its loss is a mean per micro-batch and scale_grads (the default)
        # divides the summed gradients by M: the mean over the whole batch, as one process.
        stage = PipelineStage(module, rank, world, device)
        schedule = SCHEDULES[args.schedule](stage, args.microbatches, loss_fn=F.cross_entropy)

    for r, (a, b) in enumerate(split):
        print0(f"stage {r}: layers {a}-{b - 1}, {sum(costs[a:b]) / 1e6:.2f} MFLOPs per sample forward")
    bubble = (world - 1) / (args.microbatches + world - 1) if pipelined else 0.0
    how = f"{args.schedule}, {args.microbatches} micro-batches" if pipelined else "one device, no pipeline"
    print0(
        f"{world} stage(s) on {device.type} ({how}; bubble {bubble:.0%} of each step), "
        f"batch {args.batch_size}, peak lr {args.lr:.3g}, {steps_per_epoch} steps/epoch"
    )

    step = 0
    for epoch in range(args.epochs):
        if args.max_steps and step >= args.max_steps:
            break
        generator.manual_seed(args.seed + epoch)  # the same new order on every rank
        module.train()
        # Sums of this epoch, held by the stage that has the logits (the last, or the only one).
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
        t0 = time.perf_counter()
        done = 0
        with tqdm(total=steps_per_epoch, desc=f"epoch {epoch}", disable=rank != 0, leave=False) as bar:
            for images, labels in train_loader:
                logits, losses = None, []
                if not pipelined:  # the reference: the whole model on the whole batch
                    logits = module(images.to(device))
                    losses = [F.cross_entropy(logits, labels.to(device))]
                    losses[0].backward()
                elif stage.is_first:
                    schedule.step(images.to(device))  # forwards and backwards of all micro-batches
                elif stage.is_last:
                    logits = schedule.step(target=labels.to(device), losses=losses)
                else:
                    schedule.step()  # a middle stage: receives, computes, sends
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                step += 1
                done += 1
                bar.update()
                if logits is not None:
                    labels = labels.to(device)
                    # Each loss is its micro-batch's mean; the micro-batches are of equal size.
                    loss_sum = torch.stack(losses).detach().sum() * len(labels) / len(losses)
                    sums += torch.stack([loss_sum, (logits.argmax(1) == labels).sum(), sums.new_tensor(len(labels))])
                last = done == steps_per_epoch or step == args.max_steps
                if step % args.log_every == 0 or last:
                    # The loss lives on the last stage: broadcast its sums (all ranks participate),
                    # so rank 0 can show them and every rank can stop together on a NaN.
                    if pipelined:
                        dist.broadcast(sums, src=last_rank)
                    if not torch.isfinite(sums).all():
                        fail(f"non-finite loss by step {step}: lower --lr")
                    bar.set_postfix(loss=f"{sums[0].item() / sums[2].item():.4f}")
                if last:
                    break
        epoch_seconds = time.perf_counter() - t0  # the broadcast above waited for the last stage
        train_loss, train_acc = (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()
        if pipelined:
            test_loss, test_acc = evaluate_pipeline(
                schedule, stage, module, test_loader, args.batch_size, device, last_rank
            )
        else:
            test_loss, test_acc = evaluate(module, test_loader, device)
        record = dict(
            epoch=epoch,
            step=step,
            train_loss=train_loss,
            train_acc=train_acc,
            test_loss=test_loss,
            test_acc=test_acc,
            epoch_seconds=epoch_seconds,
            samples_per_second=done * args.batch_size / epoch_seconds,
            world_size=world,
        )
        print0(
            f"epoch {epoch}: train_loss {train_loss:.4f} train_acc {train_acc:.4f} test_loss {test_loss:.4f} "
            f"test_acc {test_acc:.4f} {epoch_seconds:.1f}s {record['samples_per_second']:.0f} samples/s"
        )
        if args.output_dir:
            save_full_model(module, full_keys, out, record, args, info)  # all ranks participate


def save_full_model(module, full_keys, out, record, args, info):
    """Gather every stage's weights to rank 0 and save them as ONE state dict that loads into
    the unsplit model. All ranks participate. (Rank 0 then holds the whole model in host memory;
    a model too large for that would save one file per stage, e.g. with torch.distributed.checkpoint.)"""
    state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    parts = [state]
    if info.distributed:
        parts = [None] * info.world_size if info.rank == 0 else None
        dist.gather_object(state, parts, dst=0)
    if out:  # global rank 0
        merged = {k: v for part in parts for k, v in part.items()}
        if sorted(merged) != sorted(full_keys):
            raise RuntimeError("the stages' weights do not add up to the whole model")
        model = {k: merged[k] for k in full_keys}  # the unsplit model's order
        save_checkpoint(
            dict(model=model, epoch=record["epoch"] + 1, step=record["step"], args=vars(args)), out / "checkpoint.pt"
        )
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
