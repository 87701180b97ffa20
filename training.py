"""What a training loop needs beside its strategy: the sharded scripts' shared flags and text
recipe, the learning-rate schedule and its fast-forward on resume, exact evaluation, gradient
clipping over DTensors, the loss and epoch lines (the epoch's record in metrics.jsonl), and a
pipeline's stage cut (FLOPs per layer, the cheapest slowest stage) and schedule by name."""

import itertools
import math
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.flop_counter import FlopCounterMode

from checkpoint import append_metrics
from common import ArgumentParser, check_flags, fail, print0, reduce_value
from data import DATASETS, IGNORED, TEXT
from models import SDPA_BACKENDS, Attention
from profiling import add_flags


def sharded_parser(doc):
    """The flags of the five sharded scripts (fsdp_train.py, tensor_parallel.py,
    context_parallel.py, expert_parallel.py, nd_parallel.py), said once so that each means the
    same in all five; each adds its own."""
    p = ArgumentParser(description=doc)
    add = p.add_argument
    add("--data", default="fashion-mnist", choices=[*DATASETS, TEXT], help="data set")
    where = "images: torchvision's root (default data); text: a file or folder (default stdlib)"
    add("--data-dir", help=where)
    add("--download", action="store_true", help="download the data set if it is missing")
    add("--seq-len", type=int, default=256, help="text: bytes per sample (the context)")
    add("--epochs", type=int, help="passes over the training set (default 5; text: 1)")
    peak = "peak AdamW rate per 256 samples of global batch (default 3e-3; text: 0.14)"
    add("--lr", type=float, help=peak)
    betas = "AdamW's moment decays (default 0.9 0.999; text: 0.9 0.95, as GPT-3 and nanoGPT)"
    add("--betas", type=float, nargs=2, metavar=("B1", "B2"), help=betas)
    add("--dim", type=int, help="the transformer's width (default 96; text: 128)")
    add("--heads", type=int, help="the transformer's attention heads (default 4; gpt: 2)")
    add("--depth", type=int, help="the transformer's blocks (default 4; text: 2)")
    add("--weight-decay", type=float, default=0.05, help="AdamW's decoupled weight decay")
    add("--warmup", type=float, default=0.1, help="fraction of all steps spent warming up")
    decay = "the rate's decay to zero after warm-up (default cosine; text: linear)"
    add("--decay", choices=["cosine", "linear"], help=decay)
    add("--seed", type=int, default=0, help="seed for the weights and the shuffling")
    add("--amp", default="none", choices=["none", "bf16"], help="bf16: compute in bf16")
    clip = "max gradient norm; 0: no clipping (default 0; text: 1, as GPT-2 and nanoGPT)"
    add("--clip-grad", type=float, help=clip)
    add("--resume", help="checkpoint directory (default: OUTPUT_DIR/checkpoint if any)")
    add("--eval-only", action="store_true", help="only evaluate the model given by --resume")
    add("--max-steps", type=int, default=0, help="stop after this many steps; 0: no limit")
    add("--output-dir", help="where checkpoints, model.pt and metrics.jsonl go; none: nothing")
    add("--export", help="also write the whole trained model to this file")
    add("--log-every", type=int, default=50, help="steps between progress and NaN checks")
    add("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if any")
    add("--backend", choices=["gloo", "nccl"], help="default: nccl on CUDA, else gloo")
    add("--dist-timeout", type=float, default=300, help="seconds before a lost peer ends the job")
    kernels = "attention kernel on a GPU: auto (cuDNN's on Hopper, else PyTorch's), or only one"
    add("--sdpa-backend", default="auto", choices=["auto", "default", *SDPA_BACKENDS], help=kernels)
    add_flags(p)  # --profile DIR, --peak-tflops (profiling.py)
    return p


# The defaults that depend on the data, (images, text). The text column is the recipe of every
# script that trains the GPT (GPT-3's betas, GPT-2's clipping, a linear decay, 2 wide blocks).
DATA_DEFAULTS = dict(epochs=(5, 1), lr=(3e-3, 0.14), betas=((0.9, 0.999), (0.9, 0.95)))
DATA_DEFAULTS.update(decay=("cosine", "linear"), clip_grad=(0.0, 1.0))
DATA_DEFAULTS.update(dim=(96, 128), depth=(4, 2), heads=(4, 2))


def fill_defaults(args, defaults):
    """Each flag left None set to its default, {name: (images, text)}, by --data."""
    for name, (image, sequence) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, sequence if args.data == TEXT else image)


def check_recipe(args):
    """The bounds check_flags cannot say, of every script that takes these flags."""
    if not all(0 <= b < 1 for b in args.betas):
        fail(f"--betas are decays, each in [0, 1); got {' '.join(map(str, args.betas))}")
    if not 0 <= args.warmup < 1:
        fail(f"--warmup is a fraction of the run, in [0, 1); got {args.warmup}")
    if (args.model == "gpt") != (args.data == TEXT):  # a language model reads text, others images
        fail(f"--model {args.model} does not train on --data {args.data}: gpt reads text only")
    if args.dim % args.heads:
        fail(f"--dim {args.dim} is not a whole number of --heads {args.heads}")


def sharded_args(args, at_least_1=(), not_negative=(), positive=(), batch=(128, 8)):
    """check_flags for a sharded script's flags, the shared ones' bounds added; the defaults
    that depend on the data filled in, (images, text), for --epochs, --lr, --betas, --decay,
    --clip-grad, the shape and `batch`'s --batch-size. A text sample is a sequence of --seq-len
    bytes, an image one of 16 patches; the text defaults (GPT-3's betas, GPT-2's clipping, a
    linear decay, 2 wide blocks, small steps: benchmarks/results.md) train the GPT to about
    1.38 nats per byte in a few minutes on 2 CPU cores (README, Results)."""
    fill_defaults(args, dict(DATA_DEFAULTS, batch_size=batch))
    shape = ("seq_len", "dim", "heads", "depth")
    at_least_1 = ("epochs", "batch_size", "log_every", *shape, *at_least_1)
    not_negative = ("max_steps", "clip_grad", *not_negative)
    positive = ("lr", "dist_timeout", "peak_tflops", *positive)
    check_flags(args, at_least_1, not_negative, positive)
    if args.eval_only and not args.resume:
        fail("--eval-only needs --resume DIR (the checkpoint to evaluate)")
    check_recipe(args)
    Attention.kernels = args.sdpa_backend  # every models.Attention of this process
    return args


@torch.no_grad()
def evaluate(model, loader, device, autocast=None):
    """Loss and accuracy over the whole test set, exact at any world size; all ranks
    participate. Per sample (class logits), or per token (text: logits for each position,
    the next byte's loss in nats and its accuracy). Pass the unwrapped model: DDP's forward
    broadcasts buffers, a collective that would hang where ranks have different numbers of
    test batches."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with autocast or torch.autocast(device.type, enabled=False):
            logits = model(images)
        flat = logits.flatten(0, -2).float()  # (samples or tokens, classes)
        totals[0] += F.cross_entropy(flat, labels.flatten(), reduction="sum")
        totals[1] += (logits.argmax(-1) == labels).sum()
        totals[2] += (labels != IGNORED).sum()  # data.pad_batches' padding: not counted
    loss_sum, correct, count = reduce_value(totals).tolist()
    return loss_sum / count, correct / count


def warmup_decay(optimizer, warmup_fraction, total_steps, start=0, decay="cosine"):
    """A LambdaLR: linear warm-up to the peak over warmup_fraction of the steps, then decay to
    zero by a cosine (ddp_train.py --schedule cosine, model_parallel.py, the sharded scripts'
    images) or a straight line (decay "linear": the sharded scripts' text, as Bergsma et al.,
    2025, find best for language models), moved on to step `start` (a resumed run's: the rate
    is a function of the step alone). Warm-up 0: the first step at the peak."""
    warmup = max(1, int(warmup_fraction * total_steps))

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        done = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 1 - done if decay == "linear" else 0.5 * (1 + math.cos(math.pi * done))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    fast_forward(scheduler, start)
    return scheduler


def clip_grad_norm(params, max_norm, pp_group=None):
    """Scale the gradients to a norm of at most max_norm over the whole model (tensor_parallel.py,
    nd_parallel.py), which clip_grad_norm_ cannot take when DTensors and plain tensors mix: each
    gradient's local squares summed with those split over the same mesh dimensions (FSDP's,
    TP's, both; none for plain tensors and replicas), then one all-reduce per dimension (all
    ranks participate); with pp_group, the pipeline stages' sums added over it. Gradients
    still owed a sum (Partial: sequence parallelism's norms) get it first, in one all-reduce."""
    settle_partial([p for p in params if isinstance(p.grad, DTensor)])
    grads, sums, groups = [p.grad for p in params if p.grad is not None], {}, {}
    for g in grads:
        split = ()  # the mesh dimensions across which g's pieces differ
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            for dim, placement in enumerate(g.placements):
                # Shard, or FSDP's _StridedShard over a TP piece (which is_shard() denies)
                if not placement.is_replicate() and mesh.size(dim) > 1:
                    group = mesh.get_group(dim)  # named by its ranks: one of a kind
                    groups[ranks := tuple(dist.get_process_group_ranks(group))] = group
                    split += (ranks,)
            g = g.to_local()
        sums[split] = sums.get(split, 0) + g.float().square().sum()
    # The dimensions nest (a TP piece is FSDP-sharded again, never the other way round): the
    # widest split's sum is reduced over the dimensions only it has, the next one's added, and
    # so on: each dimension reduced once. (Splits that do not nest: each reduced on its own.)
    order = sorted(sums, key=len, reverse=True)  # stable: the same order on every rank
    nested = all(set(b) <= set(a) for a, b in zip(order, order[1:], strict=False))
    total = torch.zeros((), device=grads[0].device)
    for split, after in zip(order, [*order[1:], ()], strict=True):
        part = total + sums[split] if nested else sums[split]
        for name in (n for n in split if not nested or n not in after):
            dist.all_reduce(part, group=groups[name])
        total = part if nested else total + part
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)  # all ranks participate
    scale = (max_norm / (total.sqrt() + 1e-6)).clamp(max=1)
    for g in grads:
        g.mul_(scale)
    return total.sqrt()


def settle_partial(params):
    """The gradients that are DTensors still owed a sum over a mesh dimension (Partial), summed
    now in one all-reduce per mesh (DTensor would issue one per tensor, in the optimizer's
    step): what clipping and AdamW then read is each whole gradient."""
    owed = {}
    for p in params:
        if any(placement.is_partial() for placement in p.grad.placements):
            owed.setdefault((p.grad.device_mesh, p.grad.placements), []).append(p)
    for (mesh, placements), ps in owed.items():
        flat = torch.cat([p.grad.to_local().flatten() for p in ps])
        for dim, placement in enumerate(placements):
            if placement.is_partial():  # a sum (the only Partial reduction autograd leaves)
                dist.all_reduce(flat, group=mesh.get_group(dim))
        whole = [Replicate() if placement.is_partial() else placement for placement in placements]
        for p, piece in zip(ps, flat.split([p.grad.to_local().numel() for p in ps]), strict=True):
            local = piece.view_as(p.grad.to_local())
            p.grad = DTensor.from_local(local, mesh, whole, shape=p.shape, stride=p.stride())


def fused_adamw(groups, lr, betas):
    """torch's AdamW, fused (one kernel over many tensors: nanoGPT's and torchtitan's choice on
    CUDA; on the CPU it took under half foreach's time, benchmarks/adamw_cpu.py), also where a
    process holds plain tensors beside DTensors (tensor_parallel.py keeps the embedding and head
    whole; torchtitan makes every weight a DTensor instead). One fused call takes one kind,
    plain or DTensors of one mesh: for each step the groups are split by kind, then joined. They
    stay as given otherwise (models.param_groups' two), so a checkpoint loads at every layout
    and from fsdp_train.py, whose groups hold DTensors only."""
    optimizer = torch.optim.AdamW(groups, lr, betas=betas, fused=True)

    def split(optimizer, *_):  # before each step
        whole, kinds = optimizer.param_groups, {}
        for i, group in enumerate(whole):
            for p in group["params"]:
                kinds.setdefault((i, getattr(p, "device_mesh", None)), []).append(p)
        optimizer.param_groups = [dict(whole[i], params=ps) for (i, _), ps in kinds.items()]
        optimizer.whole_groups = whole

    def join(optimizer, *_):  # after it
        optimizer.param_groups = optimizer.whole_groups

    optimizer.register_step_pre_hook(split)
    optimizer.register_step_post_hook(join)
    return optimizer


def amp_note(amp, device):
    """One line, on rank 0, where --amp runs but slowly on this device: fp16 on a CPU, and
    bf16 on a GPU before Ampere (compute capability 8.0), which emulates it without a word."""
    if amp == "fp16" and device.type == "cpu":
        print0("note: --amp fp16 on CPU is slow; bf16 is the CPU's mixed-precision type")
    if amp == "bf16" and device.type == "cuda" and not torch.version.hip:  # AMD's have bf16
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            gpu = f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
            print0(f"note: --amp bf16 on {gpu} is emulated and slow; fp16 is its fast type")


def fast_forward(scheduler, steps):
    """Step a new scheduler to where a resumed run stopped (its rate is a function of the
    step), without PyTorch's warning about a scheduler stepped before its optimizer."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before")
        for _ in range(steps):
            scheduler.step()


def log_loss(loss_sum, count, epoch, step, lr):
    """The mean training loss since the epoch began, over all ranks, printed: one all-reduce
    (all ranks participate). Every rank sees the same NaN, so all stop at the same step,
    before it can replace a good checkpoint."""
    total, n = reduce_value(torch.stack([loss_sum, count])).tolist()
    if not math.isfinite(loss := total / n):
        fail(f"non-finite loss by step {step}: lower --lr or add --clip-grad")
    print0(f"epoch {epoch} step {step}: loss {loss:.4f} lr {lr:.3g}")
    return loss


def end_epoch(metrics, record):
    """The epoch's line on rank 0's terminal, and in metrics.jsonl (if any) before the
    checkpoint is written: a crash between the two reruns the epoch, whose line is trimmed."""
    losses = f"train_loss {record['train_loss']:.4f} test_loss {record['test_loss']:.4f}"
    seconds = f"test_acc {record['test_acc']:.4f} {record['epoch_seconds']:.1f}s"
    print0(f"epoch {record['epoch']}: {losses} {seconds}")
    if metrics:
        append_metrics(metrics, record)


# Pipelines (model_parallel.py; any script that pipelines): the stage cut, a schedule by name --
# --pipeline-schedule: torch.distributed.pipelining's class. Interleaved: V stages per process in
# a loop (stage s on rank s mod P); zbv and dualpipev: 2 per process in a V.
PIPELINE_SCHEDULES = {
    "gpipe": "ScheduleGPipe",  # all forwards, then all backwards
    "1f1b": "Schedule1F1B",  # one forward, one backward: at most P micro-batches alive
    "interleaved-1f1b": "ScheduleInterleaved1F1B",  # 1f1b over V stages per process
    "interleaved-zb": "ScheduleInterleavedZeroBubble",  # and the backward split in two
    "zbv": "ScheduleZBVZeroBubble",  # zero bubble, 2 stages per process in a V
    "dualpipev": "ScheduleDualPipeV",  # DeepSeek's DualPipe in a V
}
V_SHAPED = ("zbv", "dualpipev")


def layer_costs(layers, sample):
    """Forward FLOPs per sample of each layer (convolutions and matmuls, which dominate)."""
    costs = []
    for layer in layers:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            sample = layer(sample)
        costs.append(max(1, counter.get_total_flops()))
    return costs


def gpt_costs(gpt, tokens):
    """layer_costs of a models.GPT's blocks, the first with the embedding and positions, the
    last with the final norm and the head: the units its stages are cut from."""
    embed, head = gpt.embed, (lambda x: gpt.head(gpt.norm(x)))
    first, *blocks, last = layer_costs([lambda x: embed(x) + gpt.pos, *gpt.blocks, head], tokens)
    blocks[0], blocks[-1] = blocks[0] + first, blocks[-1] + last
    return blocks


def balanced_split(costs, stages):
    """Cut the layers into `stages` runs, (first, end)s, whose most expensive one is as cheap as
    can be (the slowest stage sets the pace): a dynamic program over prefix sums, stages x
    layers² steps. Of equally good cuts, each as early as it can be; deterministic, so every
    rank agrees."""
    n, prefix = len(costs), [0, *itertools.accumulate(costs)]

    def run(a, b, k):  # [a, b) as one stage, then the best k stages of [b, n)
        return max(prefix[b] - prefix[a], best[k][b])

    # best[k][a]: the slowest stage's cost at its cheapest, layers [a, n) cut into k stages.
    best = [[0 if a == n else math.inf for a in range(n + 1)]]
    for k in range(1, stages):
        best.append(
            [
                min((run(a, b, k - 1) for b in range(a + 1, n + 1)), default=math.inf)
                for a in range(n + 1)
            ]
        )
    slowest, cuts = min(run(0, b, stages - 1) for b in range(1, n + 1)), [0]
    for k in range(stages - 1, -1, -1):  # each cut the first that still reaches `slowest`
        cuts.append(next(b for b in range(cuts[-1] + 1, n + 1) if run(cuts[-1], b, k) <= slowest))
    return list(itertools.pairwise(cuts))


def pipeline_stage_ids(schedule, rank, processes, per_rank):
    """The stages `rank` holds, of processes x per_rank: in a V (zbv, dualpipev: rank r holds
    r and 2P-1-r, so rank 0 the first and the last), else in a loop (r, r + P, ...), as
    torchtitan's stage_ids_this_rank."""
    if schedule in V_SHAPED:
        return [rank, 2 * processes - 1 - rank]
    return [rank + k * processes for k in range(per_rank)]


def check_pipeline_schedule(schedule, microbatches, processes, per_rank):
    """One line (common.fail) where PyTorch's schedule would not run: a class this PyTorch
    lacks, a wrong number of stages per process, or micro-batches the schedule cannot take."""
    import torch.distributed.pipelining as pipelining  # not at import: modes 1 and 2 run on any

    name = PIPELINE_SCHEDULES[schedule]
    if not hasattr(pipelining, name):
        fail(
            f"--pipeline-schedule {schedule} needs {name}, which PyTorch {torch.__version__} lacks"
        )
    single = schedule in ("gpipe", "1f1b")
    if (single and per_rank != 1) or (schedule in V_SHAPED and per_rank != 2):
        wants = "1" if single else "2 (a V)"
        fail(f"--pipeline-schedule {schedule} places {wants} stage(s) per process, not {per_rank}")
    stages = processes * per_rank
    if schedule in ("1f1b", "dualpipev") and microbatches < stages:
        fail(f"{schedule} needs --microbatches >= stages ({stages}); got {microbatches}")
    rounds = max(1, microbatches // processes)  # interleaved: whole rounds of P micro-batches
    if schedule.startswith("interleaved") and microbatches % rounds:
        fail(f"{schedule}: --microbatches {microbatches} is not {rounds} rounds of {processes}")


def pipeline_schedule(schedule, stages, microbatches, loss_fn):
    """torch.distributed.pipelining's `schedule` over this process's stages (PipelineStages).
    It cuts each batch into micro-batches, takes loss_fn (a mean) of each, and divides the
    summed gradients by their number: the whole batch's mean gradient."""
    import torch._functorch.config
    import torch.distributed.pipelining as pipelining

    kind = getattr(pipelining, PIPELINE_SCHEDULES[schedule])
    if schedule in ("interleaved-zb", "zbv", "dualpipev"):
        # Their backward comes in two: the inputs' gradients, the graph kept, then the weights'.
        # A compiled block (--compile) must keep what its backward reads till the second.
        torch._functorch.config.donated_buffer = False
    return kind(stages[0] if schedule in ("gpipe", "1f1b") else stages, microbatches, loss_fn)
