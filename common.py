"""Plumbing shared by the training scripts: process-group start and teardown for every
launcher, rank helpers, data decoded once into memory, the shared models, exact distributed
evaluation and safe checkpoints. Each strategy itself (launch, wrap, shard, loop, evaluate,
save) stays in its own script; only what two or more scripts need lives here.
"""

import argparse
import datetime
import glob
import gzip
import importlib
import json
import os
import random
import re
import shutil
import subprocess
import time
import uuid
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset, default_collate


def fail(message):
    """Stop with a one-line error and exit status 1 (SystemExit prints it to stderr)."""
    raise SystemExit(f"error: {message}")


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors, like every other error of these scripts."""

    def error(self, message):
        fail(f"{message} (see --help)")


# ----------------------------------------------------------------------------------------
# Process group


class DistInfo(NamedTuple):
    distributed: bool
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device


def slurm_first_host(nodelist):
    """First host of a SLURM node list: "gpu[003-005,9],login1" -> "gpu003",
    "rack[1-2]-node[01-04]" -> "rack1-node01", "nid[001-004]-ib" -> "nid001-ib"."""
    first = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist).group()  # up to a comma outside brackets
    return re.sub(r"\[([^\],-]+)[^\]]*\]", r"\1", first)  # each bracket -> its first value


# Where each launcher puts (rank, world size, local rank, local world size).
LAUNCHER_VARS = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),  # or torch elastic, or a user's own
    "slurm": ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE"),
    "mpirun": (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # and Intel MPI (Hydra)
}


def detect_launcher(environ=None):
    """Rank, local rank and world sizes from whichever launcher started this process: a dict
    with the launcher's name, or None for a plain single process."""
    env = dict(os.environ if environ is None else environ)
    # SLURM_PROCID exists in the batch shell too, where only one process runs; a step started
    # by srun is marked by SLURM_STEP_ID, so a plain `python train.py` in sbatch stays single.
    if "SLURM_STEP_ID" not in env:
        env.pop("SLURM_PROCID", None)
    env.setdefault("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1"))
    env.setdefault("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_NTASKS_PER_NODE", ""))
    for launcher, names in LAUNCHER_VARS.items():
        if names[0] in env and names[1] in env:
            # SLURM writes task counts per node as "4(x2),3": the first number is this node's.
            rank, world, local_rank, local_world = (re.match(r"\d*", env.get(n, "")).group() for n in names)
            found = dict(launcher=launcher if launcher != "mpich" else "mpirun", rank=int(rank), world_size=int(world))
            found.update(local_rank=int(local_rank or 0), local_world_size=int(local_world or world))
            if launcher == "slurm":
                nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                found["master_addr"] = slurm_first_host(nodelist) if nodelist else None
                # Every task derives the same port from the job id, so none has to be agreed on.
                found["master_port"] = str(20000 + int(env.get("SLURM_JOB_ID", 0)) % 20000)
            return found
    return None


def cuda_device_index(local_rank, local_world_size, device_count, launcher):
    """Which of the visible GPUs this process takes. torchrun (and srun or mpirun without GPU
    binding) shows every process all of its node's GPUs: take the local rank's. srun with
    --gpus-per-task or --gpu-bind (likewise mpirun's binding) shows each task only its own, fewer
    than the tasks on the node: take the first one it sees."""
    if launcher in ("slurm", "mpirun") and 0 < device_count < local_world_size:
        return 0
    if local_rank < device_count:
        return local_rank
    fail(
        f"local rank {local_rank} has no GPU: this node shows it {device_count}; "
        "start at most that many processes per node"
    )


def init_distributed_mode(rank=None, world_size=None, backend=None, device="auto", timeout_s=300):
    """Start the process group if this process is one of several; return a DistInfo.

    rank/world_size are given by mp.spawn (which sets no environment); every other launcher
    is read from the environment. A plain `python script.py` is a single process: no group.
    """
    if rank is not None:
        found = dict(
            launcher="mp.spawn", rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size
        )
    else:
        found = detect_launcher()
    found = found or dict(launcher=None, rank=0, world_size=1, local_rank=0, local_world_size=1)
    local_rank = found["local_rank"]

    # CPU threads: mp.spawn and mpirun give every process all the cores, so N processes run
    # N x cores threads and thrash. torchrun sets OMP_NUM_THREADS=1 itself; respect any value.
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, cores // found["local_world_size"]))

    if device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda was asked for, but this machine has no usable CUDA device")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        index = cuda_device_index(local_rank, found["local_world_size"], torch.cuda.device_count(), found["launcher"])
        dev = torch.device("cuda", index)
        # Before the process group: NCCL binds each process to the current device, and
        # without this every rank would create its context on GPU 0.
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")

    # Under torchrun a group forms even for one process, so that `--nproc_per_node=1` runs the
    # same DDP and NCCL code as more processes do; a plain `python script.py` has none.
    distributed = found["world_size"] > 1 or found["launcher"] == "torchrun"
    if distributed:
        backend = backend or ("nccl" if use_cuda else "gloo")
        if backend == "mpi" and not dist.is_mpi_available():
            fail("--backend mpi: this PyTorch build has no MPI support; use gloo or nccl")
        if backend == "nccl" and not use_cuda:
            fail("--backend nccl needs CUDA devices; use gloo on CPU")
        if backend != "mpi":  # the MPI backend takes its ranks from MPI itself
            master_addr = os.environ.get("MASTER_ADDR") or found.get("master_addr")
            master_port = os.environ.get("MASTER_PORT") or found.get("master_port")
            if not master_addr or not master_port:
                fail(
                    f"{found['launcher']} launch: set MASTER_ADDR (host of rank 0) and "
                    "MASTER_PORT (a free port), e.g. mpirun -x MASTER_ADDR=host -x MASTER_PORT=29500"
                )
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, master_port
        # Before the group, not later by the first optimizer or DDP: imported while a group is
        # up, torch._dynamo keeps it alive past destroy_process_group() in cleanup(), and its
        # threads run on into interpreter exit, where they can abort the process (PyTorch
        # issue 190489).
        importlib.import_module("torch._dynamo")
        # The timeout bounds rendezvous and every collective: a peer that never arrives or
        # dies ends the job with an error instead of a hang.
        try:
            store = process_group_store(found["rank"], found["world_size"], timeout_s) if backend != "mpi" else None
            dist.init_process_group(
                backend,
                store=store,
                rank=found["rank"],
                world_size=found["world_size"],
                timeout=datetime.timedelta(seconds=timeout_s),
                device_id=dev if use_cuda else None,
            )
        except RuntimeError as e:  # DistStoreError, DistNetworkError and gloo's errors alike
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            me = f"rank {found['rank']} of {found['world_size']}"
            if isinstance(e, dist.DistNetworkError):  # nothing listens where rank 0 should be
                fail(f"{me}: rank 0 did not answer at {where} within --dist-timeout {timeout_s:g} s ({first_line(e)})")
            if isinstance(e, dist.DistStoreError):  # rank 0's store waited for the others in vain
                fail(
                    f"{me}: a peer did not join at {where} within --dist-timeout {timeout_s:g} s ({first_line(e)}); "
                    "start every process with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE"
                )
            fail(f"could not start the process group at {where}: {first_line(e)}")
    return DistInfo(distributed, found["rank"], local_rank, found["world_size"], found["local_world_size"], dev)


def process_group_store(rank, world_size, timeout_s):
    """The store to start the process group on, or None to let env:// make one.

    Under torchrun (static rendezvous, and c10d unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) the
    workers are told TORCHELASTIC_USE_AGENT_STORE=True: the store at MASTER_ADDR:MASTER_PORT belongs
    to node 0's agent and outlives the workers, so after a restart it still holds the keys of the
    failed attempt, and env:// starts the new group on them: gloo dials the dead workers' addresses
    ("connectFullMesh ... Connection refused") or waits forever (PyTorch issues 135712, 167288).
    The cure is a key prefix that is new for every attempt and the same on every rank of it.
    Pitfall: TORCHELASTIC_RESTART_COUNT is not that key: each agent counts only its own workers'
    failures, so on several nodes it differs between ranks of one attempt. Here rank 0 draws a new
    number from a counter in the store and gives it to each other rank in answer to a one-time
    token that rank posted; whatever a dead worker left behind can never pass for this attempt's.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # no store outlives the workers (plain env://, mp.spawn, SLURM, the opt-out)
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=timeout_s)
    hint = (
        f"within --dist-timeout {timeout_s:g} s; if a restart keeps failing here, launch with "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and --standalone or --rdzv-backend=c10d"
    )
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)  # raises if nobody is there
    if rank == 0:
        attempt = store.add("restart/attempts", 1)
        answered = {}  # rank -> the token last answered: answer a rank again only once it posts anew
        deadline = time.monotonic() + timeout_s
        while store.add(f"restart/{attempt}/ready", 0) < world_size - 1:
            for r in range(1, world_size):
                if store.check([f"restart/ask/{r}"]):
                    token = store.get(f"restart/ask/{r}").decode()
                    if answered.get(r) != token:  # maybe a dead worker's: answering it does no harm
                        store.set(f"restart/answer/{token}", str(attempt))
                        answered[r] = token
            if time.monotonic() > deadline:
                fail(f"rank 0: not every rank of this torchrun attempt checked in at {host}:{port} {hint}")
            time.sleep(0.01)
    else:
        token = uuid.uuid4().hex  # new in every process: no earlier attempt can have answered it
        store.set(f"restart/ask/{rank}", token)
        try:
            store.wait([f"restart/answer/{token}"])  # the store's timeout bounds the wait
        except RuntimeError:
            fail(f"rank {rank}: rank 0 of this torchrun attempt did not answer at {host}:{port} {hint}")
        attempt = int(store.get(f"restart/answer/{token}"))
        store.add(f"restart/{attempt}/ready", 1)
    return dist.PrefixStore(f"attempt_{attempt}/", store)


def first_line(error):
    """An exception's first line, without the C++ source locations ("[.../pair.cc:152]")
    that gloo and c10d put into their messages."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return re.sub(r"\[[^\]]*:\d+\]\s*", "", line)


# How gloo reports a peer that is gone (its socket closed) or silent past the timeout.
PEER_FAILURES = ("closed by peer", "reset by peer", "Broken pipe", "Timed out waiting", "timeout caused pair closure")


def peer_failed(error):
    """Whether a collective failed because another process died or stopped answering."""
    return any(s in str(error) for s in PEER_FAILURES)


def cleanup():
    """Matching teardown for init_distributed_mode; call it in a `finally`."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def get_rank():
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size():
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process():
    return get_rank() == 0


def print0(*args, **kwargs):
    """print() on global rank 0 only, so N processes don't print N copies."""
    if is_main_process():
        print(*args, **kwargs, flush=True)


def reduce_value(value, average=False):
    """Sum (or average) a tensor over all ranks and return a new tensor; the input is left
    as it was. Integer tensors (counts) sum exactly. All ranks must call it."""
    value = value.detach().clone()
    if get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        if average:
            value = value / get_world_size()
    return value


def together(fn, run=True):
    """Call fn() where `run` is true; if it stopped with an error on any rank, every rank stops
    with that error now. All ranks participate. Without this, a check made on one rank only
    (is the output directory writable?) ends the others later with "a peer died", which hides
    the cause, or, with NCCL across nodes, not before --dist-timeout."""
    result, error = None, None
    if run:
        try:
            result = fn()
        except SystemExit as e:
            error = str(e.code)
    errors = [error]
    if get_world_size() > 1:
        errors = [None] * get_world_size()
        dist.all_gather_object(errors, error)
    if any(errors):
        raise SystemExit(next(e for e in errors if e))
    return result


def broadcast_object(obj, src=0):
    """Rank `src`'s `obj` on every rank (pickled; all ranks participate)."""
    if get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def seed_everything(seed):
    random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too


# ----------------------------------------------------------------------------------------
# Data: decoded once into in-memory tensors (24x cheaper than PIL + ToTensor per sample)

DATASETS = ("fashion-mnist", "mnist", "cifar10", "imagefolder", "synthetic")


class InMemoryDataset(Dataset):
    """Images (N, C, H, W) float and labels (N,) held in memory. __getitems__ lets the
    DataLoader take a whole batch with one indexing operation instead of N __getitem__ calls
    and a stack; `collate` below passes that batch through."""

    def __init__(self, images, labels, classes):
        self.images, self.labels, self.classes = images, labels, list(classes)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]

    def __getitems__(self, indices):
        indices = torch.as_tensor(indices)
        return self.images[indices], self.labels[indices]


def collate(batch):
    """DataLoader collate_fn: batches from InMemoryDataset arrive whole; lists of samples
    (ImageFolder) are stacked as usual."""
    return batch if isinstance(batch, tuple) else default_collate(batch)


def _read_idx(path):
    """An IDX file (the MNIST format), gzipped or not, as a uint8 tensor."""
    with (gzip.open if str(path).endswith(".gz") else open)(path, "rb") as f:
        data = f.read()
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(data[3])]
    return torch.frombuffer(bytearray(data[4 + 4 * data[3] :]), dtype=torch.uint8).view(*dims)


def _debian_fashion_mnist_dir():
    """Where Debian's dataset-fashion-mnist package put its files, if it is installed."""
    try:
        out = subprocess.run(["dpkg", "-L", "dataset-fashion-mnist"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    hits = [line for line in out.splitlines() if line.endswith("train-images-idx3-ubyte.gz")]
    return Path(hits[0]).parent if hits else None


def _load_mnist_family(name, data_dir, download):
    from torchvision import datasets

    cls = datasets.FashionMNIST if name == "fashion-mnist" else datasets.MNIST
    raw = Path(data_dir) / cls.__name__ / "raw"
    try:  # torchvision's own layout: DIR/FashionMNIST/raw/*-ubyte (downloaded or gunzipped)
        return [
            (s.data, s.targets) for s in (cls(data_dir, train=t, download=download) for t in (True, False))
        ], cls.classes
    except RuntimeError as e:
        problem = f"could not download {name} into {raw} ({first_line(e).rstrip(':')})" if download else None
    # Offline, Debian's package is the next place to look (a failed download included).
    debian = _debian_fashion_mnist_dir() if name == "fashion-mnist" else None
    if debian is None:
        offline = (
            f"install Debian's dataset-fashion-mnist (used automatically) or gunzip its files into {raw}"
            if name == "fashion-mnist"
            else f"put the four IDX files into {raw}"
        )
        fail(
            f"{problem}; offline, {offline}" if problem else f"{name} not found in {raw}; pass --download, or {offline}"
        )
    read = [
        (_read_idx(debian / f"{p}-images-idx3-ubyte.gz"), _read_idx(debian / f"{p}-labels-idx1-ubyte.gz"))
        for p in ("train", "t10k")
    ]
    return read, cls.classes


def _load_cifar10(data_dir, download):
    from torchvision import datasets

    try:
        splits = [datasets.CIFAR10(data_dir, train=t, download=download) for t in (True, False)]
    except RuntimeError as e:
        fail(
            f"CIFAR-10 not found in {Path(data_dir) / 'cifar-10-batches-py'} ({first_line(e)}); "
            "pass --download, or extract cifar-10-python.tar.gz there"
        )
    # (N, H, W, C) uint8 numpy -> (N, C, H, W) tensor
    return [(torch.from_numpy(s.data).permute(0, 3, 1, 2), torch.tensor(s.targets)) for s in splits], splits[0].classes


def synthetic_data(num_train=2000, num_test=499, num_classes=10, size=28, seed=0):
    """A learnable data set made on the spot: each class is a fixed smooth pattern (random 7x7
    grids scaled up, which convolutions pick out easily) and its samples are that pattern plus
    noise. The test size (499) is divisible by neither 2 nor 3, so exact distributed
    evaluation is exercised."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(num_classes, 1, 7, 7, generator=g)
    prototypes = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    splits = []
    for n in (num_train, num_test):
        labels = torch.randint(num_classes, (n,), generator=g)
        images = prototypes[labels] + 0.7 * torch.randn(n, 1, size, size, generator=g)
        splits.append(((images.clamp(0, 1) * 255).to(torch.uint8), labels))
    return splits


def imagefolder_size(data_dir, default=224):
    """The crop size for a user's own images: their own size where it is below `default`
    (28x28 images scaled up to 224 cost 64x the compute and train worse), else `default`."""
    from PIL import Image

    first = next((p for p in sorted((Path(data_dir) / "train").glob("*/*")) if p.is_file()), None)
    if first is None:
        return default
    try:
        with Image.open(first) as image:
            return min(default, *image.size)
    except OSError:
        return default  # not an image: ImageFolder says so below


def _load_imagefolder(data_dir, image_size):
    from torchvision import datasets, transforms

    norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))  # ImageNet's
    train_tf = [transforms.RandomResizedCrop(image_size), transforms.RandomHorizontalFlip()]
    val_tf = [transforms.Resize(int(image_size * 8 / 7)), transforms.CenterCrop(image_size)]
    out = []
    for split, tf in (("train", train_tf), ("val", val_tf)):
        path = Path(data_dir) / split
        if not path.is_dir():
            fail(f"imagefolder: {path} is missing; expected DIR/train/<class>/* and DIR/val/<class>/*")
        try:
            out.append(datasets.ImageFolder(path, transform=transforms.Compose([*tf, transforms.ToTensor(), norm])))
        except (FileNotFoundError, OSError) as e:
            fail(f"imagefolder: {path}: {str(e).splitlines()[0]}")
    if out[0].classes != out[1].classes:
        fail(f"imagefolder: {data_dir}/train and {data_dir}/val have different class folders")
    return out


def _load(name, data_dir, download, image_size):
    if name == "imagefolder":
        train, test = _load_imagefolder(data_dir, image_size)
        return train, test, len(train.classes), 3
    if name == "synthetic":
        splits, classes = synthetic_data(), [f"class{i}" for i in range(10)]
    elif name == "cifar10":
        splits, classes = _load_cifar10(data_dir, download)
    else:
        splits, classes = _load_mnist_family(name, data_dir, download)
    # uint8 (N, H, W) or (N, C, H, W) -> float (N, C, H, W) in [0, 1]
    images = [(x.unsqueeze(1) if x.dim() == 3 else x).float().div_(255) for x, _ in splits]
    # Normalise with the training split's per-channel statistics (no test-set leakage).
    mean, std = images[0].mean(dim=(0, 2, 3), keepdim=True), images[0].std(dim=(0, 2, 3), keepdim=True)
    train, test = (
        InMemoryDataset((x - mean) / std, y.long(), classes) for x, (_, y) in zip(images, splits, strict=True)
    )
    return train, test, len(classes), train.images.shape[1]


def load_datasets(name, data_dir, download=False, image_size=224, local_rank=0):
    """Return (train_set, test_set, num_classes, in_channels). The MNIST family and CIFAR-10 are
    decoded once into normalised float tensors; ImageFolder (a user's own images, too many to
    hold in memory) is read from disk per sample. All ranks participate when downloading."""
    if name not in DATASETS:
        fail(f"unknown data set {name!r}; choose from {', '.join(DATASETS)}")
    result = None
    if download and get_world_size() > 1 and name in ("fashion-mnist", "mnist", "cifar10"):
        # torchvision downloads into the final file names, so ranks downloading at once truncate
        # each other's files. Global rank 0 downloads first, then the first process of each
        # other node (nothing to do where the directory is shared); the rest only read.
        for turn in (get_rank() == 0, local_rank == 0 and get_rank() != 0):
            result = together(lambda: _load(name, data_dir, True, image_size), run=turn) or result
        download = False
    return result or _load(name, data_dir, download, image_size)


# ----------------------------------------------------------------------------------------
# Models


class SmallCNN(nn.Module):
    """Three conv-BN-ReLU-maxpool blocks and a linear head: 91% on Fashion-MNIST in a few
    epochs of two CPU cores. Widths are small on purpose: CPU time goes with width squared."""

    def __init__(self, in_channels=1, num_classes=10, widths=(16, 32, 64)):
        super().__init__()
        layers, c = [], in_channels
        for w in widths:  # no conv bias: BatchNorm has its own
            layers += [nn.Conv2d(c, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(inplace=True)]
            layers.append(nn.MaxPool2d(2))
            c = w
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(3), nn.Flatten(), nn.Linear(c * 9, num_classes))

    def forward(self, x):
        return self.head(self.features(x))


def resnet18_small(in_channels, num_classes):
    """torchvision's ResNet-18 adapted to small images: a 3x3 stride-1 stem and no max-pool,
    so a 28x28 or 32x32 input is not shrunk to 7x7 before the first block."""
    from torchvision.models import resnet18

    model = resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


class MLP(nn.Sequential):
    """Two linear layers, no BatchNorm or dropout: with it, DDP's result equals one process on
    the whole batch up to float rounding (BatchNorm normalises over each rank's batch)."""

    def __init__(self, in_channels=1, num_classes=10, hidden=256, size=28):
        super().__init__(
            nn.Flatten(),
            nn.Linear(in_channels * size * size, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes),
        )


MODELS = {"cnn": SmallCNN, "resnet18": resnet18_small, "mlp": MLP}


def build_model(name, in_channels, num_classes, image_size=28):
    if name == "mlp":  # the one model whose first layer depends on the image size
        return MLP(in_channels, num_classes, size=image_size)
    return MODELS[name](in_channels, num_classes)


# ----------------------------------------------------------------------------------------
# Evaluation


def eval_shard(dataset, rank, world_size):
    """This rank's share of the test set: every sample exactly once over all ranks.
    DistributedSampler would pad the set with duplicates so that each rank gets the same
    count; counted in accuracy, those make the figure depend on the world size."""
    return torch.utils.data.Subset(dataset, range(rank, len(dataset), world_size))


@torch.no_grad()
def evaluate(model, loader, device, autocast=None):
    """Loss and accuracy over the whole test set, exact for any world size. `model` must be
    the unwrapped module: DDP's forward broadcasts buffers, a collective that would hang when
    ranks have different numbers of eval batches. All ranks participate."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with autocast or torch.autocast(device.type, enabled=False):
            logits = model(images)
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += labels.numel()
    loss_sum, correct, count = reduce_value(totals).tolist()
    return loss_sum / count, correct / count


# ----------------------------------------------------------------------------------------
# Checkpoints and metrics


def rng_state():
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    # RNG states are CPU ByteTensors whatever the training device: set_rng_state refuses others.
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


def fast_forward(scheduler, steps):
    """Step a new scheduler `steps` times, to where a resumed run stopped: its rate is a
    function of the step. PyTorch warns when a scheduler steps before its optimizer ever has
    (the usual sign of calling the two in the wrong order); here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before", UserWarning)
        for _ in range(steps):
            scheduler.step()


def load_optimizer_state(optimizer, state):
    """Load a checkpoint's optimizer state (the momentum buffers) but keep this run's settings:
    its flags (--lr, --momentum, --weight-decay) may differ from the saved run's, and its peak
    rate is scaled for its own global batch. The saved param groups would bring back the old
    ones, and an old scheduler's peak with them: make the scheduler after this call."""
    own = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, settings in zip(optimizer.param_groups, own, strict=True):
        params = group["params"]
        group.clear()
        group.update(settings, params=params)


def atomic_write(path, write):
    """Call write(tmp_path), then rename over `path`: a crash mid-write leaves the previous
    file intact, never a truncated one (rename is atomic on POSIX file systems)."""
    path = Path(path)
    # A writer killed mid-write (SIGKILL skips the `finally` below) leaves its temp file
    # behind; it is never read, and the next write clears it away.
    for stale in path.parent.glob(glob.escape(f".{path.name}.tmp") + "*"):
        stale.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_checkpoint(state, path):
    """Write a checkpoint atomically; call on global rank 0 only."""
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def read_torch_file(path, what="checkpoint"):
    """torch.load a file safely onto the CPU, or stop with a one-line error naming it (`what`
    says which flag or kind of file it is). weights_only=True unpickles tensors and plain
    containers only: a file from elsewhere cannot run code. map_location="cpu": tensors saved
    from a GPU land on the CPU (not all on the GPU they came from), and load_state_dict copies
    them to each rank's device; RNG states must stay CPU tensors anyway."""
    path = Path(path)
    if not path.is_file():
        fail(f"{what} {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to read is reported the same way
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
        if any("Unsupported global" in ln for ln in lines):  # a class or function it would have to call
            fail(f"refused to load {what} {path}: it holds pickled objects other than tensors (unsafe)")
        reason = next((ln for ln in lines if "WeightsUnpickler error" in ln), lines[0])
        fail(f"cannot read {what} {path} (truncated or not a PyTorch file): {reason}")


def load_checkpoint(path):
    """A checkpoint of these scripts (a dict with a 'model' state dict), read safely."""
    ckpt = read_torch_file(path)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict):
        fail(f"{path} is not a checkpoint of these scripts (no 'model' state dict in it)")
    return ckpt


def load_model_state(model, state_dict, path):
    """load_state_dict with an error that says which checkpoint does not fit."""
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        detail = lines[1] if len(lines) > 1 else lines[0]
        fail(f"checkpoint {path} does not fit this model (another --model or class count?): {detail}")


def check_output_dir(path, need_bytes=0):
    """Create the output directory and prove it is writable, with room for a checkpoint of
    about `need_bytes`: a full disk is found now, not after an hour of training."""
    path = Path(path)
    existing = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if free < need_bytes:
        fail(f"output directory {path} has {free >> 20} MiB free; a checkpoint needs about {need_bytes >> 20} MiB")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test{os.getpid()}"
        probe.write_bytes(b"0" * 1024)
        probe.unlink()
    except OSError as e:
        fail(f"output directory {path} is not writable: {e.strerror or e}")
    return path


def append_metrics(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def trim_metrics(path, start_epoch):
    """On resume, drop lines of epochs that will run again, so every epoch appears once."""
    path = Path(path)
    if path.exists():
        keep = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["epoch"] < start_epoch]
        atomic_write(path, lambda tmp: tmp.write_text("".join(ln + "\n" for ln in keep)))
