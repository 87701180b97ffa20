"""Expert parallelism: a mixture-of-experts ViT whose experts are spread over the processes;
each token goes to its experts' process and comes back, two all-to-all exchanges per layer.

A mixture of experts (Shazeer et al., 2017; Fedus et al., 2021) replaces each block's MLP by E
expert MLPs and a router that sends each token to k of them: the parameters grow E-fold while
a token's compute stays that of k small MLPs. With EP processes each holds E/EP experts; the
rest (attention, norms, routers, embedding, head) is whole on every process, its gradients
averaged as DDP does. Use it when the experts do not fit on one device, or to spread their
compute; the all-to-alls carry every token twice per layer each way: fast links inside a
node, and across nodes replicas (--ep below the number of processes).

    4 processes, --ep 2:  mesh [[0, 1],    each row an EP group: experts 0-3 on ranks 0 and 2,
                                [2, 3]]    4-7 on 1 and 3; each column holds the same experts

Launch (--output-dir: one directory for all processes, on several nodes a shared one):
    python expert_parallel.py                                     # one process, every expert
    torchrun --standalone --nproc_per_node=2 expert_parallel.py   # EP 2: 4 experts each
    torchrun --standalone --nproc_per_node=4 expert_parallel.py --ep 2   # 2 replicas of EP 2
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        --rdzv-id=myjob expert_parallel.py --experts 16   # on each node; EP 16, 1 expert each

Checkpoints as in fsdp_train.py: every process writes its pieces, a rerun resumes at any EP
degree (the experts re-placed), model.pt holds the whole model. --batch-size is per process;
--lr is the peak AdamW rate per 256 samples of global batch.
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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

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
    get_world_size,
    init_distributed_mode,
    peer_failure,
    print0,
    reduce_value,
    require_torch,
    together,
)
from data import load_datasets, pad_batches, shard_loaders
from models import ViT, seed_everything
from training import (
    check_sharded_args,
    end_epoch,
    evaluate,
    fast_forward,
    log_loss,
    sharded_parser,
    warmup_cosine,
)


def get_args(argv=None):
    p = sharded_parser(__doc__)  # --data, --epochs, --lr, ..., --dist-timeout: training.py's
    add = p.add_argument
    add("--experts", type=int, default=8, help="expert MLPs per block")
    add("--top-k", type=int, default=2, help="experts each token goes to")
    add("--capacity-factor", type=float, default=1.25, help="expert slots an image / even share")
    add("--aux-loss-weight", type=float, default=0.01, help="weight of the balancing loss")
    add("--ep", type=int, help="expert-parallel degree (default: all processes)")
    add("--dim", type=int, default=96, help="the ViT's width")
    add("--heads", type=int, default=4, help="the ViT's attention heads")
    add("--batch-size", type=int, default=128, help="samples per process per step")
    args = p.parse_args(argv)
    at_least_1 = ("experts", "top_k", "ep", "dim", "heads")
    check_sharded_args(args, at_least_1, ("aux_loss_weight",), ("capacity_factor",))
    if args.top_k > args.experts:
        fail(f"--top-k {args.top_k} is more than the {args.experts} experts")
    return args


def local(t):  # this process's part of a DTensor (its experts), or the tensor itself
    return t.to_local() if isinstance(t, DTensor) else t


class MoE(nn.Module):
    """A mixture of E expert MLPs and a linear router, in place of a block's MLP. Each weight
    of the experts is one tensor, expert first (E, ...): cut by its first dimension, it places
    whole experts on processes. Until shard_experts() runs, one process holds them all."""

    def __init__(self, dim, experts, top_k, capacity_factor):
        super().__init__()
        hidden = 4 * dim // top_k  # k experts per token: the dense ViT's MLP compute
        self.router = nn.Linear(dim, experts, bias=False)

        def init(fan_in, *shape):  # nn.Linear's initialisation, expert by expert
            bound = 1 / math.sqrt(fan_in)
            return nn.Parameter(torch.empty(experts, *shape).uniform_(-bound, bound))

        self.w1, self.b1 = init(dim, dim, hidden), init(dim, hidden)
        self.w2, self.b2 = init(hidden, hidden, dim), init(hidden, dim)
        self.experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.group, self.ep = None, 1  # the EP group, and its size
        self.aux_loss = self.load = self.dropped = None  # set by each forward

    def route(self, x):
        """Each token's k experts, their weights, and which of the choices fit, one row each."""
        logits = self.router(x)  # (images, tokens, E)
        top, expert = logits.topk(self.top_k, dim=-1)
        weight = top.softmax(-1)  # the mix of the token's k outputs (as Mixtral)
        # Capacity: an expert takes at most C of an image's choices, all first choices before
        # any second one, in token order; the rest are dropped (the residual carries the token
        # on). Per image, not per batch: an image's output does not depend on the images
        # beside it, so evaluation is exact at any batch size and number of processes.
        images, tokens, k = expert.shape
        capacity = math.ceil(self.capacity_factor * k * tokens / self.experts)
        queue = F.one_hot(expert, self.experts).transpose(1, 2).flatten(1, 2)  # by choice rank
        position = ((queue.cumsum(1) - 1) * queue).sum(-1)  # each choice's place in its queue
        kept = position.view(images, k, tokens).transpose(1, 2) < capacity
        return [t.flatten(0, 1) for t in (logits, expert, weight, kept)]

    def balance_loss(self, logits, expert):
        """The Switch Transformer's load-balancing loss, E x sum_e f_e x P_e: f_e the fraction
        of choices that went to expert e, P_e its mean router probability; at its least, 1,
        when both are even. Over the global batch: f from counts summed over every process
        (one all-reduce of E + 1 numbers, all ranks participate). P is a mean over tokens:
        each process adds its tokens' share, so the processes' losses average to the whole."""
        counts = torch.bincount(expert.flatten(), minlength=self.experts)
        totals = reduce_value(torch.cat([counts, counts.new_tensor([len(logits)])])).float()
        f, probs = totals[:-1] / (totals[-1] * self.top_k), logits.float().softmax(-1)
        return self.experts * get_world_size() * (f * probs.sum(0)).sum() / totals[-1]

    def forward(self, x):
        images, tokens, dim = x.shape
        logits, expert, weight, kept = self.route(x)
        x = x.reshape(-1, dim)
        if self.training:
            self.aux_loss = self.balance_loss(logits, expert)
        # The kept choices, one row each, sorted by expert: so by the process that holds it.
        token = torch.arange(len(x), device=x.device)[:, None].expand_as(expert)[kept]
        chosen, weight = expert[kept], weight[kept]
        order = chosen.argsort(stable=True)
        token, chosen, weight = token[order], chosen[order], weight[order]
        counts = torch.bincount(chosen, minlength=self.experts)
        self.load, self.dropped = counts, (~kept).sum()  # for metrics.jsonl
        h = x[token]  # a token chosen by two experts travels twice
        y = self.exchange(h, counts) if self.ep > 1 else self.run_experts(h, counts)
        # Each token's outputs, weighted, summed back in its row; a dropped choice adds 0.
        out = x.new_zeros(x.shape).index_add(0, token, (y * weight[:, None]).to(x.dtype))
        return out.view(images, tokens, dim)

    def run_experts(self, h, counts):
        """h: rows grouped by expert, counts[e] for this process's expert e."""
        w1, b1, w2, b2 = (local(p) for p in (self.w1, self.b1, self.w2, self.b2))
        rows = h.split(counts.tolist())
        out = [F.gelu(r @ w1[e] + b1[e]) @ w2[e] + b2[e] for e, r in enumerate(rows)]
        return torch.cat(out)

    def exchange(self, h, counts):
        """The rows to their experts' processes, through the experts, and back (all ranks of
        the EP group participate). Autograd runs both exchanges reversed in backward: each
        output's gradient back to its expert, each input's back to its token's process."""
        ep, group, mine = self.ep, self.group, self.experts // self.ep
        # 1. The counts first, E/EP to each process: how many rows it receives for each of
        # its experts. They size the second exchange (all-to-all needs the sizes on both
        # sides) and say which expert each received row is for: no index travels with it.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        send, recv = counts.view(ep, mine).sum(1).tolist(), received.view(ep, mine).sum(1).tolist()
        # 2. The rows (dim numbers each) to the process of their expert.
        h = all_to_all_single_autograd(h, recv, send, group)
        # They arrive by sender, then expert: sorted by expert for the expert MLPs.
        expert = torch.arange(mine, device=h.device).repeat(ep).repeat_interleave(received)
        order = expert.argsort(stable=True)
        y = self.run_experts(h[order], received.view(ep, mine).sum(0))
        # 3. The outputs back, in the order the rows came, to the processes of their tokens.
        return all_to_all_single_autograd(y[order.argsort()], send, recv, group)


class MoEViT(ViT):
    """models.py's ViT with each block's MLP a mixture of experts."""

    def __init__(self, in_channels, num_classes, size, dim, heads, experts, top_k, capacity):
        super().__init__(in_channels, num_classes, size, dim=dim, heads=heads)
        for block in self.blocks:
            block.mlp = MoE(dim, experts, top_k, capacity)


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
    """DDP's averaging, by hand, in one all-reduce per kind (all ranks participate). The loss
    is the mean of the processes' losses, so every gradient is a sum over them / world.
    Whole tensors: each process has its own tokens' part, summed over all. Experts: each
    already holds its EP group's sum (the exchanges brought every token's gradient to it);
    with replicas (dp > 1) summed over the processes holding the same experts too."""
    if mesh is None:
        return
    whole, experts = split_grads(model)
    for grads, group in ((whole, None), (experts, mesh["dp"].get_group())):
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=group)
        for g, mean in zip(grads, (flat / world).split([g.numel() for g in grads]), strict=True):
            g.copy_(mean.view_as(g))


@torch.no_grad()
def clip_grad_norm(model, mesh, max_norm):
    """Scale the gradients to a global norm of at most max_norm. The whole tensors' squares are
    the same everywhere; the experts' summed over an EP group (each expert counted once)."""
    whole, experts = split_grads(model)
    squares = sum(g.float().square().sum() for g in experts)
    if mesh is not None:
        dist.all_reduce(squares, group=mesh["ep"].get_group())  # all ranks participate
    total = (squares + sum(g.float().square().sum() for g in whole)).sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1)
    for g in whole + experts:
        g.mul_(scale)
    return total


def read_meta(path, args):
    """Rank 0: the checkpoint's step, RNG and flags, after checking that it is one of ours."""
    saved = (meta := read_sharded_meta(path))["args"]
    keys = ("dim", "heads", "experts", "top_k")
    if saved.get("model") != "moe-vit" or any(saved.get(k) != getattr(args, k) for k in keys):
        flags = " ".join(f"--{k.replace('_', '-')} {saved.get(k)}" for k in keys)
        fail(f"checkpoint {path} holds a {saved.get('model', 'vit')} of {flags}")
    return meta


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
        seed_everything(args.seed)  # the same initial weights on every rank

        # Data: every process its own 1/world of each epoch, as DDP does.
        train_set, test_set, num_classes, in_channels = load_datasets(
            args.data, args.data_dir, args.download, None, info.local_rank
        )
        sampler, train_loader, test_loader = shard_loaders(
            train_set, test_set, args, world, rank, device
        )
        steps_per_epoch, global_batch = len(train_loader), args.batch_size * world
        total_steps = args.epochs * steps_per_epoch

        # Built on no device whole, as in fsdp_train.py: the shapes on the meta device, the
        # experts cut, then memory for this process's experts and the whole rest only, filled
        # from rank 0's seeded CPU copy (all ranks participate).
        shape = (args.dim, args.heads, args.experts, args.top_k, args.capacity_factor)
        build = partial(MoEViT, in_channels, num_classes, train_set[0][0].shape[-1], *shape)
        with torch.device("meta"):
            model = build()
        state = initial_state(build, args.seed)  # rank 0: the whole model; None elsewhere
        if mesh is not None:
            shard_experts(model, mesh)  # from here on, this process's experts only
        model.to_empty(device=device)
        fill = StateDictOptions(full_state_dict=True, broadcast_from_rank0=info.distributed)
        set_model_state_dict(model, state or {}, options=fill)
        autocast = partial(torch.autocast, device.type, torch.bfloat16, args.amp == "bf16")

        # Every rank writes its own pieces into the output directory: every rank checks it.
        out = together(lambda: args.output_dir and check_output_dir(args.output_dir))

        # The optimizer, made after the cut: it holds (and steps) this process's experts.
        lr = args.lr * global_batch / 256
        optimizer = torch.optim.AdamW(model.parameters(), lr, weight_decay=args.weight_decay)

        # Resume: rank 0 finds and checks the checkpoint; every rank reads its pieces (any degree).
        resume, meta = find_checkpoint(args, partial(read_meta, args=args))
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
            """Exact: a rank with fewer test batches runs empty ones (forward is collective)."""
            padded = pad_batches(test_loader, test_set[0][0].shape, device)
            return evaluate(model, padded, device, autocast())

        if args.eval_only:
            loss, acc = evaluate_all()
            print0(f"eval {resume}: test_loss {loss:.4f} test_acc {acc:.4f}")
            return

        start_epoch = step // steps_per_epoch
        metrics = out / "metrics.jsonl" if out and rank == 0 else None
        if metrics and not (args.max_steps and step >= args.max_steps):
            trim_metrics(metrics, start_epoch)  # epochs that run again lose their old lines
        moes = [block.mlp for block in model.blocks]
        size = f"global batch {global_batch}, peak lr {lr:.3g}, {steps_per_epoch} steps/epoch"
        where = f"EP {ep} x {world // ep} replica(s) on {device.type}"
        print0(f"MoE ViT on {args.data}: {args.experts} experts, {where}, {size}")
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
                loss = F.cross_entropy(logits.float(), labels, label_smoothing=0.1)
                aux = sum(moe.aux_loss for moe in moes)  # this process's share (see MoE)
                (loss + args.aux_loss_weight * aux).backward()
                average_gradients(model, mesh, world)  # as DDP does (all ranks participate)
                loss_sum += loss.detach() * labels.numel()
                count += labels.numel()
                # The rows each expert received from this process, and the choices dropped.
                load += torch.stack([torch.cat([m.load, m.dropped[None]]) for m in moes])
                if args.clip_grad > 0:
                    clip_grad_norm(model, mesh, args.clip_grad)
                optimizer.step()  # the whole tensors, and this process's experts
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                step, done = step + 1, done + 1
                last = done == steps or step == args.max_steps
                if step % args.log_every == 0 or last:  # all ranks participate: all stop on a NaN
                    train_loss = log_loss(loss_sum, count, epoch, step, scheduler.get_last_lr()[0])
                if last:
                    break
            seconds = time.perf_counter() - t0  # the loss all-reduce above synchronised
            load = reduce_value(load).tolist()  # all ranks participate

            test_loss, test_acc = evaluate_all()
            speed, lr_now = done * global_batch / seconds, scheduler.get_last_lr()[0]
            record = dict(epoch=epoch, step=step, train_loss=train_loss, test_loss=test_loss)
            record.update(test_acc=test_acc, epoch_seconds=seconds, samples_per_second=speed)
            # Per block: the token choices each expert took this epoch; and those dropped.
            tokens, dropped = [r[:-1] for r in load], [r[-1] for r in load]
            record.update(lr=lr_now, world_size=world, ep=ep)
            record.update(expert_tokens=tokens, dropped_tokens=dropped)
            end_epoch(metrics, record)  # printed; in metrics.jsonl before the checkpoint
            busiest = max(max(r[:-1]) / max(1, sum(r[:-1]) / args.experts) for r in load)
            lost = sum(dropped) / max(1, sum(map(sum, load)))
            print0(f"  busiest expert {busiest:.2f}x an even share; {lost:.1%} choices dropped")
            if out:  # all ranks participate
                meta = dict(step=step, steps_per_epoch=steps_per_epoch, rng=rng_state(device))
                meta.update(global_batch=global_batch, args=dict(vars(args), model="moe-vit"))
                model_state, optim_state = get_state_dict(model, optimizer)
                state = dict(model=model_state, optimizer=optim_state)
                dcp.save(state, checkpoint_id=sharded_tmp(out))  # as in fsdp_train.py
                publish_sharded(out, meta)

        # The whole model in one file that loads without DTensor (all ranks participate).
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
