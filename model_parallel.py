"""Pipeline model parallelism: ONE model cut into stages on several devices, in three modes.

The model (a CNN's layers, or the GPT's blocks: the embedding with the first, the head and loss
with the last; S must divide --depth) is cut into S stages of about equal FLOPs, the slowest
setting the pace. A batch goes through stage 1, its activations on to stage 2's device, and so
on; backward runs the way back. Use it when the model does not fit on one device (ddp_train.py
is simpler and faster when it does). The launch picks the mode ("mode N:" printed says which):
1. Naive (one process, --microbatches 1): one device works at a time: memory, not speed.
2. Micro-batches (one process, --microbatches M): at tick t stage s works on piece t-s, so the
   GPUs overlap, each still idle (S-1)/(M+S-1) of a step: the bubble (GPipe, Huang et al. 2019).
3. Stages per process (torchrun; torch.distributed.pipelining, PyTorch 2.10+), sending
   activations to each other, also across machines. --pipeline-schedule gpipe: all forwards,
   then all backwards; 1f1b alternates them (fewer micro-batches' activations alive);
   interleaved-1f1b holds V stages per process (--stages-per-rank), bubble (P-1)/(VM+P-1);
   interleaved-zb, zbv and dualpipev split backward in input and weight gradients to fill it.
In every mode a step's gradients are the whole batch's mean, as on one device.

    python model_parallel.py --devices cpu                          # unsplit: the reference
    python model_parallel.py --devices cuda:0,cuda:1 --microbatches 8   # mode 2 (1 without M)
    torchrun --standalone --nproc_per_node=2 model_parallel.py      # mode 3: 2 stages
    torchrun --standalone --nproc_per_node=2 model_parallel.py --data text --model gpt \\
        --pipeline-schedule zbv                                     # the GPT, 4 stages in a V
    torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        --rdzv-id=myjob model_parallel.py                  # on every node: 4 stages, 1 per GPU
A rerun with the same --output-dir resumes at the start of its epoch, any mode and schedule.
"""

import copy
import itertools
import re
import time
from collections import OrderedDict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

from checkpoint import (
    append_metrics,
    check_output_dir,
    load_checkpoint,
    load_model_state,
    save_checkpoint,
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
    together,
)
from data import DATASETS, TEXT, collate, load_datasets
from models import GPT, keep_stage, param_groups
from profiling import Profiler, add_flags, flop_rates, step_flops
from training import (
    PIPELINE_SCHEDULES,
    V_SHAPED,
    check_pipeline_schedule,
    fast_forward,
    pipeline_schedule,
    pipeline_stage_ids,
    warmup_decay,
)


def get_args(argv=None):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--data", default="fashion-mnist", choices=[*DATASETS, TEXT], help="text: --model gpt")
    where = "images: torchvision's root (default data); text: a file or folder (default stdlib)"
    add("--data-dir", help=where)
    add("--download", action="store_true", help="download the data set if it is missing")
    add("--model", default="cnn", choices=["cnn", "gpt"], help="gpt: models.GPT, on --data text")
    add("--seq-len", type=int, default=256, help="text: bytes per sample (the context)")
    add("--dim", type=int, default=96, help="the GPT's width")
    add("--heads", type=int, default=2, help="the GPT's attention heads")
    add("--depth", type=int, default=4, help="the GPT's blocks")
    add("--epochs", type=int, help="passes over the training set (default 5; text: 1)")
    add("--batch-size", type=int, help="samples per step, through every stage (128; text: 16)")
    add("--devices", help="stages in one process, e.g. cuda:0,cuda:1 (default: 2 GPUs, else CPU)")
    add("--microbatches", type=int, help="pieces per batch (default: 1; 8 under torchrun)")
    add("--pipeline-schedule", default="1f1b", choices=PIPELINE_SCHEDULES, help="mode 3's order")
    add("--stages-per-rank", type=int, help="mode 3: stages per process (interleaved, V: 2)")
    peak = "peak rate per 256 samples of the batch (SGD 0.2; text: AdamW 0.1)"
    add("--lr", type=float, help=peak)
    add("--momentum", type=float, default=0.9, help="SGD (Nesterov) momentum (the CNN)")
    add("--weight-decay", type=float, help="SGD's L2 penalty 5e-4; text: AdamW's 0.05")
    add("--warmup", type=float, default=0.2, help="fraction of all steps spent warming up")
    add("--seed", type=int, default=0, help="seed for the weights and the shuffling")
    add("--max-steps", type=int, default=0, help="stop after this many steps; 0: no limit")
    add("--log-every", type=int, default=50, help="steps between progress and NaN checks")
    add("--output-dir", help="where checkpoint.pt and metrics.jsonl go; none: write nothing")
    add("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if any")
    add("--backend", choices=["gloo", "nccl", "mpi"], help="default: nccl on CUDA, else gloo")
    add("--dist-timeout", type=float, default=300, help="seconds before a lost peer ends the job")
    add_flags(p)  # --profile DIR, --peak-tflops (profiling.py)
    args = p.parse_args(argv)
    text = args.data == TEXT
    defaults = dict(epochs=(5, 1), batch_size=(128, 16), lr=(0.2, 0.1), weight_decay=(5e-4, 0.05))
    for name, (image, sequence) in defaults.items():  # the same defaults as training.py's
        if getattr(args, name) is None:
            setattr(args, name, sequence if text else image)
    at_least_1 = ("epochs", "batch_size", "microbatches", "stages_per_rank", "log_every")
    at_least_1 += ("seq_len", "dim", "heads", "depth")
    positive = ("lr", "momentum", "dist_timeout", "peak_tflops")  # momentum: in the checkpoint
    check_flags(args, at_least_1, ("max_steps", "weight_decay"), positive)
    if not 0 <= args.warmup < 1:
        fail(f"--warmup is a fraction of the run, in [0, 1); got {args.warmup}")
    if (args.model == "gpt") != text:
        fail(f"--model {args.model} does not train on --data {args.data}: gpt reads text only")
    if args.dim % args.heads:
        fail(f"--dim {args.dim} is not a whole number of --heads {args.heads}")
    return args


def parse_devices(text, device_flag):
    """--devices as torch.devices, one per stage, each checked to exist on this machine."""
    gpus = torch.cuda.device_count() if device_flag != "cpu" else 0
    names = (text or (f"cuda:0,cuda:{min(1, gpus - 1)}" if gpus else "cpu,cpu")).split(",")
    for name in names:  # the default: 2 GPUs (or 1 twice), else the CPU twice
        if not re.fullmatch(r"cpu|cuda(:\d+)?", name):
            fail(f"--devices: {name!r} is not a device (cpu, cuda or cuda:N)")
        if name != "cpu" and int(name[5:] or 0) >= gpus:
            fail(f"--devices: {name} does not exist here ({gpus} GPUs with --device {device_flag})")
    return [torch.device(name) for name in names]


def build_pipeline_cnn(in_channels, num_classes, widths=(32, 64, 128), hidden=128):
    """A small CNN, unlike models.build_model's a flat nn.Sequential of 5 blocks that stages
    are cut from. GroupNorm, not BatchNorm: per sample, so micro-batches change nothing. Stride
    2, not max-pooling, whose ties flip with rounding. No in-place ReLU: a stage's input is a
    received buffer autograd keeps."""
    layers = []
    for c, w in itertools.pairwise((in_channels, *widths)):
        conv = nn.Conv2d(c, w, 3, stride=2, padding=1, bias=False)
        layers.append(nn.Sequential(conv, nn.GroupNorm(8, w), nn.ReLU()))
    head = [nn.AdaptiveAvgPool2d(3), nn.Flatten(), nn.Linear(widths[-1] * 9, hidden), nn.ReLU()]
    return nn.Sequential(*layers, nn.Sequential(*head), nn.Linear(hidden, num_classes))


def layer_costs(layers, sample):
    """Forward FLOPs per sample of each layer (convolutions and matmuls, which dominate)."""
    costs = []
    for layer in layers:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            sample = layer(sample)
        costs.append(max(1, counter.get_total_flops()))
    return costs


def gpt_costs(gpt, tokens):
    """layer_costs of the GPT's blocks, the first with the embedding and positions, the last
    with the final norm and the head: the units its stages are cut from."""
    embed, head = gpt.embed, (lambda x: gpt.head(gpt.norm(x)))
    first, *blocks, last = layer_costs([lambda x: embed(x) + gpt.pos, *gpt.blocks, head], tokens)
    blocks[0], blocks[-1] = blocks[0] + first, blocks[-1] + last
    return blocks


def balanced_split(costs, stages):
    """Cut the layers into `stages` runs whose most expensive one is as cheap as can be. Brute
    force over every cut, a handful here; deterministic, so every rank agrees."""
    prefix = [0, *itertools.accumulate(costs)]
    cuts = itertools.combinations(range(1, len(costs)), stages - 1)
    splits = [list(itertools.pairwise((0, *cut, len(costs)))) for cut in cuts]  # (first, end)s
    return min(splits, key=lambda runs: max(prefix[b] - prefix[a] for a, b in runs))


def make_stage(model, first, end):
    """The layers [first, end) as a module of their own, shared with `model`. The OrderedDict
    keeps the full model's names ("2.0.weight"): the stages' state dicts make the full one. The
    GPT: a copy cut by models.keep_stage, in the whole GPT's names ("blocks.3.attn.q.weight")."""
    if isinstance(model, GPT):
        return keep_stage(copy.deepcopy(model), first, end)
    return nn.Sequential(OrderedDict(itertools.islice(model.named_children(), first, end)))


def loss_fn(logits, labels):
    """Cross-entropy, the mean per image or, text, per byte (logits (N, T, 256))."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())


def pipeline_forward(stages, devices, images, microbatches):
    """Modes 1 and 2: a batch's logits (on the last device) over `microbatches` pieces, as a
    wavefront: at tick t, stage s works on piece t-s. Nothing here waits for a GPU."""
    pieces = images.to(devices[0], non_blocking=True).chunk(microbatches)
    inputs, outputs = [None] * len(stages), []
    for tick in range(microbatches + len(stages) - 1):
        inputs[0] = pieces[tick] if tick < microbatches else None
        # A GPU stage only queues its kernels: the next stage starts at once.
        results = [None if x is None else stage(x) for stage, x in zip(stages, inputs, strict=True)]
        # Only then move each result on: a GPU-to-GPU copy waits for the work queued on both
        # GPUs; a copy to the CPU must block, or the CPU could read it before it lands.
        moves = zip(results[:-1], devices[1:], strict=True)
        moved = (x if x is None else x.to(d, non_blocking=d.type == "cuda") for x, d in moves)
        inputs = [None, *moved]
        if results[-1] is not None:
            outputs.append(results[-1])
    return torch.cat(outputs)  # autograd recorded the .to() copies: backward goes back over them


@torch.no_grad()
def evaluate_stages(run_batch, modules, loader, device, src):
    """Test loss and accuracy (text: per byte), each sample once, on the last stage's rank
    `src`, which tells all."""
    for module in modules:
        module.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for inputs, labels in loader:
        # Mode 3's receive buffers have the first batch's shape: pad the last, smaller one with
        # zeros (GroupNorm and attention are per sample: padding changes no real sample's).
        n, pad = len(labels), loader.batch_size - len(labels)
        inputs, labels = (torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) for t in (inputs, labels))
        logits = run_batch(inputs, labels, training=False)
        if logits is not None:
            logits, labels = logits[:n].flatten(0, -2).float(), labels[:n].flatten().to(device)
            totals[0] += F.cross_entropy(logits, labels, reduction="sum")
            totals[1] += (logits.argmax(1) == labels).sum()
            totals[2] += len(labels)
    if dist.is_initialized():
        dist.broadcast(totals, src=src)  # all ranks participate
    return (totals[:2] / totals[2]).tolist()


def train(args, info):
    device, rank, world = info.device, info.rank, info.world_size
    per_process = world > 1  # mode 3: stages in each process, each knowing only its own device
    if per_process and args.devices:
        fail("--devices is for one process; under torchrun each process holds its stages")
    if not per_process and args.stages_per_rank:
        fail("--stages-per-rank is for torchrun (mode 3); one process holds every stage")
    # PipelineStage inferring its shapes, gradients divided by M and schedule.eval(): 2.9 has
    # all, but on 2.9.0 gloo stops with a message size mismatch; 2.10 runs (both measured).
    if per_process and tuple(map(int, torch.__version__.split(".")[:2])) < (2, 10):
        fail(f"one stage per process needs PyTorch 2.10 or newer (this is {torch.__version__})")
    schedule_name, micro = args.pipeline_schedule, args.microbatches or (8 if per_process else 1)
    if args.batch_size % micro:
        fail(f"--microbatches {micro} does not divide --batch-size {args.batch_size} evenly")
    # Interleaved and V-shaped schedules hold several stages per process; the others, one.
    several = per_process and schedule_name not in ("gpipe", "1f1b")
    per_rank = args.stages_per_rank or (2 if several else 1)
    if per_process:
        check_pipeline_schedule(schedule_name, micro, world, per_rank)
    devices = [device] * world if per_process else parse_devices(args.devices, args.device)
    n_stages = world * per_rank if per_process else len(devices)

    # Every rank builds the WHOLE model with the same seed: the one-process run's weights, cut
    # into its stages below. (A model too large for a host would be built on the "meta"
    # device, each stage made alone.)
    torch.manual_seed(args.seed)
    data = load_datasets(
        args.data, args.data_dir, args.download, None, info.local_rank, args.seq_len
    )
    train_set, test_set, num_classes, in_channels = data
    if len(train_set) < args.batch_size:
        fail(f"--batch-size {args.batch_size} is more than the training set ({len(train_set)})")
    sample = train_set[0][0]
    if args.model == "gpt":
        model = GPT(num_classes, args.seq_len, args.dim, args.depth, args.heads)
        costs, units = gpt_costs(model, sample.unsqueeze(0)), "blocks"
    else:
        model = build_pipeline_cnn(in_channels, num_classes)
        costs, units = layer_costs(model, sample.unsqueeze(0)), "layers"
    flops = step_flops(model, sample.expand(args.batch_size, *sample.shape))  # all stages
    if n_stages > len(costs):
        fail(f"{n_stages} stages for a model of {len(costs)} {units}: at most {len(costs)}")
    if units == "blocks" and len(costs) % n_stages:  # refused, though the FLOP cut would run
        fail(f"{n_stages} stages do not divide the GPT's {len(costs)} blocks (--depth)")
    split = balanced_split(costs, n_stages)
    # Which process holds which stage (mode 3): rank 0 the first; the last, the loss.
    owner = {
        s: r for r in range(world) for s in pipeline_stage_ids(schedule_name, r, world, per_rank)
    }
    last = owner[n_stages - 1] if per_process else 0

    # Only now, with data and flags found good, is anything written. Rank 0 alone checks the
    # output directory and reads the checkpoint and tells all (all ranks participate): ranks that
    # looked for themselves could see different files (a directory not shared between nodes).
    profiler = Profiler(args.profile, rank, device)  # a trace of a few steps per rank
    writer = bool(args.output_dir) and rank == 0
    out = together(lambda: check_output_dir(args.output_dir), run=writer)  # a Path on rank 0
    path = Path(args.output_dir or "", "checkpoint.pt")
    ckpt = broadcast_object(together(lambda: path.is_file() and load_checkpoint(path), run=writer))
    if ckpt and "optimizer" not in ckpt:  # every rank has the checkpoint: all stop here
        fail(f"{path} holds no optimizer state to resume from; use another --output-dir")
    if ckpt:  # the whole model's weights, before it is cut: any split, any schedule
        load_model_state(model, ckpt["model"], path)

    if per_process:
        # Imported here: modes 1 and 2 run on any PyTorch. The schedule cuts each batch into M
        # micro-batches, takes each one's mean loss and divides the summed gradients by M.
        from torch.distributed.pipelining import PipelineStage

        ids = pipeline_stage_ids(schedule_name, rank, world, per_rank)
        modules = [make_stage(model, *split[s]).to(device) for s in ids]  # all this trains
        stages = [PipelineStage(m, s, n_stages, device) for m, s in zip(modules, ids, strict=True)]
        profiler.watch_pipeline(stages)  # "stage1 forward mb3" in a trace, activations counted
        schedule = pipeline_schedule(schedule_name, stages, micro, loss_fn)

        def run_batch(inputs, labels, training):
            # The first stage's rank feeds the inputs, the last stage's the labels and gets the
            # logits (the others None).
            inputs = (inputs.to(device),) if 0 in ids else ()
            target, losses = (labels.to(device) if rank == last else None), []
            if training or schedule_name not in V_SHAPED:
                run = schedule.step if training else schedule.eval
                logits = run(*inputs, target=target, losses=losses)
            else:  # PyTorch's eval() stops in a V's backward actions (2.14): a step, ungraded
                with torch.enable_grad():
                    logits = schedule.step(*inputs, target=target, losses=losses)
                for module in modules:
                    module.zero_grad(set_to_none=True)
            if not training or rank != last:
                return logits if rank == last else None
            return torch.stack(losses).detach().mean()  # equal micro-batches: the batch's mean
    else:
        # Each stage's layers on its device, in the whole model's names: one optimizer, and one
        # state dict in the unsplit model's names.
        pairs = zip(split, devices, strict=True)
        modules = [make_stage(model, a, b).to(d) for (a, b), d in pairs]

        def run_batch(inputs, labels, training):
            logits = pipeline_forward(modules, devices, inputs, micro)
            if not training:
                return logits
            # The whole batch's mean loss: the unsplit model's gradients, whatever --microbatches.
            loss = loss_fn(logits, labels.to(devices[-1], non_blocking=True))
            loss.backward()
            return loss.detach()

    # Every stage reads the same batches in the same order (same seed): the first stage uses
    # the inputs, the last one the labels. drop_last: every step has whole micro-batches.
    generator = torch.Generator()
    loader_args = dict(collate_fn=collate, generator=generator, pin_memory=device.type == "cuda")
    train_loader = DataLoader(train_set, args.batch_size, True, drop_last=True, **loader_args)
    test_loader = DataLoader(test_set, args.batch_size, **loader_args)
    steps_per_epoch = len(train_loader)
    total_steps = args.epochs * steps_per_epoch  # not cut by --max-steps: a resume goes on
    peak = args.lr * args.batch_size / 256  # linear scaling: the peak grows with the batch

    # Each process's optimizer steps its own stages' parameters: SGD and AdamW are per element,
    # so the optimizers take together the step of one optimizer over the whole model.
    params = {n: p for m in modules for n, p in m.named_parameters()}  # the unsplit names
    if args.model == "gpt":  # AdamW, no decay on biases, norms, the embedding or positions
        optimizer = torch.optim.AdamW(param_groups(nn.ModuleList(modules), args.weight_decay), peak)
    else:
        wd, momentum = args.weight_decay, args.momentum
        optimizer = torch.optim.SGD(params.values(), peak, momentum, weight_decay=wd, nesterov=True)
    if ckpt:  # each parameter's optimizer state by its unsplit name (AdamW's step on the CPU)
        for name, param in params.items():
            saved = ckpt["optimizer"][name].items()
            optimizer.state[param] = {k: v if k == "step" else v.to(param.device) for k, v in saved}
        print0(f"resumed from {path} at epoch {ckpt['epoch']} of {args.epochs}")
    step = ckpt["epoch"] * steps_per_epoch if ckpt else 0
    # Linear warm-up, then cosine decay to zero; a function of the step, so a resume moves it on.
    scheduler = warmup_decay(optimizer, args.warmup, total_steps)
    fast_forward(scheduler, step)
    if out:
        trim_metrics(out / "metrics.jsonl", step // steps_per_epoch)  # each epoch appears once

    pipes = world if per_process else len(devices)  # the pipeline's length in devices
    mode = f"3: {world} processes (torchrun), {schedule_name}"
    mode = mode if per_process else f"{min(micro, 2)}: one process"
    bubble = (pipes - 1) / (per_rank * micro + pipes - 1)  # the share of a step a device idles
    print0(f"mode {mode}, {n_stages} stages, {micro} micro-batch(es), bubble {bubble:.0%}")
    for s, (a, b) in enumerate(split):
        where = f"rank {owner[s]}" if per_process else devices[s]
        print0(f"stage {s}: {units} {a}-{b - 1} on {where}, {sum(costs[a:b]):.3g} FLOPs/sample")

    for epoch in range(step // steps_per_epoch, args.epochs):
        if args.max_steps and step >= args.max_steps:
            break
        generator.manual_seed(args.seed + epoch)  # the same new order on every rank
        for module in modules:
            module.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=devices[-1])  # the last stage's
        t0, done = time.perf_counter(), 0
        for inputs, labels in train_loader:
            lr = scheduler.get_last_lr()[0]  # this step's rate
            loss = run_batch(inputs, labels, training=True)  # forward and backward
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step, done = step + 1, done + 1
            if loss is not None:  # the batch's mean loss, where the last stage is
                loss_sum += loss
            end = done == steps_per_epoch or step == args.max_steps
            profiler.step(end)  # an evaluation comes next: no training step
            if step % args.log_every == 0 or end:
                # The loss lives on the last stage: it sends its sum (all ranks participate), so
                # rank 0 prints it and all stop together on a NaN.
                if per_process:
                    dist.broadcast(loss_sum, src=last)
                if not loss_sum.isfinite():
                    fail(f"non-finite loss by step {step}: lower --lr")
                print0(f"step {step}: train_loss {loss_sum.item() / done:.4f}")
            if end:
                break
        seconds, train_loss = time.perf_counter() - t0, loss_sum.item() / done
        test_loss, test_acc = evaluate_stages(run_batch, modules, test_loader, devices[-1], last)
        speed = done * args.batch_size / seconds
        record = dict(epoch=epoch, step=step, train_loss=train_loss, test_loss=test_loss)
        record.update(test_acc=test_acc, epoch_seconds=seconds, samples_per_second=speed)
        rates = flop_rates(flops * done, seconds, device, None, args.peak_tflops, pipes)
        record.update(lr=lr, world_size=world, stages=n_stages, microbatches=micro, **rates)
        record.update(schedule=schedule_name if per_process else "one process")
        losses = f"train_loss {train_loss:.4f} test_loss {test_loss:.4f} test_acc {test_acc:.4f}"
        print0(f"epoch {epoch}: {losses} {seconds:.1f}s {speed:.0f} samples/s")
        if args.output_dir:
            # Every stage's weights and optimizer state, gathered on rank 0 (all ranks
            # participate) into ONE checkpoint in the unsplit model's names that any mode,
            # split and schedule resumes from.
            weights = {k: v for m in modules for k, v in m.state_dict().items()}
            moments = {n: optimizer.state[p] for n, p in params.items()}
            part = dict(model=weights, optimizer=moments)
            part = torch.utils._pytree.tree_map(lambda t: t.detach().cpu(), part)
            parts = [part]
            if info.distributed:
                parts = [None] * world if rank == 0 else None
                dist.gather_object(part, parts, dst=0)
            if out:  # global rank 0; the keys in the unsplit model's order
                state = {key: {k: v for p in parts for k, v in p[key].items()} for key in part}
                state["model"] = {k: state["model"][k] for k in model.state_dict()}
                state.update(epoch=step // steps_per_epoch, step=step, args=vars(args))
                save_checkpoint(state, out / "checkpoint.pt")
                append_metrics(out / "metrics.jsonl", record)  # after it: every line has weights
    profiler.stop()


def main(argv=None):
    args = get_args(argv)
    info = init_distributed_mode(
        backend=args.backend, device=args.device, timeout_s=args.dist_timeout
    )
    try:
        train(args, info)
        if info.distributed:
            dist.barrier()  # leave together (all ranks participate): rank 0 hosts the store
    except RuntimeError as e:
        # A stage that died breaks its neighbours' send/recv: one line, not a traceback.
        raise peer_failure(e, info) from None
    finally:
        cleanup()  # also on an error: the peers are not left waiting on a dead group


if __name__ == "__main__":
    main()
