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
        --depth 4 --pipeline-schedule zbv                           # the GPT, 4 stages in a V
    torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        --rdzv-id=myjob model_parallel.py                  # on every node: 4 stages, 1 per GPU
A rerun with the same --output-dir resumes where the last stopped (mid-epoch too), any mode.
"""

import copy
import itertools
import re
import time
from collections import OrderedDict
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from checkpoint import (
    append_metrics,
    check_output_dir,
    load_checkpoint,
    load_model_state,
    resume_step,
    rng_state,
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
from models import GPT, build_pipeline_cnn, keep_stage, param_groups
from profiling import Profiler, add_flags, flop_rates, step_flops
from training import (
    DATA_DEFAULTS,
    PIPELINE_SCHEDULES,
    V_SHAPED,
    balanced_split,
    check_pipeline_schedule,
    check_recipe,
    clip_grad_norm,
    fill_defaults,
    gpt_costs,
    layer_costs,
    pipeline_schedule,
    pipeline_stage_ids,
    warmup_decay,
)


def get_args(argv=None):
    p = ArgumentParser(description=__doc__)
    add = p.add_argument
    add("--data", default="fashion-mnist", choices=[*DATASETS, TEXT], help="text: --model gpt")
    where = "images: torchvision's root (default data); text: a file or folder (default stdlib)"
    add("--data-dir", help=where)
    add("--download", action="store_true", help="download the data set if it is missing")
    add("--model", default="cnn", choices=["cnn", "gpt"], help="gpt: models.GPT, on --data text")
    add("--seq-len", type=int, default=256, help="text: bytes per sample (the context)")
    add("--dim", type=int, help="the GPT's width (default 128)")
    add("--heads", type=int, help="the GPT's attention heads (default 2)")
    add("--depth", type=int, help="the GPT's blocks (default 2)")
    add("--epochs", type=int, help="passes over the training set (default 5; text: 1)")
    add("--batch-size", type=int, help="samples per step, all stages (default 128; text: 8)")
    add("--devices", help="stages in one process, e.g. cuda:0,cuda:1 (default: 2 GPUs, else CPU)")
    add("--microbatches", type=int, help="pieces per batch (default: 1; 8 under torchrun)")
    add("--pipeline-schedule", default="1f1b", choices=PIPELINE_SCHEDULES, help="mode 3's order")
    add("--stages-per-rank", type=int, help="mode 3: stages per process (interleaved, V: 2)")
    peak = "peak rate per 256 samples of the batch (default SGD's 0.2; text: AdamW's 0.14)"
    add("--lr", type=float, help=peak)
    add("--momentum", type=float, default=0.9, help="SGD (Nesterov) momentum (the CNN)")
    add("--weight-decay", type=float, help="default SGD's L2 penalty 5e-4; text: AdamW's 0.05")
    betas = "text: AdamW's moment decays (default 0.9 0.95, as GPT-3 and nanoGPT)"
    add("--betas", type=float, nargs=2, metavar=("B1", "B2"), help=betas)
    add("--clip-grad", type=float, help="max gradient norm; 0: no clipping (default 0; text: 1)")
    add("--warmup", type=float, help="fraction of steps warming up (default 0.2; text: 0.1)")
    decay = "the rate's decay to zero after warm-up (default cosine; text: linear)"
    add("--decay", choices=["cosine", "linear"], help=decay)
    add("--amp", default="none", choices=["none", "bf16"], help="bf16: compute and send in bf16")
    add("--compile", action="store_true", help="torch.compile each block (layer) of each stage")
    add("--seed", type=int, default=0, help="seed for the weights and the shuffling")
    add("--max-steps", type=int, default=0, help="stop after this many steps; 0: no limit")
    add("--log-every", type=int, default=50, help="steps between progress and NaN checks")
    add("--output-dir", help="where checkpoint.pt and metrics.jsonl go; none: write nothing")
    add("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if any")
    add("--backend", choices=["gloo", "nccl", "mpi"], help="default: nccl on CUDA, else gloo")
    add("--dist-timeout", type=float, default=300, help="seconds before a lost peer ends the job")
    add_flags(p)  # --profile DIR, --peak-tflops (profiling.py)
    args = p.parse_args(argv)
    # The GPT: the text recipe of the sharded scripts (training.py); the CNN: SGD's own.
    defaults = dict(DATA_DEFAULTS, batch_size=(128, 8), lr=(0.2, DATA_DEFAULTS["lr"][1]))
    defaults.update(weight_decay=(5e-4, 0.05), warmup=(0.2, 0.1))
    fill_defaults(args, defaults)
    at_least_1 = ("epochs", "batch_size", "microbatches", "stages_per_rank", "log_every")
    at_least_1 += ("seq_len", "dim", "heads", "depth")
    positive = ("lr", "momentum", "dist_timeout", "peak_tflops")  # momentum: in the checkpoint
    check_flags(args, at_least_1, ("max_steps", "weight_decay", "clip_grad"), positive)
    check_recipe(args)  # --betas, --warmup, --model against --data, --dim against --heads
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


def make_stage(model, first, end, device, args):
    """The layers [first, end) on `device`, as a module of their own, shared with `model`. The
    OrderedDict keeps the full model's names ("2.0.weight"): the stages' state dicts make the
    full one. The GPT: a copy cut by models.keep_stage, in its names ("blocks.3.attn.q.weight").
    --compile: each block (layer) compiled on its own, as torchtitan does, so the stage stays a
    module the pipeline drives. --amp bf16: what crosses to the next stage (activations, and
    their gradients back) in bf16, half the bytes; fp32 again in the next stage's residuals."""
    gpt = isinstance(model, GPT)
    if gpt:
        stage = keep_stage(copy.deepcopy(model), first, end)
    else:
        stage = nn.Sequential(OrderedDict(itertools.islice(model.named_children(), first, end)))
    for unit in (stage.blocks if gpt else stage) if args.compile else ():
        if unit is not None:  # a block of another stage (keep_stage)
            unit.compile()
    if args.amp == "bf16":
        if first > 0:  # what it receives, in fp32 again
            stage.register_forward_pre_hook(lambda _, inputs: (inputs[0].float(),))
        if end < len(model.blocks if gpt else model):  # what it sends
            stage.register_forward_hook(lambda _, __, out: out.bfloat16())
    return stage.to(device)


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
    # into its stages below, then dropped. (A model too large for a host would be built on the
    # "meta" device, each stage made alone.)
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
    names = list(model.state_dict())  # the unsplit model's order, for the checkpoint
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
        load_model_state(model, ckpt.pop("model"), path)

    amp = partial(torch.autocast, devices[-1].type, torch.bfloat16, enabled=args.amp == "bf16")
    if per_process:
        # Imported here: modes 1 and 2 run on any PyTorch. The schedule cuts each batch into M
        # micro-batches, takes each one's mean loss and divides the summed gradients by M.
        from torch.distributed.pipelining import PipelineStage

        ids = pipeline_stage_ids(schedule_name, rank, world, per_rank)
        modules = [make_stage(model, *split[s], device, args) for s in ids]  # all this trains
        del model  # the stages hold what this process trains: not the rest of the model
        stages = [PipelineStage(m, s, n_stages, device) for m, s in zip(modules, ids, strict=True)]
        profiler.watch_pipeline(stages)  # "stage1 forward mb3" in a trace, activations counted
        schedule = pipeline_schedule(schedule_name, stages, micro, loss_fn)

        def run_batch(inputs, labels, training):
            # The first stage's rank feeds the inputs, the last stage's the labels and gets the
            # logits (the others None).
            inputs = (inputs.to(device, non_blocking=True),) if 0 in ids else ()
            target, losses = (labels.to(device, non_blocking=True) if rank == last else None), []
            with amp():
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
        modules = [make_stage(model, a, b, d, args) for (a, b), d in pairs]
        del model  # the stages hold it all, on their devices

        def run_batch(inputs, labels, training):
            with amp():
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
        # Fused: one kernel for all parameters, as nanoGPT and torchtitan on CUDA; on the CPU
        # too, where it is several times faster than foreach (measured at this width).
        groups = param_groups(nn.ModuleList(modules), args.weight_decay)
        optimizer = torch.optim.AdamW(groups, peak, betas=args.betas, fused=True)
    else:
        wd, momentum = args.weight_decay, args.momentum
        optimizer = torch.optim.SGD(params.values(), peak, momentum, weight_decay=wd, nesterov=True)
    if ckpt:  # each parameter's optimizer state by its unsplit name (fused AdamW: its step too)
        for name, param in params.items():
            saved = ckpt["optimizer"][name].items()
            optimizer.state[param] = {k: v.to(param.device) for k, v in saved}
    # The step to go on after (mid-epoch too), the schedule's flags checked; 0 without one.
    batches = (args.batch_size, steps_per_epoch)
    step = resume_step(args, optimizer, ckpt, path, batches, devices[0]) if ckpt else 0
    # Linear warm-up, then --decay to zero; a function of the step, so a resume moves it on.
    scheduler = warmup_decay(optimizer, args.warmup, total_steps, step, args.decay)
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
        # A mid-epoch resume skips the batches done: the order is a function of the epoch.
        for inputs, labels in itertools.islice(train_loader, step % steps_per_epoch, None):
            lr = scheduler.get_last_lr()[0]  # this step's rate
            loss = run_batch(inputs, labels, training=True)  # forward and backward
            if args.clip_grad and per_process:  # the whole model's norm: each stage's share
                clip_grad_norm(params.values(), args.clip_grad, dist.group.WORLD)  # all ranks
            elif args.clip_grad:  # one process: its stages may be on several devices
                nn.utils.clip_grad_norm_(params.values(), args.clip_grad)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step, done = step + 1, done + 1
            if loss is not None:  # the batch's mean loss, where the last stage is
                loss_sum += loss
            end = step % steps_per_epoch == 0 or step == args.max_steps
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
                state["model"] = {k: state["model"][k] for k in names}
                state.update(epoch=step // steps_per_epoch, step=step, args=vars(args))
                state.update(steps_per_epoch=steps_per_epoch, global_batch=args.batch_size)
                state.update(rng=rng_state(devices[0]))  # what resume_step reads (nothing drawn)
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
