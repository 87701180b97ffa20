"""N-D parallelism: the GPT trained on one device mesh of pipeline x data x context x tensor
parallel processes (--pp x --dp x --cp x --tp = the processes; any may be 1), as one process.

In the order the anchors compose them (torchtitan's parallelize_llama, picotron): the blocks
cut into pipeline stages, --stages-per-rank of them on each of --pp processes (under the whole
model's names), each block's linear layers split over --tp processes (Megatron's columns and
rows; --sequence-parallel: its norms and residuals by token), each sequence's tokens over --cp
processes (zigzag chunks; K and V all-gathered with their positions), and FSDP over dp x cp
together (the same weights on every process of both; --replicate R: HSDP, R replicas, each
sharded over dp/R x cp); --pipeline-schedule (model_parallel.py's: 1f1b, gpipe, interleaved,
zero bubble, in a V) runs micro-batches through the stages. Which layout when: README.

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

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage
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
from common import (
    cleanup,
    detect_launcher,
    fail,
    init_distributed_mode,
    peer_failure,
    print0,
    reduce_value,
    require_torch,
)
from data import IGNORED, load_datasets, pad_batches, shard_loaders
from models import GPT, generate, initial_weights, keep_stage, param_groups
from profiling import Profiler, flop_rates, step_flops
from training import (
    PIPELINE_SCHEDULES,
    check_pipeline_schedule,
    clip_grad_norm,
    end_epoch,
    log_loss,
    pipeline_schedule,
    pipeline_stage_ids,
    sharded_args,
    sharded_parser,
    warmup_decay,
)

# The autograd all-gather (all_gather_tensor_autograd in PyTorch 2.9, deprecated later): its
# backward reduce-scatters the gradients. (torch.distributed.nn's gave wrong ones on gloo.)
all_gather = getattr(funcol, "all_gather_single_autograd", funcol.all_gather_tensor_autograd)


def get_args(argv=None):
    p = sharded_parser(__doc__)  # --data, --epochs, --lr, ..., --dist-timeout: training.py's
    p.set_defaults(data="text")
    add = p.add_argument
    add("--model", default="gpt", choices=["gpt"], help="the GPT of models.py, on text")
    add("--pp", type=int, default=1, help="pipeline stages (each depth/pp blocks)")
    add("--dp", type=int, help="data-parallel degree (default: what the others leave)")
    add("--cp", type=int, default=1, help="context-parallel degree (tokens of each sequence)")
    add("--tp", type=int, default=1, help="tensor-parallel degree (heads of each block)")
    add("--sequence-parallel", action="store_true", help="norms, residuals by token (TP > 1)")
    add("--replicate", type=int, default=1, help="HSDP: --dp as R replicas x dp/R shards")
    add("--pipeline-schedule", default="1f1b", choices=PIPELINE_SCHEDULES, help="its order")
    add("--stages-per-rank", type=int, help="stages per process (interleaved: 2; a V: 2)")
    add("--microbatches", type=int, help="per step (default: the stages)")
    add("--batch-size", type=int, help="sequences per data-parallel row per step (default 8)")
    args = p.parse_args(argv)
    at_least_1 = ("pp", "dp", "cp", "tp", "replicate", "microbatches", "stages_per_rank")
    return sharded_args(args, at_least_1, batch=(8, 8))


def check_layout(args, world):
    """The mesh's shape, or one line on every rank (each checks the same flags)."""
    pp, cp, tp = args.pp, args.cp, args.tp
    dp = args.dp or max(1, world // (pp * cp * tp))
    if pp * dp * cp * tp != world:
        fail(
            f"--pp {pp} x --dp {dp} x --cp {cp} x --tp {tp} is {pp * dp * cp * tp} processes; "
            f"{world} started"
        )
    if dp % args.replicate:
        fail(f"--replicate {args.replicate} does not divide --dp {dp}")
    if args.heads % tp:  # then the widths (a multiple of the heads) split evenly too
        fail(f"--tp {tp} must divide the {args.heads} heads")
    # Interleaved and V-shaped schedules hold several stages per process; the others, one.
    name, several = args.pipeline_schedule, args.pipeline_schedule not in ("gpipe", "1f1b")
    per_rank = (args.stages_per_rank or (2 if several else 1)) if pp > 1 else 1
    if args.depth % (pp * per_rank):
        stages = f"{pp * per_rank} stages (--pp {pp} x {per_rank} per process)"
        fail(f"{stages} must divide the {args.depth} blocks (--depth)")
    if cp > 1 and args.seq_len % (2 * cp):
        fail(
            f"--cp {cp} cuts each sequence into {2 * cp} chunks; --seq-len {args.seq_len} "
            "does not divide evenly"
        )
    if args.sequence_parallel and (tp == 1 or args.seq_len // cp % tp):  # even pieces
        mine = f"the {args.seq_len // cp} tokens of each process (--seq-len / --cp)"
        fail(f"--sequence-parallel cuts {mine} over --tp {tp}: tp must be over 1 and divide them")
    micro = args.microbatches or pp * per_rank
    if args.batch_size % micro:
        fail(f"--microbatches {micro} does not divide --batch-size {args.batch_size}")
    if pp > 1:  # a class this PyTorch lacks, stages or micro-batches the schedule cannot take
        check_pipeline_schedule(name, micro, pp, per_rank)
    return pp, dp, cp, tp, micro, per_rank, args.replicate


# Context parallelism, zigzag (Megatron-Core's load balancing): each sequence cut into 2 CP
# chunks, process r holding chunks r and 2 CP - 1 - r, one early and one late, so that under
# the causal mask every process has the same attention work. (The ring that passes K and V
# round while computing is context_parallel.py's lesson; here they are all-gathered.)
def zigzag(tokens, cp, r):
    n = tokens // (2 * cp)
    return [(r * n, (r + 1) * n), ((2 * cp - 1 - r) * n, (2 * cp - r) * n)]


def own(x, chunks, dim):  # this process's tokens of x along dim, chunk after chunk
    return torch.cat([x.narrow(dim, start, end - start) for start, end in chunks], dim)


def gathered_attention(q, k, v, group, tokens, cp):
    """Causal attention of this process's queries over every process's keys and values: K and
    V all-gathered (their gradients reduce-scattered back in backward), masked by each token's
    true position: a query sees the keys at or before its own."""
    kv = all_gather(torch.stack([k, v]).contiguous(), gather_dim=3, group=group)
    place = torch.arange(tokens, device=q.device)
    keys = torch.cat([own(place, zigzag(tokens, cp, r), 0) for r in range(cp)])  # rank order
    mine = own(place, zigzag(tokens, cp, dist.get_rank(group)), 0)
    return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=keys <= mine[:, None])


class StageGPT(GPT):
    """models.py's GPT, holding this process's tokens (`mine`) at their true positions."""

    def __init__(self, seq_len, dim, depth, heads, mine):
        super().__init__(256, seq_len, dim, depth, heads)
        self.mine = mine

    def forward(self, x):  # GPT.forward, the positions this process's own
        if self.embed is not None:  # the first stage
            x = self.embed(x) + own(self.pos, self.mine, 1)
        for block in filter(None, self.blocks):  # the blocks this stage holds
            x = block(x)
        return x if self.head is None else self.head(self.norm(x))


def joined(chunks):
    """This process's stages as one module, under the whole model's names (blocks.5.mlp...):
    the same parameters, seen at once by the optimizer, the clipping and the checkpoints."""
    if len(chunks) == 1:
        return chunks[0]
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList(
        next(filter(None, blocks), None) for blocks in zip(*(c.blocks for c in chunks), strict=True)
    )
    for name in ("embed", "pos", "norm", "head"):  # the first stage's, the last stage's
        held = [getattr(c, name) for c in chunks if getattr(c, name) is not None]
        setattr(model, name, held[0] if held else None)
    return model


def by_token(src, dst):
    """A module's input, a plain tensor laid out as src (Shard(1): by token), moved to dst."""
    return PrepareModuleInput(input_layouts=src, desired_input_layouts=dst, use_local_output=True)


def parallelize(model, mesh, layout, tokens, amp, keep_gathered=False, sequence_parallel=False):
    """Tensor (and sequence), context, then data parallelism on one pipeline stage (in place)."""
    pp, dp, cp, tp, *_, replicas = layout
    blocks = list(filter(None, model.blocks))
    if tp > 1:
        # Megatron's cut: q, k, v and fc1 by output features (each process whole heads, whole
        # MLP features), proj and fc2 by input features, their partial sums added by one
        # all-reduce per pair (tensor_parallel.py tells it at length). q, k and v share one
        # input DTensor (not a copy each): in backward, one all-reduce adds its gradient.
        plan = {name: ColwiseParallel() for name in ("attn.q", "attn.k", "attn.v", "mlp.fc1")}
        rows, arriving = RowwiseParallel(), Replicate()  # each block's input
        if sequence_parallel:
            # Sequence parallelism: between the pairs the residual stream and the norms hold
            # 1/tp of this process's tokens, a plain (batch, tokens / tp, dim) tensor, and so
            # does what a stage sends the next (1/tp of the bytes); each all-reduce becomes a
            # reduce-scatter to them, then an all-gather of every token before the columns.
            rows, arriving = RowwiseParallel(output_layouts=Shard(1)), Shard(1)
            norm = SequenceParallel(use_local_output=True)
            plan |= {"norm1": norm, "norm2": norm}
        # Every token, one DTensor that q, k, v (fc1) share: gathered first under SP.
        whole = PrepareModuleInput(input_layouts=arriving, desired_input_layouts=Replicate())
        plan |= {"attn": whole, "mlp": whole, "attn.proj": rows, "mlp.fc2": rows}
        for block in blocks:
            parallelize_module(block, mesh["tp"], plan)
        # The first block's input cut by token; the final norm's joined: the head sees all.
        ends = [(model.blocks[0], Replicate(), Shard(1)), (model.norm, Shard(1), Replicate())]
        for module, src, dst in ends if sequence_parallel else []:
            if module is not None:  # the first stage's, the last stage's
                parallelize_module(module, mesh["tp"], by_token(src, dst))
    if cp > 1:  # per token but for attention: the blocks' attention sees every token
        group = mesh["cp"].get_group()
        for block in blocks:
            block.attn.attend = functools.partial(
                gathered_attention, group=group, tokens=tokens, cp=cp
            )
    if dp * cp > 1:
        # FSDP over dp x cp flattened: every process of a stage's dp x cp grid holds the same
        # weights (context parallelism splits tokens, not weights), so the gradients are
        # averaged over all of them (as torchtitan does): each rank's loss, the mean over its
        # own tokens, averaged over dp x cp, is the mean over the global batch. Each block,
        # then the stage's root, as in fsdp_train.py; after TP, each TP piece sharded again.
        # HSDP (--replicate R): sharded over dp/R x cp, the gradients then averaged over R.
        dims = ("dp_replicate", "dp_cp") if replicas > 1 else "dp_cp"
        mp = MixedPrecisionPolicy(torch.bfloat16, reduce_dtype=torch.float32)
        policy = dict(mesh=mesh[dims], mp_policy=mp if amp == "bf16" else MixedPrecisionPolicy())
        for block in blocks:  # keep_gathered: from its forward to the step's end (see train)
            fully_shard(block, reshard_after_forward=not keep_gathered, **policy)
        fully_shard(model, **policy)


def train(args, info):
    device, rank, world = info.device, info.rank, info.world_size
    layout = pp, dp, cp, tp, micro, per_rank, replicas = check_layout(args, world)
    # The mesh, outermost dimension first: consecutive ranks (one node's) share a tensor-
    # parallel group, whose collectives run in every block; the pipeline's stages, which only
    # pass activations on, are the furthest apart (across nodes).
    mesh = None
    if info.distributed:
        shape = (pp, replicas, dp // replicas, cp, tp)  # --dp: replicas x "dp" (HSDP; else 1)
        names = ("pp", "dp_replicate", "dp", "cp", "tp")
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        mesh["dp", "cp"]._flatten("dp_cp")  # FSDP's shards: both, as one
    pp_rank, replica, shard, cp_rank, _ = mesh.get_coordinate() if mesh else (0,) * 5
    dp_rank = replica * dp // replicas + shard  # the data's row
    pp_group = mesh["pp"].get_group() if pp > 1 else None
    # The stages this process holds, of pp x per_rank: one, or several in a loop or a V
    # (training.pipeline_stage_ids); owner: which pipeline rank holds each stage.
    schedule_name = args.pipeline_schedule if pp > 1 else "1f1b"  # one stage: no pipeline
    n_stages = pp * per_rank
    ids = pipeline_stage_ids(schedule_name, pp_rank, pp, per_rank)
    owner = {s: r for r in range(pp) for s in pipeline_stage_ids(schedule_name, r, pp, per_rank)}
    first, last = 0 in ids, n_stages - 1 in ids  # V-shaped: rank 0 holds both

    def peer(s):  # the global rank of the process that holds stage s
        return dist.get_global_rank(pp_group, owner[s])

    # Data: the processes of a data-parallel row (all its stages, cp and tp ranks) share each
    # batch; the dp rows take disjoint 1/dp of the global batch.
    train_set, test_set, _, _ = load_datasets(
        args.data, args.data_dir, args.download, None, info.local_rank, args.seq_len
    )
    sampler, train_loader, test_loader = shard_loaders(
        train_set, test_set, args, dp, dp_rank, device
    )
    steps_per_epoch, global_batch = len(train_loader), args.batch_size * dp
    total_steps, tokens = args.epochs * steps_per_epoch, args.seq_len
    mine = zigzag(tokens, cp, cp_rank) if cp > 1 else [(0, tokens)]

    def split(inputs, labels):  # this process's tokens of each sequence, and their labels
        return own(inputs, mine, 1), own(labels, mine, 1)

    # Built on no device whole, as in fsdp_train.py: the shapes on the meta device, cut to each
    # of this process's stages (the blocks it does not hold None: the whole model's names stay,
    # so a checkpoint loads at any other cut), parallelized, then memory for its own pieces
    # only, filled one whole tensor at a time (each drawn alone, seeded by its name).
    build = functools.partial(StageGPT, tokens, args.dim, args.depth, args.heads, mine)
    per_stage = args.depth // n_stages
    with torch.device("meta"):
        whole = build()  # names and shapes, for the checkpoints' meta.pt
        chunks = [keep_stage(build(), s * per_stage, (s + 1) * per_stage) for s in ids]
    # Zero bubble: the weights' gradients are taken after the input's, from the parameters the
    # stage holds then: those the forward used only if FSDP keeps them gathered (else lost).
    gathered = pp > 1 and schedule_name in ("interleaved-zb", "zbv", "dualpipev")
    for chunk in chunks:
        parallelize(chunk, mesh, layout, tokens, args.amp, gathered, args.sequence_parallel)
        chunk.to_empty(device=device)
    model = joined(chunks)  # what the optimizer, clipping and checkpoints see
    fill_initial(model, initial_weights(build, args.seed))  # all ranks participate
    dtype = torch.bfloat16 if args.amp == "bf16" else None  # the compute's (MFU's peak)
    use_autocast = args.amp == "bf16" and dp * cp == 1  # without FSDP, autocast gives bf16
    autocast = functools.partial(torch.autocast, device.type, dtype, use_autocast)

    def loss_of(logits, labels):  # the mean over this process's tokens
        return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())

    if pp > 1:
        # The schedule cuts each batch into micro-batches, runs them through the stages in
        # its order (1F1B: a backward as soon as one can, so at most pp micro-batches'
        # activations are held), takes each one's mean loss on the last stage and divides the
        # summed gradients by their number: the mean over the batch.
        pairs = zip(chunks, ids, strict=True)
        pipes = [PipelineStage(c, s, n_stages, device, group=pp_group) for c, s in pairs]
        schedule = pipeline_schedule(schedule_name, pipes, micro, loss_of)

    def forward_backward(inputs, labels):
        """The gradients of this step in every parameter's .grad; the mean loss of this
        process's tokens (None on stages before the last)."""
        if pp == 1:
            with autocast():
                loss = loss_of(model(inputs), labels)
            loss.backward()  # FSDP: each gradient averaged over the dp x cp processes
            return loss.detach()
        losses = []  # the first stage feeds the tokens, the last takes the labels
        with autocast():
            schedule.step(*[inputs][: int(first)], target=labels if last else None, losses=losses)
        return torch.stack(losses).mean().detach() if last else None

    out = sharded_output(args.output_dir)  # every rank writes there: every rank checks
    profiler = Profiler(args.profile, rank, device)  # a trace of a few steps per rank
    flops = 0  # a step's FLOPs, the whole model's on the global batch: rank 0 reports them
    if rank == 0:  # (the count takes a second of CPU: the others, many on a node, skip it)
        with torch.device("meta"):
            whole_gpt = GPT(256, tokens, args.dim, args.depth, args.heads)
            flops = step_flops(whole_gpt, train_set[0][0].expand(global_batch, tokens))

    # The optimizer, made after the cuts: it holds (and steps) this process's pieces only.
    lr = args.lr * global_batch / 256
    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr, betas=args.betas)

    # Resume, as in fsdp_train.py: rank 0 finds and checks the checkpoint against the whole
    # model; every rank reads the parts of the saved pieces that make up its own, at any
    # layout (all ranks participate): each stage's pieces, and its moments, under the whole
    # model's names (blocks.5.mlp.fc1.weight), whatever the stage that saved them.
    state = dict(train=TrainState(model, optimizer))
    resume, meta = find_checkpoint(args, whole)
    if resume:
        with reading(resume):
            dcp.load(state, checkpoint_id=resume)
    step = resume_step(args, optimizer, meta, resume, (global_batch, steps_per_epoch), device)
    scheduler = warmup_decay(optimizer, args.warmup, total_steps, step, args.decay)

    @torch.no_grad()
    def evaluate():
        """Exact: every held-out token once, whatever the layout. Each batch goes through the
        stages by hand (send and receive, no backward), the last stage sums the losses of its
        tokens; a rank with fewer batches runs padding (FSDP's forward is collective). The
        sums count each token tp times (and 0 times off the last stage): the ratios are exact."""
        model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, count
        for inputs, labels in pad_batches(test_loader, test_set[0], device):
            inputs, labels = split(inputs.to(device), labels.to(device))
            sent = (len(inputs), inputs.shape[1] // (tp if args.sequence_parallel else 1))
            x = inputs  # through the stages this process holds, in order: s takes s - 1's output
            for s, chunk in zip(ids, chunks, strict=True):
                if s > 0 and owner[s - 1] != pp_rank:  # another process's
                    x = torch.zeros(*sent, args.dim, device=device)
                    dist.recv(x, peer(s - 1), group=pp_group)
                with autocast():
                    x = chunk(x)
                if s < n_stages - 1 and owner[s + 1] != pp_rank:
                    dist.send(x.float(), peer(s + 1), group=pp_group)
            if not last:
                continue
            totals[0] += F.cross_entropy(x.flatten(0, 1).float(), labels.flatten(), reduction="sum")
            totals[1] += (x.argmax(-1) == labels).sum()
            totals[2] += (labels != IGNORED).sum()  # pad_batches' padding: not counted
        loss_sum, correct, count = reduce_value(totals).tolist()  # all ranks participate
        return loss_sum / count, correct / count

    if args.eval_only:
        loss, acc = evaluate()
        print0(f"eval {resume}: test_loss {loss:.4f} test_acc {acc:.4f}")
        return

    def save(step):  # all ranks participate
        meta = sharded_meta(whole, step, steps_per_epoch, global_batch, args, device)
        # Every rank writes its pieces; rank 0 then publishes them (see fsdp_train.py).
        dcp.save(state, checkpoint_id=out / "checkpoint.tmp")
        publish_sharded(out, meta)

    start_epoch = step // steps_per_epoch
    metrics = out / "metrics.jsonl" if out and rank == 0 else None
    if metrics and not (args.max_steps and step >= args.max_steps):
        trim_metrics(metrics, start_epoch)  # epochs that run again lose their old lines
    size = f"global batch {global_batch}, peak lr {lr:.3g}, {steps_per_epoch} steps/epoch"
    how = f"{pp} x {dp} x {cp} x {tp} (pp x dp x cp x tp), {schedule_name} x {micro}"
    print0(f"gpt of {tokens} tokens: {how}, {device.type}, {size}")
    if start_epoch >= args.epochs:
        print0(f"{resume} already holds all {args.epochs} epochs: nothing to train")
    for epoch in range(start_epoch, args.epochs):
        if args.max_steps and step >= args.max_steps:
            break
        sampler.set_epoch(epoch)  # without it every epoch repeats epoch 0's order
        epoch_step = step - epoch * steps_per_epoch
        steps, done = steps_per_epoch - epoch_step, 0
        loss_sum, count = torch.zeros(2, device=device, dtype=torch.float64)
        model.train()
        t0 = time.perf_counter()
        # A mid-epoch resume skips the batches done: the order is a function of the epoch.
        for inputs, labels in itertools.islice(train_loader, epoch_step, None):
            inputs, labels = split(inputs.to(device), labels.to(device))
            loss = forward_backward(inputs, labels)
            if loss is not None:  # the last stage's
                loss_sum += loss * labels.numel()
                count += labels.numel()
            if args.clip_grad > 0:  # the norm of the whole model: every stage's, every piece
                clip_grad_norm(list(model.parameters()), args.clip_grad, pp_group)
            optimizer.step()  # this process's pieces only
            optimizer.zero_grad(set_to_none=True)
            lr_now = scheduler.get_last_lr()[0]  # this step's rate (logged; the epoch's last)
            scheduler.step()  # on to the next step's
            step, done = step + 1, done + 1
            last_step = done == steps or step == args.max_steps
            profiler.step(last_step)  # an evaluation comes next: no training step
            if step % args.log_every == 0 or last_step:  # all ranks participate
                train_loss = log_loss(loss_sum, count, epoch, step, lr_now)
            if last_step:
                break
        seconds = time.perf_counter() - t0  # the loss all-reduce above synchronised

        test_loss, test_acc = evaluate()
        speed = done * global_batch / seconds
        record = dict(epoch=epoch, step=step, train_loss=train_loss, test_loss=test_loss)
        record.update(test_acc=test_acc, epoch_seconds=seconds, samples_per_second=speed)
        rates = flop_rates(flops * done, seconds, device, dtype, args.peak_tflops, world)
        record.update(lr=lr_now, world_size=world, **rates)
        end_epoch(metrics, record)  # printed; in metrics.jsonl before the checkpoint
        if out:
            save(step)  # all ranks participate

    profiler.stop()
    # The whole model in one file that loads into models.GPT, written tensor by tensor (all
    # ranks participate); rank 0's sample of what the GPT learnt, read back if small.
    written = export_whole(model, filter(None, [out and out / "model.pt", args.export]), pp_group)
    if full := weights_for_sample(written):
        print0("sample:", generate(GPT(256, tokens, args.dim, args.depth, args.heads), full))


def main(argv=None):
    args = get_args(argv)
    require_torch("2.10", "nd_parallel.py")  # pipelining's shape inference on gloo: 2.10
    # The layout, checked before any process connects: a bad one stops every rank alone, at once.
    check_layout(args, (detect_launcher() or dict(world_size=1))["world_size"])
    # The process group: rank, world size and device from whichever launcher started us.
    info = init_distributed_mode(
        backend=args.backend, device=args.device, timeout_s=args.dist_timeout
    )
    try:
        train(args, info)
        if info.distributed:
            dist.barrier()  # leave together (all ranks participate): rank 0 hosts the store
    except RuntimeError as e:
        # A peer that died or hung for --dist-timeout breaks the others' collectives.
        raise peer_failure(e, info) from None
    finally:
        cleanup()  # also on an error: the peers are not left waiting on a dead group


if __name__ == "__main__":
    main()
