"""Faults and bad input. A worker killed under torchrun --max-restarts, an
mp.spawn child killed, a process killed while it saves, a peer that never joins or stops
answering, a non-finite loss, unsafe or mismatched checkpoints, and bad flags or data: each
ends in a resumed run, or in a one-line error and a non-zero exit, never in a hang; bad
input leaves nothing in --output-dir.

Self-contained (no conftest fixtures): real processes, gloo on CPU, synthetic data. Time
limits here are generous upper bounds that only tell a hang from a slow machine.
"""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import communicate, free_port, max_abs_diff, popen, torchrun_workers

import checkpoint
import common
import ddp_mp_spawn
import ddp_train
import models

ROOT = Path(__file__).resolve().parent.parent
# Synthetic data (made in memory); a peer that never answers ends a run in a minute.
SYNTHETIC = ["--data", "synthetic", "--dist-timeout", "60"]
# 8 samples per process and step: 125 steps per epoch with 2 processes (a few seconds),
# time enough to kill a worker between the snapshot at step 10 and the end of epoch 0.
KILLABLE = [
    *SYNTHETIC,
    "--batch-size",
    "8",
    "--epochs",
    "2",
    "--save-every",
    "10",
    "--log-every",
    "10",
]
STEPS_PER_EPOCH = 2000 // (2 * 8)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
LAUNCHER_PREFIXES = (
    "SLURM_",
    "OMPI_",
    "PMI_",
    "TORCHELASTIC_",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
)


def env(**extra):
    """This environment without any launcher's variables (pytest may run inside a SLURM job,
    say), one thread per process (2 cores here), plus `extra`."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_VARS and not k.startswith(LAUNCHER_PREFIXES)
    }
    return {**clean, "OMP_NUM_THREADS": "1", **extra}


def run(cmd, timeout=180, **extra_env):
    """Run a command in the repository root and return the CompletedProcess."""
    return communicate(popen([str(c) for c in cmd], env=env(**extra_env)), timeout)


def start(cmd, log, **extra_env):
    """Start a command in the background, stdout and stderr into the file `log`."""
    with open(log, "w") as f:
        return subprocess.Popen(
            [str(c) for c in cmd],
            cwd=ROOT,
            env=env(**extra_env),
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=f,
        )


def error_line(proc):
    """A failed run's one-line error: non-zero exit, no traceback, and stderr ends with it."""
    assert proc.returncode not in (0, None), proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), proc.stderr
    return lines[-1]


def fails(main, argv):
    """Call a script's main() here; return the one-line error it stops with."""
    with pytest.raises(SystemExit) as stop:
        main([str(a) for a in argv])
    message = str(stop.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def children(pid, marker):
    """Pids of the processes `pid` started whose command line contains `marker`."""
    pids, found = [], []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            pids += [int(p) for p in (task / "children").read_text().split()]
    for p in pids:
        with contextlib.suppress(OSError):  # the process ended meanwhile
            if marker in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace"):
                found.append(p)
    return found


def kill_after_first_snapshot(proc, out, marker):
    """Wait for the run's first mid-epoch snapshot, then SIGKILL one of its workers: the
    kill lands in the middle of epoch 0, after training that only the snapshot keeps."""
    deadline = time.monotonic() + 120
    while not (out / "checkpoint.pt").exists():
        assert proc.poll() is None, "the run ended before its first snapshot"
        assert time.monotonic() < deadline, "no snapshot appeared"
        time.sleep(0.02)
    workers = children(proc.pid, marker)
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGKILL)


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def resumed_at(text):
    """(epoch, step in epoch) of every "resumed from" line a run printed."""
    return [
        (int(e), int(s))
        for e, s in re.findall(r"resumed from \S+ at epoch (\d+), step (\d+) of", text)
    ]


@pytest.fixture
def plain_process(monkeypatch):
    """Let main() run in this process as a plain `python script.py`: no launcher variables,
    and the thread count init_distributed_mode() sets is put back afterwards."""
    for name in list(os.environ):
        if name in LAUNCHER_VARS or name.startswith(LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)
    threads = torch.get_num_threads()
    yield monkeypatch
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------------------
# Restarts and resumes


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """KILLABLE's run by 2 processes that nothing stops: the weights every restart must reach.
    torchrun's workers without its agent (torchrun_workers: forked, where torchrun starts 3
    fresh interpreters); what the agent adds, restarts, is what the tests below launch."""
    out = tmp_path_factory.mktemp("uninterrupted")
    torchrun_workers(2, ["ddp_train.py", *KILLABLE, "--output-dir", out])
    return checkpoint.load_checkpoint(out / "checkpoint.pt")["model"]


def check_resumed_exactly(out, text, uninterrupted):
    # The restarted group continued inside epoch 0, not from its beginning ...
    [(epoch, step)] = resumed_at(text)
    assert epoch == 0 and 0 < step < STEPS_PER_EPOCH, text
    assert [m["epoch"] for m in metrics(out)] == [0, 1]  # every epoch once
    ckpt = checkpoint.load_checkpoint(out / "checkpoint.pt")
    assert (ckpt["epoch"], ckpt["epoch_step"], ckpt["step"]) == (2, 0, 2 * STEPS_PER_EPOCH)
    # ... and no sample of epoch 0 was trained twice or skipped: bit for bit the uninterrupted run.
    for key in uninterrupted:
        assert torch.equal(ckpt["model"][key], uninterrupted[key]), key


@pytest.mark.parametrize(
    "launch", ["standalone", "static rendezvous", "standalone, opt-out variable"]
)
@pytest.mark.slow
def test_torchrun_restart_resumes_mid_epoch(tmp_path, uninterrupted, launch):
    """The plain command with --max-restarts: a worker killed in the middle of epoch 0 makes
    torchrun restart the group, which resumes from the mid-epoch snapshot. torchrun hands the
    restarted workers the store of the failed attempt (unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1),
    which still holds the dead workers' addresses: common.process_group_store starts each attempt
    under keys of its own (without it, restarts failed to connect or hung)."""
    out = tmp_path / "run"
    rdzv = [f"--master-port={free_port()}"] if launch == "static rendezvous" else ["--standalone"]
    cmd = [*TORCHRUN, *rdzv, "--nproc_per_node=2", "--max-restarts=1", "ddp_train.py", *KILLABLE]
    log = tmp_path / "log"
    opt_out = dict(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1") if "opt-out" in launch else {}
    proc = start([*cmd, "--output-dir", out], log, **opt_out)
    try:
        kill_after_first_snapshot(proc, out, "ddp_train.py")
        assert proc.wait(timeout=240) == 0, log.read_text()
    finally:
        proc.kill()
    check_resumed_exactly(out, log.read_text(), uninterrupted)


@pytest.mark.slow
def test_restart_across_two_torchrun_nodes(tmp_path, uninterrupted):
    """Two torchrun agents ("nodes", one worker each) joined by c10d rendezvous. Each agent
    counts only its own restarts, so after a kill the two workers of the new attempt see
    different TORCHELASTIC_RESTART_COUNTs; they must still meet under the same keys."""
    out = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port()}"
    rdzv = [
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
    ]
    cmd = [
        *TORCHRUN,
        *rdzv,
        f"--rdzv-id={tmp_path.name}",
        "--max-restarts=1",
        "ddp_train.py",
        *KILLABLE,
    ]
    logs = [tmp_path / "node0", tmp_path / "node1"]
    nodes = [start([*cmd, "--output-dir", out], log) for log in logs]
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoint.pt").exists():
            assert all(n.poll() is None for n in nodes), "a node ended before the first snapshot"
            assert time.monotonic() < deadline, "no snapshot appeared"
            time.sleep(0.02)
        [worker] = children(nodes[1].pid, "ddp_train.py")
        os.kill(worker, signal.SIGKILL)
        for node, log in zip(nodes, logs, strict=True):
            assert node.wait(timeout=240) == 0, log.read_text()
    finally:
        for node in nodes:
            node.kill()
    text = logs[0].read_text() + logs[1].read_text()
    assert len(resumed_at(text)) == 1, text  # printed by global rank 0 only
    check_resumed_exactly(out, text, uninterrupted)


@pytest.mark.slow
def test_mp_spawn_child_killed_ends_job_and_rerun_resumes(tmp_path):
    """ddp_mp_spawn.py checkpoints at the end of each epoch: killed in epoch 1, its rerun
    resumes at epoch 1 and ends where a run that was never killed ends (weights, momentum)."""
    out = tmp_path / "run"
    cmd = [
        "ddp_mp_spawn.py",
        "--nprocs",
        "2",
        *SYNTHETIC,
        "--batch-size",
        "8",
        "--epochs",
        "2",
        "--output-dir",
        out,
    ]
    log = tmp_path / "log"
    proc = start([sys.executable, *cmd], log)
    try:
        kill_after_first_snapshot(proc, out, "spawn_main")
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    text = log.read_text()
    assert code == 1, text
    # Not always the last line: multiprocessing's resource tracker may warn after it.
    parent = r"^error: process \d of 2 was killed by SIGKILL; the others were stopped; "
    parent += "rerun to resume from "
    assert re.search(parent, text, re.M), text

    again = run([sys.executable, *cmd])
    assert again.returncode == 0, again.stderr
    assert re.findall(r"resumed from \S+ at epoch (\d+)", again.stdout) == ["1"], again.stdout
    assert [m["epoch"] for m in metrics(out)] == [0, 1]
    # The run never killed: ddp_train.py's, the same training under torchrun's variables
    # (test_scripts.py::test_ddp_mp_spawn: the same weights), as 2 processes forked by the fork
    # server where mp.spawn starts 2 fresh interpreters (this test: 0.77 of its time, 2026-11-27).
    straight = tmp_path / "straight"
    torchrun_workers(2, ["ddp_train.py", *cmd[3:-1], straight])
    ends = [checkpoint.load_checkpoint(d / "checkpoint.pt") for d in (out, straight)]
    assert max_abs_diff(ends[0]["model"], ends[1]["model"]) < 1e-6


@pytest.mark.slow
def test_mid_epoch_resume_equals_an_uninterrupted_run(tmp_path, plain_process):
    """Stopping inside an epoch (--max-steps here) and resuming gives bit-for-bit the weights
    of a run that never stopped: the checkpoint records the position inside the epoch, and the
    resumed epoch leaves out exactly the batches already trained."""
    # --augment draws random crops and flips every step: the RNG states must come back too.
    args = [
        *SYNTHETIC,
        "--model",
        "mlp",
        "--epochs",
        "2",
        "--batch-size",
        "32",
        "--save-every",
        "7",
        "--augment",
    ]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    ddp_train.main([str(a) for a in [*args, "--output-dir", straight]])
    ddp_train.main(
        [str(a) for a in [*args, "--output-dir", resumed, "--max-steps", "40"]]
    )  # 62 steps/epoch
    stopped = checkpoint.load_checkpoint(resumed / "checkpoint.pt")
    assert (stopped["epoch"], stopped["epoch_step"], stopped["step"]) == (0, 40, 40)
    ddp_train.main([str(a) for a in [*args, "--output-dir", resumed]])

    a = checkpoint.load_checkpoint(straight / "checkpoint.pt")
    b = checkpoint.load_checkpoint(resumed / "checkpoint.pt")
    assert a["step"] == b["step"] == 124
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert [m["epoch"] for m in metrics(resumed)] == [0, 1]  # the partial epoch-0 line was replaced


def test_sampler_skip_leaves_out_exactly_the_trained_samples():
    dataset = list(range(100))
    full = ddp_train.ResumableSampler(dataset, num_replicas=2, rank=1, seed=3, drop_last=True)
    full.set_epoch(4)
    part = ddp_train.ResumableSampler(dataset, num_replicas=2, rank=1, seed=3, drop_last=True)
    part.set_epoch(4)
    part.skip = 16
    assert list(part) == list(full)[16:] and len(part) == 50 - 16


@pytest.mark.slow
def test_mid_epoch_snapshot_resumes_at_another_world_size(tmp_path, plain_process):
    """One process stops inside epoch 0; two processes shard the epoch differently, so they
    start epoch 0 again (documented in ddp_train.py) and finish the run."""
    out = tmp_path / "run"
    args = [
        *SYNTHETIC,
        "--model",
        "mlp",
        "--epochs",
        "1",
        "--batch-size",
        "32",
        "--output-dir",
        out,
    ]
    ddp_train.main([str(a) for a in [*args, "--max-steps", "20"]])
    proc = run([*TORCHRUN, "--standalone", "--nproc_per_node=2", "ddp_train.py", *args])
    assert proc.returncode == 0, proc.stderr
    assert resumed_at(proc.stdout) == [(0, 0)], proc.stdout
    assert [m["epoch"] for m in metrics(out)] == [0]
    assert checkpoint.load_checkpoint(out / "checkpoint.pt")["world_size"] == 2


# ----------------------------------------------------------------------------------------
# Checkpoints on disk


KILLED_WHILE_SAVING = """
import io, os, signal, sys, torch
import checkpoint
checkpoint.save_checkpoint({"model": {"w": torch.zeros(3)}, "tag": "previous"}, sys.argv[1])

def dying_save(obj, path):  # half the new file reaches the disk, then the power goes out
    buffer = io.BytesIO()
    real_save(obj, buffer)
    with open(path, "wb") as f:
        f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        f.flush()
    os.kill(os.getpid(), signal.SIGKILL)

real_save, torch.save = torch.save, dying_save
checkpoint.save_checkpoint({"model": {"w": torch.ones(1_000_000)}, "tag": "new"}, sys.argv[1])
"""


@pytest.mark.slow
def test_process_killed_while_saving_leaves_previous_checkpoint(tmp_path):
    path = tmp_path / "checkpoint.pt"
    proc = run([sys.executable, "-c", KILLED_WHILE_SAVING, path], PYTHONPATH=str(ROOT))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert checkpoint.load_checkpoint(path)["tag"] == "previous"
    # The half-written temp file stays hidden beside it (SIGKILL skips all clean-up)...
    [leftover] = [p.name for p in tmp_path.iterdir() if p.name != "checkpoint.pt"]
    assert leftover.startswith(".checkpoint.pt.tmp")
    # ...and the next save clears it away.
    checkpoint.save_checkpoint({"model": {"w": torch.ones(2)}}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


class WritesFile:
    """Unpickling this calls open(path, "w"): it creates a file, as a malicious checkpoint could."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.mark.slow
def test_malicious_checkpoint_is_refused_without_running_code(tmp_path):
    marker = tmp_path / "pwned"
    bad = tmp_path / "bad.pt"
    torch.save({"model": {"w": torch.zeros(1)}, "payload": WritesFile(marker)}, bad)
    proc = run([sys.executable, "ddp_train.py", *SYNTHETIC, "--eval-only", "--resume", bad])
    line = error_line(proc)
    assert "refused" in line and str(bad) in line
    assert not marker.exists()
    # The payload is live: an unsafe load does create the file.
    torch.load(bad, weights_only=False)
    assert marker.exists()


def checkpoint_of(model, path):
    torch.save({"model": model.state_dict()}, path)
    return path


@pytest.mark.parametrize("case", ["another model", "another class count", "truncated"])
def test_unfit_checkpoint_is_a_one_line_error_naming_the_file(tmp_path, plain_process, case):
    if case == "another model":
        path = checkpoint_of(models.MLP(1, 10), tmp_path / "mlp.pt")
    elif case == "another class count":
        path = checkpoint_of(models.SmallCNN(1, 3), tmp_path / "three_classes.pt")
    else:
        whole = checkpoint_of(models.SmallCNN(1, 10), tmp_path / "whole.pt").read_bytes()
        path = tmp_path / "truncated.pt"
        path.write_bytes(whole[: len(whole) // 2])
    message = fails(ddp_train.main, [*SYNTHETIC, "--model", "cnn", "--eval-only", "--resume", path])
    assert str(path) in message


def test_unwritable_output_dir_is_refused_at_start_up(tmp_path, plain_process):
    # Tests run as root, whom chmod does not stop: a path under a regular file cannot be made.
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    message = fails(
        ddp_train.main, [*SYNTHETIC, "--max-steps", "1", "--output-dir", a_file / "out"]
    )
    assert "not writable" in message


@pytest.mark.slow
def test_failed_checkpoint_write_keeps_the_previous_one(tmp_path, plain_process, monkeypatch):
    """A disk that fills up while the checkpoint is written: one line, exit 1, the previous
    checkpoint whole and no temporary file left behind."""
    out = tmp_path / "run"
    args = [
        *SYNTHETIC,
        "--model",
        "mlp",
        "--epochs",
        "2",
        "--batch-size",
        "32",
        "--output-dir",
        out,
    ]
    args += ["--max-steps", "62"]
    ddp_train.main([str(a) for a in args])  # a whole first epoch
    before = (out / "checkpoint.pt").read_bytes()
    real_save = torch.save

    def save_half(obj, path):
        real_save(obj, path)
        with open(path, "r+b") as f:
            f.truncate(100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", save_half)
    message = fails(ddp_train.main, [a for a in args if a not in ("--max-steps", "62")])
    full = r"error: could not write .*checkpoint\.pt \(No space left on device\); the previous"
    assert re.fullmatch(full + " one is kept", message), message
    assert (out / "checkpoint.pt").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt", "metrics.jsonl"]


# ----------------------------------------------------------------------------------------
# Peers that never come or stop answering, and a non-finite loss


@pytest.mark.slow
def test_peer_that_never_joins_ends_within_the_timeout(tmp_path):
    out = tmp_path / "out"
    port = free_port()
    began = time.monotonic()
    proc = run(
        [
            sys.executable,
            "ddp_train.py",
            *SYNTHETIC,
            "--dist-timeout",
            "5",
            "--output-dir",
            out,
        ],  # the last flag wins
        timeout=120,
        RANK="0",
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    line = error_line(proc)
    assert "a peer did not join" in line and "--dist-timeout 5" in line
    assert time.monotonic() - began < 90  # 5 s of waiting plus start-up, however slow the machine
    assert not out.exists()


def two_ranks(args, **extra_env):
    """Start rank 0 and rank 1 as plain processes with a launcher's variables."""
    port = str(free_port())
    ranks = dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra_env)
    return [
        popen([sys.executable, *map(str, args)], env=env(RANK=str(rank), **ranks))
        for rank in (0, 1)
    ]


def finish(procs, timeout):
    results = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:
            p.kill()
    return results


# Run as `python -c NAN_RANK ARGS` on each of two ranks: rank 1's loss turns non-finite from
# step 5 on, rank 0's never. With SPREADS, a NaN that spreads as it would: through rank 1's
# gradients into its weights; without, its gradients stay finite (as when fp16 overflows:
# GradScaler then skips the step on every rank), so the NaN stays in rank 1's loss alone.
NAN_RANK = """
import math, os, sys, torch
import {script}
real, calls = torch.nn.functional.cross_entropy, iter(range(10**6))
def cross_entropy(*args, **kwargs):
    loss = real(*args, **kwargs)
    if os.environ["RANK"] == "0" or next(calls) < 5:
        return loss
    return loss * math.nan if {spreads} else loss + math.nan * loss.detach()
torch.nn.functional.cross_entropy = cross_entropy
{script}.main(sys.argv[1:])
"""


@pytest.mark.parametrize(
    "script, argv, spreads, error",
    [
        # Plain DDP: the NaN would reach rank 0 through the next gradient all-reduce; here
        # the gradients stay finite: the all-reduced totals alone tell rank 0.
        ("ddp_train", ["--log-every", "10"], False, "at step 5: lower --lr, .*"),  # quick tier
        # Local SGD: nothing is all-reduced between averagings (steps 8, 16); the check at
        # step 7 comes before rank 1's NaN weights reach rank 0.
        pytest.param(
            "ddp_comm",
            ["--log-every", "7", "--local-sgd-period", "8", "--local-sgd-start", "0"],
            True,
            "at step 5: lower --lr, .*",
            marks=pytest.mark.slow,
        ),
        # The sharded scripts share training.log_loss, which checks at log steps (every 4
        # here): both name step 8. Each rank checking its own loss would stop rank 1 alone.
        (
            "fsdp_train",
            ["--batch-size", "16", "--log-every", "4"],
            False,
            "by step 8: lower --lr or add --clip-grad",
        ),
    ],
)
@pytest.mark.slow
def test_every_rank_stops_at_the_first_non_finite_step_one_rank_saw(script, argv, spreads, error):
    """The ranks check the all-reduced loss totals, not their own: when rank 1 alone sees a
    non-finite loss, rank 0 stops at the same check (a rank stopping alone would leave the
    other waiting in a collective), and both name the first bad step, which only rank 1 saw.
    No launcher kills anyone here: each rank must stop by itself, with one line."""
    code = NAN_RANK.format(script=script, spreads=spreads)
    procs = two_ranks(["-c", code, *SYNTHETIC, "--model", "mlp", "--max-steps", "20", *argv])
    lines = [error_line(r) for r in finish(procs, timeout=300)]  # a hang, not a slow machine
    assert re.fullmatch(f"error: non-finite loss {error}", lines[0]), lines
    assert lines[0] == lines[1]


@pytest.mark.slow
def test_peer_that_stops_answering_ends_the_job_within_the_timeout(tmp_path):
    """Rank 1 freezes (SIGSTOP) in the middle of training: rank 0 stops after --dist-timeout."""
    out = tmp_path / "run"
    args = [
        "ddp_train.py",
        *KILLABLE,
        "--dist-timeout",
        "10",
        "--output-dir",
        out,
    ]  # the last flag wins
    rank0, rank1 = two_ranks(args)
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoint.pt").exists():
            assert rank0.poll() is None and time.monotonic() < deadline, "no snapshot appeared"
            time.sleep(0.02)
        os.kill(rank1.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        [result] = finish([rank0], timeout=120)
        assert time.monotonic() - stopped < 90  # 10 s of silence, then the error
    finally:
        rank1.kill()
        rank1.communicate()
    line = error_line(result)
    assert "rank 0: another process died or stopped responding" in line
    checkpoint.load_checkpoint(out / "checkpoint.pt")  # what was saved is intact


# ----------------------------------------------------------------------------------------
# Bad input: one line, non-zero exit, nothing written


@pytest.mark.slow
def test_missing_data_from_the_command_line(tmp_path):
    """The command-line form of a bad-input failure: exit status 1 and one line on stderr."""
    out = tmp_path / "out"
    proc = run(
        [
            sys.executable,
            "ddp_train.py",
            "--data",
            "mnist",
            "--device",
            "cpu",
            "--data-dir",
            tmp_path / "nothing",
            "--output-dir",
            out,
        ]
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "mnist not found" in error_line(proc) and "--download" in proc.stderr
    assert not out.exists()


def empty_imagefolder(root):
    for split in ("train", "val"):
        (root / split / "cat").mkdir(parents=True)  # class folders, no images
    return root


BAD_INPUT = {
    "missing data": (["--data", "cifar10", "--data-dir", "{tmp}/nothing"], "not found"),
    "no train/ folder": (["--data", "imagefolder", "--data-dir", "{tmp}"], "train is missing"),
    "empty imagefolder": (
        ["--data", "imagefolder", "--data-dir", "{tmp}/images"],
        "Found no valid file",
    ),
    "cuda without a GPU": (["--data", "synthetic", "--device", "cuda"], "no usable CUDA device"),
    "batch larger than a shard": (
        ["--data", "synthetic", "--batch-size", "4096"],
        "larger than one rank's shard",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, plain_process, case):
    if case == "cuda without a GPU" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    empty_imagefolder(tmp_path / "images")
    argv, expected = BAD_INPUT[case]
    out = tmp_path / "out"
    message = fails(ddp_train.main, [a.format(tmp=tmp_path) for a in argv] + ["--output-dir", out])
    assert expected in message
    assert not out.exists()


def test_mp_spawn_refuses_cuda_without_a_gpu(tmp_path, plain_process):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "out"
    message = fails(
        ddp_mp_spawn.main, ["--nprocs", "2", "--device", "cuda", *SYNTHETIC, "--output-dir", out]
    )
    assert "no usable CUDA device" in message and not out.exists()


def test_more_processes_than_gpus_is_refused(tmp_path, plain_process):
    """This machine has no GPU, so a one-GPU machine is simulated; both checks come before
    any CUDA call."""
    plain_process.setattr(torch.cuda, "is_available", lambda: True)
    plain_process.setattr(torch.cuda, "device_count", lambda: 1)
    message = fails(ddp_mp_spawn.main, ["--nprocs", "2", "--device", "cuda", *SYNTHETIC])
    assert "--nprocs 2 is more than the 1 GPU(s)" in message
    # torchrun with two processes on this node: the second has no GPU of its own.
    for name, value in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2").items():
        plain_process.setenv(name, value)
    with pytest.raises(SystemExit, match="local rank 1 has no GPU: this node shows 1"):
        common.init_distributed_mode(device="cuda")


def test_busy_master_port_is_refused(tmp_path, plain_process):
    out = tmp_path / "out"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        plain_process.setenv("MASTER_ADDR", "127.0.0.1")
        plain_process.setenv("MASTER_PORT", str(port))
        message = fails(ddp_mp_spawn.main, ["--nprocs", "2", *SYNTHETIC, "--output-dir", out])
    assert f"MASTER_PORT {port} is busy" in message
    assert not out.exists()
