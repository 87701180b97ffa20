"""Fine-tuning a pretrained torchvision ResNet with DistributedDataParallel (DDP).

The network keeps what it learnt on ImageNet (or in an earlier run) and gets a new head for
this data set's classes. Its early layers, edge and texture detectors that serve any image
task, stay frozen: only the head and the last --trainable-layers stages train (0: a linear
probe), and frozen layers cost no backward pass, all-reduce or optimizer state. For a small
data set, when a network pretrained on images like yours exists.

    python finetune.py --data imagefolder --data-dir DIR  # DIR/train/<class>/*, DIR/val/<class>/*
    torchrun --standalone --nproc_per_node=2 finetune.py  # one node (srun, mpirun: see README)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        --rdzv-id=myjob finetune.py --data imagefolder --data-dir DIR       # on every node
    python finetune.py --image-size 64 --epochs 1 --trainable-layers 0  # CPU: a linear probe
    python finetune.py --weights-file base/checkpoint.pt --classes 5-9 --train-per-class 50 \\
        --trainable-layers 5    # from an earlier run, on a few labels: benchmarks/transfer.py

ImageNet weights are downloaded once per node into torch's hub cache; offline, pass
--weights-file or --weights none. --weights-file takes a ResNet's weights in either form: a
plain state_dict (torchvision's file, fsdp_train.py's model.pt of --model resnet18) or a
checkpoint.pt whose "model" is one (finetune.py's own, ddp_train.py's of --model resnet18).
What fits --model by name and shape loads (a resnet18 of models.py has all but its 3x3 stem);
a file of another network (the ViT, the MLP, the small CNN) is refused in one line. No resume:
a rerun replaces --output-dir's files.
"""

import math
import re
import time
from argparse import ArgumentTypeError

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision.models import get_model, get_model_weights
from tqdm import tqdm

from checkpoint import append_metrics, check_output_dir, read_weights, save_checkpoint
from common import (
    ArgumentParser,
    check_flags,
    cleanup,
    fail,
    first_line,
    init_distributed_mode,
    once_per_node,
    peer_failure,
    print0,
    reduce_value,
    together,
)
from data import DATASETS, InMemoryDataset, collate, eval_shard, load_datasets
from profiling import Profiler, add_flags, flop_rates, step_flops
from training import evaluate

# One family, so that "stage" means the same for every choice: the stem and layer1-4.
ARCHS = [f"resnet{n}" for n in (18, 34, 50, 101, 152)] + ["resnext50_32x4d", "wide_resnet50_2"]


def class_list(text):
    """--classes: numbers and ranges such as "0-4", "5,6,7,8,9" or "0-2,7", returned sorted."""
    try:  # "-1" and "1-2-3" fail in int()
        ends = [[int(n) for n in part.split("-", 1)] for part in text.split(",")]
    except ValueError:
        raise ArgumentTypeError(f"numbers and ranges such as 0-4 or 5,6,7: {text!r}") from None
    classes = sorted(c for e in ends for c in range(e[0], e[-1] + 1))
    if len(classes) < 2 or len(set(classes)) < len(classes):
        raise ArgumentTypeError(f"needs at least 2 classes, each once, got {text!r}")
    return classes


def get_args(argv=None):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    arg = p.add_argument
    arg("--model", "--arch", default="resnet18", choices=ARCHS, help="torchvision network")
    arg("--weights", default="DEFAULT", help="torchvision's weights (DEFAULT: best); none: random")
    arg("--weights-file", help="a ResNet's state_dict, model.pt or checkpoint.pt to start from")
    arg("--trainable-layers", type=int, default=1, choices=range(6), help="0: head only; 5: all")
    arg("--data", default="fashion-mnist", choices=DATASETS, help="data set")
    arg("--data-dir", default="data", help="root holding the data set (torchvision layout)")
    arg("--download", action="store_true", help="download the data set if missing")
    arg("--classes", type=class_list, help="only these classes (0-4, 5,6,7), relabelled 0..k-1")
    arg("--train-per-class", type=int, default=0, help="train on N images a class (0: all)")
    arg("--image-size", type=int, default=224, help="input size (224: ImageNet networks' own)")
    arg("--epochs", type=int, default=3, help="passes over the training set")
    arg("--batch-size", type=int, default=64, help="samples per process per step")
    arg("--lr", type=float, default=0.1, help="the head's rate per 256 samples of global batch")
    arg("--backbone-lr-scale", type=float, default=0.1, help="pretrained stages: this * --lr")
    arg("--momentum", type=float, default=0.9, help="SGD (Nesterov) momentum")
    arg("--weight-decay", type=float, default=5e-4, help="L2 penalty on the trained parameters")
    arg("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    arg("--seed", type=int, default=0, help="seed: the head, shuffling, --train-per-class")
    arg("--max-steps", type=int, default=0, help="stop after this many steps; 0: no limit")
    arg("--output-dir", help="where checkpoint.pt and metrics.jsonl go; none: write nothing")
    arg("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if present")
    arg("--backend", choices=["gloo", "nccl", "mpi"], help="default: nccl on CUDA, else gloo")
    arg("--dist-timeout", type=float, default=300, help="seconds before a missing peer ends it")
    add_flags(p)  # --profile DIR, --peak-tflops (profiling.py)
    args = p.parse_args(argv)
    at_least_1, positive = ("epochs", "batch_size"), ("lr", "backbone_lr_scale", "dist_timeout")
    not_negative = ("max_steps", "workers", "weight_decay", "train_per_class")
    check_flags(args, at_least_1, not_negative, (*positive, "peak_tflops"))
    if args.image_size < 32:  # a ResNet halves the image 5 times: layer4 would see under 1x1
        fail(f"--image-size must be at least 32, got {args.image_size}")
    return args


def select(dataset, classes, per_class, seed):
    """The samples of `classes` only, relabelled 0..k-1 (in that order); with `per_class`, that
    many of each: the first ones of a permutation drawn from `seed`, the same on every rank."""
    in_memory = isinstance(dataset, InMemoryDataset)
    labels = torch.as_tensor(dataset.labels if in_memory else dataset.targets)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    picked = []
    for c in classes:
        of_class = order[labels[order] == c]
        if len(of_class) < max(per_class, 1):  # a class beyond the data set's has none
            fail(f"class {c} has {len(of_class)} images (--classes, --train-per-class {per_class})")
        picked.append(of_class[: per_class or None])
    keep = torch.cat(picked).sort().values  # the data set's own order (the sampler shuffles)
    relabel = {c: i for i, c in enumerate(classes)}
    if in_memory:
        new_labels = torch.tensor([relabel[c] for c in labels[keep].tolist()])
        names = [dataset.classes[c] for c in classes]
        return InMemoryDataset(dataset.images[keep], new_labels, names)
    dataset.target_transform = relabel.__getitem__  # ImageFolder: relabelled as it is read
    return Subset(dataset, keep.tolist())


def pretrained_state(args, local_rank):
    """The state_dict to start from: --weights-file's (bare, or a checkpoint's "model"),
    torchvision's --weights, or None for --weights none."""
    if args.weights_file:
        state, _ = read_weights(args.weights_file, "--weights-file")  # weights_only, CPU
        # A model saved through its DDP or torch.compile wrapper has every key prefixed.
        return {re.sub(r"^(module\.|_orig_mod\.)+", "", k): v for k, v in state.items()}
    if args.weights.lower() == "none":
        return None
    choices = get_model_weights(args.model).__members__
    if args.weights not in choices:
        fail(f"--weights {args.weights}: {args.model} has {', '.join(choices)}")

    def fetch():  # from torch's hub cache, downloaded into it on the first call
        try:
            return choices[args.weights].get_state_dict(progress=local_rank == 0, check_hash=True)
        except Exception as e:  # noqa: BLE001 - no network, a proxy, a full disk: same way out
            why = f"{args.model} {args.weights} weights ({first_line(e)})"
            fail(f"could not download the {why}; offline, pass --weights-file or --weights none")

    # One download per node, one after another (all ranks participate): processes writing
    # one file at once could spoil it. The node's other processes then read its copy.
    return once_per_node(fetch, local_rank) or fetch()


def build_pretrained_resnet(args, num_classes, local_rank=0):
    """Not models.build_model: torchvision's --model with the pretrained weights loaded where
    they fit and a new head of `num_classes` outputs; and the names of its tensors that no
    weights were loaded into (the head and whatever did not fit): these train."""
    model = get_model(args.model, weights=None)  # ImageNet's shape (1000 classes), random
    # The new head starts random (the same on every rank: same seed) and is never loaded,
    # even where its shape fits: its outputs meant another data set's classes.
    model.fc = nn.Linear(model.fc.in_features, num_classes)
    own = model.state_dict()
    state = pretrained_state(args, local_rank)
    if state is None:
        return model, set(own)  # --weights none: nothing pretrained, everything trains
    source = args.weights_file or f"--weights {args.weights}"
    fits = {k: v for k, v in state.items() if k in own and v.shape == own[k].shape}
    fits = {k: v for k, v in fits.items() if not k.startswith("fc.")}
    # Another network can share many names and shapes by chance (64-wide BatchNorm vectors are
    # everywhere), so count the kernels and weight matrices, which hold what was learnt.
    kernels = [k for k, v in own.items() if v.dim() > 1]
    matched = sum(k in fits for k in kernels)
    if matched < len(kernels) / 2:
        fail(
            f"{source} does not fit --model {args.model}: only {matched} of its {len(kernels)} "
            f"weight tensors match by name and shape (the file holds {len(state)} tensors: "
            f"{', '.join(list(state)[:3])}, ...)"
        )
    model.load_state_dict(fits, strict=False)
    why = {k: f" ({tuple(v.shape)} in the file)" for k, v in state.items()}
    why.update({k: "" for k in ("fc.weight", "fc.bias")})
    skipped = ", ".join(k + why.get(k, " (not in the file)") for k in own if k not in fits)
    unused = [k for k in state if k not in own]
    print0(
        f"{source}: loaded {len(fits)} of {len(own)} tensors; random, trained: {skipped}; "
        f"{len(unused)} tensors of the file unused" + (f" ({unused[0]}, ...)" if unused else "")
    )
    return model, set(own) - set(fits)


def freeze(model, trainable_layers, new):
    """Freeze all but the head, the last `trainable_layers` stages and the `new` (random)
    tensors; return the frozen BatchNorm layers, which must be kept in eval mode."""
    stem = nn.ModuleList([model.conv1, model.bn1])
    stages = [stem, model.layer1, model.layer2, model.layer3, model.layer4]
    # No gradient is computed for frozen weights (nor anything below the lowest trainable
    # layer), DDP does not all-reduce them and the optimizer holds no momentum for them.
    model.requires_grad_(False)
    for stage in stages[len(stages) - trainable_layers :]:
        stage.requires_grad_(True)
    for name, param in model.named_parameters():  # a frozen random layer would only scramble
        param.requires_grad_(param.requires_grad or name in new)  # what the layers above see
    # Frozen BatchNorm layers must keep their running statistics too: in train mode they would
    # normalise by each small batch of data their frozen weights never saw (a classic pitfall).
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    return [m for m in norms if not m.weight.requires_grad]


class ToImageNetInput(nn.Upsample):
    """What an ImageNet network expects, made on the device for the whole batch: 3 channels, at
    about the size it learnt at. (load_datasets has normalised the images already.)"""

    def __init__(self, size):
        super().__init__(size=(size, size), mode="bilinear", align_corners=False)

    def forward(self, x):
        x = x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x  # gray: 3 equal channels
        # Small images scaled up: at 28x28 a ResNet would pool them to 1x1 by layer3.
        x = super().forward(x) if x.shape[-2:] != self.size else x
        return x.contiguous(memory_format=torch.channels_last)  # faster convolutions


def train(args, info):
    device, rank, world = info.device, info.rank, info.world_size
    torch.manual_seed(args.seed)  # the same seed on every rank: the same new head everywhere
    data = load_datasets(args.data, args.data_dir, args.download, args.image_size, info.local_rank)
    train_set, test_set, num_classes, _ = data
    if args.classes or args.train_per_class:
        classes = args.classes or list(range(num_classes))
        train_set = select(train_set, classes, args.train_per_class, args.seed)
        test_set, num_classes = select(test_set, classes, 0, args.seed), len(classes)
    if len(train_set) // world < args.batch_size:
        fail(f"--batch-size {args.batch_size}: a rank has {len(train_set) // world} samples")
    # A disjoint 1/world of a permutation drawn from (seed, epoch) for each rank; drop_last
    # trims the set to a multiple of world instead of padding it with repeats.
    sampler = DistributedSampler(train_set, world, rank, seed=args.seed, drop_last=True)
    kw = dict(num_workers=args.workers, persistent_workers=args.workers > 0, collate_fn=collate)
    kw["pin_memory"] = device.type == "cuda"  # page-locked: copies to the GPU overlap compute
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, drop_last=True, **kw)
    # Each test sample exactly once over all ranks (DistributedSampler would pad with repeats).
    test_loader = DataLoader(eval_shard(test_set, rank, world), 2 * args.batch_size, **kw)
    total_steps = min(args.epochs * len(train_loader), args.max_steps or math.inf)
    epochs = math.ceil(total_steps / len(train_loader))  # fewer than --epochs with --max-steps

    model, new = build_pretrained_resnet(args, num_classes, info.local_rank)
    frozen_norms = freeze(model, args.trainable_layers, new)
    model = model.to(device, memory_format=torch.channels_last)
    net = nn.Sequential(ToImageNetInput(args.image_size), model)  # `model` alone is saved
    flops = step_flops(net, (1, *train_set[0][0].shape))  # a sample's; frozen layers: no backward
    # Written only now, with data, flags and weights found good. Rank 0 checks; if it fails,
    # every rank stops with its error (all ranks participate).
    profiler = Profiler(args.profile, rank, device)  # a trace of a few steps per rank
    out = together(lambda: args.output_dir and check_output_dir(args.output_dir), run=rank == 0)
    if out:
        (out / "metrics.jsonl").unlink(missing_ok=True)  # no resume: this run's epochs only
    # Two rates: the new head (and any other random tensor) needs a large one; the pretrained
    # stages need only small corrections, and a large rate would wreck what they learnt.
    lr = args.lr * args.batch_size * world / 256  # linear scaling rule, as in ddp_train.py
    fresh = [p for n, p in model.named_parameters() if p.requires_grad and n in new]
    tuned = [p for n, p in model.named_parameters() if p.requires_grad and n not in new]
    groups = [dict(params=fresh, lr=lr), dict(params=tuned, lr=lr * args.backbone_lr_scale)]
    sgd = dict(momentum=args.momentum, nesterov=True, weight_decay=args.weight_decay)
    optimizer = torch.optim.SGD([g for g in groups if g["params"]], **sgd)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, total_steps)
    # Wrapped after freezing: DDP reads requires_grad when it is built and all-reduces only the
    # trainable parameters. It also broadcasts rank 0's weights: every rank starts the same.
    ddp_net = DDP(net, gradient_as_bucket_view=True) if info.distributed else net
    print0(f"training {sum(p.numel() for p in fresh + tuned):,} parameters, head lr {lr:.3g}")
    step = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # without it every epoch repeats epoch 0's order
        ddp_net.train()
        for norm in frozen_norms:
            norm.eval()  # after every .train(), which would switch them back (see freeze())
        # Running sums stay on the device: a .item() per step would stall a GPU every step.
        totals = torch.zeros(2, device=device, dtype=torch.float64)  # loss sum, samples
        t0 = time.perf_counter()
        for batch in tqdm(train_loader, f"epoch {epoch}", disable=rank != 0, leave=False):
            images, labels = (t.to(device, non_blocking=True) for t in batch)
            loss = F.cross_entropy(ddp_net(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the trainable gradients over all ranks here
            optimizer.step()
            scheduler.step()
            totals[0] += loss.detach() * labels.numel()
            totals[1] += labels.numel()
            step += 1
            profiler.step(step == total_steps or step % len(train_loader) == 0)  # last: eval next
            if step == total_steps:
                break
        totals = reduce_value(totals)  # all ranks participate
        seconds = time.perf_counter() - t0
        train_loss = (totals[0] / totals[1]).item()
        if not math.isfinite(train_loss):  # every rank sees the same sum: all stop together
            fail(f"non-finite training loss in epoch {epoch}: lower --lr or --backbone-lr-scale")
        # Trainable BatchNorm statistics differ per rank (each saw its own batches): take rank
        # 0's, so that every rank evaluates and saves the same model (all ranks participate).
        for buffer in model.buffers() if info.distributed else ():
            dist.broadcast(buffer, src=0)
        # The unwrapped net: DDP's forward would broadcast buffers, a collective that hangs
        # when ranks have different numbers of test batches. All ranks participate.
        test_loss, test_acc = evaluate(net, test_loader, device)
        record = dict(epoch=epoch, step=step, train_loss=train_loss, test_loss=test_loss)
        record.update(test_acc=test_acc, epoch_seconds=seconds, lr=scheduler.get_last_lr()[0])
        record.update(samples_per_second=totals[1].item() / seconds, world_size=world)
        rates = flop_rates(flops * totals[1].item(), seconds, device, None, args.peak_tflops, world)
        record.update(rates)
        print0(
            f"epoch {epoch}: train_loss {train_loss:.4f} test_loss {test_loss:.4f} "
            f"test_acc {test_acc:.4f} {seconds:.1f}s {record['samples_per_second']:.0f} samples/s"
        )
        if out:
            # The bare ResNet: it loads into torchvision's get_model(args.model, num_classes=k).
            state = dict(model=model.state_dict(), optimizer=optimizer.state_dict(), step=step)
            state.update(epoch=epoch + 1, world_size=world, args=vars(args))
            save_checkpoint(state, out / "checkpoint.pt")
            append_metrics(out / "metrics.jsonl", record)  # after it: every line has its weights
    profiler.stop()


def main(argv=None):
    args = get_args(argv)
    timeout_s = args.dist_timeout
    info = init_distributed_mode(backend=args.backend, device=args.device, timeout_s=timeout_s)
    try:
        train(args, info)
        if info.distributed:
            dist.barrier()  # leave together (all ranks participate): rank 0 hosts the store
    except RuntimeError as e:
        raise peer_failure(e, info) from None  # one line if a peer died or hung
    finally:
        cleanup()  # also on error: peers are not left waiting on a dead group


if __name__ == "__main__":
    main()
