"""The data sets and their loaders: Fashion-MNIST, MNIST and CIFAR-10 decoded once into
in-memory tensors, ImageFolder read per sample, a synthetic set for smoke runs; each
data-parallel group's shard of the training set, and the exact evaluation shards (every test
sample once over all ranks). Put your own data set here, in load_datasets' place."""

import itertools
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, default_collate

from common import fail, first_line, get_world_size, once_per_node

DATASETS = ("fashion-mnist", "mnist", "cifar10", "imagefolder", "synthetic")  # images
TEXT = "text"  # bytes: the sharded scripts' language-model data


class InMemoryDataset(Dataset):
    """Images (N, C, H, W) and labels (N,) in memory; a batch is one indexing operation."""

    def __init__(self, images, labels, classes):
        self.images, self.labels, self.classes = images, labels, list(classes)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]

    def __getitems__(self, indices):  # the DataLoader's batch at once, not N items stacked
        if self.images.is_cuda:  # from pinned memory: sending them does not wait for the GPU
            pinned = torch.tensor(indices, pin_memory=True)
            indices = pinned.to(self.images.device, non_blocking=True)
        return self.images[indices], self.labels[indices]

    def to(self, device):
        """The same samples, held on `device`: on a GPU a batch is then one indexing there, with
        no copy from the host a step. Only for a DataLoader without worker processes
        (num_workers=0): CUDA tensors cannot be shared with them."""
        return InMemoryDataset(self.images.to(device), self.labels.to(device), self.classes)


def collate(batch):  # InMemoryDataset's batches arrive whole; ImageFolder's samples are stacked
    return batch if isinstance(batch, tuple) else default_collate(batch)


def synthetic_data(num_train=2000, num_test=499, size=28, seed=0):
    """10 classes, each a smooth pattern plus noise; 499 test samples (not divisible by 2 or 3)."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(10, 1, 7, 7, generator=g)
    prototypes = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    splits = []
    for n in (num_train, num_test):
        labels = torch.randint(10, (n,), generator=g)
        images = prototypes[labels] + 0.7 * torch.randn(n, 1, size, size, generator=g)
        splits.append(((images.clamp(0, 1) * 255).to(torch.uint8), labels))
    return splits, [f"class{i}" for i in range(10)]


def _load_torchvision(name, data_dir, download):
    from torchvision import datasets

    cls = dict(mnist=datasets.MNIST, cifar10=datasets.CIFAR10).get(name, datasets.FashionMNIST)
    where = Path(data_dir, f"{cls.__name__}/raw" if cls.__name__.endswith("MNIST") else "")
    try:
        splits = [cls(data_dir, train=train, download=download) for train in (True, False)]
    except (RuntimeError, OSError) as e:  # not there, or the download failed
        if download:  # not "pass --download": it was passed
            why = f"{first_line(e).rstrip(':')}; check the network, or put its files there"
            fail(f"downloading {name} into {where} failed ({why} and drop --download: README)")
        why = f"{first_line(e).rstrip(':')}; pass --download, or put its files there (README)"
        fail(f"{name} not found in {where} ({why})")
    images = [torch.as_tensor(s.data) for s in splits]  # (N, H, W), or CIFAR's (N, H, W, C)
    images = [x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2) for x in images]
    labels = [torch.as_tensor(s.targets) for s in splits]
    return list(zip(images, labels, strict=True)), splits[0].classes


def _load_imagefolder(data_dir, image_size):
    from PIL import Image
    from torchvision import datasets
    from torchvision import transforms as T

    if image_size is None:  # the images' own size, at most 224 (28x28 scaled up costs 64x)
        image_size = 224
        for first in sorted(Path(data_dir, "train").glob("*/*"))[:1]:
            with Image.open(first) as image:  # not an image: ImageFolder says so below
                image_size = min(224, *image.size)
    norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))  # ImageNet's
    train_tf = [T.RandomResizedCrop(image_size), T.RandomHorizontalFlip()]
    test_tf = [T.Resize(int(image_size * 8 / 7)), T.CenterCrop(image_size)]
    out = []
    for split, tf in (("train", train_tf), ("val", test_tf)):
        folder = Path(data_dir, split)
        try:
            tf = T.Compose([*tf, T.ToTensor(), norm])
            out.append(datasets.ImageFolder(folder, transform=tf))
        except OSError as e:  # no such folder, or no images in it
            why = first_line(e) if folder.is_dir() else f"{folder} is missing"
            fail(f"imagefolder: {why}; expected DIR/train/<class>/*, DIR/val/<class>/*")
    if out[0].classes != out[1].classes:
        fail(f"imagefolder: {data_dir}/train and {data_dir}/val have different class folders")
    return out


def _load(name, data_dir, download, image_size):
    if name == "imagefolder":
        train, test = _load_imagefolder(data_dir, image_size)
        return train, test, len(train.classes), 3
    if name == "synthetic":
        splits, classes = synthetic_data()
    else:
        splits, classes = _load_torchvision(name, data_dir, download)
    images = [x.float().div_(255) for x, _ in splits]
    # Normalised with the training split's per-channel statistics (no test-set leakage).
    mean, std = images[0].mean((0, 2, 3), keepdim=True), images[0].std((0, 2, 3), keepdim=True)
    pairs = zip(images, (y.long() for _, y in splits), strict=True)
    train, test = (InMemoryDataset((x - mean) / std, y, classes) for x, y in pairs)
    return train, test, len(classes), train.images.shape[1]


def load_datasets(name, data_dir, download=False, image_size=None, local_rank=0, seq_len=256):
    """(train_set, test_set, num_classes, in_channels); all ranks participate. ImageFolder, maybe
    too large for memory, is read per sample; the others are decoded once into memory. Text:
    windows of seq_len bytes, 256 classes (the next byte), no channels."""
    if name == TEXT:
        return *load_text(data_dir, seq_len), 256, None
    if name not in DATASETS:
        fail(f"unknown data set {name!r}; choose from {', '.join(DATASETS)}")
    data_dir = data_dir or "data"
    if download and get_world_size() > 1 and name not in ("imagefolder", "synthetic"):
        # torchvision downloads into the final file names.
        loaded = once_per_node(lambda: _load(name, data_dir, True, image_size), local_rank)
        return loaded or _load(name, data_dir, False, image_size)
    return _load(name, data_dir, download, image_size)


def shard_loaders(train_set, test_set, args, replicas, index, device):
    """Data parallelism over `replicas` groups of processes, this one in group `index` (the
    processes of a group see the same batches): (sampler, train_loader, test_loader), its shard
    of the training set, reshuffled by sampler.set_epoch(epoch), and its 1/replicas of the test
    set for exact evaluation."""
    steps = getattr(args, "accum_steps", 1)  # the batches of one optimizer step
    if (shard := len(train_set) // replicas) < args.batch_size * steps:
        each = f"--batch-size {args.batch_size}" + f" x --accum-steps {steps}" * (steps > 1)
        fail(f"{each} is larger than one data-parallel shard ({shard} samples)")
    sampler = DistributedSampler(train_set, replicas, index, seed=args.seed, drop_last=True)
    pin = dict(collate_fn=collate, pin_memory=device.type == "cuda")
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, drop_last=True, **pin)
    test_loader = DataLoader(eval_shard(test_set, index, replicas), 2 * args.batch_size, **pin)
    return sampler, train_loader, test_loader


def eval_shard(dataset, rank, world_size):
    """This rank's share of the test set, each sample once over all ranks (DistributedSampler
    pads with duplicates, which would make the accuracy depend on the world size)."""
    return torch.utils.data.Subset(dataset, range(rank, len(dataset), world_size))


IGNORED = -100  # a label cross_entropy leaves out of its sum (its ignore_index), never right


def pad_batches(loader, sample, device):
    """loader's batches, then more up to as many as any rank has: a sharded model's forward
    runs collectives, so every rank must run it as often (all ranks participate). Each extra
    batch is `sample` alone with its labels IGNORED: it adds nothing to a loss sum, an accuracy
    or a count of labels that leaves IGNORED out. (Not an empty batch: tensor parallelism's
    reshape of a 0 x seq x dim batch never returns where seq == dim, on PyTorch 2.14.)"""
    batches = torch.tensor(len(loader), device=device)
    if get_world_size() > 1:
        dist.all_reduce(batches, dist.ReduceOp.MAX)
    inputs, labels = (torch.as_tensor(t)[None] for t in sample)
    pad = inputs, torch.full_like(labels, IGNORED)
    return itertools.chain(loader, [pad] * (int(batches) - len(loader)))


# Text: bytes, a vocabulary of 256 (no tokenizer to build or ship) ---------------------------
def stdlib_sources():
    """The default corpus: the Python standard library's own top-level modules (Lib/*.py), in
    sorted order: text that is there wherever Python is, network or not (Python 3.11: 168
    files, 4.7 MB)."""
    return sorted(Path(os.__file__).parent.glob("*.py"))


class TextWindows(Dataset):
    """Windows of seq_len bytes one after another through `text` (uint8): window i is bytes
    i * seq_len to (i + 1) * seq_len - 1, each position's label the byte after it."""

    def __init__(self, text, seq_len):
        n = (len(text) - 1) // seq_len  # each window needs one byte more: its last label
        self.windows = text[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len)  # a view

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        window = self.windows[i].long()
        return window[:-1], window[1:]

    def __getitems__(self, indices):  # the DataLoader's batch at once, as InMemoryDataset's
        windows = self.windows[indices].long()
        return windows[:, :-1], windows[:, 1:]


def load_text(path, seq_len):
    """(train, validation) windows of the bytes of PATH (a UTF-8 file, or every file of a
    folder in sorted order) or, with no path, of stdlib_sources(). The validation set is a
    fixed held-out tail: the last 5% of the bytes."""
    files = stdlib_sources() if path is None else [Path(path)]
    if path is not None and Path(path).is_dir():
        files = sorted(p for p in Path(path).rglob("*") if p.is_file())
    if path is not None and not Path(path).exists():
        fail(f"text: {path} does not exist (a UTF-8 file or a folder of them; none: stdlib)")
    chunks = []
    for file in files:
        chunks.append(file.read_bytes())
        try:
            chunks[-1].decode("utf-8")
        except UnicodeDecodeError as e:
            fail(f"text: {file} is not UTF-8 text ({e.reason} at byte {e.start})")
    text = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
    held = max(len(text) // 20, seq_len + 1)
    if len(text) - held < seq_len + 1:
        source = path or "the standard library's sources (the default: no --data-dir)"
        fail(f"text: {len(text)} bytes in {source} are too few for windows of --seq-len {seq_len}")
    return TextWindows(text[:-held], seq_len), TextWindows(text[-held:], seq_len)
