"""Expert parallelism: a mixture-of-experts model whose experts are spread over the processes;
three all-to-alls a layer: each expert's count of rows, the rows to it, its outputs back.

A mixture of experts (Shazeer et al., 2017; Fedus et al., 2021) replaces each block's MLP by E
expert MLPs and a router that sends each token to k of them: the parameters grow E-fold while
a token's compute stays that of k small MLPs. With EP processes each holds E/EP experts; the
rest (attention, norms, routers, embedding, head) is whole on every process, its gradients
averaged as DDP does. Use it when the experts do not fit on one device, or to spread their
compute; the all-to-alls carry every token twice per layer each way: fast links inside a
node, and across nodes replicas (--ep below the number of processes: at 4 processes, --ep 2
makes EP groups of ranks 0-1 and 2-3, ranks 0 and 2 holding experts 0-3, ranks 1 and 3 4-7).

Launch (--output-dir: one directory for all processes, on several nodes a shared one):
    python expert_parallel.py                                     # one process, every expert
    torchrun --standalone --nproc_per_node=2 expert_parallel.py   # EP 2: 4 experts each
    torchrun --standalone --nproc_per_node=4 expert_parallel.py --ep 2   # 2 replicas of EP 2
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        --rdzv-id=myjob expert_parallel.py --experts 16   # on each node; EP 16, 1 expert each
    torchrun --standalone --nproc_per_node=2 expert_parallel.py --data text --model gpt

Checkpoints as in fsdp_train.py (resumed at any EP degree, the experts re-placed; model.pt the
whole model). --batch-size is per process; --lr the peak AdamW rate per 256 samples.
"""

import itertools
import math
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

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
from common import (
    cleanup,
    fail,
    get_world_size,
    init_distributed_mode,
    peer_failure,
    print0,
    reduce_value,
    require_torch,
)
from data import load_datasets, pad_batches, shard_loaders
from models import build_model, generate, init_weights, initial_weights, param_groups
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
    add("--experts", type=int, default=8, help="expert MLPs per block")
    add("--top-k", type=int, default=2, help="experts each token goes to")
    add("--capacity-factor", type=float, default=1.25, help="expert slots an image / even share")
    add("--aux-loss-weight", type=float, default=0.01, help="weight of the balancing loss")
    add("--ep", type=int, help="expert-parallel degree (default: all processes)")
    add("--model", default="vit", choices=["vit", "gpt"], help="gpt: on --data text")
    add("--batch-size", type=int, help="samples per process per step (default 128; text: 4)")
    args = p.parse_args(argv)
    at_least_1 = ("experts", "top_k", "ep")
    sharded_args(args, at_least_1, ("aux_loss_weight",), ("capacity_factor",), (128, 4))
    if args.top_k > args.experts:
        fail(f"--top-k {args.top_k} is more than the {args.experts} experts")
    return args


def local(t):  # this process's part of a DTensor (its experts), or the tensor itself
    return t.to_local() if isinstance(t, DTensor) else t


class MoE(nn.Module):
    """A mixture of E expert MLPs and a linear router, in place of a block's MLP. Each weight
    of the experts is one tensor, expert first (E, ...): cut by its first dimension, it places
    whole experts on processes. Until shard_experts() runs, one process holds them all. One
    host sync a forward (the sizes of the all-to-all): nothing else waits for the device."""

    def __init__(self, dim, experts, top_k, capacity_factor):
        super().__init__()
        hidden = 4 * dim // top_k  # k experts per token: the dense model's MLP compute
        self.router = nn.Linear(dim, experts, bias=False)

        shapes = dict(w1=(dim, hidden), b1=(hidden,), w2=(hidden, dim), b2=(dim,))
        for name, shape in shapes.items():  # drawn in with_experts: nn.Linear's U(+-1/sqrt(fan_in))
            setattr(self, name, nn.Parameter(torch.empty(experts, *shape)))
        self.init_draws = {n: ("uniform", shapes["w" + n[1]][0] ** -0.5) for n in shapes}
        self.experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.decayed = ("w1", "w2")  # the experts' matrices take weight decay (param_groups)
        self.group, self.ep = None, 1  # the EP group, and its size
        self.aux_loss = self.load = self.dropped = None  # set by each forward

    def route(self, x):
        """Each token's k experts, their weights, and which of the choices fit, one row each."""
        logits = self.router(x)  # (samples, tokens, E)
        top, expert = logits.topk(self.top_k, dim=-1)
        weight = top.softmax(-1)  # the mix of the token's k outputs (as Mixtral)
        # Capacity: an expert takes at most C of a sample's choices, every first choice before
        # any second, in token order; the rest dropped (the residual carries the token on). Per
        # sample, not per batch: evaluation is exact at any batch size and number of processes.
        samples, tokens, k = expert.shape
        capacity = math.ceil(self.capacity_factor * k * tokens / self.experts)
        queue = torch.zeros(*expert.shape, self.experts, dtype=torch.int32, device=x.device)
        queue = queue.scatter_(-1, expert[..., None], 1).transpose(1, 2).flatten(1, 2)  # by rank
        position = ((queue.cumsum(1) - 1) * queue).sum(-1)  # each choice's place in its queue
        kept = position.view(samples, k, tokens).transpose(1, 2) < capacity
        return [t.flatten(0, 1) for t in (logits, expert, weight, kept)]

    def forward(self, x):
        samples, tokens, dim = x.shape
        logits, expert, weight, kept = self.route(x)
        x = x.reshape(-1, dim)
        if self.training:  # for balance_loss, once every block has run
            self.choices = histogram(expert.flatten(), self.experts)
            self.probs = logits.float().softmax(-1).sum(0)
        # Every choice sorted by expert, so by the process that holds it, the dropped ones last
        # (as expert E): no boolean indexing, whose result's size only the host could know.
        target = torch.where(kept, expert, self.experts).flatten()
        order = target.argsort(stable=True)
        counts = histogram(target, self.experts + 1)
        self.load, self.dropped = counts[:-1], counts[-1]  # for metrics.jsonl
        # The counts first, E/EP to each process: how many rows it receives for each of its
        # experts. They size the rows' exchange (all-to-all needs the sizes on both sides) and
        # say which expert each received row is for: no index travels with it.
        received = torch.empty_like(counts[: self.experts if self.ep > 1 else 0])
        if self.ep > 1:
            dist.all_to_all_single(received, counts[:-1], group=self.group)  # by sender
        sizes = torch.cat([counts[:-1], received]).tolist()  # the layer's one host sync
        chosen = order[: sum(sizes[: self.experts])]  # the kept choices
        token = chosen // self.top_k  # a token chosen by two experts travels twice
        h = x[token]
        if torch.is_autocast_enabled(h.device.type):  # rows travel in the compute dtype
            h = h.to(torch.get_autocast_dtype(h.device.type))  # (bf16: half the bytes)
        y = self.exchange(h, sizes, received) if self.ep > 1 else self.run_experts(h, sizes)
        # Each token's outputs, weighted, summed back in its row; a dropped choice adds 0.
        mixed = (y * weight.flatten()[chosen, None]).to(x.dtype)
        return x.new_zeros(x.shape).index_add(0, token, mixed).view(samples, tokens, dim)

    def run_experts(self, h, counts):
        """h: rows grouped by expert, counts[e] (a list) of them for this process's expert e."""
        w1, b1, w2, b2 = (local(p) for p in (self.w1, self.b1, self.w2, self.b2))
        rows = h.split(counts)
        out = [F.gelu(r @ w1[e] + b1[e]) @ w2[e] + b2[e] for e, r in enumerate(rows)]
        return torch.cat(out).to(h.dtype)  # back in the dtype the rows came in

    def exchange(self, h, sizes, on_device):
        """The rows to their experts' processes, through the experts, and back (all ranks of
        the EP group participate). Autograd runs both exchanges reversed in backward: each
        output's gradient back to its expert, each input's back to its token's process."""
        ep, group, mine = self.ep, self.group, self.experts // self.ep
        counts, received = sizes[: self.experts], sizes[self.experts :]  # sent, received
        send = [sum(counts[p * mine : (p + 1) * mine]) for p in range(ep)]
        recv = [sum(received[p * mine : (p + 1) * mine]) for p in range(ep)]
        # 2. The rows (dim numbers each) to the process of their expert.
        h = all_to_all_single_autograd(h, recv, send, group)
        # They arrive by sender, then expert: sorted by expert for the expert MLPs (the sizes
        # known on the host, so repeat_interleave needs no sync).
        expert = torch.arange(mine, device=h.device).repeat(ep)
        expert = expert.repeat_interleave(on_device, output_size=sum(recv))
        order = expert.argsort(stable=True)
        y = self.run_experts(h[order], [sum(received[e::mine]) for e in range(mine)])
        # 3. The outputs back, in the order the rows came, to the processes of their tokens.
        return all_to_all_single_autograd(y[order.argsort()], send, recv, group)


def histogram(values, n):  # how often each of 0..n-1 occurs (bincount waits for the device)
    ones = torch.ones_like(values)
    return torch.zeros(n, dtype=torch.long, device=values.device).index_add_(0, values, ones)


def balance_loss(moes):
    """The Switch Transformer's load-balancing loss of each block, E x sum_e f_e x P_e: f_e the
    fraction of choices that went to expert e, P_e its mean router probability; at its least,
    1, when both are even. Over the global batch: f from counts summed over every process, in
    one all-reduce for all blocks (all ranks participate). P is a mean over tokens: each
    process adds its tokens' share, so the processes' losses average to the whole."""
    counts = reduce_value(torch.stack([m.choices for m in moes])).float()  # (blocks, E)
    for m, total in zip(moes, counts, strict=True):
        choices = total.sum()  # k for each token of the global batch
        share = m.top_k / choices  # 1 / the global batch's tokens
        m.aux_loss = m.experts * get_world_size() * (total / choices * m.probs).sum() * share
    return sum(m.aux_loss for m in moes)


def with_experts(model, experts, top_k, capacity_factor):
    """models.py's ViT or GPT with each block's MLP replaced by a mixture of experts."""
    for block in model.blocks:
        block.mlp = MoE(block.attn.q.in_features, experts, top_k, capacity_factor)
    init_weights(model)  # every tensor drawn by its name, the experts' too (models.py)
    return model


def shard_experts(model, mesh):
    """Keep this process's experts only: each expert weight becomes a DTensor cut by expert
    (Shard(0)) over the mesh's "ep" dimension and whole over "dp". torch.distributed.checkpoint
    then saves each expert once and re-places the experts when another degree loads them."""
    ep, rank = mesh["ep"].size(), mesh["ep"].get_local_rank()
    for block in model.blocks:
        moe = block.mlp
        moe.group, moe.ep = mesh["ep"].get_group(), ep
        for name in ("w1", "b1", "w2", "b2"):
            mine = getattr(moe, name).detach().chunk(ep)[rank].clone()  # experts in order
            piece = DTensor.from_local(mine, mesh, [Replicate(), Shard(0)], run_check=False)
            setattr(moe, name, nn.Parameter(piece))


def split_grads(model):
    """The gradients of the whole (replicated) tensors, and this process's experts'."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    whole = [g for g in grads if not isinstance(g, DTensor)]
    return whole, [g.to_local() for g in grads if isinstance(g, DTensor)]


@torch.no_grad()
def average_gradients(model, mesh, world):
    """DDP's averaging, by hand, one all-reduce per kind (all ranks participate): the loss is
    the mean of the processes' losses, every gradient a sum over them / world. Whole tensors:
    each process has its tokens' part, summed over all. Experts: each holds its EP group's sum
    already (the exchanges brought it every token's gradient); with replicas (dp > 1) summed
    over the processes holding the same experts too."""
    if mesh is None:
        return
    whole, experts = split_grads(model)
    for grads, group in ((whole, None), (experts, mesh["dp"].get_group())):
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=group)
        for g, mean in zip(grads, (flat / world).split([g.numel() for g in grads]), strict=True):
            g.copy_(mean.view_as(g))


def main(argv=None):
    args = get_args(argv)
    require_torch("2.9", "expert_parallel.py")  # requirements.txt's floor
    # The process group: rank, world size and device from whichever launcher started us.
    info = init_distributed_mode(
        backend=args.backend, device=args.device, timeout_s=args.dist_timeout
    )
    device, rank, world = info.device, info.rank, info.world_size
    try:
        ep = args.ep or world

        for n, what in ((world, "processes"), (args.experts, "experts")):
            if n % ep:  # every rank finds the same, and stops
                fail(f"EP degree {ep} does not divide the {n} {what}")
        # The mesh: EP groups of ep consecutive ranks (one node's if ep divides its processes),
        # and dp = world / ep replicas of each.
        mesh = None
        if info.distributed:
            mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("dp", "ep"))

        # Data: every process its own 1/world of each epoch, as DDP does.
        train_set, test_set, num_classes, in_channels = load_datasets(
            args.data, args.data_dir, args.download, None, info.local_rank, args.seq_len
        )
        sampler, train_loader, test_loader = shard_loaders(
            train_set, test_set, args, world, rank, device
        )
        steps_per_epoch, global_batch = len(train_loader), args.batch_size * world
        total_steps = args.epochs * steps_per_epoch

        # Built on no device whole, as in fsdp_train.py: meta, the experts cut, then memory for
        # this process's experts and the rest only, filled a whole tensor at a time (all ranks).
        text, sample = args.model == "gpt", train_set[0][0]  # an image, or a sequence
        shape = (sample.shape[-1], args.dim, args.heads, args.seq_len, args.depth)
        dense = partial(build_model, args.model, in_channels, num_classes, *shape)
        moe = (args.experts, args.top_k, args.capacity_factor)
        build = lambda: with_experts(dense(), *moe)  # noqa: E731
        with torch.device("meta"):
            model = build()
        if mesh is not None:
            shard_experts(model, mesh)  # from here on, this process's experts only
        model.to_empty(device=device)
        fill_initial(model, initial_weights(build, args.seed))
        autocast = partial(torch.autocast, device.type, torch.bfloat16, args.amp == "bf16")

        out = sharded_output(args.output_dir)  # every rank writes there: every rank checks
        profiler = Profiler(args.profile, rank, device)  # a trace of a few steps per rank
        with torch.device("meta"):  # a step's FLOPs: the dense model of the same compute
            flops = step_flops(dense(), sample.expand(global_batch, *sample.shape))

        # After the cut: this process's experts. Fused, a call per kind (training.fused_adamw).
        lr = args.lr * global_batch / 256
        optimizer = fused_adamw(param_groups(model, args.weight_decay), lr, args.betas)

        # Resume: rank 0 finds and checks the checkpoint; every rank reads its pieces (any degree).
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
            """Exact: a rank with fewer test batches runs padding (forward is collective)."""
            padded = pad_batches(test_loader, test_set[0], device)
            return evaluate(model, padded, device, autocast())

        if args.eval_only:
            loss, acc = evaluate_all()
            print0(f"eval {resume}: test_loss {loss:.4f} test_acc {acc:.4f}")
            return  # no barrier: evaluate's all-reduce was every rank's last collective

        start_epoch = step // steps_per_epoch
        metrics = out / "metrics.jsonl" if out and rank == 0 else None
        if metrics and not (args.max_steps and step >= args.max_steps):
            trim_metrics(metrics, start_epoch)  # epochs that run again lose their old lines
        moes = [block.mlp for block in model.blocks]
        size = f"global batch {global_batch}, peak lr {lr:.3g}, {steps_per_epoch} steps/epoch"
        where = f"EP {ep} x {world // ep} replica(s) on {device.type}"
        print0(f"MoE {args.model} on {args.data}: {args.experts} experts, {where}, {size}")
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
            load = torch.zeros(len(moes), args.experts + 1, device=device, dtype=torch.long)
            model.train()
            t0 = time.perf_counter()
            # A mid-epoch resume skips the batches done: the order is a function of the epoch.
            for images, labels in itertools.islice(train_loader, epoch_step, None):
                images = images.to(device, non_blocking=True)
                labels = labels.to(device, non_blocking=True)
                with autocast():
                    logits = model(images)
                logits, labels = logits.flatten(0, -2).float(), labels.flatten()  # text: tokens
                loss = F.cross_entropy(logits, labels, label_smoothing=0.0 if text else 0.1)
                aux = balance_loss(moes)  # this process's share (all ranks participate)
                (loss + args.aux_loss_weight * aux).backward()
                average_gradients(model, mesh, world)  # as DDP does (all ranks participate)
                loss_sum += loss.detach() * labels.numel()
                count += labels.numel()
                # The rows each expert received from this process, and the choices dropped.
                load += torch.stack([torch.cat([m.load, m.dropped[None]]) for m in moes])
                if args.clip_grad > 0:
                    clip_grad_norm(list(model.parameters()), args.clip_grad)  # as in TP
                optimizer.step()  # the whole tensors, and this process's experts
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
            load = reduce_value(load).tolist()  # all ranks participate

            test_loss, test_acc = evaluate_all()
            speed = done * global_batch / seconds
            record = dict(epoch=epoch, step=step, train_loss=train_loss, test_loss=test_loss)
            record.update(test_acc=test_acc, epoch_seconds=seconds, samples_per_second=speed)
            # Per block: the token choices each expert took this epoch; and those dropped.
            tokens, dropped = [r[:-1] for r in load], [r[-1] for r in load]
            dtype = torch.bfloat16 if args.amp == "bf16" else None  # MFU's peak is the dtype's
            rates = flop_rates(flops * done, seconds, device, dtype, args.peak_tflops, world)
            record.update(lr=lr_now, world_size=world, ep=ep, **rates)
            record.update(expert_tokens=tokens, dropped_tokens=dropped)
            end_epoch(metrics, record)  # printed; in metrics.jsonl before the checkpoint
            busiest = max(max(r[:-1]) / max(1, sum(r[:-1]) / args.experts) for r in load)
            lost = sum(dropped) / max(1, sum(map(sum, load)))
            print0(f"  busiest expert {busiest:.2f}x an even share; {lost:.1%} choices dropped")
            if out:  # all ranks participate
                meta = sharded_meta(model, step, steps_per_epoch, global_batch, args, device)
                dcp.save(state, checkpoint_id=out / "checkpoint.tmp")  # as in fsdp_train.py
                publish_sharded(out, meta)

        profiler.stop()
        # model.pt, written tensor by tensor (all ranks participate); rank 0's sample if small
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
