"""Context parallelism: each sequence's tokens split over CP processes, which compute it
together; with --dp D, D such groups side by side (2-D), all sharded by FSDP.

Data, tensor and pipeline parallelism split the batch, the weights and the layers; none helps
when one sequence's activations are too large for a device (long contexts). Here each process
holds 1/CP of every sequence's tokens: embeddings, norms, MLPs and the loss are per token and
stay local. Only attention needs the other tokens' keys and values, brought by --cp-impl:
    ring       K/V blocks passed around a ring while each is computed, the partial results
               merged by their log-sum-exp (Ring Attention, Liu et al., 2023)
    allgather  K and V all-gathered before attention (as in Llama 3's long-context training)
The model is a causal GPT on text (models.py's; --model vit: the ViT, each image row a token).
Causal, a process whose tokens come late sees every key, one whose tokens come early almost
none: --cp-balance zigzag (the default) gives each process an early and a late chunk.

Launch (--output-dir: one directory for all processes, on several nodes a shared one):
    python context_parallel.py                                     # one process, unsplit
    torchrun --standalone --nproc_per_node=2 context_parallel.py   # CP 2: the GPT on text
    torchrun --standalone --nproc_per_node=4 context_parallel.py --dp 2   # 2 x 2
    torchrun --nnodes=2 --nproc_per_node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        --rdzv-id=myjob context_parallel.py --dp 2   # on each node; CP 4 inside it
    torchrun --standalone --nproc_per_node=2 context_parallel.py --model vit --data fashion-mnist

Checkpoints as in fsdp_train.py (resumed at any CP and DP degree; model.pt the whole model).
--batch-size is per CP group; --lr the peak AdamW rate per 256 samples of global batch.
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

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
from models import GPT, ViT, generate, initial_weights, param_groups
from profiling import Profiler, flop_rates, step_flops
from training import end_epoch, evaluate, log_loss, sharded_args, sharded_parser, warmup_decay

# The autograd all-gather (all_gather_tensor_autograd in PyTorch 2.9, deprecated later).
all_gather = getattr(funcol, "all_gather_single_autograd", funcol.all_gather_tensor_autograd)


def get_args(argv=None):
    p = sharded_parser(__doc__)  # --data, --epochs, --lr, ..., --dist-timeout: training.py's
    p.set_defaults(data="text")  # context parallelism is for long sequences
    add = p.add_argument
    add("--model", default="gpt", choices=["gpt", "vit"], help="gpt: causal, on text")
    add("--dp", type=int, default=1, help="data-parallel degree; CP: processes / dp")
    add("--cp", type=int, help="context-parallel degree (default: processes / --dp)")
    add("--cp-impl", default="ring", choices=["ring", "allgather"], help="how K/V travel")
    balance = "which tokens each process holds (default: zigzag for gpt, contiguous for vit)"
    add("--cp-balance", choices=["zigzag", "contiguous"], help=balance)
    add("--batch-size", type=int, help="samples per CP group per step (default 128; text: 8)")
    args = p.parse_args(argv)
    args.cp_balance = args.cp_balance or ("zigzag" if args.model == "gpt" else "contiguous")
    return sharded_args(args, ("dp", "cp"), batch=(128, 8))


def layout(tokens, cp, balance):
    """Where each process's tokens sit in a sequence: per process, its chunks as (start, end).
    contiguous: process r holds the r-th of CP chunks. Under a causal mask the last process's
    queries see every key and the first's almost none: the slowest sets the pace. zigzag
    (Megatron-Core's load balancing): the sequence cut into 2 CP chunks, process r holds
    chunks r and 2 CP - 1 - r, one early and one late: the same attention work for each."""
    if balance == "contiguous":
        n = tokens // cp
        return [[(r * n, (r + 1) * n)] for r in range(cp)]
    n = tokens // (2 * cp)
    return [[(r * n, (r + 1) * n), ((2 * cp - 1 - r) * n, (2 * cp - r) * n)] for r in range(cp)]


def own(x, chunks, dim):  # this process's tokens of x along dim, chunk after chunk
    return torch.cat([x.narrow(dim, start, end - start) for start, end in chunks], dim)


# What each way costs, per attention layer, with CP processes, a batch of N, T tokens in all:
#   allgather: every process holds (and saves for backward) the whole K and V, 2 N T dim
#     numbers; it receives (CP - 1)/CP of them in forward and sends as much of their gradients
#     in backward (a reduce-scatter), before and after attention: nothing overlaps. Simple,
#     cheap while K and V fit. Causal: masked by true positions; the masked half is computed.
#   ring: every process holds its own K/V block and one in flight, 2 x 2 N T dim / CP numbers,
#     and saves only its own. Forward sends CP - 1 blocks on, each while the previous one is
#     computed; backward sends them again and their gradient accumulators once round (CP),
#     about 3x forward's bytes. Memory stays 1/CP at any length; the sends hide behind compute
#     when a block's attention takes longer than its transfer. Causal: a key block after the
#     queries is skipped (about half the work), the one at their own place masked.
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


def blocks(chunks, mine, source, causal):
    """What this process's queries compute with the K/V block from process `source`, per query
    chunk: (its rows, the block's columns it sees, whether the last of those is its own place:
    the diagonal, masked). A causal query chunk sees the key chunks before it, its own under
    a triangular mask, none after: those are skipped. Chunks are sorted, so it sees a prefix."""
    n = chunks[0][0][1] - chunks[0][0][0]  # tokens per chunk
    for i, (start, _) in enumerate(chunks[mine]):
        seen = [s for s, _ in chunks[source] if not causal or s <= start]
        if seen:
            yield slice(i * n, (i + 1) * n), slice(0, len(seen) * n), causal and seen[-1] == start


class RingAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d)) v over every process's keys and values, one block at a time;
    the math written out (PyTorch's CPU kernels do not return the log-sum-exp that merging
    needs), as in picotron's. K and V travel in their dtype (bf16 under --amp bf16: half the
    bytes); scores, softmax statistics, the merge and backward's gradient accumulator: fp32."""

    @staticmethod
    def forward(ctx, q, k, v, group, chunks, causal):
        scale, size, me = q.shape[-1] ** -0.5, dist.get_world_size(group), dist.get_rank(group)
        n = chunks[0][0][1] - chunks[0][0][0]
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)  # key after query
        with torch.autocast(q.device.type, enabled=False):
            qf, kv = q.float(), torch.stack([k, v])  # kv: the block that travels
            out, lse = torch.zeros_like(qf), torch.full_like(qf[..., :1], -math.inf)
            for step in range(size):
                if step + 1 < size:  # pass this block on while computing with it
                    next_kv, requests = ring_pass(kv, group)
                for rows, cols, diagonal in blocks(chunks, me, (me - step) % size, causal):
                    scores = (qf[..., rows, :] @ kv[0, ..., cols, :].float().mT).mul_(scale)
                    if diagonal:  # its last n columns are the chunk's own keys
                        scores[..., -n:].masked_fill_(future, -math.inf)
                    top = scores.amax(-1, keepdim=True)  # softmax over this block, stable:
                    weights = scores.sub_(top).exp_()  # one exp for the block, in place
                    total = weights.sum(-1, keepdim=True)
                    block_out = weights @ kv[1, ..., cols, :].float() / total
                    block_lse = top + total.log()  # log of softmax's denominator
                    # Merged: each part weighted by its share of the denominator over both.
                    old = lse[..., rows, :]
                    new = torch.logaddexp(old, block_lse)
                    out[..., rows, :] *= (old - new).exp()
                    out[..., rows, :] += block_out * (block_lse - new).exp()
                    lse[..., rows, :] = new
                if step + 1 < size:
                    wait(requests)
                    kv = next_kv
        ctx.save_for_backward(q, k, v, out, lse)  # this process's K/V only: 1/CP
        ctx.constants = group, scale, chunks, causal, future  # the mask: made once, not saved
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale, chunks, causal, future = ctx.constants
        size, me, n = dist.get_world_size(group), dist.get_rank(group), len(future)
        qf, dout = q.float(), dout.float()
        delta = (dout * out).sum(-1, keepdim=True)  # softmax's backward: sum_j P_ij dP_ij
        dq, kv = torch.zeros_like(qf), torch.stack([k, v])
        dkv, dkv_requests = None, []
        for step in range(size):
            if step + 1 < size:  # the K/V blocks go round again, as in forward
                next_kv, kv_requests = ring_pass(kv, group)
            grads = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            for rows, cols, diagonal in blocks(chunks, me, (me - step) % size, causal):
                keys, values = kv[0, ..., cols, :].float(), kv[1, ..., cols, :].float()
                scores = (qf[..., rows, :] @ keys.mT).mul_(scale)
                if diagonal:
                    scores[..., -n:].masked_fill_(future, -math.inf)
                p = scores.sub_(lse[..., rows, :]).exp_()  # softmax, from the lse
                ds = (dout[..., rows, :] @ values.mT).sub_(delta[..., rows, :]).mul_(p)
                dq[..., rows, :] += ds @ keys * scale
                grads[0, ..., cols, :] += ds.mT @ qf[..., rows, :] * scale
                grads[1, ..., cols, :] += p.mT @ dout[..., rows, :]
            if dkv is not None:  # this block's gradient from the processes before this one
                wait(dkv_requests)
                grads += dkv
            # The accumulator follows its block: after CP steps it is back at its owner.
            dkv, dkv_requests = ring_pass(grads, group)
            if step + 1 < size:
                wait(kv_requests)
                kv = next_kv
        wait(dkv_requests)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def allgather_attention(q, k, v, group, chunks, causal):
    """K and V of every process, then attention as on one process; causal: a query sees the
    keys at or before its position, by a mask from every token's true position. The autograd
    all-gather's backward reduce-scatters their gradients back to their owners."""
    kv = torch.stack([k, v]).contiguous()  # one collective for both
    kv = all_gather(kv, gather_dim=3, group=group)  # in rank order: chunks[0], chunks[1], ...
    mask = None
    if causal:  # True where a query may attend: the keys at or before its position
        place = torch.arange(sum(e - s for ranks in chunks for s, e in ranks), device=q.device)
        keys = torch.cat([own(place, ranks, 0) for ranks in chunks])  # as gathered: rank order
        mask = keys[None, :] <= own(place, chunks[dist.get_rank(group)], 0)[:, None]
    return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask)


def split_attention(model, group, impl, chunks, causal):
    """Every block's attention over the whole sequence, each process holding its `chunks`."""
    attend = RingAttention.apply if impl == "ring" else allgather_attention
    model.group = group  # LongViT's mean over every row
    for block in model.blocks:  # group by position: apply() takes no keywords in 2.9
        block.attn.attend = lambda q, k, v: attend(q, k, v, group, chunks, causal)


class LongViT(ViT):
    """models.py's ViT with each image row a token: 28 tokens of 28 pixels, not 16 patches
    of 7 x 7. With a context-parallel group, each process runs its own rows (`mine`: their
    (start, end) chunks) and an all-gather puts the mean over every row together."""

    def __init__(self, in_channels, num_classes, size, dim, heads, depth, mine=None):
        super().__init__(in_channels, num_classes, size, dim, depth, heads, patch=(1, size))
        self.group, self.mine = None, mine or [(0, size)]

    def forward(self, rows):  # this process's rows of each image
        x = self.patch_embed(rows).flatten(2).transpose(1, 2) + own(self.pos, self.mine, 1)
        for block in self.blocks:
            x = block(x)  # per token, but for attention (see RingAttention above)
        x = self.norm(x).sum(1)  # this process's part of the tokens' mean
        if self.group:
            # The whole mean on every process. Every process of the group then computes the
            # same loss; the all-gather's backward sums their CP equal gradients for these
            # tokens, and FSDP's mean over the mesh divides by CP again.
            x = all_gather(x, gather_dim=0, group=self.group)
            x = x.view(dist.get_world_size(self.group), -1, x.shape[-1]).sum(0)
        return self.head(x / self.pos.shape[1])


class LongGPT(GPT):
    """models.py's GPT, each process running its own tokens (`mine`) at their positions."""

    def __init__(self, seq_len, dim, heads, depth, mine=None):
        super().__init__(256, seq_len, dim, depth, heads)
        self.mine = mine or [(0, seq_len)]

    def forward(self, tokens):  # this process's tokens -> their next bytes' logits
        x = self.embed(tokens) + own(self.pos, self.mine, 1)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


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
            args.data, args.data_dir, args.download, None, info.local_rank, args.seq_len
        )
        text, sample = args.model == "gpt", train_set[0][0]
        tokens = args.seq_len if text else sample.shape[-2]  # bytes, or image rows
        if tokens % (pieces := cp * (2 if args.cp_balance == "zigzag" else 1)):  # no padding
            how = f"--cp-balance {args.cp_balance} cuts the {tokens} tokens into {pieces} chunks"
            fail(f"CP degree {cp}: {how}; they do not divide evenly")
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

        # Which tokens of each sample this process holds, with their positions and labels.
        group = mesh["cp"].get_group() if cp > 1 else None
        chunks = layout(tokens, cp, args.cp_balance)
        mine = chunks[mesh["cp"].get_local_rank() if mesh else 0]

        def split(inputs, labels):  # this process's tokens of the batch (text: and labels)
            if text:
                return own(inputs, mine, 1), own(labels, mine, 1)
            return own(inputs, mine, 2), labels  # a ViT's tokens are the images' rows

        unsplit = functools.partial(LongGPT, tokens)  # the model: every token a process's
        if not text:
            unsplit = functools.partial(LongViT, in_channels, num_classes, tokens)
        unsplit = functools.partial(unsplit, args.dim, args.heads, args.depth)
        build = functools.partial(unsplit, mine=mine)  # this process's tokens only

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
        # then memory for each rank's pieces, filled one whole tensor at a time.
        with torch.device("meta"):
            model = build()
        if group:  # attention over every process's keys and values
            split_attention(model, group, args.cp_impl, chunks, causal=text)
        shard(model)
        model.to_empty(device=device)
        fill_initial(model, initial_weights(build, args.seed))  # all ranks participate
        dtype = torch.bfloat16 if args.amp == "bf16" else None  # the compute's (MFU's peak)
        use_autocast = args.amp == "bf16" and not info.distributed  # FSDP gives bf16 itself
        autocast = functools.partial(torch.autocast, device.type, dtype, use_autocast)

        out = sharded_output(args.output_dir)  # every rank writes there: every rank checks
        profiler = Profiler(args.profile, rank, device)  # a trace of a few steps per rank
        with torch.device("meta"):  # a step's FLOPs: the whole model on the global batch
            flops = step_flops(unsplit(), sample.expand(global_batch, *sample.shape))

        lr = args.lr * global_batch / 256
        groups = param_groups(model, args.weight_decay)  # fused, as in fsdp_train.py
        optimizer = torch.optim.AdamW(groups, lr, betas=args.betas, fused=True)

        # Resume, as in fsdp_train.py: rank 0 finds and checks the checkpoint; every rank reads
        # the parts of the saved pieces that make up its own, on any mesh (all participate).
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
            """Exact: a rank with fewer test batches runs padding (FSDP's forward is
            collective). Text: each token counted once, by its process; images: cp times."""
            padded = pad_batches(test_loader, test_set[0], device)
            return evaluate(model, (split(x, y) for x, y in padded), device, autocast())

        if args.eval_only:
            loss, acc = evaluate_all()
            print0(f"eval {resume}: test_loss {loss:.4f} test_acc {acc:.4f}")
            return  # no barrier: evaluate's all-reduce was every rank's last collective

        start_epoch = step // steps_per_epoch
        metrics = out / "metrics.jsonl" if out and rank == 0 else None
        if metrics and not (args.max_steps and step >= args.max_steps):
            trim_metrics(metrics, start_epoch)  # epochs that run again lose their old lines
        size = f"global batch {global_batch}, peak lr {lr:.3g}, {steps_per_epoch} steps/epoch"
        how = f"{dp} x {cp} (dp x cp) process(es), {args.cp_impl}, {args.cp_balance}"
        print0(f"{args.model} of {tokens} tokens on {args.data}: {how}, {device.type}, {size}")
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
                images, labels = split(images.to(device), labels.to(device))
                with autocast():
                    logits = model(images)  # gpt: this process's tokens; vit: whole
                # gpt: the loss per token of this process's own tokens, their summed loss over
                # the global batch's token count, times world as FSDP averages the gradients
                # over the world processes: the mean over its own (each holds as many). vit:
                # every process of a CP group the same loss, of whole images (see LongViT).
                smooth = 0.0 if text else 0.1
                logits, labels = logits.flatten(0, -2).float(), labels.flatten()
                loss = F.cross_entropy(logits, labels, label_smoothing=smooth)
                loss.backward()  # FSDP: each gradient averaged over all dp x cp processes
                loss_sum += loss.detach() * labels.numel()
                count += labels.numel()
                if args.clip_grad > 0:  # DTensor sums the shards' squares over all ranks
                    nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
                optimizer.step()  # this rank's shards only
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
            if out:  # every rank writes its pieces; rank 0 then publishes them (all participate)
                meta = sharded_meta(model, step, steps_per_epoch, global_batch, args, device)
                dcp.save(state, checkpoint_id=out / "checkpoint.tmp")  # as in fsdp_train.py
                publish_sharded(out, meta)

        profiler.stop()
        # The whole model in one file that loads into models.GPT or models.ViT(patch=(1, 28))
        # without DTensor, written tensor by tensor (all ranks participate); rank 0's sample
        # of what the GPT learnt, read back if small.
        written = export_whole(model, filter(None, [out and out / "model.pt", args.export]))
        if text and (whole := weights_for_sample(written)):
            print0("sample:", generate(GPT(256, tokens, args.dim, args.depth, args.heads), whole))
        if info.distributed:
            dist.barrier()  # leave together (all ranks participate): rank 0 hosts the store
    except RuntimeError as e:
        # A peer that died or hung for --dist-timeout breaks the others' collectives.
        raise peer_failure(e, info) from None
    finally:
        cleanup()  # also on an error: the peers are not left waiting on a dead group


if __name__ == "__main__":
    main()
