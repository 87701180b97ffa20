"""Tensor parallelism: each transformer block's linear layers split over TP processes, which
compute one sample together; with --dp D, 2-D parallelism: D such groups sharded by FSDP.

Megatron-LM's cut (Shoeybi et al., 2019): a block's first linear layers are split by output
features (each process computes some attention heads, some MLP features), its last by input
features; the partial outputs are summed by one all-reduce per pair. Use it when one block's
weights or activations are too large for one device, inside a node (collectives in every
block need NVLink-class links); across nodes add --dp, so only FSDP's traffic leaves a node.

    4 processes, --dp 2:  mesh [[0, 1],    each row a tensor-parallel group (a block split
                                [2, 3]]    over 2), each column an FSDP group (same pieces)

Launch (--output-dir: one directory for all processes, on several nodes a shared one):
    python tensor_parallel.py                                     # one process, unsplit
    torchrun --standalone --nproc_per_node=2 tensor_parallel.py   # TP degree 2
    torchrun --standalone --nproc_per_node=4 tensor_parallel.py --dp 2   # 2 x 2
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        --rdzv-id=myjob tensor_parallel.py --dp 2 --heads 8   # on each node; TP 8 inside it
    torchrun --standalone --nproc_per_node=2 tensor_parallel.py --data text --model gpt

Checkpoints as in fsdp_train.py: every process writes its pieces, a rerun resumes at any TP
and DP degree, model.pt holds the whole model. --batch-size is per TP group (its processes
share each batch); --lr is the peak AdamW rate per 256 samples of global batch.
"""

import functools
import itertools
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

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
from models import build_model, generate, initial_weights, param_groups
from profiling import Profiler, flop_rates, step_flops
from training import (
    clip_grad_norm,
    end_epoch,
    evaluate,
    fused_adamw,
    log_loss,
    sharded_args,
    sharded_parser,
    warmup_decay,
)


def get_args(argv=None):
    p = sharded_parser(__doc__)  # --data, --epochs, --lr, ..., --dist-timeout: training.py's
    add = p.add_argument
    add("--dp", type=int, default=1, help="data-parallel degree (FSDP); TP: processes / dp")
    add("--tp", type=int, help="tensor-parallel degree (default: processes / --dp)")
    add("--sequence-parallel", action="store_true", help="norms, residuals by token (TP > 1)")
    add("--model", default="vit", choices=["vit", "gpt"], help="gpt: on --data text")
    add("--batch-size", type=int, help="samples per TP group per step (default 128; text: 8)")
    args = p.parse_args(argv)
    return sharded_args(args, ("dp", "tp"), batch=(128, 8))


def move(src, dst, local=True):
    """A module's input, laid out as src (Shard(1): by token), moved to dst; plain if local."""
    return PrepareModuleInput(
        input_layouts=(src,), desired_input_layouts=(dst,), use_local_output=local
    )


def block_plan(sequence_parallel):
    """Which of a block's linear layers are split by output features (Megatron's "columns")
    and which by input features ("rows"). q, k, v, fc1 by columns: each process computes whole
    heads (MLP features) from the whole input, alone; proj, fc2 by rows: each turns those into
    a partial sum of the output, and one all-reduce per pair adds them. In backward, one per
    pair adds the input's gradient, as q, k and v share one input DTensor (not a copy each)."""
    tokens = Shard(1) if sequence_parallel else Replicate()  # the input, as it arrives
    gather = move(tokens, Replicate(), local=False)  # every token, for attention and the MLP
    plan = {name: ColwiseParallel() for name in ("attn.q", "attn.k", "attn.v", "mlp.fc1")}
    plan |= {"attn": gather, "mlp": gather}
    if not sequence_parallel:
        return plan | {"attn.proj": RowwiseParallel(), "mlp.fc2": RowwiseParallel()}
    # Sequence parallelism: between the pairs, the residual stream and the norms hold (and save
    # for backward) 1/TP of the tokens, not all. Each all-reduce becomes a reduce-scatter (to
    # each process's tokens) and an all-gather before the next column-split layers.
    rows = RowwiseParallel(output_layouts=Shard(1))  # outputs: this process's tokens
    plan |= {"attn.proj": rows, "mlp.fc2": rows}
    return plan | {"norm1": SequenceParallel(), "norm2": SequenceParallel()}


def main(argv=None):
    args = get_args(argv)
    require_torch("2.9", "tensor_parallel.py")  # requirements.txt's floor
    # The process group: rank, world size and device from whichever launcher started us.
    info = init_distributed_mode(
        backend=args.backend, device=args.device, timeout_s=args.dist_timeout
    )
    device, rank, world = info.device, info.rank, info.world_size
    try:
        dp, tp = args.dp, args.tp or max(1, world // args.dp)
        if dp * tp != world:
            fail(f"--dp {dp} x --tp {tp} makes a mesh of {dp * tp} processes; {world} started")
        if args.heads % tp:  # then the widths (a multiple of the heads) split evenly too
            fail(f"TP degree {tp} must divide the {args.heads} heads (and --dim {args.dim})")
        # The mesh: TP groups of tp consecutive ranks, one node's if tp divides its processes.
        mesh = None
        if info.distributed:
            mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
        dp_rank = mesh["dp"].get_local_rank() if mesh else 0

        # Data: a TP group shares each batch; the dp rows of the mesh take disjoint 1/dp.
        train_set, test_set, num_classes, in_channels = load_datasets(
            args.data, args.data_dir, args.download, None, info.local_rank, args.seq_len
        )
        sampler, train_loader, test_loader = shard_loaders(
            train_set, test_set, args, dp, dp_rank, device
        )
        steps_per_epoch, global_batch = len(train_loader), args.batch_size * dp
        total_steps = args.epochs * steps_per_epoch

        text, sample = args.model == "gpt", train_set[0][0]  # an image, or a sequence
        shape = (sample.shape[-1], args.dim, args.heads, args.seq_len, args.depth)
        build = functools.partial(build_model, args.model, in_channels, num_classes, *shape)

        def split(model):
            if tp > 1:
                # Each split weight becomes a DTensor that holds 1/tp of it here; the
                # embedding, the norms and the head stay whole on every process. (A GPT's
                # head to 256 bytes is smaller than one block. Over a vocabulary of 128K it
                # is the largest layer: split by vocabulary, ColwiseParallel(output_layouts=
                # Shard(-1)), with the loss under loss_parallel(), no process holds all the
                # logits of a token.)
                for block in model.blocks:
                    parallelize_module(block, mesh["tp"], block_plan(args.sequence_parallel))
                if args.sequence_parallel:  # 1st block's input cut by token, the last's joined
                    if (tokens := model.pos.shape[1]) % tp:  # from_local assumes even pieces
                        fail(f"--sequence-parallel: TP degree {tp} must divide the {tokens} tokens")
                    cut, join = move(Replicate(), Shard(1)), move(Shard(1), Replicate())
                    parallelize_module(model, mesh["tp"], {"blocks.0": cut, "norm": join})
            if dp > 1:
                # FSDP over the other dimension, as in fsdp_train.py: each block, then the root.
                # After TP: each TP piece is sharded again by rows over the dp processes with it.
                mp = MixedPrecisionPolicy(torch.bfloat16, reduce_dtype=torch.float32)
                policy = mp if args.amp == "bf16" else MixedPrecisionPolicy()
                for block in model.blocks:
                    fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
                fully_shard(model, mesh=mesh["dp"], mp_policy=policy)

        # Built on no device whole, as in fsdp_train.py: the model's shapes on the meta device,
        # split, then memory for each rank's pieces, filled one whole tensor at a time.
        with torch.device("meta"):
            model = build()
        split(model)
        model.to_empty(device=device)
        fill_initial(model, initial_weights(build, args.seed))  # all ranks participate
        dtype = torch.bfloat16 if args.amp == "bf16" else None  # the compute's (MFU's peak)
        use_autocast = args.amp == "bf16" and dp == 1  # without FSDP, autocast gives bf16
        autocast = functools.partial(torch.autocast, device.type, dtype, use_autocast)

        out = sharded_output(args.output_dir)  # every rank writes there: every rank checks
        profiler = Profiler(args.profile, rank, device)  # a trace of a few steps per rank
        with torch.device("meta"):  # a step's FLOPs: the whole model on the global batch
            flops = step_flops(build(), sample.expand(global_batch, *sample.shape))

        # The optimizer, made after the split: it holds (and steps) this process's pieces.
        lr = args.lr * global_batch / 256
        # Fused, a call per kind: the embedding and head stay plain (training.fused_adamw).
        optimizer = fused_adamw(param_groups(model, args.weight_decay), lr, args.betas)

        # Resume, as in fsdp_train.py: rank 0 finds and checks the checkpoint; every rank reads
        # the parts of the saved pieces that make up its own, at any degree (all participate).
        state = dict(train=TrainState(model, optimizer))  # what DCP saves and loads
        resume, meta = find_checkpoint(args, model)
        if resume:  # each rank reads the parts of the saved pieces that make up its own
            with reading(resume):
                dcp.load(state, checkpoint_id=resume)
        batches = (global_batch, steps_per_epoch)
        step = resume_step(args, optimizer, meta, resume, batches, device)

        # Warm-up, then --decay to zero; from the step resumed at (a function of the step alone).
        scheduler = warmup_decay(optimizer, args.warmup, total_steps, step, args.decay)

        @torch.no_grad()
        def evaluate_all():
            """Exact: a rank with fewer test batches runs padding (forward is collective);
            evaluate() sums each TP group's totals tp times, so the ratios are exact."""
            padded = pad_batches(test_loader, test_set[0], device)
            return evaluate(model, padded, device, autocast())

        if args.eval_only:
            loss, acc = evaluate_all()
            print0(f"eval {resume}: test_loss {loss:.4f} test_acc {acc:.4f}")
            return  # no barrier: evaluate's all-reduce was every rank's last collective

        def save(step):  # all ranks participate
            meta = sharded_meta(model, step, steps_per_epoch, global_batch, args, device)
            # Every rank writes its pieces; rank 0 then publishes them (see fsdp_train.py).
            dcp.save(state, checkpoint_id=out / "checkpoint.tmp")
            publish_sharded(out, meta)

        start_epoch = step // steps_per_epoch
        metrics = out / "metrics.jsonl" if out and rank == 0 else None
        if metrics and not (args.max_steps and step >= args.max_steps):
            trim_metrics(metrics, start_epoch)  # epochs that run again lose their old lines
        size = f"global batch {global_batch}, peak lr {lr:.3g}, {steps_per_epoch} steps/epoch"
        how = f"{dp} x {tp} (dp x tp) process(es) on {device.type}"
        print0(f"{args.model} on {args.data}: {how}, {size}")
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
            for images, labels in itertools.islice(train_loader, epoch_step, None):
                images = images.to(device, non_blocking=True)
                labels = labels.to(device, non_blocking=True)
                with autocast():
                    logits = model(images)  # whole on every process of the TP group
                logits, labels = logits.flatten(0, -2).float(), labels.flatten()  # text: tokens
                loss = F.cross_entropy(logits, labels, label_smoothing=0.0 if text else 0.1)
                loss.backward()
                loss_sum += loss.detach() * labels.numel()
                count += labels.numel()
                if args.clip_grad > 0:
                    clip_grad_norm(list(model.parameters()), args.clip_grad)
                optimizer.step()  # this process's pieces only
                optimizer.zero_grad(set_to_none=True)
                lr_now = scheduler.get_last_lr()[0]  # this step's rate (logged; the epoch's last)
                scheduler.step()  # on to the next step's
                step, done = step + 1, done + 1
                last = done == steps or step == args.max_steps
                profiler.step(last)  # an evaluation comes next: no training step
                if step % args.log_every == 0 or last:  # all ranks participate: all stop on a NaN
                    train_loss = log_loss(loss_sum, count, epoch, step, lr_now)
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

        profiler.stop()
        # The whole model in one file that loads without DTensor, written tensor by tensor
        # (all ranks participate); rank 0's sample of what the GPT learnt, read back if small.
        written = export_whole(model, filter(None, [out and out / "model.pt", args.export]))
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
