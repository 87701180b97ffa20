"""benchmarks/gpu/check.py, the first thing a session lent a GPU runs, here on the CPU: a stalled
command is stopped at its bound with everything it started, its Python stacks kept; a stalled
phase is reported and the next one runs; the dry mode runs every phase and writes what the
device tool brings back (at most 8 files, 16 MiB each, no deeper than 2 folders)."""

import gzip
import importlib.util
import json
import re
import sys
import time

import pytest
from conftest import ROOT, clean_env

spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks/gpu/check.py")
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)

# A parent that ignores SIGTERM (only SIGKILL ends it) and a child in a session of its own,
# as torchrun starts its workers: stopping the parent's group alone would leave the child.
PARENT = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
print(child.pid, flush=True)
def parent_waits():
    while True:
        time.sleep(1)
parent_waits()
"""
CHILD = """
import time
def child_waits():
    while True:
        time.sleep(1)
child_waits()
"""


def test_a_stalled_command_is_stopped_with_its_tree_and_its_stacks():
    t0 = time.monotonic()
    run = check.run_bounded([sys.executable, "-c", PARENT, CHILD], timeout=3, grace=2)
    assert run.status == "timed out"
    # 3 s, then 1 s for the stacks, 2 s for SIGTERM, then SIGKILL
    assert 5.5 < time.monotonic() - t0 < 12
    assert "in parent_waits" in run.stacks and "in child_waits" in run.stacks, run.stacks
    child = int(run.stdout.split()[0])
    for _ in range(50):  # the child, orphaned by the parent's end, is reaped by init
        if not check.alive(child):
            break
        time.sleep(0.1)
    assert not check.alive(child), "the child, in a session of its own, outlived the stop"


def test_a_command_that_ends_in_time_keeps_its_output_and_status():
    run = check.run_bounded([sys.executable, "-c", "print('out'); raise SystemExit(3)"], 30)
    assert (run.status, run.stdout, run.stacks) == (3, "out\n", "")


def test_fashion_mnist_is_unpacked_from_the_carried_gz_files(tmp_path):
    gz = tmp_path / "gz"
    gz.mkdir()
    for i, name in enumerate(check.RAW):
        with gzip.open(gz / f"{name}.gz", "wb") as f:
            f.write(bytes([i]) * 10)
    data = tmp_path / "data"
    assert not check.unpack_fashion_mnist([tmp_path / "none"], data)
    assert check.unpack_fashion_mnist([tmp_path / "none", gz], data)
    raw = data / "FashionMNIST" / "raw"
    assert sorted(p.name for p in raw.iterdir()) == sorted(check.RAW)
    assert (raw / check.RAW[2]).read_bytes() == bytes([2]) * 10


def run_check(flags, timeout):
    """check.py FLAGS, itself bounded: a check that overruns is stopped with all it started."""
    cmd = [sys.executable, "benchmarks/gpu/check.py", *flags]
    run = check.run_bounded(cmd, timeout, env=clean_env())
    assert run.status == 0, f"check.py: {run.status}\n{run.tail()}\n{run.stacks}"
    return run


def summary_rows(stdout):
    """{phase letter: (status, key figures)} from the table the check prints last."""
    rows = re.findall(r"^\| ([a-e]) [^|]+\| ([^|]+) \| (\d+) \| ([^|]*) \|$", stdout, re.M)
    return {phase: (status, key) for phase, status, _, key in rows}


def assert_files_come_back(out):
    """What the device tool brings back from $OUT: at most 8 files, 16 MiB each, none
    deeper than 2 folders, named in letters, digits, '.', '_' and '-'."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= 8, files
    for f in files:
        assert f.stat().st_size <= 16 << 20, f
        assert len(f.relative_to(out).parts) <= 3, f
        assert re.fullmatch(r"[A-Za-z0-9._-]+", f.name), f
    assert not [p for p in out.rglob("*") if p.is_dir()], "the check writes no folders"


def test_a_stalled_phase_is_stopped_reported_and_the_check_goes_on(tmp_path):
    """Phases a and c stalled on purpose with a bound of 3 s each: both stopped at it, both
    reported as timed out with their stacks, and the check ends in seconds."""
    flags = ["--cpu", "--no-fork-server", "--out", tmp_path, "--phases", "ac", "--stall", "ac"]
    flags += ["--phase-timeout", "a=3", "--phase-timeout", "c=3"]
    proc = run_check(flags, timeout=40)  # each phase 3 s, 1 s for the stacks, the SIGTERM
    rows = summary_rows(proc.stdout)
    assert rows.keys() == {"a", "c"} and all(s == "timed out" for s, _ in rows.values()), rows
    assert "0/2 finished; stalled: vit-bf16-clip, cnn-none" in rows["c"][1]
    blocks = (tmp_path / "stacks.txt").read_text().split("\n== ")
    for name in ("a/on", "a/off", "c/vit-bf16-clip", "c/cnn-none"):
        [block] = [b for b in blocks if b.removeprefix("== ").startswith(f"{name}: timed out")]
        assert "in stalled_on_purpose" in block, block
    phases = json.loads((tmp_path / "check.json").read_text())["phases"]
    assert phases["c"]["status"] == "timed out" and phases["c"]["bound"] == 3
    assert_files_come_back(tmp_path)


@pytest.mark.slow
def test_the_dry_mode_runs_every_phase_on_the_cpu(tmp_path):
    """check.py --cpu: every phase, small, on the CPU (what needs CUDA skipped and said so),
    the probes' relative errors at CPU rounding, the summary, and files that come back."""
    flags = ["--cpu", "--out", tmp_path, "--modes", "off,repeat,det"]
    flags += ["--tests", "test_dataparallel_replicas_compute_in_the_asked_dtype"]
    proc = run_check(flags, timeout=600)
    rows = summary_rows(proc.stdout)
    assert rows.keys() == set("abcde") and all(s == "ok" for s, _ in rows.values()), rows
    assert "dry mode: on the CPU" in rows["a"][1]
    assert "2/2 finished" in rows["c"][1] and "targeted: 1 passed" in rows["e"][1]
    assert re.search(r"ddp_train.py [\d.]+ ms, bare loop [\d.]+ ms: [\d.]+x", rows["d"][1])
    results = json.loads((tmp_path / "check.json").read_text())["phases"]
    probes = results["b"]["figures"]
    assert probes.keys() == {"channels_last vs NCHW", "model_parallel split vs one device"}
    for quantity in probes.values():  # the CPU: fp32 rounding only, and no noise
        assert all(quantity[m] < 1e-4 for m in ("off", "repeat", "det")), quantity
        assert quantity["noise"] == 0, quantity
    summary = (tmp_path / "summary.md").read_text()
    assert "| GPU vs CPU (MLP) | test_gpu_equals_cpu | skipped: needs CUDA |" in summary
    assert "1 passed" in (tmp_path / "pytest.log").read_text()
    assert (tmp_path / "stacks.txt").read_text() == ""  # nothing was stopped
    assert_files_come_back(tmp_path)


def test_a_check_stopped_from_outside_stops_what_it_runs(tmp_path):
    """SIGTERM to the check (the device tool's own timeout, say) stops the commands it runs,
    which are in sessions of their own, out of the tool's reach; their stacks are kept."""
    flags = ["--cpu", "--no-fork-server", "--out", tmp_path, "--phases", "c", "--stall", "c"]
    proc = check.start_fresh([sys.executable, "benchmarks/gpu/check.py", *flags], ROOT, clean_env())
    try:
        while "phase c" not in proc.stdout.readline():
            pass
        time.sleep(2)  # the stalled commands start
        proc.terminate()
        proc.communicate(timeout=30)
    finally:
        check.stop_tree(proc, grace=1)
    assert proc.returncode == 128 + 15
    stacks = (tmp_path / "stacks.txt").read_text()
    pids = [int(p) for p in re.findall(r"^pid (\d+): ", stacks, re.M)]
    assert len(pids) == 2 and stacks.count("in stalled_on_purpose") == 2, stacks
    assert not any(check.alive(p) for p in pids), "a stalled command outlived the check"
