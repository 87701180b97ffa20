"""Context parallelism: each sample's sequence of tokens split over CP processes, which compute
the sample together; with --dp D, D such groups side by side (2-D), all sharded by FSDP.

Data, tensor and pipeline parallelism split the batch, the weights and the layers; none helps
when one sample's activations are too large for a device, as with long contexts. Here each
process holds 1/CP of every sample's tokens from the patch embedding on: norms, MLPs and the
residual stream are per token and stay local. Only attention needs every token: each query
must see every key and value, brought in one of two ways (--cp-impl):
    allgather  K and V all-gathered before attention (as in Llama 3's long-context training)
    ring       K/V blocks passed around a ring while each block is computed, the partial
               results merged by their log-sum-exp (Ring Attention, Liu et al., 2023)

    4 processes, --dp 2:  mesh [[0, 1],    each row a context-parallel group (one batch,
                                [2, 3]]    each process half of every image's rows)

The model is models.py's ViT made long: each image row one token (28, not 16 patches), so
the sequence splits over 2, 4, 7, 14 or 28 processes with no padding.

Launch (--output-dir: one directory for all processes, on several nodes a shared one):
    python context_parallel.py                                     # one process, unsplit
    torchrun --standalone --nproc_per_node=2 context_parallel.py   # CP degree 2
    torchrun --standalone --nproc_per_node=4 context_parallel.py --dp 2   # 2 x 2
    torchrun --nnodes=2 --nproc_per_node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        --rdzv-id=myjob context_parallel.py --dp 2   # on each node; CP 4 inside it

Checkpoints as in fsdp_train.py: every process writes its shards, a rerun resumes at any CP
and DP degree, model.pt holds the whole model. --batch-size is per CP group (its processes
share each batch); --lr is the peak AdamW rate per 256 samples of global batch.
"""

import functools
import itertools
import math
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from checkpoint import (
    check_output_dir,
    export_whole,
    find_checkpoint,
    initial_state,
    publish_sharded,
    read_sharded_meta,
    reading,
    resume_step,
    rng_state,
    sharded_tmp,
    trim_metrics,
)
from common import (
    cleanup,
    fail,
    init_distributed_mode,
    peer_failure,
    print0,
    require_torch,
    together,
)
from data import load_datasets, pad_batches, shard_loaders
from models import ViT
from training import (
    check_sharded_args,
    end_epoch,
    evaluate,
    fast_forward,
    log_loss,
    sharded_parser,
    warmup_cosine,
)

# The autograd all-gather, named all_gather_tensor_autograd in PyTorch 2.9 (deprecated later).
all_gather = (
    getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
)


def get_args(argv=None):
    p = sharded_parser(__doc__)  # --data, --epochs, --lr, ..., --dist-timeout: training.py's
    add = p.add_argument
    add("--dp", type=int, default=1, help="data-parallel degree; CP: processes / dp")
    add("--cp", type=int, help="context-parallel degree (default: processes / --dp)")
    add("--cp-impl", default="ring", choices=["ring", "allgather"], help="how K/V travel")
    add("--dim", type=int, default=96, help="the ViT's width")
    add("--heads", type=int, default=4, help="the ViT's attention heads")
    add("--batch-size", type=int, default=128, help="samples per CP group per step")
    args = p.parse_args(argv)
    return check_sharded_args(args, at_least_1=("dp", "cp", "dim", "heads"))


# What each way costs, per attention layer, with CP processes, a batch of N, T tokens in all:
#   allgather: every process holds (and saves for backward) the whole K and V, 2 N T dim
#     numbers, beside its 1/CP of the rest; it receives (CP - 1)/CP of them in forward and
#     sends as much of their gradients in backward (a reduce-scatter). Nothing overlaps: the
#     all-gather must finish before attention starts. Simple, and cheap while K and V fit.
#   ring: every process holds its own K/V block and one in flight, 2 x 2 N T dim / CP numbers,
#     and saves only its own for backward. Forward sends CP - 1 blocks to the next process,
#     each while the previous one is computed; backward sends the K/V blocks again (CP - 1)
#     and their gradient accumulators once around the whole ring (CP), about 3x forward's bytes.
#     Memory stays 1/CP at any length; the sends hide behind compute when a block's attention
#     takes longer than its transfer.
def ring_pass(tensor, group):
    """Start sending tensor to the next process of the ring and receiving the previous one's
    (one send, one receive, all processes of the group at once); returns (received, requests)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + 1) % size), group),
        dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - 1) % size), group),
    ]
    return received, dist.batch_isend_irecv(ops)


def wait(requests):
    for request in requests:
        request.wait()


class RingAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d)) v over every process's keys and values, one block at a time.
    PyTorch's CPU attention kernels do not return the log-sum-exp that merging needs, so the
    math is written out (in fp32), as in picotron's context_parallel.py."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        scale, size = q.shape[-1] ** -0.5, dist.get_world_size(group)
        with torch.autocast(q.device.type, enabled=False):
            qf, kv = q.float(), torch.stack([k, v]).float()  # kv: the block that travels
            out, lse = torch.zeros_like(qf), torch.full_like(qf[..., :1], -math.inf)
            for step in range(size):
                if step + 1 < size:  # pass this block on while computing with it
                    next_kv, requests = ring_pass(kv, group)
                scores = qf @ kv[0].transpose(-2, -1) * scale
                block_lse = scores.logsumexp(-1, keepdim=True)  # log of softmax's denominator
                block_out = torch.exp(scores - block_lse) @ kv[1]  # softmax over this block
                # Merged: each part weighted by its share of the denominator over both.
                new_lse = torch.logaddexp(lse, block_lse)
                out = out * (lse - new_lse).exp() + block_out * (block_lse - new_lse).exp()
                lse = new_lse
                if step + 1 < size:
                    wait(requests)
                    kv = next_kv
        ctx.save_for_backward(q, k, v, out, lse)  # this process's K/V only: 1/CP of them
        ctx.group, ctx.scale = group, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale, size = ctx.group, ctx.scale, dist.get_world_size(ctx.group)
        qf, dout = q.float(), dout.float()
        delta = (dout * out).sum(-1, keepdim=True)  # softmax's backward: sum_j P_ij dP_ij
        dq, kv = torch.zeros_like(qf), torch.stack([k, v]).float()
        dkv, dkv_requests = None, []
        for step in range(size):
            if step + 1 < size:  # the K/V blocks go round again, as in forward
                next_kv, kv_requests = ring_pass(kv, group)
            p = torch.exp(qf @ kv[0].transpose(-2, -1) * scale - lse)  # softmax, from the lse
            ds = p * (dout @ kv[1].transpose(-2, -1) - delta)
            dq += ds @ kv[0] * scale
            grads = torch.stack([ds.transpose(-2, -1) @ qf * scale, p.transpose(-2, -1) @ dout])
            if dkv is not None:  # this block's gradient from the processes before this one
                wait(dkv_requests)
                grads += dkv
            # The accumulator follows its block: after CP steps it is back at its owner.
            dkv, dkv_requests = ring_pass(grads, group)
            if step + 1 < size:
                wait(kv_requests)
                kv = next_kv
        wait(dkv_requests)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def allgather_attention(q, k, v, group):
    """K and V of every process, in token order, then attention as on one process. The
    autograd all-gather's backward reduce-scatters their gradients back to their owners."""
    kv = torch.stack([k, v]).contiguous()  # one collective for both
    kv = all_gather(kv, gather_dim=3, group=group)
    return F.scaled_dot_product_attention(q, kv[0], kv[1])


class LongViT(ViT):
    """models.py's ViT with each image row a token: 28 tokens of 28 pixels, not 16 patches
    of 7 x 7. With a context-parallel group, each process runs its own rows only."""

    def __init__(self, in_channels, num_classes, size, dim, heads, group=None, impl="ring"):
        super().__init__(in_channels, num_classes, size, dim, heads=heads, patch=(1, size))
        self.group, self.cp, self.rank = group, 1, 0
        if group is not None:
            self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
            attend = RingAttention.apply if impl == "ring" else allgather_attention
            for block in self.blocks:  # group by position: apply() takes no keywords in 2.9
                block.attn.attend = lambda q, k, v: attend(q, k, v, group)

    def forward(self, images):
        n = self.pos.shape[1] // self.cp  # tokens (rows) per process, with their positions
        rows = slice(self.rank * n, (self.rank + 1) * n)
        x = self.patch_embed(images[:, :, rows]).flatten(2).transpose(1, 2) + self.pos[:, rows]
        for block in self.blocks:
            x = block(x)  # per token, but for attention (see RingAttention above)
        x = self.norm(x).sum(1)  # this process's part of the tokens' mean
        if self.cp > 1:
            # The whole mean on every process. Every process of the group then computes the
            # same loss; the all-gather's backward sums their CP equal gradients for these
            # tokens, and FSDP's mean over the mesh divides by CP again.
            x = all_gather(x, gather_dim=0, group=self.group)
            x = x.view(self.cp, -1, x.shape[-1]).sum(0)
        return self.head(x / self.pos.shape[1])


def read_meta(path, args, tokens):
    """Rank 0: the checkpoint's step, RNG and flags, after checking that it is one of ours."""
    saved = (meta := read_sharded_meta(path))["args"]
    shape = (saved.get("model", "vit"), saved.get("tokens", 16), saved["dim"], saved["heads"])
    if shape != (want := ("vit", tokens, args.dim, args.heads)):  # a 16-token ViT's pos
        held = "a {} of {} tokens, --dim {} --heads {}".format  # does not fit
        fail(f"checkpoint {path} holds {held(*shape)}; this is {held(*want)}")
    return meta


def main(argv=None):
    args = get_args(argv)
    require_torch("2.9", "context_parallel.py")  # requirements.txt's floor
    # The process group: rank, world size and device from whichever launcher started us.
    info = init_distributed_mode(
        backend=args.backend, device=args.device, timeout_s=args.dist_timeout
    )
    device, rank, world = info.device, info.rank, info.world_size
    try:
        dp, cp = args.dp, args.cp or max(1, world // args.dp)
        if dp * cp != world:
            fail(f"--dp {dp} x --cp {cp} makes a mesh of {dp * cp} processes; {world} started")
        # Data: a CP group shares each batch; the dp rows of the mesh take disjoint 1/dp.
        train_set, test_set, num_classes, in_channels = load_datasets(
            args.data, args.data_dir, args.download, None, info.local_rank
        )
        if (tokens := train_set[0][0].shape[-2]) % cp:  # rows: even pieces, no padding
            fail(f"CP degree {cp} must divide the {tokens} tokens (the images' rows)")
        # The mesh: CP groups of cp consecutive ranks, one node's if cp divides its processes.
        mesh = None
        if info.distributed:
            mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
        dp_rank = mesh["dp"].get_local_rank() if mesh else 0

        sampler, train_loader, test_loader = shard_loaders(
            train_set, test_set, args, dp, dp_rank, device
        )
        steps_per_epoch, global_batch = len(train_loader), args.batch_size * dp
        total_steps = args.epochs * steps_per_epoch

        group = mesh["cp"].get_group() if cp > 1 else None
        # tokens: the images' rows, and their size (square)
        build = functools.partial(LongViT, in_channels, num_classes, tokens, args.dim, args.heads)
        build = functools.partial(build, group, args.cp_impl)

        def shard(model):
            if not info.distributed:
                return
            # Every process holds the same weights, so their gradients are averaged over the
            # whole mesh, dp x cp (as torchtitan does): FSDP over all processes, each block
            # then the root, as in fsdp_train.py.
            everyone = init_device_mesh(device.type, (world,))
            mp = MixedPrecisionPolicy(torch.bfloat16, reduce_dtype=torch.float32)
            policy = mp if args.amp == "bf16" else MixedPrecisionPolicy()
            for block in model.blocks:
                fully_shard(block, mesh=everyone, mp_policy=policy)
            fully_shard(model, mesh=everyone, mp_policy=policy)

        # Built on no device whole, as in fsdp_train.py: the shapes on the meta device, sharded,
        # then memory for each rank's pieces, filled from rank 0's seeded CPU copy.
        with torch.device("meta"):
            model = build()
        state = initial_state(build, args.seed)  # rank 0: the whole model; None elsewhere
        shard(model)
        model.to_empty(device=device)
        fill = StateDictOptions(full_state_dict=True, broadcast_from_rank0=info.distributed)
        set_model_state_dict(model, state or {}, options=fill)  # all ranks participate
        use_autocast = args.amp == "bf16" and not info.distributed  # FSDP gives bf16 itself
        autocast = functools.partial(torch.autocast, device.type, torch.bfloat16, use_autocast)

        # Every rank writes its own shards into the output directory: every rank checks it.
        out = together(lambda: args.output_dir and check_output_dir(args.output_dir))

        lr = args.lr * global_batch / 256
        optimizer = torch.optim.AdamW(model.parameters(), lr, weight_decay=args.weight_decay)

        # Resume, as in fsdp_train.py: rank 0 finds and checks the checkpoint; every rank reads
        # the parts of the saved pieces that make up its own, on any mesh (all participate).
        resume, meta = find_checkpoint(args, functools.partial(read_meta, args=args, tokens=tokens))
        step = 0
        if resume:
            model_state, optim_state = get_state_dict(model, optimizer)  # to be filled in
            with reading(resume):
                dcp.load(dict(model=model_state, optimizer=optim_state), checkpoint_id=resume)
            loaded = dict(model_state_dict=model_state, optim_state_dict=optim_state)
            set_state_dict(model, optimizer, **loaded)
        if resume and not args.eval_only:
            batches = (global_batch, steps_per_epoch)
            step = resume_step(args, optimizer, meta, resume, batches, device)

        scheduler = warmup_cosine(optimizer, args.warmup, total_steps)  # warm-up, cosine decay
        fast_forward(scheduler, step)  # the rate is a function of the step alone

        @torch.no_grad()
        def evaluate_all():
            """Exact: a rank with fewer test batches runs empty ones (FSDP's forward is
            collective); evaluate() sums each CP group's totals cp times: the ratios are exact."""
            padded = pad_batches(test_loader, test_set[0][0].shape, device)
            return evaluate(model, padded, device, autocast())

        if args.eval_only:
            loss, acc = evaluate_all()
            print0(f"eval {resume}: test_loss {loss:.4f} test_acc {acc:.4f}")
            return

        def save(step):  # all ranks participate
            meta = dict(step=step, steps_per_epoch=steps_per_epoch, rng=rng_state(device))
            flags = dict(vars(args), model="vit", tokens=tokens)
            meta.update(global_batch=global_batch, args=flags)
            # Every rank writes its pieces; rank 0 then publishes them (see fsdp_train.py).
            model_state, optim_state = get_state_dict(model, optimizer)
            state = dict(model=model_state, optimizer=optim_state)
            dcp.save(state, checkpoint_id=sharded_tmp(out))
            publish_sharded(out, meta)

        start_epoch = step // steps_per_epoch
        metrics = out / "metrics.jsonl" if out and rank == 0 else None
        if metrics and not (args.max_steps and step >= args.max_steps):
            trim_metrics(metrics, start_epoch)  # epochs that run again lose their old lines
        size = f"global batch {global_batch}, peak lr {lr:.3g}, {steps_per_epoch} steps/epoch"
        how = f"{dp} x {cp} (dp x cp) process(es), {args.cp_impl}, on {device.type}"
        print0(f"ViT of {tokens} tokens on {args.data}: {how}, {size}")
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
                    logits = model(images)  # whole on every process of the CP group
                loss = F.cross_entropy(logits.float(), labels, label_smoothing=0.1)
                loss.backward()  # FSDP: each gradient averaged over all dp x cp processes
                loss_sum += loss.detach() * labels.numel()
                count += labels.numel()
                if args.clip_grad > 0:  # DTensor sums the shards' squares over all ranks
                    nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
                optimizer.step()  # this rank's shards only
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                step, done = step + 1, done + 1
                last = done == steps or step == args.max_steps
                if step % args.log_every == 0 or last:  # all ranks participate: all stop on a NaN
                    train_loss = log_loss(loss_sum, count, epoch, step, scheduler.get_last_lr()[0])
                if last:
                    break
            seconds = time.perf_counter() - t0  # the loss all-reduce above synchronised

            test_loss, test_acc = evaluate_all()
            speed, lr_now = done * global_batch / seconds, scheduler.get_last_lr()[0]
            record = dict(epoch=epoch, step=step, train_loss=train_loss, test_loss=test_loss)
            record.update(test_acc=test_acc, epoch_seconds=seconds, samples_per_second=speed)
            record.update(lr=lr_now, world_size=world)
            end_epoch(metrics, record)  # printed; in metrics.jsonl before the checkpoint
            if out:
                save(step)  # all ranks participate

        # The whole model in one file that loads into models.ViT(patch=(1, 28)) without
        # DTensor (all ranks participate).
        export_whole(model, filter(None, [out and out / "model.pt", args.export]))
        if info.distributed:
            dist.barrier()  # leave together (all ranks participate): rank 0 hosts the store
    except RuntimeError as e:
        # A peer that died or hung for --dist-timeout breaks the others' collectives.
        raise peer_failure(e, info) from None
    finally:
        cleanup()  # also on an error: the peers are not left waiting on a dead group


if __name__ == "__main__":
    main()
