"""N-D parallelism: the GPT trained on one device mesh of pipeline x data x context x tensor
parallel processes (--pp x --dp x --cp x --tp = the processes; any may be 1), as one process.

In torchtitan's order (parallelize_llama): the blocks cut into pipeline stages first, then on
each stage apply_tp (Megatron's columns and rows over --tp; --sequence-parallel: norms by
token), apply_cp (tokens over --cp in zigzag chunks), apply_compile (--compile) and apply_fsdp
last, over dp x cp flattened (--replicate R: HSDP). Unlike it: K and V all-gathered (its
context_parallel rings them), no activation checkpointing. Which layout when: README.

    8 processes, --pp 2 --dp 2 --tp 2:  stage 0 [[0, 1], [2, 3]]  stage 1 [[4, 5], [6, 7]]
                                        (rows: dp; in a row, a tensor-parallel pair)

Launch (--output-dir: one directory for all processes, on several nodes a shared one):
    python nd_parallel.py                                          # one process: the reference
    torchrun --standalone --nproc_per_node=8 nd_parallel.py --pp 2 --dp 2 --tp 2
    torchrun --standalone --nproc_per_node=8 nd_parallel.py --dp 2 --cp 2 --tp 2
    torchrun --nnodes=2 --nproc_per_node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        --rdzv-id=myjob nd_parallel.py --pp 2 --tp 4 --heads 4   # a stage per node, TP in it

Every process writes its pieces of a checkpoint (torch.distributed.checkpoint) each epoch; a
rerun resumes at any other layout and number of processes. OUTPUT_DIR/model.pt: the whole
model. --batch-size is per data-parallel row; --lr the peak AdamW rate per 256 sequences.
"""

import functools
import itertools
import time
from collections import namedtuple
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.attention.bias import causal_lower_right

import checkpoint
import common
import training
from common import fail, print0, reduce_value
from data import IGNORED, load_datasets, pad_batches, shard_loaders
from models import GPT, generate, initial_weights, keep_stage, param_groups
from profiling import Profiler, flop_rates, step_flops

# The autograd all-gather (all_gather_tensor_autograd in PyTorch 2.9, deprecated later): its
# backward reduce-scatters the gradients. (torch.distributed.nn's gave wrong ones on gloo.)
all_gather = getattr(funcol, "all_gather_single_autograd", funcol.all_gather_tensor_autograd)
PIPELINE_FLAGS = ("microbatches", "pipeline_schedule", "stages_per_rank")


def get_args(argv=None):
    p = training.sharded_parser(__doc__)  # --data, --epochs, --lr, ..., --dist-timeout
    p.set_defaults(data="text")
    add = p.add_argument
    add("--model", default="gpt", choices=["gpt"], help="the GPT of models.py, on text")
    add("--pp", type=int, default=1, help="pipeline stages (each depth/pp blocks)")
    add("--dp", type=int, help="data-parallel degree (default: what the others leave)")
    add("--cp", type=int, default=1, help="context-parallel degree (tokens of each sequence)")
    add("--tp", type=int, default=1, help="tensor-parallel degree (heads of each block)")
    add("--sequence-parallel", action="store_true", help="norms, residuals by token (TP > 1)")
    add("--replicate", type=int, default=1, help="HSDP: --dp as R replicas x dp/R shards")
    add("--pipeline-schedule", choices=training.PIPELINE_SCHEDULES, help="default 1f1b (pp > 1)")
    add("--stages-per-rank", type=int, help="stages per process (interleaved: 2; a V: 2)")
    add("--microbatches", type=int, help="per step (default: the stages)")
    add("--batch-size", type=int, help="sequences per data-parallel row per step (default 8)")
    add("--compile", action="store_true", help="torch.compile each block")
    args = p.parse_args(argv)
    at_least_1 = ("pp", "dp", "cp", "tp", "replicate", "microbatches", "stages_per_rank")
    return training.sharded_args(args, at_least_1, batch=(8, 8))


# The mesh's degrees and the pipeline's shape; dp: all of data parallelism, replicas x dp_shard.
Layout = namedtuple("Layout", "pp dp cp tp replicas dp_shard stages_per_rank microbatches schedule")


def check_layout(args, world):
    """The Layout, or one line on every rank (each checks the same flags)."""
    pp, cp, tp = args.pp, args.cp, args.tp
    dp = args.dp or max(1, world // (pp * cp * tp))
    if pp * dp * cp * tp != world:
        degrees = f"--pp {pp} x --dp {dp} x --cp {cp} x --tp {tp}"
        fail(f"{degrees} is {pp * dp * cp * tp} processes; {world} started")
    ignored = [name for name in PIPELINE_FLAGS if getattr(args, name) is not None]
    if pp == 1 and ignored:  # one stage: no schedule to shape (it would run as 1f1b x 1)
        fail(f"--{ignored[0].replace('_', '-')} shapes a pipeline: --pp 1 has none")
    if dp % args.replicate:
        fail(f"--replicate {args.replicate} does not divide --dp {dp}")
    if args.heads % tp:  # then the widths (a multiple of the heads) split evenly too
        fail(f"--tp {tp} must divide the {args.heads} heads")
    name = args.pipeline_schedule or "1f1b"  # interleaved, a V: several stages per process
    per_rank = args.stages_per_rank or (1 if name in ("gpipe", "1f1b") else 2)
    if args.depth % (pp * per_rank):
        stages = f"{pp * per_rank} stages (--pp {pp} x {per_rank} per process)"
        fail(f"{stages} must divide the {args.depth} blocks (--depth)")
    if cp > 1 and args.seq_len % (2 * cp):
        chunks = f"--cp {cp} cuts each sequence into {2 * cp} chunks"
        fail(f"{chunks}; --seq-len {args.seq_len} does not divide evenly")
    if args.sequence_parallel and (tp == 1 or args.seq_len // cp % tp):  # even pieces
        mine = f"the {args.seq_len // cp} tokens of each process (--seq-len / --cp)"
        fail(f"--sequence-parallel cuts {mine} over --tp {tp}: tp must be over 1 and divide them")
    micro = args.microbatches or pp * per_rank
    if args.batch_size % micro:
        fail(f"--microbatches {micro} does not divide --batch-size {args.batch_size}")
    if pp > 1:  # a class this PyTorch lacks, stages or micro-batches the schedule cannot take
        training.check_pipeline_schedule(name, micro, pp, per_rank)
    return Layout(pp, dp, cp, tp, args.replicate, dp // args.replicate, per_rank, micro, name)


# Context parallelism, zigzag (Megatron-Core's balance): each sequence cut into 2 CP chunks,
# process r holding chunks r and 2 CP - 1 - r: under the causal mask, equal attention work.
def zigzag(tokens, cp, r):
    n = tokens // (2 * cp)
    return [(r * n, (r + 1) * n), ((2 * cp - 1 - r) * n, (2 * cp - r) * n)]


def own(x, chunks, dim):  # this process's tokens of x along dim, chunk after chunk
    return torch.cat([x.narrow(dim, start, end - start) for start, end in chunks], dim)


def gathered_attention(q, k, v, group, rank, cp):
    """Causal attention of this process's two query chunks: K and V all-gathered (gradients
    reduce-scattered back) in position order; chunk c attends to chunks 0..c by the kernel's own
    causal mode, aligned bottom right (its last query sees every key): no mask, flash on a GPU."""
    kv = all_gather(torch.stack([k, v]).contiguous(), gather_dim=3, group=group)
    kv = kv.unflatten(3, (cp, 2, -1))  # (k or v, N, heads, rank, its chunk 0 or 1, n, dim)
    kv = torch.cat([kv.select(4, 0), kv.select(4, 1).flip(3)], 3).flatten(3, 4)  # chunks 0..
    out = []
    for queries, chunk in zip(q.chunk(2, 2), (rank, 2 * cp - 1 - rank), strict=True):
        seen = kv[..., : (chunk + 1) * q.shape[2] // 2, :]  # chunks 0..chunk: the keys it sees
        causal = causal_lower_right(queries.shape[2], seen.shape[3])
        out.append(F.scaled_dot_product_attention(queries, *seen, attn_mask=causal))
    return torch.cat(out, 2)


class StageGPT(GPT):
    """models.py's GPT on this process's tokens (`mine`) at their true positions; a stage before
    the last sends in send_dtype (bf16 under --amp bf16: half the bytes)."""

    def __init__(self, seq_len, dim, depth, heads, mine, send_dtype=torch.float32):
        super().__init__(256, seq_len, dim, depth, heads)
        self.mine, self.send_dtype = mine, send_dtype

    def forward(self, x):  # GPT.forward, the positions this process's own
        if self.embed is not None:  # the first stage
            x = self.embed(x) + own(self.pos, self.mine, 1)
        for block in filter(None, self.blocks):  # the blocks this stage holds
            x = block(x)
        return x.to(self.send_dtype) if self.head is None else self.head(self.norm(x))


def joined(chunks):
    """This process's stages as one module, under the whole model's names (blocks.5.mlp...):
    the same parameters, seen at once by the optimizer, the clipping and the checkpoints."""
    if len(chunks) == 1:
        return chunks[0]
    model = torch.nn.Module()
    stacked = zip(*(c.blocks for c in chunks), strict=True)  # block i of each: one holds it
    model.blocks = torch.nn.ModuleList(next(filter(None, blocks), None) for blocks in stacked)
    for name in ("embed", "pos", "norm", "head"):  # the first stage's, the last stage's
        held = [getattr(c, name) for c in chunks if getattr(c, name) is not None]
        setattr(model, name, held[0] if held else None)
    return model


def apply_tp(model, tp_mesh, sequence_parallel, dtype):
    """Megatron's cut (tensor_parallel.py tells it at length): q, k, v and fc1 by output
    features (whole heads), proj and fc2 by input features, their partial sums added by one
    all-reduce per pair; q, k and v share one input DTensor: one all-reduce for its gradient."""
    plan = {name: ColwiseParallel() for name in ("attn.q", "attn.k", "attn.v", "mlp.fc1")}
    rows, arriving = RowwiseParallel(), Replicate()  # each block's input
    if sequence_parallel:
        # Sequence parallelism: between the pairs, the residual stream and the norms hold 1/tp
        # of the tokens; each all-reduce a reduce-scatter, then an all-gather before columns.
        rows, arriving = RowwiseParallel(output_layouts=Shard(1)), Shard(1)
        norm = SequenceParallel(use_local_output=True)
        plan |= {"norm1": norm, "norm2": norm}
    # Every token, one DTensor that q, k, v (fc1) share: gathered first under SP.
    whole = PrepareModuleInput(input_layouts=arriving, desired_input_layouts=Replicate())
    plan |= {"attn": whole, "mlp": whole, "attn.proj": rows, "mlp.fc2": rows}
    for block in filter(None, model.blocks):
        parallelize_module(block, tp_mesh, plan)
        for norm in (block.norm1, block.norm2) if sequence_parallel and dtype else ():
            # autocast keeps a norm's output in fp32: gathered in bf16, half the bytes
            norm.register_forward_hook(lambda module, args, out: out.to(dtype))
    # Under SP the first block's input cut by token; the final norm's joined: the head sees all.
    ends = [(model.blocks[0], Replicate(), Shard(1)), (model.norm, Shard(1), Replicate())]
    for module, src, dst in ends if sequence_parallel else []:
        if module is not None:  # the first stage's, the last stage's (a plain tensor: local)
            moved = dict(input_layouts=src, desired_input_layouts=dst, use_local_output=True)
            parallelize_module(module, tp_mesh, PrepareModuleInput(**moved))


def apply_cp(model, cp_mesh):
    """Per token but for attention: each block's attention sees every token's K and V."""
    group = cp_mesh.get_group()
    mine = dict(group=group, rank=dist.get_rank(group), cp=cp_mesh.size())
    for block in filter(None, model.blocks):
        block.attn.attend = functools.partial(gathered_attention, **mine)


def apply_compile(model):
    """Each block's forward compiled (torchtitan's unit): the blocks are alike, so one graph
    serves them all, and FSDP's hooks and the pipeline's sends stay outside it."""
    for block in filter(None, model.blocks):
        block.forward = torch.compile(block.forward)


def apply_fsdp(model, mesh, amp, reshard_after_forward):
    """FSDP over dp x cp flattened: context parallelism splits tokens, not weights, so the
    gradients are averaged over both (as torchtitan does): the mean over the global batch.
    After TP, each TP piece sharded again; HSDP (--replicate R): over dp/R x cp, then averaged
    over R. Units: the embedding, each block, the final norm with the head (its backward comes
    next: never resharded after forward), the root (the positions)."""
    dims = ("dp_replicate", "dp_shard_cp") if mesh["dp_replicate"].size() > 1 else "dp_shard_cp"
    mp = MixedPrecisionPolicy(torch.bfloat16, reduce_dtype=torch.float32)
    policy = dict(mesh=mesh[dims], mp_policy=mp if amp == "bf16" else MixedPrecisionPolicy())
    if model.embed is not None:  # the first stage's
        fully_shard(model.embed, reshard_after_forward=reshard_after_forward, **policy)
    for block in filter(None, model.blocks):
        fully_shard(block, reshard_after_forward=reshard_after_forward, **policy)
    if model.head is not None:  # the last stage's
        fully_shard([model.norm, model.head], reshard_after_forward=False, **policy)
    fully_shard(model, **policy)


def parallelize(model, mesh, layout, args):
    """Tensor (and sequence), context, compile, then data parallelism on one pipeline stage
    (in place), torchtitan's order."""
    if layout.tp > 1:
        dtype = torch.bfloat16 if args.amp == "bf16" else None
        apply_tp(model, mesh["tp"], args.sequence_parallel, dtype)
    if layout.cp > 1:
        apply_cp(model, mesh["cp"])
    if args.compile:
        apply_compile(model)
    if layout.dp * layout.cp > 1:  # under a pipeline each unit gathered once a step, not M + 1
        # times (torchtitan's choice), as zero bubble's late weight gradients need anyway
        apply_fsdp(model, mesh, args.amp, reshard_after_forward=layout.pp == 1)


def build_stages(args, layout, mesh, device, mine):
    """This process's stages, built on no device whole: the shapes on the meta device, cut to
    each stage it holds (the blocks it does not hold None: the whole model's names stay, so a
    checkpoint loads at any other cut), parallelized, then memory for its own pieces only,
    filled one whole tensor at a time, each seeded by its name. Also returns the model's shapes."""
    pp, per_rank = layout.pp, layout.stages_per_rank
    pp_rank = mesh["pp"].get_local_rank() if mesh else 0
    stage_ids = functools.partial(training.pipeline_stage_ids, layout.schedule, processes=pp)
    stages = SimpleNamespace(ids=stage_ids(pp_rank, per_rank=per_rank), rank=pp_rank)
    # owner: which pipeline rank holds each stage (in a loop, or a V: rank 0 the first, last)
    stages.owner = {s: r for r in range(pp) for s in stage_ids(r, per_rank=per_rank)}
    stages.count, stages.group = pp * per_rank, mesh["pp"].get_group() if pp > 1 else None
    stages.first, stages.last = 0 in stages.ids, stages.count - 1 in stages.ids
    send = torch.bfloat16 if args.amp == "bf16" else torch.float32
    build = functools.partial(StageGPT, args.seq_len, args.dim, args.depth, args.heads, mine, send)
    blocks = args.depth // stages.count
    with torch.device("meta"):
        whole = build()
        chunks = [keep_stage(build(), s * blocks, (s + 1) * blocks) for s in stages.ids]
    for chunk in chunks:
        parallelize(chunk, mesh, layout, args)
        chunk.to_empty(device=device)
    model = joined(chunks)  # what the optimizer, clipping and checkpoints see
    # Each tensor drawn whole from a generator seeded by its name, one at a time, and cut to
    # this rank's pieces: no process builds the whole model (all ranks participate).
    checkpoint.fill_initial(model, initial_weights(build, args.seed))
    return stages, chunks, model, whole


def loss_of(logits, labels):  # the mean over this process's tokens
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())


def setup(args, info):
    """Everything a run holds, in one namespace: the mesh, the data, the stages and their
    schedule, the optimizer and its rate, resumed from a checkpoint if there is one."""
    device, rank, world = info.device, info.rank, info.world_size
    run = SimpleNamespace(args=args, device=device, rank=rank, world=world)
    run.layout = layout = check_layout(args, world)
    mesh = None  # outermost dimension first: a node's consecutive ranks share the busiest, TP
    if info.distributed:  # (its collectives in every block); the stages, the furthest apart
        shape = (layout.pp, layout.replicas, layout.dp_shard, layout.cp, layout.tp)
        names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")  # FSDP's shards: both, as one
    _, replica, shard, cp_rank, _ = mesh.get_coordinate() if mesh else (0,) * 5
    run.dp_rank = replica * layout.dp_shard + shard  # the data's row
    # Data: a data-parallel row's processes (its stages, cp and tp ranks) share each batch.
    text = (args.data, args.data_dir, args.download, None, info.local_rank, args.seq_len)
    run.train_set, run.test_set, _, _ = load_datasets(*text)
    loaders = shard_loaders(run.train_set, run.test_set, args, layout.dp, run.dp_rank, device)
    run.sampler, run.train_loader, run.test_loader = loaders
    run.steps_per_epoch, run.global_batch = len(run.train_loader), args.batch_size * layout.dp
    run.mine = zigzag(args.seq_len, layout.cp, cp_rank) if layout.cp > 1 else [(0, args.seq_len)]
    stages = build_stages(args, layout, mesh, device, run.mine)
    run.stages, run.chunks, run.model, run.whole = stages
    run.dtype = torch.bfloat16 if args.amp == "bf16" else None  # the compute's (MFU's peak)
    use_autocast = args.amp == "bf16" and layout.dp * layout.cp == 1  # FSDP's policy casts
    run.autocast = functools.partial(torch.autocast, device.type, run.dtype, use_autocast)
    run.schedule = None
    if layout.pp > 1:
        # Each batch cut into micro-batches, run through the stages in the schedule's order,
        # each one's mean loss taken, the summed gradients divided by their number: the mean.
        pairs = zip(run.chunks, run.stages.ids, strict=True)
        group, n = run.stages.group, run.stages.count
        pipes = [PipelineStage(c, s, n, device, group=group) for c, s in pairs]
        micro = layout.microbatches
        run.schedule = training.pipeline_schedule(layout.schedule, pipes, micro, loss_of)
    run.flops = 0  # a step's FLOPs, the whole model's on the global batch: rank 0 reports them
    if rank == 0:  # (the count takes a second of CPU: the others, many on a node, skip it)
        with torch.device("meta"):
            gpt = GPT(256, args.seq_len, args.dim, args.depth, args.heads)
            run.flops = step_flops(gpt, run.train_set[0][0].expand(run.global_batch, -1))
    run.lr = args.lr * run.global_batch / 256
    groups = param_groups(run.model, args.weight_decay)  # this process's pieces, each kind fused
    run.optimizer = training.fused_adamw(groups, run.lr, args.betas)
    # Resume (all ranks participate): rank 0 checks the checkpoint against the whole model;
    # each rank reads its own pieces by the whole model's names, whatever layout saved them.
    run.state = dict(train=checkpoint.TrainState(run.model, run.optimizer))
    run.resume, meta = checkpoint.find_checkpoint(args, run.whole)
    if run.resume:
        with checkpoint.reading(run.resume):
            dcp.load(run.state, checkpoint_id=run.resume)
    progress, steps = (run.global_batch, run.steps_per_epoch), args.epochs * run.steps_per_epoch
    run.step = checkpoint.resume_step(args, run.optimizer, meta, run.resume, progress, device)
    run.scheduler = training.warmup_decay(run.optimizer, args.warmup, steps, run.step, args.decay)
    return run


def forward_backward(run, inputs, labels):
    """The gradients of this step in every parameter's .grad; the mean loss of this process's
    tokens (None on stages before the last)."""
    if run.schedule is None:
        with run.autocast():
            loss = loss_of(run.model(inputs), labels)
        loss.backward()  # FSDP: each gradient averaged over the dp x cp processes
        return loss.detach()
    losses, first, last = [], run.stages.first, run.stages.last
    with run.autocast():  # the first stage feeds the tokens, the last takes the labels
        run.schedule.step(*[inputs][: int(first)], target=labels if last else None, losses=losses)
    return torch.stack(losses).mean().detach() if last else None


def batch(run, inputs, labels):
    """This process's tokens of a batch and their labels, on its device (not waiting: pinned)."""
    on = functools.partial(torch.Tensor.to, device=run.device, non_blocking=True)
    return own(on(inputs), run.mine, 1), own(on(labels), run.mine, 1)


@torch.no_grad()
def evaluate(run):
    """Exact: every held-out token once, whatever the layout. Each batch goes through the
    stages by hand (send and receive), the last stage sums its tokens' losses (tp times each:
    the ratios are exact); a rank with fewer batches runs padding (FSDP's forward is collective)."""
    run.model.eval()
    stages, device, dim = run.stages, run.device, run.args.dim
    peer = functools.partial(dist.get_global_rank, stages.group)
    cut = run.layout.tp if run.args.sequence_parallel else 1  # what a stage sends: 1/tp
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, count
    for inputs, labels in pad_batches(run.test_loader, run.test_set[0], device):
        x, labels = batch(run, inputs, labels)
        sent = (len(x), x.shape[1] // cut, dim)
        for s, chunk in zip(stages.ids, run.chunks, strict=True):  # s takes s - 1's output
            if s > 0 and stages.owner[s - 1] != stages.rank:  # another process's
                x = torch.zeros(sent, dtype=chunk.send_dtype, device=device)
                dist.recv(x, peer(stages.owner[s - 1]), group=stages.group)
            with run.autocast():
                x = chunk(x)
            if s < stages.count - 1 and stages.owner[s + 1] != stages.rank:
                dist.send(x, peer(stages.owner[s + 1]), group=stages.group)
        if not stages.last:
            continue
        totals[0] += F.cross_entropy(x.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        totals[1] += (x.argmax(-1) == labels).sum()
        totals[2] += (labels != IGNORED).sum()  # pad_batches' padding: not counted
    for module in run.model.modules():  # what the pipeline kept gathered, sharded again
        if isinstance(module, FSDPModule):
            module.reshard()
    loss_sum, correct, count = reduce_value(totals).tolist()  # all ranks participate
    return loss_sum / count, correct / count


def train_epoch(run, epoch, profiler):
    """One epoch's steps from run.step (a resumed run's, mid-epoch: the batches done skipped,
    the order a function of the epoch), to its end or --max-steps: the record's first part."""
    args, model, optimizer = run.args, run.model, run.optimizer
    run.sampler.set_epoch(epoch)  # without it every epoch repeats epoch 0's order
    epoch_step = run.step - epoch * run.steps_per_epoch
    steps, done = run.steps_per_epoch - epoch_step, 0
    loss_sum, count = torch.zeros(2, device=run.device, dtype=torch.float64)
    model.train()
    t0 = time.perf_counter()
    for inputs, labels in itertools.islice(run.train_loader, epoch_step, None):
        inputs, labels = batch(run, inputs, labels)
        loss = forward_backward(run, inputs, labels)
        if loss is not None:  # the last stage's
            loss_sum += loss * labels.numel()
            count += labels.numel()
        if args.clip_grad > 0:  # the norm of the whole model: every stage's, every piece
            training.clip_grad_norm(list(model.parameters()), args.clip_grad, run.stages.group)
        optimizer.step()  # this process's pieces only
        optimizer.zero_grad(set_to_none=True)
        lr_now = run.scheduler.get_last_lr()[0]  # this step's rate (logged; the epoch's last)
        run.scheduler.step()  # on to the next step's
        run.step, done = run.step + 1, done + 1
        last_step = done == steps or run.step == args.max_steps
        profiler.step(last_step)  # an evaluation comes next: no training step
        if run.step % args.log_every == 0 or last_step:  # all ranks participate
            train_loss = training.log_loss(loss_sum, count, epoch, run.step, lr_now)
        if last_step:
            break
    seconds = time.perf_counter() - t0  # the loss all-reduce above synchronised
    speed, flops = done * run.global_batch / seconds, run.flops * done
    rates = flop_rates(flops, seconds, run.device, run.dtype, args.peak_tflops, run.world)
    record = dict(epoch=epoch, step=run.step, train_loss=train_loss, epoch_seconds=seconds)
    return record | dict(samples_per_second=speed, lr=lr_now, world_size=run.world, **rates)


def train(args, info):
    run = setup(args, info)
    if args.eval_only:
        loss, acc = evaluate(run)
        print0(f"eval {run.resume}: test_loss {loss:.4f} test_acc {acc:.4f}")
        return
    out = checkpoint.sharded_output(args.output_dir)  # every rank writes there: every rank checks
    profiler = Profiler(args.profile, run.rank, run.device)  # a trace of a few steps per rank
    start_epoch = run.step // run.steps_per_epoch
    metrics = out / "metrics.jsonl" if out and run.rank == 0 else None
    if metrics and not (args.max_steps and run.step >= args.max_steps):
        checkpoint.trim_metrics(metrics, start_epoch)  # epochs that run again lose their old lines
    pp, dp, cp, tp, *_, micro, schedule = run.layout
    pipeline = f"{schedule} x {micro}" if pp > 1 else "no pipeline"
    how = f"{pp} x {dp} x {cp} x {tp} (pp x dp x cp x tp), {pipeline}"
    size = f"global batch {run.global_batch}, peak lr {run.lr:.3g}, {run.steps_per_epoch} steps"
    print0(f"gpt of {args.seq_len} tokens: {how}, {run.device.type}, {size}/epoch")
    if start_epoch >= args.epochs:
        print0(f"{run.resume} already holds all {args.epochs} epochs: nothing to train")
    for epoch in range(start_epoch, args.epochs):
        if args.max_steps and run.step >= args.max_steps:
            break
        record = train_epoch(run, epoch, profiler)
        record["test_loss"], record["test_acc"] = evaluate(run)
        training.end_epoch(metrics, record)  # printed; in metrics.jsonl before the checkpoint
        if out:  # all ranks participate
            progress = (run.step, run.steps_per_epoch, run.global_batch)
            meta = checkpoint.sharded_meta(run.whole, *progress, args, run.device)
            # Every rank writes its pieces; rank 0 then publishes them (see fsdp_train.py).
            dcp.save(run.state, checkpoint_id=out / "checkpoint.tmp")
            checkpoint.publish_sharded(out, meta)
    profiler.stop()
    # The whole model in one file that loads into models.GPT, written tensor by tensor (all
    # ranks participate); rank 0's sample of what the GPT learnt, read back if small.
    paths = filter(None, [out and out / "model.pt", args.export])
    written = checkpoint.export_whole(run.model, paths, run.stages.group)
    if full := checkpoint.weights_for_sample(written):
        print0("sample:", generate(GPT(256, args.seq_len, args.dim, args.depth, args.heads), full))


def main(argv=None):
    args = get_args(argv)
    common.require_torch("2.10", "nd_parallel.py")  # pipelining's shape inference on gloo: 2.10
    # The layout, checked before any process connects: a bad one stops every rank alone, at once.
    check_layout(args, (common.detect_launcher() or dict(world_size=1))["world_size"])
    # The process group: rank, world size and device from whichever launcher started us.
    launch = dict(backend=args.backend, device=args.device, timeout_s=args.dist_timeout)
    info = common.init_distributed_mode(**launch)
    try:
        train(args, info)
        if info.distributed:
            dist.barrier()  # leave together (all ranks participate): rank 0 hosts the store
    except RuntimeError as e:
        # A peer that died or hung for --dist-timeout breaks the others' collectives.
        raise common.peer_failure(e, info) from None
    finally:
        common.cleanup()  # also on an error: the peers are not left waiting on a dead group


if __name__ == "__main__":
    main()
