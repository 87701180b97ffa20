"""The fork server's children (forkserver.py: how the tests start `python ...` without importing
torch each time) behave as fresh interpreters: the same view of their command, environment and
threads, the same ending, the same training run to the bit."""

import os
import re
import signal
import subprocess
import sys
import time

import forkserver
import pytest
import torch
from conftest import ROOT, SET_BY_TORCH, SYNTHETIC, clean_env, load_ckpt, popen

# What a script sees of its start, one value a line.
PROBE = """
import atexit, os, random, sys, threading, time
import torch
print(sys.argv)
print(os.path.realpath(sys.path[0]), sys.path[1:3])
print(os.getcwd(), os.environ.get("PROBE_VALUE"), "RANK" in os.environ)
print(torch.get_num_threads(), __name__, os.path.basename(globals().get("__file__", "-")))
print("tqdm's line\\rthe next", flush=True)
sys.stderr.write(f"random {random.random()}\\n")
atexit.register(print, "atexit ran")
threading.Thread(target=lambda: (time.sleep(0.3), print("thread joined"))).start()
{end}
"""
# How the probe ends: its exit status, its last line, and OMP_NUM_THREADS (unset: torch's own).
ENDS = {
    "returns": (0, "pass", None),
    "exits 3": (3, "sys.exit(3)", "1"),
    "exits with a message": (1, "sys.exit('error: a message')", None),
    "raises": (1, "raise ValueError('a traceback')", "1"),
}


def run(args, env, cwd, fresh=False):
    """`python ARGS`: a child of the fork server, or (fresh) a new interpreter."""
    cmd = [sys.executable, *args]
    if fresh:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    proc = popen(cmd, cwd=cwd, env=env)
    assert isinstance(proc, forkserver.Forked), "the fork server did not take the command"
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.slow
@pytest.mark.parametrize("end", ENDS)
def test_a_forked_child_sees_and_ends_as_a_fresh_interpreter(end, tmp_path):
    code, last, threads = ENDS[end]
    script = tmp_path / "probe.py"
    script.write_text(PROBE.replace("{end}", last))
    env = clean_env(omp_threads=threads, PROBE_VALUE="x")
    forked, fresh = (run([script, "--flag", "1"], env, ROOT, fresh) for fresh in (False, True))
    assert forked.returncode == fresh.returncode == code
    assert forked.stdout == fresh.stdout
    assert "atexit ran" in fresh.stdout and "thread joined" in fresh.stdout
    assert "tqdm's line\nthe next" in fresh.stdout  # text=True's universal newlines
    assert forked.stderr.splitlines()[1:] == fresh.stderr.splitlines()[1:]  # [0]: random


@pytest.mark.slow
def test_python_c_runs_as_in_a_fresh_interpreter_and_draws_its_own_random_numbers(tmp_path):
    code, last, _ = ENDS["raises"]
    probe, env = PROBE.replace("{end}", last), clean_env(PROBE_VALUE="x")
    forked, fresh = (run(["-c", probe, "a"], env, tmp_path, f) for f in (False, True))
    assert forked.returncode == fresh.returncode == code and forked.stdout == fresh.stdout
    forked_err, fresh_err = (p.stderr.splitlines() for p in (forked, fresh))
    assert forked_err[1:] == fresh_err[1:] and "<string>" in fresh_err[2]
    # fork copies the server's random state: each child must draw its own
    again = run(["-c", probe, "a"], env, tmp_path)
    assert forked_err[0] != again.stderr.splitlines()[0]


def test_a_variable_read_when_torch_starts_gets_a_fresh_interpreter(monkeypatch):
    # What torch sets in this process when it compiles (test_faults.py does, before this file)
    # is not passed on: otherwise every later command would start fresh, slowly and silently.
    for name in SET_BY_TORCH:  # unless the session began with it set
        monkeypatch.setenv(name, "/tmp/torchinductor_test")
    plain = clean_env()
    proc = popen([sys.executable, "-c", "pass"], env=plain)
    assert isinstance(proc, forkserver.Forked)
    proc.communicate()
    # NVIDIA_TF32_OVERRIDE: read by cuBLAS and cuDNN when they load (test_gpu.py turns TF32 off)
    names = ("TORCH_LOGS", "CUDA_VISIBLE_DEVICES", "OMP_PROC_BIND", "PYTHONHASHSEED")
    for name in (*names, "NVIDIA_TF32_OVERRIDE"):
        proc = popen([sys.executable, "-c", "pass"], env=plain | {name: "1"})
        assert isinstance(proc, subprocess.Popen), name
        proc.communicate()


@pytest.mark.slow
def test_a_forked_training_run_equals_a_fresh_one(tmp_path):
    """ddp_train.py, forked and fresh: the same weights bit for bit, the same log but for the
    timings."""
    args = [ROOT / "ddp_train.py", *SYNTHETIC, "--max-steps", "3", "--channels-last"]
    names = ("forked", "fresh")
    runs = [
        run([*args, "--output-dir", tmp_path / n], clean_env(), ROOT, n == "fresh") for n in names
    ]
    assert runs[0].returncode == runs[1].returncode == 0, runs[0].stderr + runs[1].stderr
    weights = [load_ckpt(tmp_path / name)["model"] for name in names]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[1])
    timings = r" [\d.]+s [\d.]+ samples/s"
    logs = [re.sub(timings, "", r.stdout).replace(n, "") for r, n in zip(runs, names, strict=True)]
    assert logs[0] == logs[1] and "epoch 0: train_loss" in logs[0]


# A sitecustomize module on PYTHONPATH: Python imports it at start-up, before the command runs
# (benchmarks/gpu/check.py arms faulthandler through one). It prints what it sees of the command.
SITECUSTOMIZE = {
    "runs": "import os, sys\nprint('SITE', sys.argv, sys.orig_argv[1:], __name__)\n",
    "raises": "raise ValueError('in sitecustomize')\n",
}


@pytest.mark.parametrize("kind", SITECUSTOMIZE)
def test_a_sitecustomize_on_pythonpath_runs_in_a_forked_child_as_in_a_fresh_one(kind, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE[kind])
    script = tmp_path / "main.py"
    script.write_text("import sys\nprint('main', sys.argv)\n")
    env = clean_env(PYTHONPATH=str(tmp_path))
    for args in ([script, "a"], ["-c", "import sys; print('main', sys.argv)", "b"]):
        forked, fresh = (run(args, env, tmp_path, fresh) for fresh in (False, True))
        assert forked.returncode == fresh.returncode == 0
        assert (forked.stdout, forked.stderr) == (fresh.stdout, fresh.stderr)
        assert ("SITE " in fresh.stdout) == (kind == "runs"), fresh.stdout
        assert ("Error in sitecustomize" in fresh.stderr) == (kind == "raises"), fresh.stderr


NEW_SESSION_PROBE = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
leads = os.getsid(0) == os.getpid() == os.getpgid(0)
with open(sys.argv[1] + ".new", "w") as f:
    f.write(f"{leads} {child.pid}")
os.rename(sys.argv[1] + ".new", sys.argv[1])
child.wait()
"""


def gone(pid):
    """pid has ended (a zombie waiting for its parent counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_a_child_in_a_new_session_leads_a_group_that_one_signal_ends(fresh, tmp_path):
    """new_session=True (benchmarks/gpu/check.py stops a stalled run by its process group):
    forked as started fresh, the child leads a session and group of its own, so a signal to
    the group ends the child and what it started, and not the tests or the fork server."""
    report = tmp_path / "report"
    cmd = [sys.executable, "-c", NEW_SESSION_PROBE, report]
    if fresh:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    else:
        proc = popen(cmd, new_session=True)
        assert isinstance(proc, forkserver.Forked)
    deadline = time.monotonic() + 30
    while not report.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    leads, grandchild = report.read_text().split()
    assert leads == "True", "the child does not lead a session and process group of its own"
    os.killpg(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGTERM
    deadline = time.monotonic() + 10
    while not gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(grandchild), "what the child started survived the signal to its group"
