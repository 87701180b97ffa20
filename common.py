"""The distributed helpers every script shares: the process group for every launcher
(torchrun, SLURM, mpirun, mp.spawn, or one plain process), the rank helpers, and the one-line
errors. It imports no other module of this project: copy it along with any script."""

import argparse
import datetime
import gc
import importlib
import os
import re
import time
import uuid
from collections import namedtuple

import torch
import torch.distributed as dist


# One-line errors ----------------------------------------------------------------------------
def fail(message):
    """Stop with a one-line error and exit status 1 (SystemExit prints it to stderr)."""
    raise SystemExit(f"error: {message}")


class DefaultsFormatter(argparse.HelpFormatter):
    """--help with each flag's default, where it has one its help does not already say."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors and defaults in --help; description: a docstring, of which
    the first sentence is shown (a first line can stop mid-sentence)."""

    def __init__(self, description=None, **kwargs):
        if description:
            paragraph = " ".join(description.strip().split("\n\n")[0].split())
            description = re.split(r"(?<=[.!?])\s", paragraph, maxsplit=1)[0]
        super().__init__(description=description, formatter_class=DefaultsFormatter, **kwargs)

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


def require_torch(version, what):
    """One line where this PyTorch is older than `version` (requirements.txt's floor, or a
    feature's): no traceback from deep inside a distributed API that is missing or different."""
    have = tuple(int(n) for n in re.findall(r"\d+", torch.__version__)[:2])
    if have < tuple(int(n) for n in version.split(".")):
        fail(f"{what} needs PyTorch {version} or newer (this is {torch.__version__})")


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
