"""The first thing a session lent a GPU runs: one check of at most 7 minutes, every phase
bounded, whose files say what the next changes need (tolerances, a stalled run's stacks).

    python benchmarks/gpu/check.py                   # on the GPU machine: files under $OUT
    python benchmarks/gpu/check.py --cpu --out DIR   # dry mode: every phase small, on the CPU

Phases, in this order, each with a bound of its own (--phase-timeout) under one deadline
(--deadline, 420 s); a phase that runs out is stopped, reported, and the next one starts:
  a  versions: torch, CUDA, cuDNN, the GPU, its driver; the TF32 flags, and the error of an fp32
     convolution and matmul against float64 with TF32 as it is and with NVIDIA_TF32_OVERRIDE=0
  b  tolerance probes: what tests/test_gpu.py compares (channels_last against NCHW, the CNN
     split over cuda:0 and the CPU against one device, the GPU against the CPU), each run with
     TF32 on, off, off again (run-to-run noise), and off with deterministic algorithms
  c  fsdp_train.py --cpu-offload, with and without --amp bf16 and --clip-grad, ViT and CNN:
     side by side, each under torchrun, which finished and in how long
  d  ddp_train.py's step against benchmarks/bare_loop.py's on the GPU (ResNet-18, bf16)
  e  tests/test_gpu.py: the tests that failed last time first, then the others (-x)

A command that outlives its bound is stopped with its whole process tree (torchrun's workers
run in sessions of their own): first every Python process in it writes its threads' stacks
(faulthandler, armed by a sitecustomize on PYTHONPATH), then SIGTERM, then SIGKILL. Files
under --out ($OUT), five: summary.md (the table printed at the end, and each phase's
figures), check.json, commands.log (every command, its status and its output's end),
stacks.txt (the stacks of what was stopped), pytest.log. Runs write under a temporary folder.
The Fashion-MNIST files for phase d: the four .gz files in --gz-dir (default .gpudata/, the
folder carried to the GPU machine), unpacked into --data-dir/FashionMNIST/raw/.
"""

import argparse
import concurrent.futures
import contextlib
import gzip
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
PHASES = {
    "a": ("versions", 60),
    "b": ("tolerance probes", 150),
    "c": ("fsdp cpu offload", 130),
    "d": ("step vs bare loop", 100),
    "e": ("test_gpu.py", 300),
}
GRACE = 10  # seconds between SIGTERM and SIGKILL when a command is stopped
TF32_OFF = {"NVIDIA_TF32_OVERRIDE": "0"}  # read by cuBLAS and cuDNN when they load
# test_gpu.py's environment for every run: cuBLAS repeats its bits only with a fixed workspace.
TEST_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", **TF32_OFF}


# ----------------------------------------------------------------------------------------
# Bounded commands, their process trees and their stacks (tests/test_gpu.py uses these too)

SITECUSTOMIZE = '''\
"""Written by benchmarks/gpu/check.py: with DUMP_STACKS_DIR set, SIGUSR1 makes this process
write every thread's Python stack to DUMP_STACKS_DIR/PID.txt. faulthandler writes from the
signal handler itself: a thread stuck in C (a collective, a CUDA call) still shows its stack."""
import faulthandler, importlib.machinery, importlib.util, os, signal, sys


def _arm(folder):
    try:
        file = open(os.path.join(folder, f"{os.getpid()}.txt"), "w")
    except OSError:
        return None
    argv = " ".join(a.replace("\\n", " ")[:200] for a in sys.orig_argv)
    file.write(f"pid {os.getpid()}: {argv}\\n")
    file.flush()
    faulthandler.register(signal.SIGUSR1, file=file, all_threads=True, chain=False)
    return file


_file = _arm(os.environ["DUMP_STACKS_DIR"]) if os.environ.get("DUMP_STACKS_DIR") else None
# The sitecustomize this one hides, if there is one, runs as it would have.
_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
'''


def with_stack_dumps(env, folder):
    """env for a command whose Python processes write their stacks into `folder` on SIGUSR1
    (the sitecustomize above, first on PYTHONPATH; every process started inherits it)."""
    site = Path(folder) / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = [str(site), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    return {**env, "PYTHONPATH": os.pathsep.join(path), "DUMP_STACKS_DIR": str(folder)}


def read_stacks(folder):
    """The stacks written into `folder`: one block per process that wrote any."""
    files = sorted(Path(folder).glob("*.txt"), key=lambda f: f.stat().st_mtime)
    texts = [f.read_text(errors="replace") for f in files]
    return "\n".join(t for t in texts if "most recent call first" in t)


def process_tree(pid):
    """pid and every process below it (children, their children, ...), from /proc."""
    children = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        with contextlib.suppress(OSError):
            os.kill(pid, 0)
            return True
        return False


def process_group(pid):
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def signal_all(pids, sig, groups=True):
    """sig to the process groups of `pids` (but the caller's own) or, without groups, to each
    process alone; once to each process (torchrun's SIGTERM handler, hit twice, stops its
    own shutdown)."""
    own, by_group = os.getpgid(0), set()
    for group in {process_group(p) for p in pids} - {None, own} if groups else ():
        with contextlib.suppress(OSError):
            os.killpg(group, sig)
            by_group.add(group)
    for pid in pids:
        if process_group(pid) not in by_group:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)


def stop_tree(proc, grace=GRACE, dump_wait=1.0):
    """Stop proc and everything it started: their Python stacks first (SIGUSR1, see
    with_stack_dumps), then SIGTERM to every process and process group of the tree, SIGKILL
    to what is left after `grace` s. The tree, not only proc's group: torchrun starts each
    worker in a session of its own. Collected before the first signal: an orphan is found no
    more."""
    seen = set(process_tree(proc.pid))
    signal_all(seen, signal.SIGUSR1, groups=False)
    time.sleep(dump_wait)
    seen |= set(process_tree(proc.pid))
    signal_all(seen, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        proc.poll()
        if not any(alive(p) for p in seen):
            break
        time.sleep(0.1)
    seen |= set(process_tree(proc.pid))
    signal_all([p for p in seen if alive(p)], signal.SIGKILL)


def start_fresh(cmd, cwd, env):
    """A new interpreter in a session (and process group) of its own."""
    return subprocess.Popen(
        list(map(str, cmd)),
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
    )


@dataclass
class Run:
    cmd: list
    status: object  # the exit status, or "timed out", "not started"
    seconds: float = 0.0
    stdout: str = ""
    stderr: str = ""
    stacks: str = ""
    timeout: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def ok(self):
        return self.status == 0

    def tail(self, chars=3000):
        return f"--- stdout\n{self.stdout[-chars:]}\n--- stderr\n{self.stderr[-chars:]}"


LIVE = set()  # the commands running now (stop_live ends them)


def run_bounded(cmd, timeout, env=None, cwd=ROOT, start=start_fresh, grace=GRACE):
    """Run cmd to its end or for `timeout` s, whichever comes first, in a session of its own
    (start(cmd, cwd, env) must give it one); on timeout stop_tree, with the stacks."""
    cmd = list(map(str, cmd))
    folder = tempfile.mkdtemp(prefix="stacks-")
    proc = None
    try:
        proc = start(cmd, cwd, with_stack_dumps(dict(env or os.environ), folder))
        t0 = time.monotonic()  # the command's own time (not a fork server's start)
        LIVE.add(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
            status = proc.returncode
        except BaseException as e:
            stop_tree(proc, grace)
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            status = "timed out"
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # a process out of reach still holds a pipe
                out, err = "", "(output not read: a process still holds the pipes)"
        return Run(cmd, status, time.monotonic() - t0, out, err, read_stacks(folder), timeout)
    finally:
        LIVE.discard(proc)
        shutil.rmtree(folder, ignore_errors=True)


def stop_live(signum, frame):
    """On SIGTERM (a caller's own timeout): stop every running command with its tree (they run
    in sessions of their own, out of the caller's reach), then end."""
    for proc in list(LIVE):
        stop_tree(proc, grace=2)
    raise SystemExit(128 + signum)


# ----------------------------------------------------------------------------------------
# The check: phases, each command bounded by its own time and by the phase's


def show(cmd):
    """The command as a person would type it; the long `python -c` programs by name."""
    names = {VERSIONS: "VERSIONS", STALL: "STALL"}  # (in this file)
    cmd = [names.get(str(c), str(c)) for c in cmd]
    if cmd[:3] == TORCHRUN[:3]:
        cmd = ["torchrun", *cmd[3:]]
    elif cmd[:1] == [PY]:
        cmd = ["python", *cmd[1:]]
    return shlex.join(cmd).replace(str(ROOT) + "/", "")


STALL = "import time\ndef stalled_on_purpose():\n    while True:\n        time.sleep(1)\n"
STALL += "stalled_on_purpose()\n"


class Check:
    def __init__(self, args):
        self.args, self.t0 = args, time.monotonic()
        self.deadline = self.t0 + args.deadline
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu-check-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        for name in ("commands.log", "stacks.txt"):
            (self.out / name).write_text("")
        self.phase, self.phase_end, self.runs = None, self.deadline, []
        self.cuda = False
        self.device = "cpu"
        self.start = start_fresh
        self.server = None
        if args.fork_server:  # the dry mode's: torch imported once (tests/forkserver.py)
            sys.path.insert(0, str(ROOT / "tests"))
            import forkserver

            self.server = forkserver.Server(self.env(TEST_ENV))
            self.start = self.forked

    def forked(self, cmd, cwd, env):
        if cmd[0] == PY and not self.server.needs_fresh(cmd[1:], env):
            return self.server.popen(cmd, cwd, env, new_session=True)
        return start_fresh(cmd, cwd, env)

    def append(self, name, text):
        with open(self.out / name, "a") as f:
            f.write(text)

    def close(self):
        if self.server:
            self.server.close()
        if not self.args.work_dir:
            shutil.rmtree(self.work, ignore_errors=True)

    def elapsed(self):
        return time.monotonic() - self.t0

    def say(self, message):
        print(f"[{self.elapsed():5.0f} s] {message}", flush=True)

    def env(self, extra=None, omit=("NVIDIA_TF32_OVERRIDE",)):
        """This process's environment, less TF32's override, plus `extra`: each mode's own."""
        env = {k: v for k, v in os.environ.items() if k not in omit}
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "2"))
        return env | (extra or {})

    def run(self, name, cmd, bound, env=None, start=None):
        """One command, bounded by `bound` and by what is left of the phase; logged."""
        left = self.phase_end - time.monotonic()
        if left < 1:
            run = Run(list(map(str, cmd)), "not started", extra=dict(name=name))
        else:
            if self.phase in self.args.stall:
                cmd = [PY, "-c", STALL]
            run = run_bounded(cmd, min(bound, left), env or self.env(), start=start or self.start)
            run.extra["name"] = name
        with self.lock:
            self.runs.append(run)
            status = "ok" if run.ok else run.status
            self.say(f"{self.phase}/{name}: {status} in {run.seconds:.1f} s")
            head = (
                f"== {self.phase}/{name}: {status}, {run.seconds:.1f} s (bound {run.timeout:.0f} s)"
            )
            self.append("commands.log", f"{head}\n$ {show(run.cmd)}\n{run.tail()}\n\n")
            if run.stacks:
                self.append("stacks.txt", f"{head}\n$ {show(run.cmd)}\n{run.stacks}\n\n")
        return run

    def run_many(self, jobs, parallel):
        """jobs: {name: (cmd, bound, env)}, `parallel` at a time; {name: Run}."""
        with concurrent.futures.ThreadPoolExecutor(max(1, parallel)) as pool:
            futures = {n: pool.submit(self.run, n, *job) for n, job in jobs.items()}
            return {n: f.result() for n, f in futures.items()}

    def output_dir(self, name):
        path = self.work / name
        shutil.rmtree(path, ignore_errors=True)
        return path


def phase_status(runs):
    statuses = [r.status for r in runs]
    if "timed out" in statuses or "not started" in statuses:
        return "timed out"
    return "ok" if all(s == 0 for s in statuses) else "failed"


def last_json(text):
    for line in reversed(text.splitlines()):
        with contextlib.suppress(json.JSONDecodeError):
            if line.startswith("{"):
                return json.loads(line)
    return None


# ---- a: versions

VERSIONS = r"""
import json, os, sys
import torch
import torch.nn.functional as F
b = torch.backends
info = dict(python=sys.version.split()[0], torch=torch.__version__, cuda=torch.version.cuda)
info["cudnn"] = b.cudnn.version() if b.cudnn.is_available() else None
info["tf32"] = dict(
    NVIDIA_TF32_OVERRIDE=os.environ.get("NVIDIA_TF32_OVERRIDE"),
    matmul_allow_tf32=b.cuda.matmul.allow_tf32,
    cudnn_allow_tf32=b.cudnn.allow_tf32,
    float32_matmul_precision=torch.get_float32_matmul_precision(),
)
for name, obj in (("matmul", b.cuda.matmul), ("cudnn_conv", getattr(b.cudnn, "conv", None))):
    if hasattr(obj, "fp32_precision"):  # PyTorch 2.9's way of saying it
        info["tf32"][name + "_fp32_precision"] = obj.fp32_precision
info["cuda_available"] = torch.cuda.is_available()
if info["cuda_available"]:
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, gpus=torch.cuda.device_count(), memory_gib=p.total_memory / 2**30)
    info["capability"] = "%d.%d" % (p.major, p.minor)
    # What the arithmetic does: fp32 on the GPU against float64 on the CPU. TF32 keeps 10
    # bits of mantissa: about 1e-3 of relative error; fp32: about 1e-6.
    torch.manual_seed(0)
    x, w = torch.randn(8, 64, 28, 28), torch.randn(64, 64, 3, 3)
    conv = F.conv2d(x.cuda(), w.cuda(), padding=1).cpu().double()
    exact = F.conv2d(x.double(), w.double(), padding=1)
    info["conv_error"] = ((conv - exact).norm() / exact.norm()).item()
    a, m = torch.randn(512, 512), torch.randn(512, 512)
    exact = a.double() @ m.double()
    got = (a.cuda() @ m.cuda()).cpu().double()
    info["matmul_error"] = ((got - exact).norm() / exact.norm()).item()
print(json.dumps(info))
"""


def phase_versions(c):
    env = {"on": c.env(), "off": c.env(TF32_OFF)}
    runs = c.run_many({m: ([PY, "-c", VERSIONS], 50, e) for m, e in env.items()}, 2)
    info = {m: last_json(r.stdout) for m, r in runs.items() if r.ok}
    figures = dict(info.get("on") or {})
    if "off" in info:
        figures["tf32_override_0"] = info["off"]["tf32"]
        for key in ("conv_error", "matmul_error"):
            if key in info["off"]:
                figures[key + "_tf32_override_0"] = info["off"][key]
    if shutil.which("nvidia-smi"):
        query = ["--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        smi = c.run("nvidia-smi", ["nvidia-smi", *query], 20)
        figures["nvidia_smi"] = smi.stdout.strip() if smi.ok else f"failed: {smi.status}"
    c.cuda = bool(figures.get("cuda_available")) and not c.args.cpu
    c.device = "cuda" if c.cuda else "cpu"
    key = [f"torch {figures.get('torch')}", f"CUDA {figures.get('cuda')}"]
    key += [f"cuDNN {figures.get('cudnn')}", str(figures.get("gpu", "no GPU"))]
    if "," in figures.get("nvidia_smi", ""):
        key.append(f"driver {figures['nvidia_smi'].split(', ')[1]}")
    if "conv_error" in figures:
        key.append(
            f"fp32 conv error {figures['conv_error']:.1e} (TF32 off: "
            f"{figures.get('conv_error_tf32_override_0', float('nan')):.1e})"
        )
    return phase_status(runs.values()), figures, "; ".join(key), [], list(runs.values())


# ---- b: tolerance probes

SYN = ["--data", "synthetic", "--dist-timeout", "60"]
# tests/test_gpu.py's runs: 5 steps at a high rate, so that the weights move far more than
# any tolerance; the initial weights from one step at a rate too small to change them.
MLP = ["--model", "mlp", "--epochs", "1", "--batch-size", "32", "--max-steps", "5"]
MLP += ["--lr", "0.8", "--warmup", "0"]
CNN = ["--model", "cnn", "--epochs", "1", "--batch-size", "32", "--max-steps", "5", "--lr", "0.4"]
MP = ["--epochs", "1", "--max-steps", "5", "--batch-size", "32", "--lr", "4"]
INITIAL = ["--max-steps", "1", "--lr", "1e-12"]
DETERMINISTIC = (
    "import runpy, sys, torch\n"
    "torch.use_deterministic_algorithms(True, warn_only=True)\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)
# Each mode: its environment and whether it runs with torch.use_deterministic_algorithms.
MODES = {
    "on": ({"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, False),  # TF32 as PyTorch leaves it
    "off": (TEST_ENV, False),  # what test_gpu.py runs with
    "repeat": (TEST_ENV, False),  # the same again: run-to-run noise
    "det": (TEST_ENV, True),
}


def weights(state):
    """As tests/test_gpu.py: the trained parameters as one vector (no BatchNorm statistics)."""
    import torch

    keys = sorted(k for k in state if not any(s in k for s in ("running_", "num_batches")))
    return torch.cat([state[k].double().flatten() for k in keys])


def relative_error(state, reference, initial):
    """As tests/test_gpu.py: |state - reference| / |reference - initial|."""
    moved = (weights(reference) - weights(initial)).norm()
    if moved <= 1e-3:
        return float("nan")
    return ((weights(state) - weights(reference)).norm() / moved).item()


def load_model(path):
    import torch

    file = Path(path) / "checkpoint.pt"
    return (
        torch.load(file, map_location="cpu", weights_only=True)["model"] if file.exists() else None
    )


def probe_runs(c):
    """{name: (script, flags)} of every run the probes need, at each mode; the names are
    QUANTITY's runs as 'run@mode', the initial weights' as 'initial-...'."""
    dev = c.device
    mp_one, mp_split = ("cuda:0", "cuda:0,cpu") if c.cuda else ("cpu", "cpu,cpu")
    runs = {
        "cnn_nhwc": ("ddp_train.py", [*CNN, "--device", dev, "--channels-last"]),
        "cnn_nchw": ("ddp_train.py", [*CNN, "--device", dev, "--no-channels-last"]),
        "mp_one": ("model_parallel.py", [*MP, "--device", dev, "--devices", mp_one]),
        "mp_split": (
            "model_parallel.py",
            [*MP, "--device", dev, "--devices", mp_split, "--microbatches", "4"],
        ),
    }
    if c.cuda:
        runs["mlp_gpu"] = ("ddp_train.py", [*MLP, "--device", "cuda"])
    shared = {
        "initial-cnn": ("ddp_train.py", [*CNN, "--device", "cpu", *INITIAL]),
        "initial-mp": ("model_parallel.py", [*MP, "--device", "cpu", "--devices", "cpu", *INITIAL]),
    }
    if c.cuda:
        shared["mlp_cpu"] = ("ddp_train.py", [*MLP, "--device", "cpu"])
        shared["initial-mlp"] = ("ddp_train.py", [*MLP, "--device", "cpu", *INITIAL])
    return runs, shared


# quantity: (what test_gpu.py compares, its run, the reference run, the initial weights' run)
QUANTITIES = {
    "channels_last vs NCHW": ("test_channels_last", "cnn_nhwc", "cnn_nchw", "initial-cnn"),
    "model_parallel split vs one device": (
        "test_model_parallel_devices",
        "mp_split",
        "mp_one",
        "initial-mp",
    ),
    "GPU vs CPU (MLP)": ("test_gpu_equals_cpu", "mlp_gpu", "mlp_cpu", "initial-mlp"),
}


def phase_probes(c):
    runs, shared = probe_runs(c)
    modes = [m for m in c.args.modes.split(",") if c.cuda or m != "on"]  # TF32 needs CUDA
    jobs = {}
    for name, (script, flags) in shared.items():
        cmd = [PY, script, *SYN, *flags, "--output-dir", c.output_dir(name)]
        jobs[name] = (cmd, 90, c.env(TEST_ENV))
    for mode in modes:
        extra, deterministic = MODES[mode]
        for name, (script, flags) in runs.items():
            key = f"{name}@{mode}"
            cmd = [PY, "-c", DETERMINISTIC] if deterministic else [PY]
            cmd += [script, *SYN, *flags, "--output-dir", c.output_dir(key)]
            jobs[key] = (cmd, 90, c.env(extra))
    done = c.run_many(jobs, c.args.parallel)
    state = {name: load_model(c.work / name) for name in jobs}
    table, figures = [], {}
    for quantity, (test, run, reference, initial) in QUANTITIES.items():
        if run not in runs:
            table.append([quantity, test, "skipped: needs CUDA"] + [""] * 4)
            continue
        row = {}
        for mode in modes:
            parts = [state.get(f"{run}@{mode}"), state.get(reference), state.get(initial)]
            parts[1] = state.get(f"{reference}@{mode}", parts[1])
            row[mode] = relative_error(*parts) if all(p is not None for p in parts) else None
        # run-to-run noise: each run against its repeat, measured by the same yardstick
        if "off" in modes and "repeat" in modes:
            noise = []
            for name in (run, reference):
                a, b = state.get(f"{name}@off"), state.get(f"{name}@repeat")
                if a is not None and b is not None and state.get(initial) is not None:
                    noise.append(relative_error(a, b, state[initial]))
            row["noise"] = max(noise) if noise else None
        det = [done[k] for k in done if k.endswith("@det") and k.split("@")[0] in (run, reference)]
        if any("does not have a deterministic implementation" in r.stderr for r in det):
            row["det_warnings"] = True
        figures[quantity] = dict(test=test, **row)
        cells = [fmt(row.get(m)) for m in ("on", "off", "repeat", "noise", "det")]
        table.append([quantity, test, *cells])
    header = ["quantity", "test", "TF32 on", "TF32 off", "off again", "noise", "deterministic"]
    lines = ["Relative error (test_gpu.relative_error: the distance between the two runs' "]
    lines[0] += "weights over the distance training moved the reference), by mode:"
    lines += ["", *markdown([header, *table])]
    key = "; ".join(
        f"{q.split(' vs')[0]}: " + " ".join(f"{m} {fmt(v)}" for m, v in f.items() if m in MODES)
        for q, f in figures.items()
    )
    return phase_status(done.values()), figures, key, lines, list(done.values())


def fmt(value):
    if value is None:
        return "n/a"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return f"{value:.2g}" if isinstance(value, float) else str(value)


def markdown(rows):
    header, *body = rows
    return [
        "| " + " | ".join(map(str, header)) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(map(str, r)) + " |" for r in body),
    ]


# ---- c: fsdp_train.py --cpu-offload, side by side

FSDP = ["--dist-timeout", "60", "--data", "synthetic", "--batch-size", "32", "--max-steps", "5"]
FSDP += ["--warmup", "0", "--lr", "0.05", "--save-every", "2"]


def fsdp_variants(c):
    """{name: flags}: the test's run (ViT, bf16, clip, async save) and its neighbours."""
    variants = {}
    for model in ("vit", "cnn"):
        for amp in ("bf16", "none"):
            for clip in (True, False):
                name = f"{model}-{amp}" + "-clip" * clip
                flags = ["--model", model, "--amp", amp, "--async-save"]
                variants[name] = flags + ["--clip-grad", "1"] * clip
    variants["vit-bf16-clip-sync-save"] = ["--model", "vit", "--amp", "bf16", "--clip-grad", "1"]
    if not c.cuda:  # the dry mode: two of them, on the CPU (no offload without CUDA)
        variants = {k: variants[k] for k in ("vit-bf16-clip", "cnn-none")}
    return variants


def phase_fsdp(c):
    offload = ["--device", "cuda", "--cpu-offload"] if c.cuda else ["--device", "cpu"]
    jobs = {}
    for name, flags in fsdp_variants(c).items():
        cmd = [*TORCHRUN, "fsdp_train.py", *FSDP, *offload, *flags]
        jobs[name] = ([*cmd, "--output-dir", c.output_dir("fsdp-" + name)], 120, c.env(TEST_ENV))
    done = c.run_many(jobs, len(jobs))
    table, figures = [], {}
    for name, run in done.items():
        status = "finished" if run.ok else str(run.status)
        steps = re.findall(r"\bstep (\d+)", run.stdout)
        figures[name] = dict(status=status, seconds=round(run.seconds, 1), command=show(run.cmd))
        table.append([name, status, f"{run.seconds:.1f}", steps[-1] if steps else ""])
    lines = ["Each variant under `torchrun --nproc_per_node=1`, all at once:", ""]
    lines += markdown([["variant", "status", "seconds", "last step logged"], *table])
    finished = sum(r.ok for r in done.values())
    stalled = [n for n, r in done.items() if r.status == "timed out"]
    key = f"{finished}/{len(done)} finished" + (f"; stalled: {', '.join(stalled)}" * bool(stalled))
    return phase_status(done.values()), figures, key, lines, list(done.values())


# ---- d: ddp_train.py's step against the bare loop

RAW = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte")
RAW += ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def unpack_fashion_mnist(gz_dirs, data_dir):
    """The four raw files in data_dir/FashionMNIST/raw/, unpacked from NAME.gz in the first of
    gz_dirs that holds it where missing; True if all four are there."""
    raw = Path(data_dir) / "FashionMNIST" / "raw"
    for name in RAW:
        if (raw / name).exists():
            continue
        found = [Path(d) / f"{name}.gz" for d in gz_dirs if (Path(d) / f"{name}.gz").exists()]
        if not found:
            return False
        raw.mkdir(parents=True, exist_ok=True)
        with gzip.open(found[0]) as src, open(raw / f"{name}.part", "wb") as dst:
            shutil.copyfileobj(src, dst)
        (raw / f"{name}.part").rename(raw / name)
    return True


def phase_step(c):
    data_dir = Path(c.args.data_dir)
    if data_dir.is_symlink() and not data_dir.exists():  # a link that did not travel whole
        data_dir = Path(c.args.gz_dir) / "data"
    gz_dirs = [c.args.gz_dir, "/usr/share/datasets/fashion-mnist"]
    fashion = c.cuda and unpack_fashion_mnist(gz_dirs, data_dir)
    if fashion:  # run_all.py's section e, two epochs
        data = ["--data", "fashion-mnist", "--data-dir", data_dir]
        model = ["--model", "resnet18", "--batch-size", "256", "--amp", "bf16", "--augment"]
        epochs, bare_steps = 2, 200
    else:  # no data set or no GPU: the same commands, small
        data, model, epochs, bare_steps = ["--data", "synthetic"], ["--model", "mlp"], 2, 50
        model += ["--batch-size", "64"]
    dev = ["--device", c.device]
    ddp = [PY, "ddp_train.py", *data, *model, *dev, "--epochs", str(epochs), "--channels-last"]
    ddp += ["--output-dir", c.output_dir("step-ddp")]
    bare = [PY, "benchmarks/bare_loop.py", *data, *model, *dev, "--steps", str(bare_steps)]
    runs = [c.run("ddp_train", ddp, 90), c.run("bare_loop", bare, 60)]  # one after the other
    figures = dict(data="fashion-mnist" if fashion else "synthetic", model=model[1])
    metrics = c.work / "step-ddp" / "metrics.jsonl"
    if runs[0].ok and metrics.exists():
        m = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        steady = m[-1]["epoch_seconds"] / (m[-1]["step"] - m[-2]["step"])  # after the first
        figures["ddp_ms_per_step"] = 1000 * steady
    out = last_json(runs[1].stdout) if runs[1].ok else None
    if out:
        figures["bare_ms_per_step_wall"] = out["ms_per_step_wall"]
        figures["bare_ms_per_step"] = out["ms_per_step"]
    if "ddp_ms_per_step" in figures and out:
        figures["ratio"] = figures["ddp_ms_per_step"] / out["ms_per_step_wall"]
    figures["commands"] = [show(r.cmd) for r in runs]
    key = f"{figures['model']} on {figures['data']}: ddp_train.py " + (
        f"{figures['ddp_ms_per_step']:.2f} ms" if "ddp_ms_per_step" in figures else "n/a"
    )
    key += ", bare loop " + (f"{out['ms_per_step_wall']:.2f} ms" if out else "n/a")
    key += f": {figures['ratio']:.2f}x" if "ratio" in figures else ""
    return phase_status(runs), figures, key, [], runs


# ---- e: tests/test_gpu.py

# The tests that failed last time (2026-11-26, H200), and the one that says TF32 is off.
FAILED_LAST = "channels_last or model_parallel_devices or fsdp_bf16_and_cpu_offload or equals_cpu"
FAILED_LAST += " or without_tf32"


def phase_tests(c):
    env = c.env({"GPU_TESTS_ON_CPU": "1"} if not c.cuda else {})
    pytest = [PY, "-m", "pytest", "tests/test_gpu.py", "-v", "-p", "no:cacheprovider"]
    first = c.args.tests or FAILED_LAST
    runs = [c.run("targeted", [*pytest, "-k", first], 240, env, start_fresh)]
    if not c.args.tests:  # the rest, with the time left
        runs.append(c.run("rest", [*pytest, "-x", "-k", f"not ({first})"], 600, env, start_fresh))
    with open(c.out / "pytest.log", "w") as log:
        for run in runs:
            log.write(f"$ {show(run.cmd)}\n{run.status}\n{run.stdout[-2_000_000:]}\n")
            log.write(f"{run.stderr[-200_000:]}\n{run.stacks}\n\n")
    figures, key = {}, []
    for run in runs:
        name = run.extra["name"]
        counts = {}
        for outcome in ("PASSED", "FAILED", "SKIPPED", "ERROR"):
            counts[outcome.lower()] = len(re.findall(rf" {outcome}( |$)", run.stdout, re.M))
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", run.stdout, re.M)
        figures[name] = dict(status=str(run.status), seconds=round(run.seconds, 1), **counts)
        figures[name]["failed_tests"] = failed
        shown = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
        key.append(f"{name}: {shown or 'nothing ran'}" + f" ({run.status})" * (not run.ok))
    lines = [f"- {r.extra['name']}: `{show(r.cmd)}`" for r in runs]
    for run in runs:
        lines += [f"  - failed: {t}" for t in figures[run.extra["name"]]["failed_tests"]]
    return phase_status(runs), figures, "; ".join(key), lines, runs


PHASE_FUNCTIONS = dict(a=phase_versions, b=phase_probes, c=phase_fsdp, d=phase_step, e=phase_tests)


# ----------------------------------------------------------------------------------------


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--out", default=os.environ.get("OUT"), help="folder for the files (default: $OUT)")
    add("--cpu", action="store_true", help="dry mode: every phase small, on the CPU")
    add("--phases", default="abcde", help="which phases to run, e.g. 'ab'")
    add("--deadline", type=float, default=420, help="seconds for the whole check")
    bounds = ", ".join(f"{k}={v[1]}" for k, v in PHASES.items())
    add("--phase-timeout", action="append", default=[], metavar="P=S", help=f"({bounds})")
    add("--modes", default="on,off,repeat,det", help=f"phase b's modes, of {','.join(MODES)}")
    add("--parallel", type=int, help="phase b's runs at a time (default: 6 on a GPU, 2 on CPU)")
    add("--tests", help="phase e: this pytest -k expression only (default: the last failures)")
    add("--gz-dir", default=".gpudata", help="folder holding Fashion-MNIST's four .gz files")
    add("--data-dir", default="data", help="torchvision root to unpack Fashion-MNIST into")
    add("--work-dir", help="where the runs write (default: a temporary folder, removed)")
    forks = "start `python` commands from tests/forkserver.py (torch imported once; default: --cpu)"
    add("--fork-server", action=argparse.BooleanOptionalAction, help=forks)
    add("--stall", default="", help="for tests: these phases' commands sleep forever, e.g. 'c'")
    args = p.parse_args(argv)
    if not args.out:
        p.error("no folder for the files: set OUT or pass --out")
    if args.fork_server is None:
        args.fork_server = args.cpu
    if args.parallel is None:
        args.parallel = 2 if args.cpu else 6
    args.bounds = {k: v[1] for k, v in PHASES.items()}
    for item in args.phase_timeout:
        phase, _, seconds = item.partition("=")
        if phase not in PHASES or not seconds:
            p.error(f"--phase-timeout {item}: expected P=SECONDS, P one of {''.join(PHASES)}")
        args.bounds[phase] = float(seconds)
    if set(args.modes.split(",")) - set(MODES):
        p.error(f"--modes: of {','.join(MODES)}")
    return args


def main(argv=None):
    args = get_args(argv)
    signal.signal(signal.SIGTERM, stop_live)
    c = Check(args)
    summary, results = [], dict(started=time.strftime("%Y-%m-%d %H:%M:%S %Z"), phases={})
    details = []
    try:
        for phase in PHASES:
            name = PHASES[phase][0]
            if phase not in args.phases:
                continue
            left = c.deadline - time.monotonic()
            if left < 5:
                summary.append([f"{phase} {name}", "skipped: deadline", "0", ""])
                continue
            c.phase, c.phase_end = phase, time.monotonic() + min(args.bounds[phase], left)
            c.say(f"phase {phase} ({name}): bound {c.phase_end - time.monotonic():.0f} s")
            t0 = time.monotonic()
            try:
                status, figures, key, lines, runs = PHASE_FUNCTIONS[phase](c)
            except Exception as e:  # a phase's own error: said, and the check goes on
                status, figures, key, lines, runs = f"error: {e!r}"[:200], {}, "", [], []
            seconds = time.monotonic() - t0
            if phase == "a" and not c.cuda:
                key += "; dry mode: on the CPU" if args.cpu else "; no CUDA: on the CPU"
            summary.append([f"{phase} {name}", status, f"{seconds:.0f}", key])
            results["phases"][phase] = dict(name=name, status=status, seconds=seconds)
            results["phases"][phase].update(figures=figures, bound=args.bounds[phase])
            results["phases"][phase]["commands"] = [
                dict(name=r.extra.get("name"), command=show(r.cmd), status=str(r.status))
                | dict(seconds=round(r.seconds, 1))
                for r in runs
            ]
            details += [f"## {phase}. {name}: {status}", "", *lines, ""] if lines else []
            write_files(c, summary, results, details)
    finally:
        c.close()
    table = markdown([["phase", "status", "seconds", "key figures"], *summary])
    print("\n" + "\n".join(table), flush=True)
    print(f"\n{c.elapsed():.0f} s in all; files in {args.out}", flush=True)
    return 0


def write_files(c, summary, results, details):
    """summary.md and check.json, rewritten after each phase: a check stopped from outside
    still leaves what it had."""
    results["seconds"] = c.elapsed()
    (c.out / "check.json").write_text(json.dumps(results, indent=1, default=str))
    head = [f"# GPU check, {results['started']}", ""]
    head += markdown([["phase", "status", "seconds", "key figures"], *summary]) + [""]
    (c.out / "summary.md").write_text("\n".join(head + details) + "\n")


if __name__ == "__main__":
    sys.exit(main())
