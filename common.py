"""What the training scripts share: process-group start and teardown for every launcher,
rank helpers, in-memory data, the models, exact evaluation and safe checkpoints."""

import argparse
import datetime
import gc
import glob
import importlib
import itertools
import json
import math
import os
import random
import re
import shutil
import time
import uuid
import warnings
from collections import OrderedDict, namedtuple
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, default_collate


def fail(message):
    """Stop with a one-line error and exit status 1 (SystemExit prints it to stderr)."""
    raise SystemExit(f"error: {message}")


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line, like every other error of these scripts
        fail(f"{message} (see --help)")


def check_flags(args, at_least_1=(), not_negative=(), positive=()):
    """A one-line error for the first flag out of its range."""
    for names, bad, must in (
        (at_least_1, lambda v: v < 1, "must be at least 1"),
        (not_negative, lambda v: v < 0, "cannot be negative"),
        (positive, lambda v: not v > 0, "must be positive"),
    ):
        for name in names:
            if getattr(args, name) is not None and bad(getattr(args, name)):
                fail(f"--{name.replace('_', '-')} {must}, got {getattr(args, name)}")


def sharded_parser(doc):
    """The flags of the sharded scripts (fsdp_train.py, tensor_parallel.py, context_parallel.py,
    expert_parallel.py), said once so that each means the same in all four; each adds its own."""
    p = ArgumentParser(description=doc.splitlines()[0])
    add = p.add_argument
    add("--data", default="fashion-mnist", choices=DATASETS, help="data set")
    add("--data-dir", default="data", help="root holding the data set (torchvision's layout)")
    add("--download", action="store_true", help="download the data set if it is missing")
    add("--epochs", type=int, default=5, help="passes over the training set")
    add("--lr", type=float, default=3e-3, help="peak AdamW rate per 256 samples of global batch")
    add("--weight-decay", type=float, default=0.05, help="AdamW's decoupled weight decay")
    add("--warmup", type=float, default=0.1, help="fraction of all steps spent warming up")
    add("--seed", type=int, default=0, help="seed for the weights and the shuffling")
    add("--amp", default="none", choices=["none", "bf16"], help="bf16: compute in bf16")
    add("--clip-grad", type=float, default=0.0, help="max gradient norm; 0: no clipping")
    add("--resume", help="checkpoint directory (default: OUTPUT_DIR/checkpoint if any)")
    add("--eval-only", action="store_true", help="only evaluate the model given by --resume")
    add("--max-steps", type=int, default=0, help="stop after this many steps; 0: no limit")
    add("--output-dir", help="where checkpoints, model.pt and metrics.jsonl go; none: nothing")
    add("--export", help="also write the whole trained model to this file")
    add("--log-every", type=int, default=50, help="steps between progress and NaN checks")
    add("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if any")
    add("--backend", choices=["gloo", "nccl"], help="default: nccl on CUDA, else gloo")
    add("--dist-timeout", type=float, default=300, help="seconds before a lost peer ends the job")
    return p


def check_sharded_args(args, at_least_1=(), not_negative=(), positive=()):
    """check_flags for a sharded script's flags, the shared ones' bounds added."""
    at_least_1 = ("epochs", "batch_size", "log_every", *at_least_1)
    not_negative = ("max_steps", "clip_grad", *not_negative)
    check_flags(args, at_least_1, not_negative, ("lr", "dist_timeout", *positive))
    if not 0 <= args.warmup < 1:
        fail(f"--warmup is a fraction of the run, in [0, 1); got {args.warmup}")
    if args.eval_only and not args.resume:
        fail("--eval-only needs --resume DIR (the checkpoint to evaluate)")
    if hasattr(args, "heads") and args.dim % args.heads:
        fail(f"--dim {args.dim} is not a whole number of --heads {args.heads}")
    return args


# Process group ----------------------------------------------------------------------------
# What init_distributed_mode found out about this process.
DistInfo = namedtuple("DistInfo", "distributed rank local_rank world_size local_world_size device")


def slurm_first_host(nodelist):
    """'gpu[003-005,9],login1' -> 'gpu003', 'rack[1-2]-node[01-04]' -> 'rack1-node01'."""
    first = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist).group()  # up to a top-level comma
    return re.sub(r"\[([^\],-]+)[^\]]*\]", r"\1", first)  # each bracket -> its first value


# Where each launcher puts (rank, world size, local rank, local world size or node index).
LAUNCHER_VARS = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),  # or any env:// launch
    "slurm": ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_NODEID"),
    "mpirun": tuple("OMPI_COMM_WORLD_" + n for n in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE")),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # and Intel MPI
}


def detect_launcher(environ=None):
    """This process's ranks and world sizes as its launcher set them, or None for one process."""
    env = dict(os.environ if environ is None else environ)
    # SLURM_PROCID exists in the batch shell too, where only one process runs; a step started
    # by srun has SLURM_STEP_ID, so a plain `python train.py` in sbatch stays single.
    if "SLURM_STEP_ID" not in env:
        env.pop("SLURM_PROCID", None)
    env.setdefault("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1"))
    for launcher, names in LAUNCHER_VARS.items():
        if names[0] not in env or names[1] not in env:
            continue
        rank, world, local_rank, local_world = (env.get(n) for n in names)
        found = dict(launcher="mpirun" if launcher == "mpich" else launcher, rank=int(rank))
        found.update(world_size=int(world), local_rank=int(local_rank or 0))
        if launcher == "slurm":
            # Tasks per node as "2(x3),1": take this node's count, by its index.
            names = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
            pairs = re.findall(r"(\d+)(?:\(x(\d+)\))?", next(filter(None, map(env.get, names)), ""))
            counts = [int(n) for n, times in pairs for _ in range(int(times or 1))]
            local_world = counts[min(int(local_world or 0), len(counts) - 1)] if counts else None
            nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
            found["master_addr"] = slurm_first_host(nodes) if nodes else None
            # Every task derives the same port from the job id: none has to be agreed on.
            found["master_port"] = str(20000 + int(env.get("SLURM_JOB_ID", 0)) % 20000)
        found["local_world_size"] = int(local_world or world)
        return found
    return None


def cuda_device_index(local_rank, local_world_size, device_count, launcher):
    """The visible GPU this process takes: its local rank's where it sees all of the node's;
    the first where srun or mpirun bound each task to its own (fewer GPUs than tasks)."""
    if launcher in ("slurm", "mpirun") and 0 < device_count < local_world_size:
        return 0
    if local_rank >= device_count:
        most = f"torchrun --nproc_per_node={max(device_count, 1)}"
        fail(f"local rank {local_rank} has no GPU: this node shows {device_count} ({most})")
    return local_rank


def init_distributed_mode(rank=None, world_size=None, backend=None, device="auto", timeout_s=300):
    """Start the process group if this process is one of several; return a DistInfo. mp.spawn
    passes rank and world_size; the other launchers are read from the environment."""
    found = detect_launcher() or dict(launcher=None, rank=0, world_size=1, local_rank=0)
    if rank is not None:
        found = dict(launcher="mp.spawn", rank=rank, world_size=world_size, local_rank=rank)
    launcher, local_rank = found["launcher"], found["local_rank"]
    local_world = found.get("local_world_size", found["world_size"])
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets 1; a value set is respected
        # Processes from mp.spawn or mpirun share their parent's CPUs: N of them with all of
        # them each would thrash, so divide. A SLURM task owns its --cpus-per-task already.
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        share = os.environ.get("SLURM_CPUS_PER_TASK") if launcher == "slurm" else None
        torch.set_num_threads(max(1, min(cpus, int(share or cpus // local_world))))
    if device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda was asked for, but this machine has no usable CUDA device")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    dev = torch.device("cpu")
    if use_cuda:
        index = cuda_device_index(local_rank, local_world, torch.cuda.device_count(), launcher)
        dev = torch.device("cuda", index)
        torch.cuda.set_device(dev)  # before the group, or every rank makes a context on GPU 0

    # Under torchrun a group forms even for one process, so that --nproc_per_node=1 runs the
    # same DDP and NCCL code as more processes do; a plain `python script.py` has none.
    if found["world_size"] == 1 and found["launcher"] != "torchrun":
        return DistInfo(False, 0, 0, 1, 1, dev)
    backend = backend or ("nccl" if use_cuda else "gloo")
    if backend == "mpi" and not dist.is_mpi_available():
        fail("--backend mpi: this PyTorch build has no MPI support; use gloo or nccl")
    if backend == "nccl" and not use_cuda:
        fail("--backend nccl needs CUDA devices; use gloo on CPU")
    for name in ("MASTER_ADDR", "MASTER_PORT") if backend != "mpi" else ():  # MPI has its own
        os.environ[name] = os.environ.get(name) or found.get(name.lower()) or ""
        if not os.environ[name]:
            fail(f"{launcher} launch: set MASTER_ADDR and MASTER_PORT (where rank 0 listens)")
    # Imported while a group is up (by the first optimizer or DDP), torch._dynamo keeps the
    # group alive past destroy_process_group(), its threads running into interpreter exit,
    # where they can abort the process (PyTorch issue 190489): import it first.
    importlib.import_module("torch._dynamo")
    me, at = f"rank {found['rank']} of {found['world_size']}", os.environ.get("MASTER_ADDR")
    at = f"at {at}:{os.environ.get('MASTER_PORT')} within --dist-timeout {timeout_s:g} s"
    try:
        store = process_group_store(found["rank"], timeout_s) if backend != "mpi" else None
        # The timeout bounds rendezvous and every collective: a peer that never arrives or
        # dies ends the job with an error instead of a hang.
        rank, world_size = found["rank"], found["world_size"]
        kwargs = dict(store=store, timeout=datetime.timedelta(seconds=timeout_s))
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, **kwargs, device_id=dev if use_cuda else None
        )
    except dist.DistNetworkError as e:  # nothing listens where rank 0 should be
        fail(f"{me}: rank 0 did not answer {at} ({first_line(e)})")
    except RuntimeError as e:  # DistStoreError: rank 0 waited for the others in vain
        same = "start every process with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE"
        fail(f"{me}: a peer did not join {at} ({first_line(e)}); {same}")
    return DistInfo(True, rank, local_rank, world_size, local_world, dev)


def process_group_store(rank, timeout_s):
    """The store for this attempt's group, or None to let env:// make one. Under torchrun the
    store is node 0's agent's: it outlives the workers, and a group formed on a failed
    attempt's keys dials dead workers or hangs (PyTorch issues 135712, 167288). So each attempt
    takes a key prefix of its own: rank 0 draws a number from a counter in the store and
    answers each rank's one-time token with it (each node's agent counts its own restarts)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # no store outlives the workers (env://, mp.spawn, SLURM, the opt-out)
    host, port, world = (os.environ[v] for v in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"))
    why = f"at {host}:{port} within --dist-timeout {timeout_s:g} s; if restarts keep failing "
    why += "here, launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    if rank == 0:
        attempt = store.add("restart/attempts", 1)
        answered, deadline = {}, time.monotonic() + timeout_s  # rank -> the token answered
        while store.add(f"restart/{attempt}/ready", 0) < int(world) - 1:
            for r in range(1, int(world)):
                token = store.get(f"restart/ask/{r}") if store.check([f"restart/ask/{r}"]) else None
                if token and answered.get(r) != token:  # maybe a dead worker's: harmless
                    store.set(f"restart/answer/{token.decode()}", str(attempt))
                    answered[r] = token
            if time.monotonic() > deadline:
                fail(f"rank 0: not every rank of this torchrun attempt checked in {why}")
            time.sleep(0.01)
    else:
        token = uuid.uuid4().hex  # new in every process: no earlier attempt answered it
        store.set(f"restart/ask/{rank}", token)
        try:
            store.wait([f"restart/answer/{token}"])  # the store's timeout bounds the wait
        except RuntimeError:
            fail(f"rank {rank}: rank 0 of this torchrun attempt did not answer {why}")
        attempt = int(store.get(f"restart/answer/{token}"))
        store.add(f"restart/{attempt}/ready", 1)
    return dist.PrefixStore(f"attempt_{attempt}/", store)


def first_line(error):  # without the C++ source locations that gloo adds

    text = str(error).strip() or type(error).__name__
    return re.sub(r"\[[^\]]*:\d+\]\s*", "", text.splitlines()[0])


def peer_failure(error, info):
    """What to raise for an error in training: one line if a peer died or hung, else itself."""
    lost = ("closed by peer", "reset by peer", "Broken pipe", "Timed out", "caused pair closure")
    if not info.distributed or not any(s in str(error) for s in lost):
        return error
    why = f"another process died or stopped responding ({first_line(error).split('. ')[0]})"
    again = "rerun with the same --output-dir to resume from its last checkpoint"
    return SystemExit(f"error: rank {info.rank}: {why}; the first error is the cause; {again}")


def cleanup():  # the teardown matching init_distributed_mode; call it in a `finally`
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        # DTensor's caches keep every DeviceMesh alive, and a mesh its process groups, whose
        # threads would run into the interpreter's exit and can abort it (PyTorch issue 190489).
        from torch.distributed.device_mesh import DeviceMesh

        for mesh in [obj for obj in gc.get_objects() if type(obj) is DeviceMesh]:
            getattr(mesh, "_pg_registry", {}).clear()


def get_world_size():
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process():
    return get_world_size() == 1 or dist.get_rank() == 0


def print0(*args, **kwargs):  # on global rank 0 only: N processes, one copy
    if is_main_process():
        print(*args, **kwargs, flush=True)


def reduce_value(value, average=False):
    """Sum (or average) a tensor over all ranks into a new tensor. All ranks participate."""
    value = value.detach().clone()
    if get_world_size() > 1:
        dist.all_reduce(value)
    return value / get_world_size() if average else value


def together(fn, run=True):
    """fn() where `run` is true; if it failed anywhere, every rank stops with its error now (all
    ranks participate), not later with "a peer died", which hides the cause."""
    result, errors = None, [None] * get_world_size()
    try:
        result = fn() if run else None
    except SystemExit as e:
        errors[0] = str(e.code)
    if get_world_size() > 1:
        dist.all_gather_object(errors, errors[0] if run else None)
    if any(errors):
        raise SystemExit(next(e for e in errors if e))
    return result


def once_per_node(fn, local_rank):
    """fn() on global rank 0, then on the first process of every other node, in turn (the
    others wait; all ranks participate): processes downloading one file at once truncate it."""
    first = together(fn, run=is_main_process())
    return together(fn, run=local_rank == 0 and not is_main_process()) or first


def broadcast_object(obj, src=0):  # rank src's obj on every rank; all ranks participate
    box = [obj]
    if get_world_size() > 1:
        dist.broadcast_object_list(box, src=src)
    return box[0]


def seed_everything(seed):
    random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too


# Data: decoded once into in-memory tensors, not PIL + ToTensor per sample each epoch ----------

DATASETS = ("fashion-mnist", "mnist", "cifar10", "imagefolder", "synthetic")


class InMemoryDataset(Dataset):
    """Images (N, C, H, W) and labels (N,) in memory; a batch is one indexing operation."""

    def __init__(self, images, labels, classes):
        self.images, self.labels, self.classes = images, labels, list(classes)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]

    def __getitems__(self, indices):  # the DataLoader's batch at once, not N items stacked
        return self.images[indices], self.labels[indices]


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


def load_datasets(name, data_dir, download=False, image_size=None, local_rank=0):
    """(train_set, test_set, num_classes, in_channels); all ranks participate. ImageFolder, maybe
    too large for memory, is read per sample; the others are decoded once into memory."""
    if name not in DATASETS:
        fail(f"unknown data set {name!r}; choose from {', '.join(DATASETS)}")
    if download and get_world_size() > 1 and name not in ("imagefolder", "synthetic"):
        # torchvision downloads into the final file names.
        loaded = once_per_node(lambda: _load(name, data_dir, True, image_size), local_rank)
        return loaded or _load(name, data_dir, False, image_size)
    return _load(name, data_dir, download, image_size)


# Models -----------------------------------------------------------------------------------
class SmallCNN(nn.Sequential):
    """Three conv-BN-ReLU-maxpool blocks and a linear head; narrow, for CPUs."""

    def __init__(self, in_channels=1, num_classes=10, widths=(16, 32, 64)):
        layers = []
        for c, w in zip((in_channels, *widths), widths, strict=False):  # no bias: BatchNorm's
            layers += [nn.Conv2d(c, w, 3, padding=1, bias=False), nn.BatchNorm2d(w)]
            layers += [nn.ReLU(inplace=True), nn.MaxPool2d(2)]
        head = [nn.AdaptiveAvgPool2d(3), nn.Flatten(), nn.Linear(widths[-1] * 9, num_classes)]
        super().__init__(OrderedDict(features=nn.Sequential(*layers), head=nn.Sequential(*head)))


def resnet18_small(in_channels, num_classes):
    """torchvision's ResNet-18 for small images: a 3x3 stride-1 stem and no max-pool, so a
    28x28 or 32x32 input is not shrunk to 7x7 before the first block."""
    from torchvision.models import resnet18

    model = resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


class MLP(nn.Sequential):
    """Two linear layers, no BatchNorm or dropout: with it, DDP's result equals one process on
    the whole batch up to float rounding (BatchNorm normalises over each rank's batch)."""

    def __init__(self, in_channels=1, num_classes=10, hidden=256, size=28):
        first = nn.Linear(in_channels * size * size, hidden)
        super().__init__(nn.Flatten(), first, nn.ReLU(inplace=True), nn.Linear(hidden, num_classes))


class Attention(nn.Module):
    """Multi-head self-attention with q, k, v and the output projection as four Linears
    (tensor parallelism splits each of them, and with them the heads)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.head_dim = dim // heads
        # attend(q, k, v): F.scaled_dot_product_attention unless set (context_parallel.py sets
        # attention over every process's keys and values)
        self.attend = None
        self.q, self.v, self.proj = (nn.Linear(dim, dim) for _ in range(3))
        # No key bias: it adds one constant to a query's scores, which softmax ignores, so its
        # gradient is zero plus rounding noise (that Adam would scale up to full steps).
        self.k = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        def heads(y):  # (N, tokens, heads * head_dim) -> (N, heads, tokens, head_dim)
            # -1: the heads this process holds (all unless a tensor-parallel plan split them)
            return y.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)

        attend = self.attend or F.scaled_dot_product_attention
        out = attend(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)))
        return self.proj(out.transpose(1, 2).flatten(2))


class Block(nn.Module):
    """A pre-norm transformer block: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, dim, heads, mlp_ratio=4):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        hidden = mlp_ratio * dim
        self.mlp = nn.Sequential(
            OrderedDict(fc1=nn.Linear(dim, hidden), act=nn.GELU(), fc2=nn.Linear(hidden, dim))
        )

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """A small Vision Transformer (Dosovitskiy et al., 2021): each patch of the image a token,
    pre-norm blocks (the units that FSDP shards and tensor parallelism splits), the tokens'
    mean, a linear head."""

    def __init__(
        self, in_channels=1, num_classes=10, size=28, dim=96, depth=4, heads=4, patch=None
    ):
        super().__init__()
        # patch: (height, width) of a token's pixels; default 4 x 4 tokens
        ph, pw = patch or (max(1, size // 4),) * 2
        self.patch_embed = nn.Conv2d(in_channels, dim, (ph, pw), stride=(ph, pw))
        self.pos = nn.Parameter(0.02 * torch.randn(1, (size // ph) * (size // pw), dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos  # (N, tokens, dim)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


MODELS = {"cnn": SmallCNN, "resnet18": resnet18_small, "mlp": MLP, "vit": ViT}


def build_model(name, in_channels, num_classes, image_size=28):
    if name in ("mlp", "vit"):  # the models whose shape depends on the image size
        return MODELS[name](in_channels, num_classes, size=image_size)
    return MODELS[name](in_channels, num_classes)


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


# Evaluation -------------------------------------------------------------------------------
def eval_shard(dataset, rank, world_size):
    """This rank's share of the test set, each sample once over all ranks (DistributedSampler
    pads with duplicates, which would make the accuracy depend on the world size)."""
    return torch.utils.data.Subset(dataset, range(rank, len(dataset), world_size))


def pad_batches(loader, image_shape, device):
    """loader's batches, then empty ones up to as many as any rank has: a sharded model's
    forward runs collectives, so every rank must run it as often (all ranks participate)."""
    batches = torch.tensor(len(loader), device=device)
    if get_world_size() > 1:
        dist.all_reduce(batches, dist.ReduceOp.MAX)
    empty = (torch.zeros(0, *image_shape), torch.zeros(0, dtype=torch.long))
    return itertools.chain(loader, [empty] * (int(batches) - len(loader)))


@torch.no_grad()
def evaluate(model, loader, device, autocast=None):
    """Loss and accuracy over the whole test set, exact at any world size; all ranks
    participate. Pass the unwrapped model: DDP's forward broadcasts buffers, a collective
    that would hang where ranks have different numbers of test batches."""
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


# Checkpoints and metrics ------------------------------------------------------------------
def rng_state(device):
    """The RNG states to resume with; CUDA's only on CUDA (else: a context on GPU 0 per rank)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"].cpu())  # RNG states must be CPU tensors
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def warmup_cosine(optimizer, warmup_fraction, total_steps):
    """A LambdaLR: linear warm-up to the peak over warmup_fraction of the steps, then cosine
    decay to zero (ddp_train.py --schedule cosine, model_parallel.py, fsdp_train.py,
    tensor_parallel.py). Warm-up 0: the first step at the peak."""
    warmup = max(1, int(warmup_fraction * total_steps))

    def factor(step):
        done = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return (step + 1) / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * done))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


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


def load_optimizer_state(optimizer, state):
    """A checkpoint's optimizer state (the momentum) with this run's settings (--lr,
    --momentum, --weight-decay): make the scheduler after it, for this run's peak rate."""
    own = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, settings in zip(optimizer.param_groups, own, strict=True):
        params = group["params"]  # and nothing saved: a scheduler would keep its initial_lr
        group.clear()
        group.update(settings, params=params)


def atomic_write(path, write):
    """write(tmp) then rename it to `path`: a crash mid-write leaves the previous file whole."""
    path = Path(path)
    for stale in path.parent.glob(glob.escape(f".{path.name}.tmp") + "*"):
        stale.unlink(missing_ok=True)  # left by a writer that was killed
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except OSError as e:  # a full disk, say
        fail(f"could not write {path} ({e.strerror or e}); the previous one is kept")
    finally:
        tmp.unlink(missing_ok=True)


def save_checkpoint(state, path):  # on global rank 0 only
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def read_torch_file(path, what="checkpoint"):
    """torch.load onto the CPU (tensors saved on GPUs do not all land on GPU 0), weights only
    (a file from elsewhere cannot run code), or a one-line error naming the file."""
    if not Path(path).is_file():
        fail(f"{what} {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to read is reported the same way
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
        if any("Unsupported global" in ln for ln in lines):  # it would have to call a class
            fail(f"refused to load {what} {path}: it holds pickled objects other than tensors")
        reason = next((ln for ln in lines if "WeightsUnpickler error" in ln), lines[0])
        fail(f"cannot read {what} {path} (truncated or not a PyTorch file): {reason}")


def load_checkpoint(path):
    ckpt = read_torch_file(path)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict):
        fail(f"{path} is not a checkpoint of these scripts (no 'model' state dict in it)")
    return ckpt


def load_model_state(model, state_dict, path):
    """load_state_dict with an error that says which checkpoint does not fit."""
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as e:
        detail = [ln.strip() for ln in str(e).splitlines() if ln.strip()][1:2] or [first_line(e)]
        fail(f"checkpoint {path} does not fit this model (another --model?): {detail[0]}")


def read_weights(path, what="weights file"):
    """A whole model's weights, read on this rank: a plain state_dict (model.pt of the sharded
    scripts, a pretrained network's) or the 'model' of a checkpoint of these scripts; and the
    flags that checkpoint recorded ({} for a plain state_dict)."""
    state, flags = read_torch_file(path, what), {}
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state, flags = state["model"], state.get("args", {})
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        why = "neither a checkpoint of these scripts nor a state_dict (names to tensors)"
        fail(f"{what} {path} is {why}")
    return state, flags


def check_weights(state, model, path):
    """Stop naming the first name or shape in `state` that does not fit `model` (which may be
    on the meta device: only its shapes are read)."""
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for key in sorted(want.keys() | state.keys()):
        if key not in state or key not in want:
            where = "the model has no" if key in state else "the file has no"
            fail(f"{path} does not fit this model: {where} {key!r}")
        if tuple(state[key].shape) != want[key]:
            got = f"{tuple(state[key].shape)} in the file, {want[key]} in the model"
            fail(f"{path} does not fit this model: {key!r} is {got}")


def build_sharded(build, shard, device, seed, init_from=None):
    """A model that no rank ever holds whole on its device (all ranks participate): build()
    on the meta device (shapes, no memory), shard(model) (fully_shard, parallelize_module: the
    layout of the pieces), then memory for this rank's pieces only, on `device`, filled by
    broadcast from rank 0. Rank 0 builds the model once whole in CPU memory, seeded as one
    process does (so every layout starts from the same weights), or reads init_from."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    with torch.device("meta"):
        model = build()

    def whole():  # rank 0
        if init_from:
            state, _ = read_weights(init_from, "--init-from")
            check_weights(state, model, init_from)
            return state
        seed_everything(seed)
        return build().state_dict()

    state = together(whole, run=is_main_process())  # a bad file stops every rank
    shard(model)
    model.to_empty(device=device)  # uninitialised memory, this rank's pieces only
    if dist.is_initialized():
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, state if is_main_process() else {}, options=options)
    else:
        model.load_state_dict(state)
    return model


# Sharded checkpoints (fsdp_train.py, tensor_parallel.py): a torch.distributed.checkpoint
# directory of every rank's pieces, plus meta.pt (step, RNG, flags) from rank 0.
def find_sharded(output_dir):
    """OUTPUT_DIR's checkpoint, or checkpoint.old (a save that died between its renames)."""
    found = [Path(output_dir or "", n) for n in ("checkpoint", "checkpoint.old")]
    return next((p for p in found if output_dir and (p / "meta.pt").is_file()), None)


def read_sharded_meta(path):
    if Path(path).is_file():
        why = "this script resumes from a directory of torch.distributed.checkpoint"
        fail(f"{path} is a single-file checkpoint (ddp_train.py's?); {why}")
    return read_torch_file(Path(path, "meta.pt"))  # "does not exist" for another directory


def load_sharded(state, path):
    """Fill `state` in: every rank reads the parts of the saved pieces that make up its own,
    whatever the layout that saved them (all ranks participate)."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(state, checkpoint_id=path)
    except dcp.CheckpointException as e:  # every rank gets every rank's failures
        cause = first_line(next(iter(e.failures.values()))[0])
        fail(f"cannot read checkpoint {path} (a missing or truncated shard?): {cause}")
    except Exception as e:  # noqa: BLE001 - a shape or key that does not fit, say
        fail(f"cannot read checkpoint {path}: {first_line(e)}")


def resume_sharded(args, model, optimizer, check, batches, device):
    """Load --resume or OUTPUT_DIR's checkpoint, if any (all ranks participate): rank 0 finds it
    and check(path) reads and checks its meta.pt; every rank reads the parts of the saved pieces
    that make up its own, whatever the layout that saved them. `batches`: this run's (global
    batch, steps per epoch). Returns (path, the step to go on after), or (None, 0)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = broadcast_object(args.resume or find_sharded(args.output_dir))
    if not path:
        return None, 0
    meta = broadcast_object(together(lambda: check(path), run=is_main_process()))
    own = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    model_sd, optim_sd = get_state_dict(model, optimizer)  # to be filled in
    together(lambda: load_sharded(dict(model=model_sd, optimizer=optim_sd), path))
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    if args.eval_only:
        return path, 0
    saved = meta["args"]
    changed = [k for k in ("epochs", "warmup") if saved[k] != getattr(args, k)]
    if changed:  # the schedule is a function of these: it cannot go on where it was
        was = ", ".join(f"--{k} {saved[k]}" for k in changed)
        fail(f"{path} was trained with {was}; resume with the same, or start anew")
    for group, settings in zip(optimizer.param_groups, own, strict=True):
        group.update(settings, initial_lr=settings["lr"])  # this run's settings, saved moments
    # The same global batch and seed make the same global batches at any layout (rank r takes
    # every world-th sample): go on after the last step saved.
    steps_per_epoch = batches[1]
    if (meta["global_batch"], meta["steps_per_epoch"], saved["seed"]) == (*batches, args.seed):
        step = meta["step"]
        set_rng_state(meta["rng"], device)
    else:  # other batches: a half-done epoch starts again, the schedule goes on
        step = meta["step"] // meta["steps_per_epoch"] * steps_per_epoch
    epoch, at = divmod(step, steps_per_epoch)
    print0(f"resumed from {path} at epoch {epoch}, step {at} of {steps_per_epoch}")
    return path, step


def export_whole(model, paths):
    """The whole model in one file per path that loads without FSDP or DTensor: the pieces
    gathered into rank 0's CPU memory (all ranks participate) and written there alone."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not (paths := list(paths)):
        return
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    whole = get_model_state_dict(model, options=options)

    def write():  # a bad path stops every rank
        for path in paths:
            atomic_write(path, lambda tmp: torch.save(whole, tmp))

    together(write, run=is_main_process())


def save_sharded(out, model, optimizer, meta, background=False, group=None):
    """Every rank writes its pieces of the model and optimizer into OUT/checkpoint.tmp, rank 0
    adds meta.pt and renames it to checkpoint: a crash mid-save leaves the previous one whole
    (all ranks participate).
    In the background: dcp.async_save copies the pieces to CPU memory and writes them in a
    thread while training goes on (`group`: a gloo group of the save's own); call the function
    it returns (all ranks) to wait for the writes and publish the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = dict(model=model_state, optimizer=optim_state)
    tmp, final, old = (Path(out, n) for n in ("checkpoint.tmp", "checkpoint", "checkpoint.old"))
    if is_main_process():  # a crashed save's, removed before any rank writes (the save's
        shutil.rmtree(tmp, ignore_errors=True)  # first step is collective)

    def publish():
        if is_main_process():  # the save returns once every rank's pieces are written
            atomic_write(tmp / "meta.pt", lambda path: torch.save(meta, path))
            if final.exists():  # then `old` is stale: a save killed while removing it
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)

    if not background:
        dcp.save(state, checkpoint_id=tmp)
        return publish()
    future = dcp.async_save(state, checkpoint_id=tmp, process_group=group)
    return lambda: (future.result(), publish())


def check_output_dir(path):
    """Create the output directory and prove it writable now, not after hours of training."""
    # A name no other process can hold: ranks on different nodes (or in containers) writing
    # one shared folder can have the same process id, and would delete each other's probe.
    probe = Path(path, f".write-test-{uuid.uuid4().hex}")
    try:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as e:
        fail(f"output directory {path} is not writable: {e.strerror or e}")
    return probe.parent


def append_metrics(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def trim_metrics(path, start_epoch):
    """On resume, drop the lines of epochs that will run again: every epoch appears once."""
    if Path(path).exists():
        lines = Path(path).read_text().splitlines()
        keep = "".join(ln + "\n" for ln in lines if json.loads(ln)["epoch"] < start_epoch)
        atomic_write(path, lambda tmp: tmp.write_text(keep))


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
