"""Shared helpers: start the scripts as real processes, read what they wrote, compare weights.

Every multi-process run is real (torchrun, mp.spawn, or several plain processes under a
fake launcher environment), on CPU with gloo, and small: synthetic data, a few steps.
`python ...` commands start as children of a fork server that has imported torch once
(forkserver.py, test_forkserver.py): 0.3 s a start instead of 3.
"""

import atexit
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import forkserver
import pytest
import torch

import common
import ddp_train
import models
import training

ROOT = Path(__file__).resolve().parent.parent
FRESH = os.environ.get("FRESH_PROCESSES") == "1"  # no fork server: see forkserver.py
# CPU and gloo even where a GPU is present: the tests are about the logic, not the device.
SYNTHETIC = ["--data", "synthetic", "--device", "cpu"]
# A peer that never arrives ends a run after a minute instead of the default five.
DIST_TIMEOUT = ["--dist-timeout", "60"]
# Variables through which a launcher tells a process its rank; none may leak from the
# environment pytest runs in (say, a SLURM job) into the runs that tests start.
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
)
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_")
# The output contract: keys every metrics.jsonl line has.
METRIC_KEYS = {
    "epoch",
    "train_loss",
    "test_loss",
    "test_acc",
    "epoch_seconds",
    "samples_per_second",
}


def is_launcher_var(name):
    return name in LAUNCHER_VARS or name.startswith(LAUNCHER_PREFIXES)


# What torch sets in os.environ for its own subprocesses once this process compiles: not
# passed on (a child's torch finds the same by itself, and the fork server would refuse it).
SET_BY_TORCH = {"TORCHINDUCTOR_CACHE_DIR"} - set(os.environ)


def clean_env(omp_threads="1", **extra):
    """os.environ without launcher variables, plus `extra`. OMP_NUM_THREADS=1 keeps several
    processes from fighting over the cores; omp_threads=None leaves it unset."""
    skip = {"OMP_NUM_THREADS", *SET_BY_TORCH}
    env = {k: v for k, v in os.environ.items() if not is_launcher_var(k) and k not in skip}
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = omp_threads
    env.update(extra)
    return env


def _report(cmd, proc):
    command = " ".join(map(str, cmd))
    out, err = proc.stdout[-3000:], proc.stderr[-3000:]
    return f"{command}\nexit {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"


# The fork server's environment: the session's, as it was when the tests started.
SERVER_ENV = clean_env(omp_threads=None)
_server = None
STARTS = [0, 0]  # commands started fresh, forked


def pytest_terminal_summary(terminalreporter):
    fresh, forked = STARTS
    terminalreporter.write_line(f"fork server: {forked} commands forked, {fresh} started fresh")


def popen(cmd, cwd=ROOT, env=None, new_session=False):
    """subprocess.Popen(CMD, stdin=DEVNULL, stdout=PIPE, stderr=PIPE, text=True), CMD a
    `python ...` command line, started by the fork server (forkserver.py: torch already
    imported, 2-3 s less a start) unless FRESH_PROCESSES=1 or the command needs a fresh one.
    new_session: in a session and process group of its own (start_new_session=True)."""
    global _server
    env = env or clean_env()
    if _server is None and not FRESH:
        _server = forkserver.Server(SERVER_ENV)
        atexit.register(_server.close)
    forked = cmd[0] == sys.executable and _server and not _server.needs_fresh(cmd[1:], env)
    STARTS[bool(forked)] += 1
    if forked:
        return _server.popen(cmd, cwd, env, new_session)
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=new_session,
    )


def communicate(proc, timeout):
    """proc's CompletedProcess; proc killed if it runs past the timeout."""
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_python(args, env=None, timeout=180, check=True):
    """Run `python ARGS` in the repository root; return the CompletedProcess."""
    cmd = [sys.executable, *map(str, args)]
    proc = communicate(popen(cmd, env=env), timeout)
    if check and proc.returncode != 0:
        raise AssertionError("command failed:\n" + _report(cmd, proc))
    return proc


def torchrun(nproc, args, timeout=180, check=True):
    """torchrun --standalone (it picks its own free port) with nproc processes."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return run_python(launcher + list(args), timeout=timeout, check=check)


def torchrun_workers(nproc, args, timeout=180, check=True, cwd=ROOT):
    """nproc plain processes with the variables torchrun gives its workers (RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; OMP_NUM_THREADS=1): the processes
    of torchrun --standalone without its agent, forked by the fork server where torchrun's
    workers start fresh interpreters (0.5 s against 5-6 s a launch here). For tests of what
    the processes compute; what torchrun adds (its store, restarts, tearing down the others
    when one fails) is tested under real torchrun: test_launch.py, test_faults.py,
    test_scripts.py, the docstring commands that give torchrun options of its own."""
    for attempt in range(2):
        port = free_port()
        envs = [
            clean_env(RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r))
            | dict(LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            for r in range(nproc)
        ]
        results = run_ranks(args, envs, timeout=timeout, check=False, cwd=cwd)
        taken = any("EADDRINUSE" in r.stderr for r in results)  # another process took it first
        if not taken or attempt:
            break
    if check and any(r.returncode != 0 for r in results):
        raise AssertionError("a rank failed:\n" + "\n".join(_report(r.args, r) for r in results))
    code = next((r.returncode for r in results if r.returncode), 0)
    out, err = ("".join(getattr(r, s) for r in results) for s in ("stdout", "stderr"))
    return subprocess.CompletedProcess(results[0].args, code, out, err)


def run_ranks(args, envs, timeout=180, check=True, cwd=ROOT):
    """Start one `python ARGS` per environment in `envs` (one per rank) and wait for all. `args`
    is one command line for every rank, or a list of them, one per rank. Raises with every
    rank's output if one fails (unless check=False); a hung rank is killed at the timeout."""
    argvs = args if isinstance(args[0], list) else [args] * len(envs)
    cmds = [[sys.executable, *map(str, a)] for a in argvs]
    procs = [popen(cmd, cwd, env) for cmd, env in zip(cmds, envs, strict=True)]
    results = []
    try:
        for p in procs:
            results.append(communicate(p, timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    if check and any(r.returncode != 0 for r in results):
        raise AssertionError("a rank failed:\n" + "\n".join(_report(r.args, r) for r in results))
    return results


def free_port(low=20000, high=32000):
    """A TCP port that is free now, within [low, high). The default range lies below Linux's
    ephemeral ports (32768-60999), which the OS hands out for outgoing connections: a port
    taken from there and released could be given to another connection before a rank binds it."""
    for _ in range(200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", random.randrange(low, high)))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port found")


def one_line_errors(script, argv, world=2):
    """SCRIPT as `world` plain processes with launcher variables, expected to fail: each rank's
    error line. Every rank must stop with exit status 1 and one line, no traceback, within
    seconds (well below --dist-timeout)."""
    port = free_port()
    envs = [
        clean_env(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r))
        | dict(LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        for r in range(world)
    ]
    start = time.monotonic()
    procs = run_ranks([script, *argv], envs, timeout=120, check=False)
    assert time.monotonic() - start < 60
    errors = []
    for p in procs:
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
        assert lines[-1].startswith("error: ") and sum("error:" in ln for ln in lines) == 1
        errors.append(lines[-1])
    return errors


def last_json(text):
    """The last line of a command's output that holds JSON: the report a test's script prints
    (PyTorch 2.9's Gloo prints a connection line of its own to every rank's stdout)."""
    for line in reversed(text.strip().splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:  # "[Gloo] Rank 1 is connected to 1 peer ranks. ..."
            continue
    raise AssertionError(f"no JSON in the output:\n{text}")


def read_metrics(out_dir):
    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def load_ckpt(out_dir_or_path):
    path = Path(out_dir_or_path)
    if path.is_dir():
        path = path / "checkpoint.pt"
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_state_close(actual, expected, atol=1e-5, rtol=0.0):
    """Two state dicts have the same keys and every tensor agrees within the tolerance."""
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(
            actual[key], expected[key], atol=atol, rtol=rtol, msg=lambda m, k=key: f"{k}: {m}"
        )


def max_abs_diff(a, b):
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def built_loaders(argv, world, rank, datasets=None):
    """The training sampler, training loader and test loader that ddp_train.main() builds on
    `rank` of `world` processes, with `argv` (and load_datasets' answer `datasets`, if given).
    main() runs under a stand-in launcher until it has made both loaders (DistributedSampler
    takes the rank explicitly: no process group needed)."""

    class Built(Exception):
        pass

    loaders = []

    def record(*args, **kwargs):
        loaders.append(torch.utils.data.DataLoader(*args, **kwargs))
        if len(loaders) == 2:
            raise Built
        return loaders[-1]

    info = common.DistInfo(world > 1, rank, rank, world, world, torch.device("cpu"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ddp_train, "DataLoader", record)
        patch.setattr(ddp_train, "init_distributed_mode", lambda **_: info)
        patch.setattr(ddp_train, "cleanup", lambda: None)  # a caller's group stays up
        if datasets:
            patch.setattr(ddp_train, "load_datasets", lambda *_: datasets)
        with pytest.raises(Built):
            ddp_train.main(list(map(str, argv)))
    return loaders[0].sampler, loaders[0], loaders[1]


def single_process_eval(ckpt_path, argv):
    """Loss and accuracy of a checkpoint on the whole test set, computed here by one process
    the way the scripts do it (same loader, batch size and memory format): the reference
    that every world size must reproduce."""
    args = ddp_train.get_args(argv)
    _, train_loader, test_loader = built_loaders(argv, 1, 0)
    image = train_loader.dataset[0][0]
    model = models.build_model(args.model, image.shape[0], 10, image_size=image.shape[-1])
    model.load_state_dict(load_ckpt(ckpt_path)["model"])
    memory_format = torch.channels_last if args.channels_last else torch.preserve_format
    return training.evaluate(
        model.to(memory_format=memory_format), test_loader, torch.device("cpu")
    )


@pytest.fixture
def no_launcher(monkeypatch):
    """This process looks like a plain `python script.py`: no launcher variables, no
    OMP_NUM_THREADS, and whatever the code under test writes to os.environ is undone."""
    for name in list(os.environ):
        if is_launcher_var(name) or name == "OMP_NUM_THREADS":
            monkeypatch.delenv(name)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        # set, then delete: monkeypatch then restores "absent" even if the code sets it
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    threads = torch.get_num_threads()
    yield monkeypatch
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------------------
# Runs that several test files use, made once per session.

# 5 steps of the MLP (no BatchNorm, so DDP equals one process up to rounding) at a rate
# high enough that the weights move far more than the parity tolerance.
MLP_ARGS = [
    *SYNTHETIC,
    "--model",
    "mlp",
    "--max-steps",
    "5",
    "--lr",
    "0.8",
    "--warmup",
    "0",
    *DIST_TIMEOUT,
]
# The default CNN, 3 epochs: learns the synthetic set to > 80% test accuracy.
CNN_ARGS = [*SYNTHETIC, "--epochs", "3", "--lr", "0.05", *DIST_TIMEOUT]


@pytest.fixture(scope="session")
def mlp_reference(tmp_path_factory):
    """One process, batch 32: the reference for every 2-process parity run (2 x 16)."""
    out = tmp_path_factory.mktemp("mlp_reference")
    run_python(["ddp_train.py", *MLP_ARGS, "--batch-size", "32", "--output-dir", out])
    return out


@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory):
    """ddp_train.py under torchrun with 2 processes, 3 epochs of the CNN."""
    out = tmp_path_factory.mktemp("ddp_run")
    proc = torchrun(2, ["ddp_train.py", *CNN_ARGS, "--output-dir", out])
    return out, proc


def docstring_launches_reach_the_mesh(module, monkeypatch, extra=SYNTHETIC):
    """Every torchrun command in a sharded script's docstring passes the script's checks at its
    number of processes: a pretended world of that size gets as far as making its mesh. Returns
    the numbers of processes, for the caller to compare with the commands it expects."""
    script, worlds = Path(module.__file__).name, []

    class Reached(Exception):
        pass

    def mesh(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(module, "init_device_mesh", mesh)
    for line in module.__doc__.replace("\\\n", " ").splitlines():
        if "torchrun" not in line:
            continue
        words = line.split("#")[0].split()
        sizes = dict(w[2:].split("=") for w in words if w.startswith(("--nnodes=", "--nproc")))
        world = int(sizes.get("nnodes", 1)) * int(sizes["nproc_per_node"])
        info = common.DistInfo(True, 0, 0, world, world, torch.device("cpu"))
        monkeypatch.setattr(module, "init_distributed_mode", lambda info=info, **_: info)
        with pytest.raises(Reached):
            argv, tail = words[words.index(script) + 1 :], list(extra)
            if "--data" in argv and "--data" in tail:  # the line's own data set (text) stays
                del tail[tail.index("--data") : tail.index("--data") + 2]
            module.main([*argv, *tail])
        worlds.append(world)
    return sorted(worlds)


def moe_vit(experts, top_k, capacity_factor):
    """expert_parallel.py's mixture-of-experts ViT, built as the script builds it."""
    import expert_parallel

    vit = models.ViT(1, 10, 28, 96, heads=4)
    return expert_parallel.with_experts(vit, experts, top_k, capacity_factor)


@pytest.fixture(scope="session")
def small_text(tmp_path_factory):
    """The language-model tests' corpus: the first 16,000 bytes of the standard library's
    argparse.py (UTF-8 text on every machine). At --seq-len 32, 474 training windows and a
    held-out tail of 800 bytes: 24 validation windows."""
    import argparse

    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_bytes(Path(argparse.__file__).read_bytes()[:16000])
    return path


def text_flags(path, seq_len=32):
    """The flags of a GPT run on `path` (small_text), on the CPU: the tests' GPT, 4 blocks of
    96 (the images' shape, not the text default's), which their references build."""
    data = ["--data", "text", "--data-dir", str(path), "--seq-len", str(seq_len)]
    return [*data, "--model", "gpt", "--device", "cpu", "--dim", "96", "--depth", "4"]


def tp_shapes(gpt, tp):
    """{name: shape} of `gpt`'s parameters on a tensor-parallel rank, before FSDP cuts them, as
    nd_parallel.py's TP cuts them: q, k, v and fc1 by rows, proj's and fc2's weights by columns."""
    shapes = {}
    for name, p in gpt.named_parameters():
        shape = list(p.shape)
        if any(f".{cut}." in name for cut in ("attn.q", "attn.k", "attn.v", "mlp.fc1")):
            shape[0] //= tp
        elif name.endswith(("attn.proj.weight", "mlp.fc2.weight")):
            shape[1] //= tp
        shapes[name] = tuple(shape)
    return shapes
