"""Fine-tuning a pretrained torchvision ResNet with DistributedDataParallel (DDP).

The network keeps what it learnt on ImageNet (or in an earlier run) and gets a new head for
this data set's classes. Early layers detect edges and textures that serve any image task, so
they stay frozen; only the head and the last --trainable-layers stages train. With 0 it is
a linear probe (only the head learns: fast, needs little data); with 5 everything trains
(best with a lot of data, slowest). Frozen layers cost no backward pass, no all-reduce and
no optimizer state. Use it when a network pretrained on images like yours exists and your
data set is small: the pretrained features do most of the work.

Launch (the same file, nothing to edit; SLURM and mpirun as for ddp_train.py, see README.md):
    python finetune.py --data imagefolder --data-dir DIR       # DIR/train/<class>/*, DIR/val/<class>/*
    torchrun --standalone --nproc_per_node=2 finetune.py       # one node, 2 processes
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 --rdzv-id=myjob finetune.py --data imagefolder --data-dir DIR
    python finetune.py --image-size 64 --epochs 1 --trainable-layers 0   # CPU: a quick linear probe

Transfer between tasks (Fashion-MNIST at 64x64 pixels, a few CPU minutes): learn classes 0-4
from random weights, then classes 5-9 from 50 labels each, from that run or from scratch:
    python finetune.py --weights none --classes 0-4 --image-size 64 --epochs 1 --output-dir base
    python finetune.py --weights-file base/checkpoint.pt --classes 5-9 --train-per-class 50 \\
        --image-size 64 --trainable-layers 5 --backbone-lr-scale 1 --batch-size 25 --lr 0.2 --epochs 2
    python finetune.py --weights none --classes 5-9 --train-per-class 50 \\
        --image-size 64 --batch-size 25 --lr 0.2 --epochs 2

The ImageNet weights are downloaded once into torch's hub cache (~/.cache/torch). Offline,
pass --weights-file PATH or --weights none (random initialisation: everything trains, from
scratch, whatever --trainable-layers says). --weights-file takes a state_dict or a checkpoint
of these scripts (ddp_train.py --model resnet18 included) and loads every tensor whose name
and shape fit; it prints which ones it skipped, and those start random and train.
Without resume: a rerun with the same --output-dir starts afresh and replaces its files.
"""

import argparse
import math
import re
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from tqdm import tqdm

from common import (
    DATASETS,
    ArgumentParser,
    InMemoryDataset,
    append_metrics,
    check_output_dir,
    cleanup,
    collate,
    eval_shard,
    evaluate,
    fail,
    first_line,
    init_distributed_mode,
    load_datasets,
    peer_failed,
    print0,
    read_torch_file,
    reduce_value,
    save_checkpoint,
    seed_everything,
)

# One family, so that "stage" means the same thing for every choice: the stem and layer1-4.
ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnext50_32x4d", "wide_resnet50_2")


def class_list(text):
    """--classes: numbers and ranges such as "0-4", "5,6,7,8,9" or "0-2,7", returned sorted."""
    classes = []
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")  # "-1" and "1-2-3" fail in int()
            classes += range(int(first), int(last or first) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers and ranges such as 0-4 or 5,6,7, got {text!r}") from None
    classes.sort()
    if len(classes) < 2 or len(set(classes)) < len(classes):
        raise argparse.ArgumentTypeError(f"needs at least 2 classes, each once, got {text!r}") from None
    return classes


def get_args(argv=None):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    # --model as in the other scripts; --arch, its first name, still works.
    p.add_argument("--model", "--arch", dest="model", default="resnet18", choices=ARCHS, help="torchvision network")
    p.add_argument("--weights", default="DEFAULT", help="torchvision weights (DEFAULT: ImageNet's best); none: random")
    p.add_argument(
        "--weights-file", default=None, help="a state_dict or checkpoint to load instead (by name and shape)"
    )
    p.add_argument(
        "--trainable-layers",
        type=int,
        default=1,
        help="stages that train besides the head, counted from the output: 0 = head only (linear probe), "
        "1 = layer4, ..., 5 = everything (stem, layer1-4)",
    )
    p.add_argument("--data", default="fashion-mnist", choices=DATASETS, help="data set")
    p.add_argument("--data-dir", default="data", help="root holding the data set (torchvision layout)")
    p.add_argument("--download", action="store_true", help="download the data set if missing")
    p.add_argument("--classes", type=class_list, help="keep only these classes (0-4 or 5,6,7), relabelled 0..k-1")
    p.add_argument("--train-per-class", type=int, default=0, help="train on N images per class (by --seed); 0: all")
    p.add_argument("--image-size", type=int, default=224, help="images are resized to this (ImageNet models: 224)")
    p.add_argument("--epochs", type=int, default=3, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=64, help="samples per process per step")
    p.add_argument("--lr", type=float, default=0.1, help="the head's learning rate per 256 samples of global batch")
    p.add_argument("--backbone-lr-scale", type=float, default=0.1, help="pretrained stages learn at this * --lr")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD (Nesterov) momentum")
    p.add_argument("--weight-decay", type=float, default=1e-4, help="L2 penalty on the trained parameters")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    p.add_argument("--seed", type=int, default=0, help="seed for the head's weights, shuffling and --train-per-class")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (smoke runs); 0: no limit")
    p.add_argument("--output-dir", default=None, help="where checkpoint.pt and metrics.jsonl go; none: write nothing")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if present")
    p.add_argument("--backend", default=None, choices=["gloo", "nccl", "mpi"], help="default: nccl on CUDA, else gloo")
    p.add_argument("--dist-timeout", type=float, default=300, help="seconds before a missing peer ends the job")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("lr", "backbone_lr_scale", "dist_timeout"):
        if not getattr(args, name) > 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if min(args.max_steps, args.workers, args.weight_decay, args.train_per_class) < 0:
        fail("--max-steps, --workers, --weight-decay and --train-per-class cannot be negative")
    if not 0 <= args.trainable_layers <= 5:
        fail(f"--trainable-layers counts a ResNet's 5 stages (stem, layer1-4): 0 to 5, got {args.trainable_layers}")
    if args.image_size < 32:  # a ResNet halves the image 5 times; below 32 pixels layer4 sees less than 1x1
        fail(f"--image-size must be at least 32, got {args.image_size}")
    return args


def select(dataset, classes, per_class, seed):
    """The samples of `classes` only, relabelled 0..k-1 (in that order); with `per_class`, that
    many of each: the first ones of a permutation drawn from `seed`, the same on every rank."""
    labels = torch.as_tensor(dataset.labels if isinstance(dataset, InMemoryDataset) else dataset.targets)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    picked = []
    for c in classes:
        of_class = order[labels[order] == c]
        if len(of_class) < per_class:
            fail(f"--train-per-class {per_class}: class {c} has only {len(of_class)} training images")
        picked.append(of_class[: per_class or None])
    keep = torch.cat(picked).sort().values  # the data set's own order (the sampler shuffles)
    relabel = {c: i for i, c in enumerate(classes)}
    if isinstance(dataset, InMemoryDataset):
        new_labels = torch.tensor([relabel[c] for c in labels[keep].tolist()])
        return InMemoryDataset(dataset.images[keep], new_labels, [dataset.classes[c] for c in classes])
    dataset.target_transform = relabel.__getitem__  # ImageFolder: relabel each sample as it is read
    return Subset(dataset, keep.tolist())


def read_weights_file(path):
    """The state_dict in --weights-file: a bare one (torch.save(model.state_dict(), path)) or
    a checkpoint of these scripts, which holds it under "model"."""
    state = read_torch_file(path, what="--weights-file")  # weights_only, onto the CPU
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        fail(f"--weights-file {path} holds no state_dict (a dict of tensors, or one under 'model')")
    # A model saved through its DDP or torch.compile wrapper has every key prefixed.
    return {re.sub(r"^(module\.|_orig_mod\.)+", "", k): v for k, v in state.items()}


def pretrained_state(args, is_main):
    """The pretrained weights as a state_dict, or None for --weights none."""
    if args.weights_file:
        return read_weights_file(args.weights_file)
    if args.weights.lower() == "none":
        return None
    from torchvision.models import get_model_weights

    choices = get_model_weights(args.model)
    if args.weights not in choices.__members__:
        fail(f"--weights {args.weights} does not exist for {args.model}: choose from {', '.join(choices.__members__)}")
    try:
        # Every rank reads the file from the hub cache; the first run downloads it there (to
        # a temporary name, renamed when complete, so ranks downloading at once do no harm).
        return choices[args.weights].get_state_dict(progress=is_main, check_hash=True)
    except Exception as e:  # noqa: BLE001 - no network, a proxy, a full disk: the way out is the same
        fail(
            f"could not download the {args.model} {args.weights} weights ({first_line(e)}); offline, pass "
            "--weights-file PATH (a state_dict saved with torch.save) or --weights none (random initialisation)"
        )


def seems_to_hold(state):
    """A guess at what a state_dict is: the torchvision ResNet it fits best, or its first names."""
    from torchvision.models import get_model

    ours = {(k, tuple(v.shape)) for k, v in state.items()}
    for arch in ARCHS:
        with torch.device("meta"):  # shapes only: no memory, no time spent on initialisation
            theirs = {(k, tuple(v.shape)) for k, v in get_model(arch).state_dict().items()}
        if len(ours & theirs) > 0.9 * len(ours | theirs):  # all but a head of another size
            return f"a torchvision {arch}"
    return f"{len(state)} tensors named {', '.join(list(state)[:3])}, ..., no torchvision ResNet"


def build_model(args, num_classes, is_main):
    """The network with a new head of `num_classes` outputs, and the names of its tensors that
    no weights were loaded into: the head and whatever else did not fit. These train."""
    from torchvision.models import get_model

    model = get_model(args.model, weights=None)  # ImageNet's shape (1000 classes), random weights
    # The new head: a linear layer from the pooled features to this data set's classes. It
    # starts random (the same on every rank: same seed) and is never loaded, even where its
    # shape fits: its outputs meant another data set's classes.
    model.fc = nn.Linear(model.fc.in_features, num_classes)
    own = model.state_dict()
    state = pretrained_state(args, is_main)
    if state is None:
        return model, set(own)  # --weights none: nothing pretrained, everything trains
    source = args.weights_file or f"--weights {args.weights}"
    # Load every tensor whose name and shape fit; report the rest, which stay random.
    fits = {k: v for k, v in state.items() if k in own and v.shape == own[k].shape and not k.startswith("fc.")}
    # Another architecture can still share many names and shapes by chance (64-wide BatchNorm
    # vectors are everywhere; resnet50 fits 98 of resnet18's 122 tensors), so the test counts
    # the convolution kernels and weight matrices, which hold what was learnt: fewer than half
    # of them loaded means the file holds another network, not a fine-tuning start.
    kernels = [k for k, v in own.items() if v.dim() > 1]
    matched = sum(k in fits for k in kernels)
    if matched < len(kernels) / 2:
        fail(
            f"{source} does not fit --model {args.model}: only {matched} of its {len(kernels)} weight tensors "
            f"match by name and shape; it seems to hold {seems_to_hold(state)}"
        )
    model.load_state_dict(fits, strict=False)
    # Why each tensor not loaded stays random: the head is new by design; the others did not fit.
    why = {k: f" ({tuple(state[k].shape)} in the file)" if k in state else " (not in the file)" for k in own}
    skipped = ", ".join(k + ("" if k.startswith("fc.") else why[k]) for k in own if k not in fits)
    unused = [k for k in state if k not in own]
    print0(
        f"{source}: loaded {len(fits)} of {len(own)} tensors; random, trained: {skipped}; "
        f"{len(unused)} tensors of the file unused" + (f" ({unused[0]}, ...)" if unused else "")
    )
    return model, set(own) - set(fits)


def freeze(model, trainable_layers, new):
    """Freeze all but the head, the last `trainable_layers` stages and the `new` (random)
    tensors; return the frozen BatchNorm layers, which must be kept in eval mode."""
    stages = [nn.ModuleList([model.conv1, model.bn1]), model.layer1, model.layer2, model.layer3, model.layer4]
    # requires_grad=False: autograd computes no gradient for these weights (and none at all
    # below the lowest trainable layer), DDP neither registers nor all-reduces them, and the
    # optimizer, built from the trainable ones only, holds no momentum for them.
    model.requires_grad_(False)
    for stage in stages[len(stages) - trainable_layers :]:
        stage.requires_grad_(True)
    for name, param in model.named_parameters():
        if name in new:  # a frozen random layer would only scramble what the layers above it see
            param.requires_grad_(True)
    # A frozen BatchNorm must keep its running mean and variance too. In train mode it would
    # replace them with this data set's batch statistics (while its weight and bias, frozen,
    # stay fitted to the old ones), and normalise with the statistics of each small batch:
    # the classic fine-tuning pitfall, which shifts every frozen layer above it. Eval mode
    # normalises with the pretrained statistics and leaves them alone.
    return [m for m in model.modules() if isinstance(m, nn.BatchNorm2d) and not m.weight.requires_grad]


class ToImageNetInput(nn.Module):
    """What an ImageNet network expects: 3 channels, at about the size it was trained on; on the
    device, for the whole batch. Grayscale becomes 3 equal channels. No normalisation here:
    load_datasets already normalised imagefolder with ImageNet's mean and std, and the in-memory
    sets to mean 0 and std 1 per channel, the range ImageNet's normalisation gives ImageNet images."""

    def __init__(self, size):
        super().__init__()
        self.size = size

    def forward(self, x):
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        if x.shape[-2:] != (self.size, self.size):
            # Small images (28x28) scaled up: at their own size a ResNet would pool them to 1x1
            # by layer3, and its filters were learnt at ImageNet's scale.
            x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False)
        return x.contiguous(memory_format=torch.channels_last)  # faster convolutions, CPU and GPU


def train(args, info):
    device, rank, world = info.device, info.rank, info.world_size
    seed_everything(args.seed)  # same seed on every rank: the same new head everywhere
    train_set, test_set, num_classes, _ = load_datasets(
        args.data, args.data_dir, args.download, args.image_size, info.local_rank
    )
    if args.classes or args.train_per_class:
        classes = args.classes or list(range(num_classes))
        if classes[-1] >= num_classes:
            fail(f"--classes {classes[-1]} does not exist: {args.data} has classes 0-{num_classes - 1}")
        train_set = select(train_set, classes, args.train_per_class, args.seed)
        test_set, num_classes = select(test_set, classes, 0, args.seed), len(classes)
    if len(train_set) // world < args.batch_size:
        fail(f"--batch-size {args.batch_size} is larger than one rank's shard ({len(train_set) // world} samples)")

    # DistributedSampler hands each rank a disjoint 1/world of a permutation that depends on
    # (seed, epoch): set_epoch() below makes every epoch's order new. drop_last trims the set
    # to a multiple of world instead of padding it with repeated samples.
    train_sampler = DistributedSampler(train_set, world, rank, shuffle=True, seed=args.seed, drop_last=True)
    # pin_memory: page-locked host memory lets the copies to the GPU overlap compute.
    loader_args = dict(num_workers=args.workers, pin_memory=device.type == "cuda", collate_fn=collate)
    loader_args.update(persistent_workers=args.workers > 0)
    # drop_last: every step sees a full batch (steady BatchNorm statistics).
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, drop_last=True, **loader_args)
    # Each test sample exactly once over all ranks (DistributedSampler would pad with repeats).
    test_loader = DataLoader(eval_shard(test_set, rank, world), 2 * args.batch_size, **loader_args)
    total_steps = min(args.epochs * len(train_loader), args.max_steps or math.inf)

    model, new = build_model(args, num_classes, rank == 0)
    frozen_norms = freeze(model, args.trainable_layers, new)
    model = model.to(device, memory_format=torch.channels_last)
    net = nn.Sequential(ToImageNetInput(args.image_size), model)  # `model` alone is what gets saved

    # Only now, with data, flags and weights found good, is anything written (rank 0 only).
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    out = check_output_dir(args.output_dir, need_bytes=2 * model_bytes) if args.output_dir and rank == 0 else None
    if out:
        (out / "metrics.jsonl").unlink(missing_ok=True)  # no resume: this run's epochs only

    # Two learning rates: the new head (and any other random tensor) needs a large one; the
    # pretrained stages need only small corrections, and a large rate would wreck what they learnt.
    lr = args.lr * args.batch_size * world / 256  # linear scaling rule, as in ddp_train.py
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    fresh, tuned = [p for n, p in trainable if n in new], [p for n, p in trainable if n not in new]
    groups = [dict(params=fresh, lr=lr)] + ([dict(params=tuned, lr=lr * args.backbone_lr_scale)] if tuned else [])
    optimizer = torch.optim.SGD(groups, momentum=args.momentum, nesterov=True, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, total_steps)

    # The DDP wrap, after freezing: DDP reads requires_grad when it is built and all-reduces
    # only the trainable parameters, in buckets while backward() runs. Every one of them is used
    # in every forward, so find_unused_parameters (an extra graph pass per step) is not needed.
    # DDP also broadcasts rank 0's weights and buffers here: every rank starts the same.
    ddp_net = net
    if info.distributed:
        ddp_net = DDP(net, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)

    print0(
        f"{args.model} on {args.data} ({num_classes} classes, {len(train_set)} training images): training "
        f"{sum(p.numel() for p in fresh + tuned):,} of {sum(p.numel() for p in model.parameters()):,} "
        f"parameters, {len(frozen_norms)} frozen BatchNorm layers; {world} process(es) on {device.type}, "
        f"global batch {args.batch_size * world}, head lr {lr:.3g}"
    )
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)  # without it every epoch repeats epoch 0's order
        ddp_net.train()
        for norm in frozen_norms:
            norm.eval()  # after every .train(), which would switch them back (see freeze())
        # Running sums stay on the device: a .item() per step would stall a GPU every step.
        totals = torch.zeros(2, device=device, dtype=torch.float64)  # loss sum, samples
        t0 = time.perf_counter()
        for images, labels in tqdm(train_loader, desc=f"epoch {epoch}", disable=rank != 0, leave=False):
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            loss = F.cross_entropy(ddp_net(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the trainable gradients over all ranks here
            optimizer.step()
            scheduler.step()
            totals[0] += loss.detach() * labels.numel()
            totals[1] += labels.numel()
            step += 1
            if step == total_steps:
                break
        totals = reduce_value(totals)  # all ranks participate
        epoch_seconds = time.perf_counter() - t0
        train_loss = (totals[0] / totals[1]).item()
        if not math.isfinite(train_loss):  # every rank sees the same sum, so all stop together
            fail(f"non-finite training loss in epoch {epoch}: lower --lr or --backbone-lr-scale")
        if info.distributed:
            # Trainable stages' BatchNorm statistics are per rank (each saw its own batches);
            # take rank 0's, so that every rank evaluates and saves the same model.
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)  # all ranks participate
        # The unwrapped net: DDP's forward would broadcast buffers, a collective that hangs
        # when ranks have different numbers of test batches. All ranks participate.
        test_loss, test_acc = evaluate(net, test_loader, device)
        record = dict(epoch=epoch, step=step, train_loss=train_loss, test_loss=test_loss, test_acc=test_acc)
        record.update(epoch_seconds=epoch_seconds, samples_per_second=totals[1].item() / epoch_seconds)
        record.update(lr=scheduler.get_last_lr()[0], world_size=world)
        print0(
            f"epoch {epoch}: train_loss {train_loss:.4f} test_loss {test_loss:.4f} test_acc {test_acc:.4f} "
            f"{epoch_seconds:.1f}s {record['samples_per_second']:.0f} samples/s"
        )
        if out:
            # "model" is the bare ResNet with its new head: it loads into
            # torchvision.models.get_model(model, num_classes=...) as it is.
            state = dict(model=model.state_dict(), optimizer=optimizer.state_dict(), epoch=epoch + 1, step=step)
            save_checkpoint(dict(state, world_size=world, args=vars(args)), out / "checkpoint.pt")
            append_metrics(out / "metrics.jsonl", record)  # after the checkpoint: every line has its weights
        if step == total_steps:
            break


def main(argv=None):
    args = get_args(argv)
    info = init_distributed_mode(backend=args.backend, device=args.device, timeout_s=args.dist_timeout)
    try:
        train(args, info)
        if info.distributed:
            dist.barrier()  # leave together (all ranks participate): rank 0 hosts the store
    except RuntimeError as e:
        # A peer that died or hung past --dist-timeout breaks the others' collectives.
        if not info.distributed or not peer_failed(e):
            raise
        fail(f"rank {info.rank}: another process died or stopped responding ({first_line(e).split('. ')[0]})")
    finally:
        cleanup()  # also when training raised: peers are not left waiting on a dead group


if __name__ == "__main__":
    main()
