"""Fully sharded data parallelism (FSDP2): each process keeps 1/N of every weight, gradient
and optimizer state; launched by torchrun.

DDP keeps the whole model, its gradients and its optimizer state on every device. FSDP shards
them over the N processes (Zhao et al., 2023): just before a block runs, its weights are
all-gathered from the shards, and freed after it; backward reduce-scatters its gradients, so
each process gets the mean for its own shard and steps its own slice of the optimizer state.
Use it when the model and its optimizer state do not fit on one device beside the
activations; while they do, ddp_train.py is simpler. No device ever holds the whole model:
every rank builds it on the meta device (shapes, no memory), shards it, and only then gets
memory for its own pieces, filled one whole tensor at a time (each drawn from a generator
seeded by its name, or read from --init-from FILE); model.pt is written tensor by tensor.

Launch (--output-dir: one directory for all processes, on several nodes a shared one):
    python fsdp_train.py                                    # one process: nothing to shard
    torchrun --standalone --nproc_per_node=N fsdp_train.py  # N: this machine's GPUs
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        --rdzv-id=myjob fsdp_train.py --replicate 2   # HSDP: shard in a node, replicate across
    torchrun --standalone --nproc_per_node=N fsdp_train.py --init-from model.pt  # fine-tune
    torchrun --standalone --nproc_per_node=2 fsdp_train.py --data text --model gpt  # a GPT

Every process writes its shards of a checkpoint (torch.distributed.checkpoint) each epoch and
every --save-every steps (--async-save: in the background); a rerun resumes at any number of
processes. OUTPUT_DIR/model.pt (and --export PATH) holds the whole model for one process.
--batch-size is per process and micro-batch; --lr the peak AdamW rate per 256 samples.
"""

import argparse
import contextlib
import datetime
import functools
import itertools
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from checkpoint import (
    TrainState,
    export_whole,
    fill_initial,
    find_checkpoint,
    publish_sharded,
    reading,
    resume_step,
    sharded_meta,
    sharded_output,
    trim_metrics,
    weights_for_sample,
)
from common import cleanup, fail, init_distributed_mode, peer_failure, print0, require_torch
from data import load_datasets, pad_batches, shard_loaders
from models import MODELS, build_model, generate, initial_weights, param_groups
from profiling import Profiler, flop_rates, step_flops
from training import end_epoch, evaluate, log_loss, sharded_args, sharded_parser, warmup_decay


def get_args(argv=None):
    p = sharded_parser(__doc__)  # --data, --epochs, --lr, ..., --dist-timeout: training.py's
    add = p.add_argument
    add("--model", default="vit", choices=[*sorted(MODELS), "gpt"], help="gpt: on --data text")
    per = "samples per process per micro-batch (default 128; text: 4 sequences)"
    add("--batch-size", type=int, help=per)
    add("--accum-steps", type=int, default=1, help="micro-batches per optimizer step")
    reshard = "free a block's gathered weights after forward (--no-...: keep them for backward)"
    add(
        "--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True, help=reshard
    )
    ac = "keep each block's input only; recompute the block in backward"
    add("--checkpoint-activations", action="store_true", help=ac)
    add("--cpu-offload", action="store_true", help="keep the shards in CPU memory (CUDA)")
    hsdp = "HSDP: R replicas, each sharded over processes/R (a node's); 1: plain FSDP"
    add("--replicate", type=int, default=1, metavar="R", help=hsdp)
    add("--init-from", help="start from this whole-model file (model.pt, a state_dict)")
    add("--compile", action="store_true", help="torch.compile the model")
    add("--save-every", type=int, default=0, help="steps between mid-epoch checkpoints; 0: none")
    add("--async-save", action="store_true", help="write checkpoints while training goes on")
    args = p.parse_args(argv)
    sharded_args(args, ("accum_steps", "replicate"), ("save_every",), batch=(128, 4))
    if (args.save_every or args.async_save) and not args.output_dir:
        fail("--save-every and --async-save need --output-dir (where the checkpoints go)")
    if args.checkpoint_activations and args.model not in ("vit", "resnet18", "gpt"):
        fail(f"--checkpoint-activations recomputes blocks; --model {args.model} has none")
    return args


def units(model):
    """What FSDP gathers and frees one at a time: the ViT's transformer blocks, ResNet's
    stages (the MLP and the CNN have none: one unit, the root, whole)."""
    stages = [getattr(model, f"layer{i}", None) for i in range(1, 5)]
    return list(getattr(model, "blocks", [])) + [s for s in stages if s is not None]


def recompute_keeps_statistics(block):
    """checkpoint's context_fn for `block`: its forward runs as usual, and again in backward
    to remake the activations, where BatchNorm would update its running statistics a second
    time (num_batches_tracked 2 a step, running_mean pulled twice as far; PyTorch issue
    96136). So the recomputation gives back what it changed of them."""
    norms = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

    @contextlib.contextmanager
    def recompute():
        kept = [[b.clone() for b in norm.buffers()] for norm in norms]
        try:
            yield
        finally:
            with torch.no_grad():
                for norm, buffers in zip(norms, kept, strict=True):
                    for buffer, old in zip(norm.buffers(), buffers, strict=True):
                        buffer.copy_(old)

    return contextlib.nullcontext(), recompute()


def main(argv=None):
    args = get_args(argv)
    require_torch("2.9", "fsdp_train.py")  # on 2.7 and 2.8, N processes differ from one
    # Offloaded shards and their gradients are CPU tensors, which NCCL cannot reduce (the
    # gradient norm's all-reduce, say): such a group needs gloo beside NCCL for them.
    backend = args.backend
    if args.cpu_offload and backend in (None, "nccl"):
        backend = "cuda:nccl,cpu:gloo"
    # The process group: rank, world size and device from whichever launcher started us.
    info = init_distributed_mode(backend=backend, device=args.device, timeout_s=args.dist_timeout)
    device, rank, world = info.device, info.rank, info.world_size
    try:
        if args.cpu_offload and device.type != "cuda":
            fail("--cpu-offload keeps the shards in CPU memory for a GPU to compute on: no GPU")
        if world % args.replicate:  # every rank checks, before any collective
            fail(f"--replicate {args.replicate} does not divide the {world} processes")

        # Data: each rank trains on a disjoint 1/world of a permutation of (seed, epoch).
        train_set, test_set, num_classes, in_channels = load_datasets(
            args.data, args.data_dir, args.download, None, info.local_rank, args.seq_len
        )
        sampler, train_loader, test_loader = shard_loaders(
            train_set, test_set, args, world, rank, device
        )
        steps_per_epoch = len(train_loader) // args.accum_steps
        global_batch = args.batch_size * world * args.accum_steps
        total_steps = args.epochs * steps_per_epoch

        # The mesh of the device in use (without one, fully_shard would take CUDA's whenever
        # there is a GPU). HSDP: each row of R x world/R is one replica, sharded over a node.
        mesh = None
        if info.distributed:
            shape, names = (args.replicate, world // args.replicate), ("replicate", "shard")
            mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
            mesh = mesh if args.replicate > 1 else mesh["shard"]

        def shard(model):
            """FSDP's units: each gathered whole just before it runs and freed after."""
            if not info.distributed:
                return  # one process has nothing to shard
            # bf16: the gathered weights, and so the compute, in bf16; the gradients are
            # reduced in fp32, where bf16's 8-bit mantissa would lose small contributions.
            mp = MixedPrecisionPolicy(torch.bfloat16, reduce_dtype=torch.float32)
            kwargs = dict(mesh=mesh, reshard_after_forward=args.reshard_after_forward)
            kwargs.update(mp_policy=mp if args.amp == "bf16" else MixedPrecisionPolicy())
            if args.cpu_offload:
                kwargs.update(offload_policy=CPUOffloadPolicy())
            if args.amp == "bf16":  # BatchNorm's running statistics stay fp32: so must it
                fp32 = MixedPrecisionPolicy(torch.float32, output_dtype=torch.bfloat16)
                for norm in [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]:
                    fully_shard(norm, **dict(kwargs, mp_policy=fp32))
            # Each block a unit of its own, so that one block's whole weights exist at a time
            # (and the next one's all-gather overlaps its compute); then the root, which takes
            # the rest and must come last. Each parameter becomes a DTensor: 1/world of it here.
            for block in units(model):
                fully_shard(block, **kwargs)
            fully_shard(model, **kwargs)

        # Built on no device whole: the shapes on the meta device (no memory), sharded, then
        # memory for this rank's shards only, filled one whole tensor at a time with what one
        # process starts from (each drawn alone, seeded by its name) or the --init-from file's.
        text, sample = args.model == "gpt", train_set[0][0]  # an image, or a sequence
        shape = (sample.shape[-1], args.dim, args.heads, args.seq_len, args.depth)
        build = functools.partial(build_model, args.model, in_channels, num_classes, *shape)
        with torch.device("meta"):
            model = build()
        shard(model)
        offload = args.cpu_offload and info.distributed  # one process: no FSDP to offload
        model.to_empty(device=torch.device("cpu") if offload else device)
        fill_initial(model, initial_weights(build, args.seed), args.init_from)  # all ranks
        # FSDP offloads the parameters; buffers (BatchNorm's statistics) stay with the forward.
        # Moved after the fill, which refuses a model on two devices ("Multiple devices found").
        for module in model.modules() if offload else ():
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, buffer.to(device))
        raw_model = model  # no torch.compile wrapper
        if args.checkpoint_activations:
            for block in units(model):
                again = functools.partial(recompute_keeps_statistics, block)
                kwargs = dict(use_reentrant=False, context_fn=again)
                block.forward = functools.partial(checkpoint, block.forward, **kwargs)
        # One process has nothing to shard: autocast gives it bf16 instead.
        dtype = torch.bfloat16 if args.amp == "bf16" else None  # the compute's (MFU's peak)
        use_autocast = args.amp == "bf16" and not info.distributed  # FSDP gives bf16 itself
        autocast = functools.partial(torch.autocast, device.type, dtype, use_autocast)

        out = sharded_output(args.output_dir)  # every rank writes there: every rank checks
        profiler = Profiler(args.profile, rank, device)  # a trace of a few steps per rank
        with torch.device("meta"):  # a step's FLOPs: the whole model on the global batch
            flops = step_flops(build(), sample.expand(global_batch, *sample.shape))

        # The optimizer, made after fully_shard: it holds (and steps) the local shards only.
        lr = args.lr * global_batch / 256
        # Fused: one kernel steps every parameter, on CUDA and on the CPU too, where its step
        # took 0.43-0.47 of foreach's time and of the default loop's (benchmarks/results.md).
        groups = param_groups(model, args.weight_decay)
        optimizer = torch.optim.AdamW(groups, lr, betas=args.betas, fused=True)

        # Resume: rank 0 finds the checkpoint and checks its meta.pt; every rank reads the parts
        # of the saved shards that make up its own, whatever the number of processes that
        # saved them: DCP cuts them anew (all ranks participate).
        state = dict(train=TrainState(raw_model, optimizer))  # what DCP saves and loads
        resume, meta = find_checkpoint(args, raw_model)
        if resume:  # each rank reads the parts of the saved pieces that make up its own
            with reading(resume):
                dcp.load(state, checkpoint_id=resume)
        batches = (global_batch, steps_per_epoch)
        step = resume_step(args, optimizer, meta, resume, batches, device)

        # Warm-up, then --decay to zero; from the step resumed at (a function of the step alone).
        scheduler = warmup_decay(optimizer, args.warmup, total_steps, step, args.decay)

        @torch.no_grad()
        def evaluate_all():
            """Exact evaluation of the sharded model. Each forward all-gathers weights (all
            ranks participate), so a rank with fewer test batches runs padding."""
            for buffer in raw_model.buffers() if info.distributed else ():
                dist.broadcast(buffer, src=0)  # BatchNorm statistics: one model on every rank
            padded = pad_batches(test_loader, test_set[0], device)
            return evaluate(raw_model, padded, device, autocast())

        if args.eval_only:
            loss, acc = evaluate_all()
            print0(f"eval {resume}: test_loss {loss:.4f} test_acc {acc:.4f}")
            return  # no barrier: evaluate's all-reduce was every rank's last collective

        if args.compile:
            model = torch.compile(model)

        # --async-save: the shards are copied to CPU memory (a copy of this rank's share of
        # the weights and optimizer state) and written by a background thread, whose
        # collectives need a gloo group of their own while training's run on the default one.
        timeout = datetime.timedelta(seconds=args.dist_timeout)  # gloo's default: 30 minutes
        group = None
        if args.async_save and info.distributed:
            group = dist.new_group(backend="gloo", timeout=timeout)
        pending = []  # the background save in flight: one at a time

        def save(step):  # all ranks participate
            if pending:
                pending.pop()()  # the previous save written (and published), before the next
            meta = sharded_meta(raw_model, step, steps_per_epoch, global_batch, args, device)
            # Every rank writes its own shards of the model and the optimizer state; once all
            # are written, rank 0 publishes them (a crash mid-save keeps the last checkpoint).
            if not args.async_save:
                dcp.save(state, checkpoint_id=out / "checkpoint.tmp")
                return publish_sharded(out, meta)
            # In the background: copied to CPU memory now, written by a thread meanwhile.
            future = dcp.async_save(
                state, checkpoint_id=out / "checkpoint.tmp", process_group=group
            )
            pending.append(lambda: (future.result(), publish_sharded(out, meta)))

        start_epoch = step // steps_per_epoch
        metrics = out / "metrics.jsonl" if out and rank == 0 else None
        if metrics and not (args.max_steps and step >= args.max_steps):
            trim_metrics(metrics, start_epoch)  # epochs that run again lose their old lines
        size = f"global batch {global_batch}, peak lr {lr:.3g}, {steps_per_epoch} steps/epoch"
        print0(f"{args.model} on {args.data}: {world} process(es) on {device.type}, {size}")
        if start_epoch >= args.epochs:
            print0(f"{resume} already holds all {args.epochs} epochs: nothing to train")
        for epoch in range(start_epoch, args.epochs):
            if args.max_steps and step >= args.max_steps:
                break
            sampler.set_epoch(epoch)  # without it every epoch repeats epoch 0's order
            epoch_step = step - epoch * steps_per_epoch
            steps, done = steps_per_epoch - epoch_step, 0
            # Sums stay on the device until a log step: .item() would stall a GPU every step.
            loss_sum, count = torch.zeros(2, device=device, dtype=torch.float64)
            model.train()
            t0 = time.perf_counter()
            # A mid-epoch resume skips the batches done: the order is a function of the epoch.
            micro_batches = itertools.islice(train_loader, epoch_step * args.accum_steps, None)
            for i, (images, labels) in enumerate(micro_batches):
                images = images.to(device, non_blocking=True)
                labels = labels.to(device, non_blocking=True)
                # Accumulation: on all but a step's last micro-batch, backward keeps each
                # unit's whole (unsharded) gradient on every rank and adds the next one to it,
                # reduce-scattering nothing: one reduce-scatter per step instead of K, for a
                # whole gradient's memory per rank in between, as DDP holds.
                last_micro = (i + 1) % args.accum_steps == 0
                if info.distributed:
                    raw_model.set_requires_gradient_sync(last_micro)
                with autocast():
                    logits = model(images)
                # Per sample, or per token (text: the mean over each position's next byte).
                logits, labels = logits.flatten(0, -2).float(), labels.flatten()
                loss = F.cross_entropy(logits, labels, label_smoothing=0.0 if text else 0.1)
                # Each unit's gradients are reduce-scattered as soon as backward has made them:
                # every rank keeps the mean over all ranks for its own shard (over the
                # micro-batches too, by the division).
                (loss / args.accum_steps).backward()
                loss_sum += loss.detach() * labels.numel()
                count += labels.numel()
                if not last_micro:
                    continue
                if args.clip_grad > 0:
                    # The norm of the whole gradient: DTensor sums the shards' squares over all
                    # ranks, so every rank scales by the same factor.
                    nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
                optimizer.step()  # this rank's shards only
                optimizer.zero_grad(set_to_none=True)
                lr_now = scheduler.get_last_lr()[0]  # this step's rate (logged; the epoch's last)
                scheduler.step()  # on to the next step's
                step, done = step + 1, done + 1
                last = done == steps or step == args.max_steps
                snapshot = args.save_every and step % args.save_every == 0 and not last
                profiler.step(last or snapshot)  # evaluation, saving: no training step
                if step % args.log_every == 0 or last or snapshot:  # all ranks participate
                    train_loss = log_loss(loss_sum, count, epoch, step, lr_now)
                if snapshot:
                    save(step)  # a mid-epoch checkpoint; all ranks participate
                if last:
                    break
            seconds = time.perf_counter() - t0  # the loss all-reduce above synchronised

            test_loss, test_acc = evaluate_all()
            speed = done * global_batch / seconds
            record = dict(epoch=epoch, step=step, train_loss=train_loss, test_loss=test_loss)
            record.update(test_acc=test_acc, epoch_seconds=seconds, samples_per_second=speed)
            rates = flop_rates(flops * done, seconds, device, dtype, args.peak_tflops, world)
            record.update(lr=lr_now, world_size=world, **rates)
            end_epoch(metrics, record)  # printed; in metrics.jsonl before the checkpoint
            if out:
                save(step)  # all ranks participate
        if pending:
            pending.pop()()  # the last checkpoint written (and published by rank 0)

        profiler.stop()
        # The whole model in one file that loads without FSDP, written tensor by tensor (all
        # ranks participate); rank 0's sample of what the GPT learnt, read back if small.
        written = export_whole(raw_model, filter(None, [out and out / "model.pt", args.export]))
        if text and (whole := weights_for_sample(written)):
            print0("sample:", generate(build(), whole))
        if info.distributed:
            dist.barrier()  # leave together (all ranks participate): rank 0 hosts the store
    except RuntimeError as e:
        # A peer that died or hung for --dist-timeout breaks the others' collectives.
        raise peer_failure(e, info) from None
    finally:
        cleanup()  # also on an error: the peers are not left waiting on a dead group


if __name__ == "__main__":
    main()
