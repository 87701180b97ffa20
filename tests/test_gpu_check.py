"""benchmarks/gpu/check.py, here on the CPU: a stalled command is stopped at its bound with
everything it started, its Python stacks kept; a stalled phase is reported and the next one
runs; the dry mode runs every phase and writes its files (at most 8, 16 MiB each, no folders),
summary.json's headline figures first."""

import functools
import gzip
import importlib.util
import json
import pickle
import re
import sys
import tarfile
import time
from types import SimpleNamespace

import pytest
from conftest import ROOT, clean_env, run_python

spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks/gpu/check.py")
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)

# A parent that ignores SIGTERM (only SIGKILL ends it) and a child in a process group of its own,
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


@pytest.mark.slow
def test_a_stalled_command_is_stopped_with_its_tree_and_its_stacks():
    t0 = time.monotonic()
    cmd = [sys.executable, "-c", PARENT, CHILD]
    run = check.run_bounded(cmd, timeout=3, grace=2, native=False)
    assert run.status == "timed out"
    # 3 s, then 1 s for the stacks, 2 s for SIGTERM, then SIGKILL
    assert 5.5 < time.monotonic() - t0 < 12
    assert "in parent_waits" in run.stacks and "in child_waits" in run.stacks, run.stacks
    child = int(run.stdout.split()[0])
    for _ in range(50):  # the child, orphaned by the parent's end, is reaped by init
        if not check.alive(child):
            break
        time.sleep(0.1)
    assert not check.alive(child), "the child, in a process group of its own, outlived the stop"


@pytest.mark.slow
@pytest.mark.skipif(not check.native_tool(), reason="neither py-spy nor gdb is installed")
def test_a_stalled_command_leaves_its_native_stacks_after_its_python_ones():
    """Where a debugger is installed, each stalled process's native stacks (py-spy or gdb) are
    kept beside its Python stacks, taken first (a debugger's attach stops the process)."""
    run = check.run_bounded([sys.executable, "-c", PARENT, CHILD], timeout=3, grace=2)
    child = int(run.stdout.split()[0])
    python, *native = re.split(r"^native stacks of pid (\d+) \(\S+\):$", run.stacks, flags=re.M)
    assert "in parent_waits" in python and "in child_waits" in python, run.stacks
    blocks = dict(zip(map(int, native[::2]), native[1::2], strict=True))
    assert len(blocks) == 2 and child in blocks, run.stacks
    for block in blocks.values():  # both in time.sleep's C code
        assert re.search(r"clock_nanosleep|select|pysleep", block), block
    assert not check.alive(child)


@pytest.mark.slow
def test_a_bounded_command_inside_a_bounded_command_keeps_its_stacks(tmp_path):
    """tests/test_gpu.py's runs under check.py's phase f have two of the check's sitecustomize
    on PYTHONPATH: the inner one arms the stacks and runs the hidden one, which runs no other
    (they found each other without end: a RecursionError at every start)."""
    env = check.with_stack_dumps(clean_env(), tmp_path / "outer")
    cmd = [sys.executable, "-c", CHILD]
    run = check.run_bounded(cmd, timeout=3, env=env, grace=2, native=False)
    assert run.status == "timed out" and "in child_waits" in run.stacks, run.tail()
    assert "sitecustomize" not in run.stderr, run.stderr


def test_a_command_is_cut_once_what_it_measures_is_written(tmp_path):
    """Phase c stops a GPT run once its last epoch's metrics line is written: what the run does
    after it (checkpoint, model.pt, the sample) is not waited for; its output is kept, it is
    not a stall (no stacks), and it counts as done."""
    folder = tmp_path / "run"
    folder.mkdir()
    writes = "import pathlib, sys, time\nf = pathlib.Path(sys.argv[1]) / 'metrics.jsonl'\n"
    writes += "for i in range(2):\n    print('epoch', i, flush=True)\n"
    writes += "    f.open('a').write('{}\\n')\n"
    writes += "while True:\n    time.sleep(1)\n"
    until = functools.partial(check.epochs_written, folder)
    t0 = time.monotonic()
    run = check.run_bounded([sys.executable, "-c", writes, folder], 60, until=until)
    assert time.monotonic() - t0 < 20 and run.status == 0 and run.extra["cut"], run.tail()
    assert run.stdout == "epoch 0\nepoch 1\n" and run.stacks == ""


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
    rows = re.findall(r"^\| ([a-fm]) [^|]+\| ([^|]+) \| (\d+) \| ([^|]*) \|$", stdout, re.M)
    return {phase: (status, key) for phase, status, _, key in rows}


def assert_files_come_back(out):
    """The check's files: at most 8, 16 MiB each, none deeper than 2 folders, named in letters,
    digits, '.', '_' and '-' (easy to copy off a machine)."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= 8, files
    for f in files:
        assert f.stat().st_size <= 16 << 20, f
        assert len(f.relative_to(out).parts) <= 3, f
        assert re.fullmatch(r"[A-Za-z0-9._-]+", f.name), f
    assert not [p for p in out.rglob("*") if p.is_dir()], "the check writes no folders"


@pytest.mark.slow
def test_a_stalled_phase_is_stopped_reported_and_the_check_goes_on(tmp_path):
    """Phases a and e stalled on purpose with a bound of 3 s each: both stopped at it, both
    reported as timed out with their stacks, and the check ends in seconds."""
    flags = ["--cpu", "--no-fork-server", "--out", tmp_path, "--phases", "ae", "--stall", "ae"]
    flags += ["--phase-timeout", "a=3", "--phase-timeout", "e=3"]
    # each phase 3 s, 1 s for the Python stacks, the native ones (a debugger's attach), SIGTERM
    proc = run_check(flags, timeout=60)
    rows = summary_rows(proc.stdout)
    assert rows.keys() == {"a", "e"} and all(s == "timed out" for s, _ in rows.values()), rows
    assert "0/2 finished; stalled: vit-bf16-clip, cnn-none" in rows["e"][1]
    blocks = (tmp_path / "stacks.txt").read_text().split("\n== ")
    for name in ("a/on", "a/off", "e/vit-bf16-clip", "e/cnn-none"):
        [block] = [b for b in blocks if b.removeprefix("== ").startswith(f"{name}: timed out")]
        assert "in stalled_on_purpose" in block, block
    phases = json.loads((tmp_path / "summary.json").read_text())["phases"]
    assert phases["e"]["status"] == "timed out" and phases["e"]["bound"] == 3
    assert_files_come_back(tmp_path)


@pytest.mark.slow
def test_the_dry_mode_runs_every_phase_on_the_cpu(tmp_path):
    """check.py --cpu: every phase, small, on the CPU (what needs CUDA skipped and said so): the
    fork server probed, mfu.py's rows (the levers), ddp_train.py against the bare loop with
    time to 94% and its warm-up apart, the GPT's run read from its metrics.jsonl with its trace
    gzipped, the probes' relative errors at CPU rounding, summary.json's headline, every run's
    metrics.jsonl in one archive, and files that come back."""
    flags = ["--cpu", "--out", tmp_path, "--modes", "off,repeat,det", "--phases", "ambcdef"]
    # the GPU's bounds, with room for a loaded 2-core machine (load 22: phase d took 167 s)
    flags += ["--deadline", "560", "--phase-timeout", "d=240"]
    flags += ["--tests", "test_dataparallel_replicas_compute_in_the_asked_dtype"]
    proc = run_check(flags, timeout=600)
    rows = summary_rows(proc.stdout)
    assert rows.keys() == set("ambcdef") and all(s == "ok" for s, _ in rows.values()), rows
    assert "dry mode: on the CPU" in rows["a"][1] and "fork server: works (cpu)" in rows["a"][1]
    assert re.search(r"^\d+/11 rows measured; best: \S+, no peak known", rows["m"][1]), rows["m"]
    assert re.search(r"seed 0: 94% (in [\d.]+ s \(epoch \d+\)|not reached), final", rows["b"][1])
    assert re.search(r"ddp_train.py [\d.]+ ms, bare loop [\d.]+ ms: [\d.]+x", rows["b"][1])
    assert re.search(r"fsdp_train.py: [\d.e+]+ tok/s", rows["c"][1]), rows["c"][1]
    assert "profile: trace.json.gz" in rows["c"][1]
    assert "2/2 finished" in rows["e"][1] and "targeted: 1 passed" in rows["f"][1]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary)[: len(check.HEADLINE)] == list(check.HEADLINE)
    assert summary["device"] == "CPU (dry run)" and summary["torch"].startswith("2.")
    assert summary["gpt2_small_best_mfu"] is None  # no peak to divide by on a CPU
    results = summary["phases"]
    levers = {r["name"]: r for r in results["m"]["figures"]["rows"]}
    assert summary["gpt2_small_best_config"]["name"] in levers
    assert levers["baseline"]["status"] == "ok" and levers["baseline"]["tokens_per_second"] > 0
    fashion = results["b"]["figures"]
    assert fashion["flops_per_second"] > 0 and fashion["bare_cudnn_benchmark"] is False, fashion
    assert fashion["warmup_seconds"] >= 0 and fashion["seeds"]["0"]["epochs"] == 2, fashion
    gpt = results["c"]["figures"]["fsdp_train.py"]
    assert gpt["epochs"] == 2 and gpt["steps"] == 6, gpt  # 3 steps an epoch, as the file made
    assert gpt["tokens_per_second"] == pytest.approx(32 * gpt["samples_per_second"])
    probes = results["d"]["figures"]
    assert probes.keys() == {"channels_last vs NCHW", "model_parallel split vs one device"}
    for quantity in probes.values():  # the CPU: fp32 rounding only, and no noise
        assert all(quantity[m] < 1e-4 for m in ("off", "repeat", "det")), quantity
        assert quantity["noise"] == 0, quantity
    text = (tmp_path / "summary.md").read_text()
    assert "| GPU vs CPU (MLP) | test_gpu_equals_cpu | skipped: needs CUDA |" in text
    assert "| compiled CNN vs eager | test_compile | skipped: needs CUDA |" in text
    assert "| baseline | 2 |" in text  # phase m's table
    assert "1 passed" in (tmp_path / "pytest.log").read_text()
    assert (tmp_path / "stacks.txt").read_text() == ""  # nothing was stopped
    with gzip.open(tmp_path / "trace.json.gz") as f:
        assert json.load(f)["traceEvents"]
    with tarfile.open(tmp_path / "metrics.tar.gz") as tar:
        names = tar.getnames()
        record = json.loads(tar.extractfile("gpt-fsdp_train/metrics.jsonl").readline())
    wanted = {"fashion-seed0-2ep/metrics.jsonl", "gpt-fsdp_train/metrics.jsonl"}
    assert wanted <= set(names), names
    assert record["step"] == 3 and "flops_per_second" in record
    assert_files_come_back(tmp_path)
    assert (
        not (ROOT / "benchmarks/gpu/summary.json").exists()
        or "CPU" not in (ROOT / "benchmarks/gpu/summary.json").read_text()
    )  # the dry run leaves the GPU's figures alone


@pytest.mark.slow
def test_a_check_stopped_from_outside_stops_what_it_runs(tmp_path):
    """SIGTERM to the check (a caller's own timeout, say) stops the commands it runs, which are
    in process groups of their own, out of the caller's reach; their stacks are kept."""
    flags = ["--cpu", "--no-fork-server", "--out", tmp_path, "--phases", "e", "--stall", "e"]
    proc = check.start_fresh([sys.executable, "benchmarks/gpu/check.py", *flags], ROOT, clean_env())
    try:
        while "phase e" not in proc.stdout.readline():
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


# ----------------------------------------------------------------------------------------
# What the GPU run builds, read here without it


def fake_check(tmp_path, cuda=True, phases="abcdef"):
    """What the phases' builders read of a Check: its device, phases, work and out folders."""
    c = SimpleNamespace(cuda=cuda, device="cuda" if cuda else "cpu", fork_ok=None)
    c.args = SimpleNamespace(phases=phases)
    c.work = c.out = tmp_path
    c.env = lambda extra=None: {"PATH": "/usr/bin", **(extra or {})}
    c.output_dir = lambda name: tmp_path / name
    return c


def test_the_gpt_runs_are_built_with_every_flag_and_skipped_where_one_is_missing(tmp_path):
    """Each sharded script runs the GPT at GPT-2-small size with --depth; a script whose --help
    lacks one of the command's flags (or the text and gpt choices) is skipped, saying which."""
    plan = check.lm_plan(fake_check(tmp_path))
    assert [name for name, _, _ in plan[:2]] == ["fsdp_train.py", "fsdp_train.py --compile"]
    assert {script for _, script, _ in plan} == set(check.LM_SCRIPTS)
    assert check.LM_SIZE == ["--depth", "12", "--dim", "768", "--heads", "12", "--seq-len", "1024"]
    cmd = [*check.LM, *check.LM_SIZE, "--max-steps", "60"]
    shown = "usage: [--data {fashion-mnist,text}] [--model {vit,gpt}] [--amp {none,bf16}]"
    shown += " [--lr LR] [--dim DIM] [--heads HEADS] [--seq-len SEQ_LEN] [--max-steps N]"
    assert check.missing_flags(shown, cmd) == ["--depth"]
    assert check.missing_flags(shown + " [--depth DEPTH]", cmd) == []
    assert check.missing_flags(shown.replace(",text", ""), cmd) == ["--depth", "text"]
    # --dim is not --dimension, nor --max-steps --max-steps-per-epoch
    assert check.missing_flags("--dimension --max-steps-per-epoch", ["--dim", "--max-steps"]) == [
        "--dim",
        "--max-steps",
        "text",
        "gpt",
    ]


def test_the_text_file_makes_the_asked_steps_per_epoch(tmp_path):
    """data.load_text on the check's text file: exactly `steps` whole batches to train on (the
    second epoch, the measured one, is as long as the first), and a held-out tail."""
    import data

    for steps, batch, seq_len in ((30, 16, 1024), (3, 4, 32), (30, 8, 1024)):
        path = check.text_file(tmp_path / "text.txt", steps, batch, seq_len)
        train, held = data.load_text(path, seq_len)
        assert len(train) // batch == steps and len(held) >= 1, (steps, batch, len(train))


def test_a_memory_snapshot_too_large_is_cut_to_come_back(tmp_path, monkeypatch):
    """A CUDA memory snapshot over the check's file limit (16 MiB) keeps 8 frames per
    stack, then its later events, until it fits; one that fits comes back whole."""
    frames = [dict(filename=f"file{i}.py", line=i, name=f"f{i}") for i in range(30)]
    events = [dict(action="alloc", addr=i, size=512, frames=frames) for i in range(4000)]
    snapshot = dict(segments=[dict(blocks=[dict(size=512, frames=frames)])], device_traces=[events])
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "rank0_memory.pickle").write_bytes(pickle.dumps(snapshot))
    c = fake_check(tmp_path)
    assert check.profile_files(c) == ["memory.pickle.gz"]
    whole = pickle.loads(gzip.decompress((tmp_path / "memory.pickle.gz").read_bytes()))
    assert whole == snapshot
    monkeypatch.setattr(check, "FILE_LIMIT", 4000)
    assert check.profile_files(c) == ["memory.pickle.gz"]
    packed = (tmp_path / "memory.pickle.gz").read_bytes()
    cut = pickle.loads(gzip.decompress(packed))
    assert len(packed) <= 4000 and cut["device_traces"][0], len(packed)
    assert cut["device_traces"][0][-1] == dict(events[-1], frames=frames[:8])
    assert cut["segments"][0]["blocks"][0]["frames"] == frames[:8]


def test_no_command_runs_twice_and_a_failed_fork_falls_back_to_fresh_processes(tmp_path):
    """Phase e leaves the FSDP test's own run to phase f when f runs too (else keeps it); phase
    f's pytest starts fresh interpreters when the fork server's children could not use CUDA."""
    assert check.TEST_OWN in check.fsdp_variants(fake_check(tmp_path, phases="abcde"))
    assert check.TEST_OWN not in check.fsdp_variants(fake_check(tmp_path, phases="ef"))
    c = fake_check(tmp_path)
    assert "FRESH_PROCESSES" not in check.tests_env(c)
    c.fork_ok = False
    assert check.tests_env(c)["FRESH_PROCESSES"] == "1"


def test_the_probes_deterministic_mode_runs_the_script_as_itself(tmp_path):
    """The new probes' commands (test_compile's, test_sync_bn_one_gpu's under torchrun,
    cuda:0,cuda:0), and the deterministic mode's wrapper: the script runs as __main__ with
    its own folder on sys.path (its imports) and deterministic algorithms on."""
    c = fake_check(tmp_path)
    runs, shared = check.probe_runs(c)
    jobs = check.probe_jobs(c, runs, shared, ["off", "det"])
    assert "--compile" in jobs[next(iter(jobs))][0]  # the longest first
    sync_bn = [str(a) for a in jobs["cnn_sync_bn@det"][0]]
    assert sync_bn[: len(check.TORCHRUN) + 2] == [
        *check.TORCHRUN,
        str(tmp_path / "deterministic.py"),
        "ddp_train.py",
    ]
    assert "cuda:0,cuda:0" in jobs["mp_gpus@off"][0]
    assert check.QUANTITIES["compiled CNN vs eager"][1:3] == ("cnn_compile", "cnn_nhwc")
    folder = tmp_path / "scripts"  # not the wrapper's folder (the first on sys.path)
    folder.mkdir()
    (folder / "sibling.py").write_text("VALUE = 7\n")
    script = "import sibling, torch\nprint(__name__, sibling.VALUE,"
    script += " torch.are_deterministic_algorithms_enabled())\n"
    (folder / "script.py").write_text(script)
    proc = run_python([tmp_path / "deterministic.py", folder / "script.py"])
    assert proc.stdout.split() == ["__main__", "7", "True"]


def test_the_headline_is_merged_into_the_kept_summary_on_a_gpu(tmp_path, monkeypatch):
    """On a GPU, summary.json's headline also goes into benchmarks/gpu/summary.json, merged: a
    later check (--phases cf) adds each script's MFU and keeps the first check's figures; the
    dry mode writes nothing there."""
    monkeypatch.setattr(check, "ROOT", tmp_path)
    (tmp_path / "benchmarks/gpu").mkdir(parents=True)
    kept = tmp_path / "benchmarks/gpu/summary.json"
    c = fake_check(tmp_path)
    c.args.cpu, c.started, c.elapsed = False, time.time(), lambda: 1.0
    c.device_name = lambda: "NVIDIA H200"  # nvidia-smi's, where phase a did not run
    best = dict(name="best", batch=64, fused=True, sdpa="cudnn", mfu=0.4567, compile="model")
    first = dict(a=dict(figures=dict(gpu="NVIDIA H200", torch="2.11.0")))
    first["m"] = dict(figures=dict(best=best))
    first["b"] = dict(figures=dict(data="fashion-mnist", time_to_target=12.5, warmup_seconds=2))
    check.write_files(c, [], dict(phases=first), [])
    scripts = {"fsdp_train.py": dict(mfu=0.3), "model_parallel.py": dict(status="skipped")}
    check.write_files(c, [], dict(phases=dict(c=dict(figures=scripts))), [])
    merged = json.loads(kept.read_text())
    assert merged["device"] == "NVIDIA H200" and merged["gpt2_small_best_mfu"] == 45.7
    assert merged["gpt2_small_best_config"]["sdpa"] == "cudnn"
    assert merged["fashion_mnist_94_seconds"] == 12.5
    assert merged["script_mfu"] == {"fsdp_train.py": 30.0}
    assert json.loads((tmp_path / "summary.json").read_text())["fashion_mnist_94_seconds"] is None
    kept.unlink()
    c.args.cpu = True
    check.write_files(c, [], dict(phases=first), [])
    assert not kept.exists()
