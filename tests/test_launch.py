"""How a process learns its place in the job: every launcher's environment, the
single-process fallback, the thread budget, and reduce_value."""

import json
import os

import pytest
import torch
import torch.distributed as dist
from conftest import clean_env, free_port, run_ranks

import checkpoint
import common

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_STEP_ID": "0",
    "SLURM_NTASKS": "16",
    "SLURM_STEP_NUM_TASKS": "6",  # the step's own count wins over the allocation's
    "SLURM_LOCALID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "2(x3)",
    "SLURM_JOB_NODELIST": "gpu[003-005,009],login1",
    "SLURM_JOB_ID": "123456",
}
OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}
MPICH = {"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"}


def test_plain_process_has_no_launcher():
    assert common.detect_launcher({"HOME": "/root", "OMP_NUM_THREADS": "1"}) is None


@pytest.mark.parametrize(
    "env, expected",
    [
        (
            TORCHRUN,
            dict(launcher="torchrun", rank=3, world_size=8, local_rank=1, local_world_size=2),
        ),
        (OPEN_MPI, dict(launcher="mpirun", rank=2, world_size=4, local_rank=0, local_world_size=2)),
        (MPICH, dict(launcher="mpirun", rank=1, world_size=3, local_rank=1, local_world_size=3)),
        (
            SLURM,
            dict(
                launcher="slurm",
                rank=5,
                world_size=6,
                local_rank=1,
                local_world_size=2,
                master_addr="gpu003",
                master_port=str(20000 + 123456 % 20000),
            ),
        ),
    ],
    ids=["torchrun", "openmpi", "mpich", "slurm"],
)
def test_detect_launcher(env, expected):
    assert common.detect_launcher(env) == expected


def test_slurm_allocation_counts_when_step_counts_are_missing():
    env = {
        k: v
        for k, v in SLURM.items()
        if k not in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE")
    }
    env["SLURM_NTASKS_PER_NODE"] = "4"
    found = common.detect_launcher(env)
    assert (found["world_size"], found["local_world_size"]) == (16, 4)


def test_slurm_batch_shell_is_a_single_process():
    # `python train.py` inside an sbatch script: SLURM_PROCID is set, but no srun step.
    env = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    assert common.detect_launcher(env) is None


def test_torchrun_inside_a_slurm_job_wins():
    # torchrun started by srun: its own variables describe the process, not SLURM's.
    assert common.detect_launcher({**SLURM, **TORCHRUN})["launcher"] == "torchrun"


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("node01", "node01"),
        ("gpu[003-005,009],login1", "gpu003"),
        ("gpu[7,2-3]", "gpu7"),
        ("login1,gpu[1-2]", "login1"),
        ("rack-1-n[10-11]", "rack-1-n10"),
        ("c[1]", "c1"),
        ("rack[1-2]-node[01-04]", "rack1-node01"),
        ("nid[001-004]-ib", "nid001-ib"),
        ("rack[3,5]-n[7-8],login1", "rack3-n7"),
    ],
)
def test_slurm_first_host(nodelist, first):
    assert common.slurm_first_host(nodelist) == first


@pytest.mark.parametrize(
    "local_rank, local_world, gpus, launcher, index",
    [
        (1, 2, 2, "torchrun", 1),  # every process sees the node's GPUs: the local rank's
        (3, 4, 4, "slurm", 3),  # srun without GPU binding: the same
        (3, 4, 1, "slurm", 0),  # srun --gpus-per-task=1: each task sees only its own
        (1, 2, 1, "mpirun", 0),  # mpirun binding one GPU per rank
        (3, 4, 2, "slurm", 0),  # --gpus-per-task=2: its first
    ],
)
def test_cuda_device_index(local_rank, local_world, gpus, launcher, index):
    assert common.cuda_device_index(local_rank, local_world, gpus, launcher) == index


def test_cuda_device_index_refuses_more_torchrun_processes_than_gpus():
    with pytest.raises(SystemExit, match="local rank 1 has no GPU"):
        common.cuda_device_index(1, 2, 1, "torchrun")


def test_single_process_fallback(no_launcher):
    info = common.init_distributed_mode()
    assert info == common.DistInfo(False, 0, 0, 1, 1, info.device)
    assert not dist.is_initialized()
    common.cleanup()  # nothing to tear down: must not raise


@pytest.fixture
def fake_init(no_launcher):
    """init_process_group replaced by a recorder: the set-up around it runs for real."""
    calls = []
    no_launcher.setattr(dist, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    no_launcher.setattr(torch.cuda, "is_available", lambda: False)
    return no_launcher, calls


@pytest.mark.parametrize(
    "env, rank, world, local_rank, local_world",
    [(TORCHRUN, 3, 8, 1, 2), (OPEN_MPI, 2, 4, 0, 2), (MPICH, 1, 3, 1, 3), (SLURM, 5, 6, 1, 2)],
    ids=["torchrun", "openmpi", "mpich", "slurm"],
)
def test_init_under_launcher(fake_init, env, rank, world, local_rank, local_world):
    monkeypatch, calls = fake_init
    for k, v in {**env, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29555"}.items():
        monkeypatch.setenv(k, v)
    info = common.init_distributed_mode(timeout_s=42)
    assert info == common.DistInfo(True, rank, local_rank, world, local_world, torch.device("cpu"))
    [(args, kwargs)] = calls
    assert args == ("gloo",)
    assert (kwargs["rank"], kwargs["world_size"], kwargs["timeout"].total_seconds()) == (
        rank,
        world,
        42,
    )
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.0.0.1", "29555")


def test_slurm_derives_master_address_and_port(fake_init):
    monkeypatch, calls = fake_init
    for k, v in SLURM.items():
        monkeypatch.setenv(k, v)
    common.init_distributed_mode()
    assert len(calls) == 1
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == (
        "gpu003",
        str(20000 + 123456 % 20000),
    )


def test_mp_spawn_rank_overrides_environment(fake_init):
    monkeypatch, calls = fake_init
    for k, v in {**OPEN_MPI, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}.items():
        monkeypatch.setenv(k, v)
    info = common.init_distributed_mode(rank=1, world_size=2)
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (1, 1, 2, 2)
    assert (calls[0][1]["rank"], calls[0][1]["world_size"]) == (1, 2)


def one_line_error(excinfo):
    message = excinfo.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, (
        message
    )
    return message


def test_mpirun_without_master_address_fails_clearly(fake_init):
    monkeypatch, calls = fake_init
    for k, v in OPEN_MPI.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as excinfo:
        common.init_distributed_mode()
    assert "MASTER_ADDR" in one_line_error(excinfo)
    assert calls == []


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(device="cuda"), "no usable CUDA"),
        (dict(rank=0, world_size=2, backend="nccl"), "nccl needs CUDA"),
        pytest.param(
            dict(rank=0, world_size=2, backend="mpi"),
            "no MPI support",
            marks=pytest.mark.skipif(dist.is_mpi_available(), reason="this PyTorch has MPI"),
        ),
    ],
    ids=["cuda-without-gpu", "nccl-on-cpu", "mpi-unavailable"],
)
def test_impossible_device_or_backend(fake_init, kwargs, words):
    monkeypatch, calls = fake_init
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29555")
    with pytest.raises(SystemExit) as excinfo:
        common.init_distributed_mode(**kwargs)
    assert words in one_line_error(excinfo)
    assert calls == []


@pytest.mark.parametrize("local_world, threads", [(None, 8), (2, 4), (3, 2), (16, 1)])
def test_thread_budget(fake_init, local_world, threads):
    # 8 cores shared by the processes of one node; a process never gets fewer than one.
    monkeypatch, _ = fake_init
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29555")
    torch.set_num_threads(5)
    if local_world is None:
        common.init_distributed_mode()
    else:
        common.init_distributed_mode(rank=0, world_size=local_world)
    assert torch.get_num_threads() == threads


def test_thread_budget_respects_omp_num_threads(fake_init):
    monkeypatch, _ = fake_init
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29555")
    torch.set_num_threads(3)
    common.init_distributed_mode(rank=0, world_size=2)
    assert torch.get_num_threads() == 3


def test_reduce_value_single_process_returns_a_copy():
    counts = torch.tensor([2**53 + 1, 7], dtype=torch.int64)
    out = common.reduce_value(counts)
    assert out.dtype == torch.int64 and out.tolist() == [2**53 + 1, 7]
    out += 1
    assert counts.tolist() == [2**53 + 1, 7]  # the input is left as it was


# Run in real processes under an MPICH-style environment: the launcher is detected, the
# group forms, integer counts sum exactly (2**53 + 1 does not survive a float64 round trip),
# and with OMP_NUM_THREADS unset each process takes its share of the cores.
PROBE = """
import json, os, torch, common
info = common.init_distributed_mode(device="cpu", timeout_s=60)
try:
    counts = torch.tensor([2**53 + 1, info.rank], dtype=torch.int64)
    total = common.reduce_value(counts)
    mean = common.reduce_value(torch.tensor(float(info.rank)), average=True)
    found = dict(info=list(info[:5]), total=total.tolist(), dtype=str(total.dtype))
    found.update(input=counts.tolist(), mean=mean.item(), threads=torch.get_num_threads())
    print(json.dumps(dict(found, main=common.is_main_process())))
finally:
    common.cleanup()
"""


def test_mpich_processes_reduce_integers():
    port = str(free_port())
    envs = [
        clean_env(
            omp_threads=None,
            PMI_RANK=str(r),
            PMI_SIZE="2",
            MPI_LOCALRANKID=str(r),
            MPI_LOCALNRANKS="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        for r in range(2)
    ]
    results = [
        json.loads(r.stdout.strip().splitlines()[-1])
        for r in run_ranks(["-c", PROBE], envs, timeout=120)
    ]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for rank, res in enumerate(results):
        assert res["info"] == [True, rank, rank, 2, 2]
        assert res["total"] == [2 * (2**53 + 1), 1] and res["dtype"] == "torch.int64"
        assert res["input"] == [2**53 + 1, rank]
        assert res["mean"] == 0.5
        assert res["threads"] == max(1, cores // 2)
        assert res["main"] == (rank == 0)


# torch.optim and DDP import torch._dynamo; made while a group is up, that import keeps the group
# alive (seen with PyTorch 2.15): its threads outlive destroy_process_group() into interpreter exit,
# where a live gloo group can abort the process ("terminate called without an active
# exception", PyTorch issue 190489; most likely what once ended a finished mp.spawn run in CI).
# init_distributed_mode() imports it before the group starts: nothing the group started may be
# left once cleanup() has run.
TEARDOWN = """
import gc, json, os, sys, torch, common
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

def threads():
    tasks = os.listdir("/proc/self/task")
    return {t: open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks}

before = threads()
info = common.init_distributed_mode(device="cpu", timeout_s=60)
if sys.argv[1] == "ddp":
    model = DDP(torch.nn.Linear(4, 2))
else:  # FSDP's DTensor caches keep the group's DeviceMesh after the model is gone
    model = torch.nn.Linear(4, 2)
    fully_shard(model)
model(torch.ones(3, 4)).sum().backward()
torch.optim.SGD(model.parameters(), lr=0.1).step()
during = len(threads()) - len(before)
del model
common.cleanup()
gc.collect()
# Autograd's device threads are the engine's, started by FSDP's hooks: not the group's.
left = sorted(n for t, n in threads().items() if t not in before and "autograd" not in n)
print(json.dumps(dict(during=during, left=left)))
"""


@pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="reads the threads from Linux's /proc"
)
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_cleanup_ends_the_process_groups_threads(wrapper):
    port = str(free_port())
    envs = [
        clean_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        for r in range(2)
    ]
    for r in run_ranks(["-c", TEARDOWN, wrapper], envs, timeout=120):
        res = json.loads(r.stdout.strip().splitlines()[-1])
        assert res["during"] > 0  # the group ran threads of its own: there was something to end
        assert res["left"] == [], res


@pytest.mark.parametrize(
    "per_node, node, local_world",
    [("3,1", 0, 3), ("3,1", 1, 1), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1), ("4(x2)", 1, 4)],
)
def test_slurm_local_world_size_is_this_nodes_count(per_node, node, local_world):
    # An uneven layout: the first count is the first node's, not every node's.
    env = {**SLURM, "SLURM_STEP_TASKS_PER_NODE": per_node, "SLURM_NODEID": str(node)}
    assert common.detect_launcher(env)["local_world_size"] == local_world


def test_slurm_task_keeps_the_cpus_it_was_given(fake_init):
    # srun --ntasks-per-node=4 --cpus-per-task=8 binds each task to its own 8 CPUs: the
    # affinity mask already is this task's share, not the node's to divide by 4.
    monkeypatch, _ = fake_init
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    for k, v in {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_CPUS_PER_TASK": "8"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", "29555")
    info = common.init_distributed_mode()
    assert (info.local_world_size, torch.get_num_threads()) == (4, 8)


def test_rng_state_leaves_cuda_alone_on_the_cpu(monkeypatch):
    # With --device cpu on a machine with GPUs, asking CUDA for its RNG state would create a
    # CUDA context on GPU 0 in every process.
    def touched(*args, **kwargs):
        raise AssertionError("CUDA touched")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", touched)
    monkeypatch.setattr(torch.cuda, "set_rng_state", touched)
    state = checkpoint.rng_state(torch.device("cpu"))
    assert "cuda" not in state
    checkpoint.set_rng_state(
        {**state, "cuda": torch.zeros(1, dtype=torch.uint8)}, torch.device("cpu")
    )
