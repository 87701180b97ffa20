"""Everything the project has not yet measured or run on a GPU, in bounded phases: the GPT's
MFU lever by lever, Fashion-MNIST's time to 94%, the GPU tests never run (README.md beside it).

    python benchmarks/gpu/check.py                        # phases a m b e f, 450 s at most
    python benchmarks/gpu/check.py --phases cf --deadline 220   # each script's MFU; the tests
    python benchmarks/gpu/check.py --phases b --fashion-seeds 1,2,3 --deadline 220
    python benchmarks/gpu/check.py --cpu --out DIR         # dry mode: every phase small, on CPU

Phases, in this order, each with a bound of its own (--phase-timeout) under one deadline
(--deadline, 450 s); a phase that runs out is stopped, reported, and the next one starts:
  a  versions: torch, CUDA, cuDNN, the GPU, its driver, the TF32 flags and an fp32 convolution's
     error with and without NVIDIA_TF32_OVERRIDE=0; whether a fork server's children can use
     CUDA (else phase f runs with FRESH_PROCESSES=1); which debugger can take native stacks
  m  benchmarks/gpu/mfu.py: the GPT at GPT-2-small size, bf16, one GPU, one lever at a time
     (fused AdamW, attention kernel, bf16 parameters, batch, compile), then the best together
  b  ddp_train.py's fast Fashion-MNIST recipe (airbench's network, batch 1024) to the end:
     training seconds to 94% with the warm-up apart, ms per step against the bare loop's
  c  the GPT at GPT-2-small size under each sharded script that takes the flags: tokens/s and
     MFU of a steady epoch; fsdp_train.py's run profiled (a trace and a memory snapshot)
  d  tolerance probes: what tests/test_gpu.py compares, with TF32 on, off, off again (noise),
     and off with deterministic algorithms
  e  fsdp_train.py --cpu-offload variants side by side, the CNN's among them
  f  tests/test_gpu.py: the tests never run on a GPU first, then the others (--maxfail=3)

A command past its bound is stopped with its process tree, after its Python stacks
(faulthandler) and native ones (py-spy or gdb, where installed) are taken. Files under --out
(8 at most): summary.md, summary.json (the headline figures first, then every figure and
command), commands.log, stacks.txt, pytest.log, metrics.tar.gz (every run's metrics.jsonl),
trace.json.gz and memory.pickle.gz (phase c's profile). On a GPU the headline figures also go
into benchmarks/gpu/summary.json, merged with an earlier check's.
"""

import argparse
import concurrent.futures
import contextlib
import functools
import gzip
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
PHASES = {  # in the order they run: letter: (name, bound in seconds)
    "a": ("versions", 60),
    "m": ("gpt levers", 240),
    "b": ("fashion-mnist to 94%", 150),
    "c": ("gpt mfu per script", 240),
    "d": ("tolerance probes", 140),
    "e": ("fsdp cpu offload", 100),
    "f": ("test_gpu.py", 300),
}
FIRST = "ambef"  # the default: what has not been measured or run on a GPU yet
GRACE = 10  # seconds between SIGTERM and SIGKILL when a command is stopped
NATIVE_BOUND = 20  # seconds for a stalled command's native stacks (all its processes at once)
TF32_KEY = "NVIDIA_TF32_OVERRIDE"
TF32_OFF = {TF32_KEY: "0"}  # read by cuBLAS and cuDNN when they load
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


def _ours(folder):  # one like this (a command bounded inside a bounded command has two)
    try:
        with open(os.path.join(folder or ".", "sitecustomize.py")) as f:
            return "Written by benchmarks/gpu/check.py" in f.read(100)
    except OSError:
        return False


_file = _arm(os.environ["DUMP_STACKS_DIR"]) if os.environ.get("DUMP_STACKS_DIR") else None
# The sitecustomize this one hides, if there is one, runs as it would have; one of this kind
# is not run again (two would find each other, without end).
_rest = [p for p in sys.path if not _ours(p)]
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


def native_tool():
    """The command that prints a process's native stacks, PID last, or None: py-spy (Python
    and C frames interleaved) where installed, else gdb's backtrace of every thread."""
    if shutil.which("py-spy"):
        return ["py-spy", "dump", "--native", "--pid"]
    if shutil.which("gdb"):
        quiet = ["-nx", "-batch", "-ex", "set debuginfod enabled off", "-ex", "set pagination off"]
        return ["gdb", *quiet, "-ex", "thread apply all bt 40", "-p"]
    return None


def native_stacks(pids, timeout=NATIVE_BOUND):
    """Each process's native stacks (native_tool), all at once, each bounded; "" without a
    tool. Where a thread is stuck in C (NCCL, a CUDA call, a lock), the frames say which."""
    tool = native_tool()
    if not tool or not pids:
        return ""

    def one(pid):
        try:
            proc = subprocess.run(
                [*tool, str(pid)], capture_output=True, text=True, errors="replace", timeout=timeout
            )
            text = proc.stdout + proc.stderr[-2000:]
        except subprocess.TimeoutExpired:
            text = f"(no stacks in {timeout} s)"
        return f"native stacks of pid {pid} ({tool[0]}):\n{text.strip()}\n"

    with concurrent.futures.ThreadPoolExecutor(len(pids)) as pool:
        return "\n".join(pool.map(one, pids))


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


def stop_tree(proc, grace=GRACE, dump_wait=1.0, native=False):
    """Stop proc and everything it started: their Python stacks first (SIGUSR1, see
    with_stack_dumps; none with dump_wait None), with `native` their native stacks next
    (returned), then SIGTERM to every process and process group of the tree, SIGKILL to what
    is left after `grace` s. The tree, not only proc's group: torchrun starts each worker in a
    process group of its own (setsid). Collected before the first signal: an orphan is found
    no more."""
    seen = set(process_tree(proc.pid))
    if dump_wait is not None:
        signal_all(seen, signal.SIGUSR1, groups=False)
        time.sleep(dump_wait)
    seen |= set(process_tree(proc.pid))
    stacks = native_stacks(sorted(p for p in seen if alive(p))) if native else ""
    if stacks:  # a debugger stopped in its attach leaves its process stopped
        signal_all(seen, signal.SIGCONT, groups=False)
    signal_all(seen, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        proc.poll()
        if not any(alive(p) for p in seen):
            break
        time.sleep(0.1)
    seen |= set(process_tree(proc.pid))
    signal_all([p for p in seen if alive(p)], signal.SIGKILL)
    return stacks


def start_fresh(cmd, cwd, env):
    """A new interpreter in a process group of its own (setsid), out of reach of signals to ours."""
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


def run_bounded(
    cmd, timeout, env=None, cwd=ROOT, start=start_fresh, grace=GRACE, native=True, until=None
):
    """Run cmd to its end or for `timeout` s, whichever comes first, in a process group of its own
    (start(cmd, cwd, env) must give it one); on timeout stop_tree, with the stacks (and with
    `native`, each process's native stacks after the Python ones). With `until`, a function
    asked every half second: once it says True, what is left of the command is not waited
    for (stopped without stacks; status 0, extra["cut"] True)."""
    cmd = list(map(str, cmd))
    folder = tempfile.mkdtemp(prefix="stacks-")
    proc, native_text = None, ""
    try:
        proc = start(cmd, cwd, with_stack_dumps(dict(env or os.environ), folder))
        t0 = time.monotonic()  # the command's own time (not a fork server's start)
        LIVE.add(proc)
        try:
            out, err, cut = wait(proc, timeout, until)
            status = 0 if cut else proc.returncode
        except BaseException as e:
            timeout_hit = isinstance(e, subprocess.TimeoutExpired)
            native_text = stop_tree(proc, grace, native=native and timeout_hit)
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            status = "timed out"
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # a process out of reach still holds a pipe
                out, err = "", "(output not read: a process still holds the pipes)"
        stacks = "\n".join(filter(None, [read_stacks(folder), native_text]))
        run = Run(cmd, status, time.monotonic() - t0, out, err, stacks, timeout)
        run.extra["cut"] = status == 0 and proc.returncode != 0
        return run
    finally:
        LIVE.discard(proc)
        shutil.rmtree(folder, ignore_errors=True)


def wait(proc, timeout, until=None):
    """(stdout, stderr, cut): proc's output once it ends or, where until() says True first,
    once it is stopped (cut True); TimeoutExpired after `timeout` s."""
    if until is None:
        return (*proc.communicate(timeout=timeout), False)
    end = time.monotonic() + timeout
    while True:
        try:
            return (*proc.communicate(timeout=min(0.5, max(0.01, end - time.monotonic()))), False)
        except subprocess.TimeoutExpired:
            if until():
                stop_tree(proc, grace=5, dump_wait=None)
                return (*proc.communicate(timeout=30), True)
            if time.monotonic() >= end:
                raise


def stop_live(signum, frame):
    """On SIGTERM (a caller's own timeout): stop every running command with its tree (they run
    in process groups of their own, out of the caller's reach), then end."""
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


def cuda_available():
    import torch

    return torch.cuda.is_available()


class Check:
    def __init__(self, args):
        self.args, self.t0, self.started = args, time.monotonic(), time.time()
        self.deadline = self.t0 + args.deadline
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu-check-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        for name in ("commands.log", "stacks.txt"):
            (self.out / name).write_text("")
        self.phase, self.phase_end, self.runs = None, self.deadline, []
        # (phase a says it again, with the device's name)
        self.cuda = not args.cpu and "a" not in args.phases and cuda_available()
        self.device = "cuda" if self.cuda else "cpu"
        self.fork_ok, self.fork_runs = None, []  # can a fork server's children use CUDA?
        self.start = start_fresh
        self.server = None
        if args.fork_server:  # the dry mode's: torch imported once (tests/forkserver.py)
            sys.path.insert(0, str(ROOT / "tests"))
            import forkserver

            self.server = forkserver.Server(self.env(TEST_ENV))
            self.start = self.forked

    def forked(self, cmd, cwd, env):
        # On the CPU no cuBLAS or cuDNN loads to read TF32's override: a command whose
        # environment differs from the server's by it alone is forked too (the child still gets
        # its own environment). In the dry mode: 10 fresh starts fewer (phases a-c).
        seen = env
        if self.args.cpu and TF32_KEY in self.server.env:
            seen = env | {TF32_KEY: self.server.env[TF32_KEY]}
        if cmd[0] == PY and not self.server.needs_fresh(cmd[1:], seen):
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

    def device_name(self):
        """The GPU's name by nvidia-smi (this process leaves CUDA alone), else "GPU"."""
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            return (
                subprocess.run(query, capture_output=True, text=True, timeout=20)
                .stdout.split("\n")[0]
                .strip()
                or "GPU"
            )
        return "GPU"

    def say(self, message):
        print(f"[{self.elapsed():5.0f} s] {message}", flush=True)

    def env(self, extra=None, omit=("NVIDIA_TF32_OVERRIDE",)):
        """This process's environment, less TF32's override, plus `extra`: each mode's own."""
        env = {k: v for k, v in os.environ.items() if k not in omit}
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "2"))
        return env | (extra or {})

    def run(self, name, cmd, bound, env=None, start=None, until=None):
        """One command, bounded by `bound` and by what is left of the phase; logged."""
        left = self.phase_end - time.monotonic()
        if left < 1:
            run = Run(list(map(str, cmd)), "not started", extra=dict(name=name))
        else:
            if self.phase in self.args.stall:
                cmd = [PY, "-c", STALL]
            start = start or self.start
            run = run_bounded(cmd, min(bound, left), env or self.env(), start=start, until=until)
            run.extra["name"] = name
        with self.lock:
            self.runs.append(run)
            status = ("ok, cut" if run.extra.get("cut") else "ok") if run.ok else run.status
            self.say(f"{self.phase}/{name}: {status} in {run.seconds:.1f} s")
            head = (
                f"== {self.phase}/{name}: {status}, {run.seconds:.1f} s (bound {run.timeout:.0f} s)"
            )
            self.append("commands.log", f"{head}\n$ {show(run.cmd)}\n{run.tail()}\n\n")
            if run.stacks:
                self.append("stacks.txt", f"{head}\n$ {show(run.cmd)}\n{run.stacks}\n\n")
        return run

    def run_many(self, jobs, parallel):
        """jobs: {name: (cmd, bound, env[, start])}, `parallel` at a time; {name: Run}."""
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
    figures["fork_server"] = fork_probe(c)
    tool = native_tool()
    figures["native_stacks"] = shlex.join(tool[:1]) if tool else "none: Python stacks only"
    runs = [*runs.values(), *c.fork_runs]
    key = [f"torch {figures.get('torch')}", f"CUDA {figures.get('cuda')}"]
    key += [f"cuDNN {figures.get('cudnn')}", str(figures.get("gpu", "no GPU"))]
    if "," in figures.get("nvidia_smi", ""):
        key.append(f"driver {figures['nvidia_smi'].split(', ')[1]}")
    if "conv_error" in figures:
        key.append(
            f"fp32 conv error {figures['conv_error']:.1e} (TF32 off: "
            f"{figures.get('conv_error_tf32_override_0', float('nan')):.1e})"
        )
    key.append(f"fork server: {figures['fork_server']}")
    key.append(f"native stacks: {figures['native_stacks']}")
    return phase_status(runs), figures, "; ".join(key), [], runs


# Two children of a fork server at once, as tests/test_gpu.py starts its runs: each uses the
# GPU (a matmul, a cuDNN convolution). CUDA initialised in the server before the fork would
# fail them ("CUDA initialization error", or a hang).
FORK_PROBE = r"""
import json, torch
import torch.nn.functional as F
device = "cuda" if torch.cuda.is_available() else "cpu"
x = torch.randn(64, 64, device=device)
conv = F.conv2d(torch.randn(2, 3, 8, 8, device=device), torch.randn(4, 3, 3, 3, device=device))
print(json.dumps(dict(device=device, value=float((x @ x).sum() + conv.sum()))))
"""


def fork_probe(c):
    """'works' or 'fails: ...' for python commands forked from tests/forkserver.py's server
    (phase f falls back to FRESH_PROCESSES=1 when it fails); once per check, the runs kept in
    c.fork_runs."""
    if c.fork_ok is not None:
        return "works" if c.fork_ok else "fails"
    if c.phase_end - time.monotonic() < 5:
        return "not probed: no time left in the phase"
    sys.path.insert(0, str(ROOT / "tests"))
    import forkserver

    server = c.server or forkserver.Server(c.env(TEST_ENV))  # the dry mode's, or one like it
    try:
        start = lambda cmd, cwd, env: server.popen(cmd, cwd, env, new_session=True)  # noqa: E731
        jobs = {f"fork-{i}": ([PY, "-c", FORK_PROBE], 60, c.env(TEST_ENV), start) for i in (1, 2)}
        done = c.run_many(jobs, 2)
    finally:
        if server is not c.server:
            server.close()
    c.fork_runs = list(done.values())
    reports = [last_json(r.stdout) if r.ok else None for r in c.fork_runs]
    c.fork_ok = all(r and r["device"] == c.device for r in reports)
    if c.fork_ok:
        return f"works ({c.device})"
    failed = [r for r, report in zip(c.fork_runs, reports, strict=True) if not report]
    failed = (failed or c.fork_runs)[0]
    return f"fails ({failed.status}: {failed.stderr.strip()[-150:]}): FRESH_PROCESSES=1"


# ---- b: tolerance probes

SYN = ["--data", "synthetic", "--dist-timeout", "60"]
# tests/test_gpu.py's runs: 5 steps at a high rate, so that the weights move far more than
# any tolerance; the initial weights from one step at a rate too small to change them.
MLP = ["--model", "mlp", "--epochs", "1", "--batch-size", "32", "--max-steps", "5"]
MLP += ["--lr", "0.8", "--warmup", "0"]
CNN = ["--model", "cnn", "--epochs", "1", "--batch-size", "32", "--max-steps", "5", "--lr", "0.4"]
MP = ["--epochs", "1", "--max-steps", "5", "--batch-size", "32", "--lr", "4"]
INITIAL = ["--max-steps", "1", "--lr", "1e-12"]
DETERMINISTIC = (  # written to a file: python FILE SCRIPT ARGS, or torchrun FILE SCRIPT ARGS
    "import os, runpy, sys, torch\n"
    "torch.use_deterministic_algorithms(True, warn_only=True)\n"
    "sys.argv = sys.argv[1:]\n"
    "sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))\n"
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
    if c.cuda:  # (on the CPU: no TF32 to differ by; no compile or SyncBatchNorm without CUDA)
        runs["mlp_gpu"] = ("ddp_train.py", [*MLP, "--device", "cuda"])
        runs["mp_gpus"] = (
            "model_parallel.py",
            [*MP, "--device", dev, "--devices", "cuda:0,cuda:0", "--microbatches", "4"],
        )
        runs["cnn_compile"] = ("ddp_train.py", [*CNN, "--device", dev, "--compile"])
        # under torchrun, as the test: SyncBatchNorm with a process group of one
        runs["cnn_sync_bn"] = ("torchrun ddp_train.py", [*CNN, "--device", dev, "--sync-bn"])
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
    "model_parallel cuda:0,cuda:0 vs one device": (
        "test_model_parallel_devices[cuda:0,cuda:0]",
        "mp_gpus",
        "mp_one",
        "initial-mp",
    ),
    "compiled CNN vs eager": ("test_compile", "cnn_compile", "cnn_nhwc", "initial-cnn"),
    "SyncBatchNorm, one GPU, vs BatchNorm": (
        "test_sync_bn_one_gpu",
        "cnn_sync_bn",
        "cnn_nhwc",
        "initial-cnn",
    ),
}


def probe_jobs(c, runs, shared, modes):
    """{name: (cmd, bound, env)} of the probes' runs, the compiled ones first (the longest);
    a script named "torchrun SCRIPT" runs under torchrun, and in the deterministic mode every
    script runs through c.work/deterministic.py."""
    jobs = {}
    for name, (script, flags) in shared.items():
        cmd = [PY, script, *SYN, *flags, "--output-dir", c.output_dir(name)]
        jobs[name] = (cmd, 90, c.env(TEST_ENV))
    wrapper = c.work / "deterministic.py"
    wrapper.write_text(DETERMINISTIC)
    for mode in modes:
        extra, deterministic = MODES[mode]
        for name, (script, flags) in runs.items():
            key = f"{name}@{mode}"
            cmd = TORCHRUN if script.startswith("torchrun ") else [PY]
            cmd = [*cmd, *[wrapper] * deterministic, script.removeprefix("torchrun ")]
            cmd += [*SYN, *flags, "--output-dir", c.output_dir(key)]
            jobs[key] = (cmd, 150 if "--compile" in flags else 90, c.env(extra))
    return dict(sorted(jobs.items(), key=lambda job: "--compile" not in job[1][0]))


def phase_probes(c):
    runs, shared = probe_runs(c)
    modes = [m for m in c.args.modes.split(",") if c.cuda or m != "on"]  # TF32 needs CUDA
    jobs = probe_jobs(c, runs, shared, modes)
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


TEST_OWN = "vit-bf16-clip"  # test_gpu.py::test_fsdp_bf16_and_cpu_offload's own run


def fsdp_variants(c):
    """{name: flags}: the test's run (ViT, bf16, clip, async save) and its neighbours; the
    test's own run left to phase f where that runs too (no command twice)."""
    variants = {}
    for model in ("vit", "cnn"):
        for amp in ("bf16", "none"):
            for clip in (True, False):
                name = f"{model}-{amp}" + "-clip" * clip
                flags = ["--model", model, "--amp", amp, "--async-save"]
                variants[name] = flags + ["--clip-grad", "1"] * clip
    variants["vit-bf16-clip-sync-save"] = ["--model", "vit", "--amp", "bf16", "--clip-grad", "1"]
    if "f" in c.args.phases:
        del variants[TEST_OWN]
    if not c.cuda:  # the dry mode: two of them, on the CPU (no offload without CUDA)
        names = [n for n in (TEST_OWN, "cnn-none", "vit-bf16-clip-sync-save") if n in variants]
        variants = {k: variants[k] for k in names[:2]}
    return variants


def phase_fsdp(c):
    offload = ["--device", "cuda", "--cpu-offload"] if c.cuda else ["--device", "cpu"]
    jobs = {}
    for name, flags in fsdp_variants(c).items():
        cmd = [*TORCHRUN, "fsdp_train.py", *FSDP, *offload, *flags]
        jobs[name] = ([*cmd, "--output-dir", c.output_dir("fsdp-" + name)], 90, c.env(TEST_ENV))
    done = c.run_many(jobs, len(jobs))
    table, figures = [], {}
    for name, run in done.items():
        status = "finished" if run.ok else str(run.status)
        steps = re.findall(r"\bstep (\d+)", run.stdout)
        figures[name] = dict(status=status, seconds=round(run.seconds, 1), command=show(run.cmd))
        table.append([name, status, f"{run.seconds:.1f}", steps[-1] if steps else ""])
    lines = ["Each variant under `torchrun --nproc_per_node=1`, all at once:", ""]
    if "f" in c.args.phases:
        lines[0] += f" ({TEST_OWN}, the test's own run, is phase f's)"
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


def run_all():
    """benchmarks/run_all.py as a module: its GPU recipe and its readings of metrics.jsonl."""
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks/run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def epochs_written(folder, trace=None):
    """Whether FOLDER/metrics.jsonl holds two whole lines (2 epochs) and `trace`, if any, is
    written."""
    file = Path(folder) / "metrics.jsonl"
    done = file.exists() and file.read_text().count("\n") >= 2
    return done and (trace is None or trace.exists())


def read_metrics(folder):
    file = Path(folder) / "metrics.jsonl"
    lines = file.read_text().splitlines() if file.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def steady_mean(metrics, key):
    """The mean of `key` over the epochs after the first (run_all.steady), or None."""
    values = [m[key] for m in (metrics[1:] or metrics) if m.get(key) is not None]
    return sum(values) / len(values) if values else None


# Fashion-MNIST to 94% fast: airbench's network (models.AirbenchNet: it pools early), a
# batch of 1024, bf16, channels_last, shifts and flips on the GPU, evaluated on each image and
# its mirror (--tta, as airbench evaluates), airbench's label smoothing 0.2; the data set on
# the GPU (ddp_train.py moves an in-memory set there: a batch is one indexing, in an order
# drawn each epoch). FAST_EPOCHS: the second only where the first ends below the target.
FAST = ["--data", "fashion-mnist", "--model", "airbench", "--batch-size", "1024"]
FAST += ["--amp", "bf16", "--channels-last", "--augment", "--tta", "--label-smoothing", "0.2"]
FAST_BARE = ["--model", "airbench", "--batch-size", "1024", "--amp", "bf16", "--augment"]
FAST_EPOCHS = "12,20"


def fashion_figures(metrics, target):
    """Time to `target` from a run's metrics.jsonl: cumulative training seconds (evaluation
    excluded) at the first epoch end at or above it; the warm-up (the first epoch's seconds
    above a steady epoch's: cuDNN's benchmarking, the allocator) said apart."""
    bench = run_all()
    f = dict(epochs=len(metrics), final_acc=metrics[-1]["test_acc"])
    f["best_acc"] = max(m["test_acc"] for m in metrics)
    f["first_epoch_seconds"] = metrics[0]["epoch_seconds"]
    steady = sorted(m["epoch_seconds"] for m in metrics[1:]) or [metrics[0]["epoch_seconds"]]
    f["steady_epoch_seconds"] = steady[len(steady) // 2]
    f["warmup_seconds"] = max(0.0, f["first_epoch_seconds"] - f["steady_epoch_seconds"])
    hit = bench.time_to(metrics, target)
    f.update(time_to_target=hit and hit[0], target_epoch=hit and hit[1])
    if hit:
        f["time_to_target_less_warmup"] = hit[0] - f["warmup_seconds"]
    f["ms_per_step"] = bench.ms_per_step(metrics) if len(metrics) > 1 else None
    for key in ("flops_per_second", "mfu"):
        f[key] = steady_mean(metrics, key)
    return f


def phase_fashion(c):
    """ddp_train.py's fast recipe to the end (the longer one only where the shorter ends below
    94%; each --fashion-seeds seed), then the bare loop on the same model: time to 94% with the
    warm-up apart, ms per step against the bare loop's, FLOP/s and MFU."""
    bench = run_all()
    data_dir = Path(c.args.data_dir)
    if data_dir.is_symlink() and not data_dir.exists():  # a link to data not on this machine
        data_dir = Path(c.args.gz_dir) / "data"
    gz_dirs = [c.args.gz_dir, "/usr/share/datasets/fashion-mnist"]
    fashion = c.cuda and unpack_fashion_mnist(gz_dirs, data_dir)
    if fashion:
        recipe, bare_flags = [*FAST, "--data-dir", data_dir], [*FAST_BARE, "--data-dir", data_dir]
        epochs, bounds = [int(e) for e in c.args.fashion_epochs.split(",")], (120, 45)
    else:  # no data set or no GPU: the same commands, small
        data = ["--data", "synthetic", "--model", "mlp", "--batch-size", "64"]
        recipe, bare_flags, epochs, bounds = data, [*data, "--steps", "50"], [2], (90, 60)
    dev = ["--device", c.device]
    runs, figures = [], dict(data="fashion-mnist" if fashion else "synthetic", seeds={})
    figures.update(target=bench.GPU_TARGET, recipe=show(recipe))
    for seed in c.args.fashion_seeds.split(","):
        for n in epochs:
            folder = c.output_dir(f"fashion-seed{seed}-{n}ep")
            cmd = [PY, "ddp_train.py", *recipe, *dev, "--epochs", n, "--seed", seed]
            runs.append(
                c.run(
                    f"ddp_train seed {seed}, {n} epochs", cmd + ["--output-dir", folder], bounds[0]
                )
            )
            metrics = read_metrics(folder)
            if metrics:
                figures["seeds"][seed] = dict(
                    fashion_figures(metrics, bench.GPU_TARGET), epochs_asked=n
                )
            if figures["seeds"].get(seed, {}).get("time_to_target") or not runs[-1].ok:
                break
    bare = c.run("bare_loop", [PY, "benchmarks/bare_loop.py", *bare_flags, *dev], bounds[1])
    runs.append(bare)
    out = last_json(bare.stdout) if bare.ok else None
    if out:
        figures["bare_ms_per_step_wall"] = out["ms_per_step_wall"]
        figures["bare_ms_per_step"] = out["ms_per_step"]
        figures["bare_cudnn_benchmark"] = out.get("cudnn_benchmark")
    first = next(iter(figures["seeds"].values()), {})
    figures.update(first)  # the first seed's figures, at the top
    if first.get("ms_per_step") and out:
        figures["ratio"] = first["ms_per_step"] / out["ms_per_step_wall"]
    figures["commands"] = [show(r.cmd) for r in runs]
    f = figures
    key = f"{'airbench' if fashion else 'mlp'} on {f['data']}: "
    for seed, s in f["seeds"].items():
        to = s["target_epoch"] and f"in {s['time_to_target']:.1f} s (epoch {s['target_epoch']})"
        key += f"seed {seed}: {f['target']:.0%} {to or 'not reached'}, final {s['final_acc']:.1%}"
        key += f", warm-up {s['warmup_seconds']:.1f} s; "
    ms = f.get("ms_per_step")
    key += "ddp_train.py " + (f"{ms:.2f} ms" if ms else "n/a")
    key += ", bare loop " + (f"{out['ms_per_step_wall']:.2f} ms" if out else "n/a")
    key += f": {f['ratio']:.2f}x" if "ratio" in f else ""
    if f.get("flops_per_second"):
        key += f"; {f['flops_per_second'] / 1e12:.3g} TFLOP/s"
        key += f", MFU {f['mfu']:.1%}" if f.get("mfu") else ""
    return phase_status(runs), figures, key, [], runs


# ---- m: the GPT at GPT-2-small size, one lever at a time (mfu.py)


def phase_levers(c):
    """benchmarks/gpu/mfu.py, bounded by the phase; its rows read from the file it rewrites
    after each row (a phase cut short keeps the rows measured)."""
    rows_file = c.work / "mfu.json"
    cmd = [PY, "benchmarks/gpu/mfu.py", "--json", rows_file, *(["--cpu"] if not c.cuda else [])]
    run = c.run("mfu.py", cmd, 600)
    result = json.loads(rows_file.read_text()) if rows_file.exists() else dict(rows=[], table=[])
    rows = result["rows"]
    measured = [r for r in rows if r.get("mfu") or r.get("tokens_per_second")]
    best = max(measured, key=lambda r: r.get("mfu") or r["tokens_per_second"], default=None)
    figures = dict(rows=rows, best=best)
    lines = [f"`{show(run.cmd)}`:", "", *result["table"]]
    if best:
        mfu = f"MFU {best['mfu']:.1%}" if best.get("mfu") else "no peak known: no MFU"
        key = f"{len(measured)}/{len(rows)} rows measured; best: {best['name']}, {mfu}, "
        key += f"{best['tokens_per_second']:.3g} tok/s"
    else:
        key = f"no row measured ({len(rows)} rows)"
    return phase_status([run]), figures, key, lines, [run]


# ---- c: the GPT at GPT-2-small size under each sharded script, one GPU

LM_SCRIPTS = ("fsdp_train.py", "tensor_parallel.py", "context_parallel.py")
LM_SCRIPTS += ("expert_parallel.py", "model_parallel.py", "nd_parallel.py")
LM = ["--data", "text", "--model", "gpt", "--amp", "bf16", "--lr", "0.01"]  # 6e-4 at batch 16
# GPT-2 small's shape (124 M weights with its 50 k-token vocabulary; here bytes: 85 M), and a
# batch that fits an H100 with room. The dry mode's: small, without --depth (the default).
LM_SIZE = ["--depth", "12", "--dim", "768", "--heads", "12", "--seq-len", "1024"]
LM_DRY = ["--dim", "32", "--heads", "2", "--seq-len", "32"]
LM_STEPS = 30  # per epoch; 2 epochs: the second, steady, is the one measured
COMPILED = ("fsdp_train.py", "nd_parallel.py")  # also with --compile (on a GPU)
PROFILED = "fsdp_train.py"  # the run whose trace and memory snapshot come back


def lm_plan(c):
    """[(name, script, its own flags)]: each script, fsdp_train.py's compiled run second (the
    best MFU expected, and a cut phase loses the runs at its end)."""
    plan = [(s, s, []) for s in LM_SCRIPTS]
    plan[4][2].extend(["--devices", "cuda:0" if c.cuda else "cpu"])  # model_parallel.py: unsplit
    compiled = [(f"{s} --compile", s, ["--compile"]) for s in COMPILED]
    if not c.cuda:  # the dry mode: no compile (minutes on the CPU)
        return plan
    return [plan[0], compiled[0], *plan[1:], *compiled[1:]]


def text_file(path, steps, batch, seq_len):
    """A UTF-8 file of the standard library's sources cut so that data.load_text makes
    `steps` whole batches of `batch` windows (and half a batch, dropped) for training, the
    held-out 5% after them."""
    need = (steps * batch + batch // 2) * seq_len + 1
    size = need
    while size - max(size // 20, seq_len + 1) < need:
        size += 1 + (need - size + max(size // 20, seq_len + 1)) // 2
    text = b""
    for file in sorted(Path(os.__file__).parent.glob("*.py")):
        text += file.read_bytes()
        if len(text) > size + 8:
            break
    Path(path).write_bytes(text[:size].decode("utf-8", "ignore").encode())
    return path


def missing_flags(help_text, cmd):
    """The flags (and the choices text and gpt) of cmd that a script's --help does not show."""
    wanted = [a for a in map(str, cmd) if a.startswith("--")] + ["text", "gpt"]
    shown = lambda w: re.search(rf"(?<![\w-]){re.escape(w)}(?![\w-])", help_text)  # noqa: E731
    return [w for w in dict.fromkeys(wanted) if not shown(w)]


def phase_gpt(c):
    batch, steps = (16, LM_STEPS) if c.cuda else (4, 3)
    size = LM_SIZE if c.cuda else LM_DRY
    seq_len = int(size[size.index("--seq-len") + 1])
    present = [s for s in LM_SCRIPTS if (ROOT / s).exists()]
    helps = c.run_many({s: ([PY, s, "--help"], 60, c.env()) for s in present}, len(present))
    rows, figures, runs = [], {}, list(helps.values())
    texts = {}
    for name, script, extra in lm_plan(c):
        base = [*LM, *size, "--device", c.device, "--epochs", "2", "--max-steps", str(2 * steps)]
        base += extra
        if script not in present:
            figures[name] = dict(status="skipped: not in this tree")
            continue
        missing = missing_flags(helps[script].stdout, [*base, "--batch-size", "--output-dir"])
        if not helps[script].ok or missing:
            why = f"does not take {' '.join(missing)}" if helps[script].ok else "--help failed"
            figures[name] = dict(status=f"skipped: {why}")
            continue
        if not c.cuda and name != PROFILED:  # the dry mode: one run, the others' flags read
            figures[name] = dict(status="skipped: dry mode (takes the flags)")
            continue
        for b in (batch, batch // 2):  # out of memory: once more at half the batch
            if b not in texts:
                texts[b] = text_file(c.work / f"text-{b}.txt", steps, b, seq_len)
            folder = c.output_dir("gpt-" + name.replace(".py", "").replace(" --", "-"))
            cmd = [PY, script, *base, "--batch-size", str(b), "--data-dir", texts[b]]
            cmd += ["--output-dir", folder]
            if name == PROFILED:  # steps 4-6, in the first epoch (on the GPU: of 30 steps)
                cmd += ["--profile", c.work / "profile"]
            bound = 150 if "--compile" in extra or not c.cuda else 60  # (the CPU: a shared one)
            # Measured once the last epoch's line is written (and the profile, if any): the
            # checkpoint, model.pt and the sample generated on the CPU after it are not waited for.
            trace = c.work / "profile" / "rank0.json" if name == PROFILED else None
            run = c.run(
                name, cmd, bound, c.env(), until=functools.partial(epochs_written, folder, trace)
            )
            runs.append(run)
            if run.ok or "out of memory" not in run.stderr.lower() or b < 2:
                break
        figures[name] = lm_figures(run, read_metrics(folder), b, seq_len)
        figures[name]["command"] = show(run.cmd)
    for name, f in figures.items():
        cells = [fmt(f.get(k)) for k in ("batch", "tokens_per_second", "tflops", "mfu", "epochs")]
        rows.append([name, f["status"], *cells])
    header = ["run", "status", "batch", "tokens/s", "TFLOP/s", "MFU", "epochs"]
    lines = ["The GPT, " + " ".join(size) + ", bf16, one device; the last epoch's figures:", ""]
    lines += markdown([header, *rows])
    measured = {n: f for n, f in figures.items() if f.get("tokens_per_second")}
    key = "; ".join(
        f"{n}: {f['tokens_per_second']:.3g} tok/s"
        + (f", MFU {f['mfu']:.1%}" if f.get("mfu") else "")
        for n, f in measured.items()
    )
    skipped = [n for n, f in figures.items() if f["status"].startswith("skipped")]
    key += f"; skipped: {', '.join(skipped)}" * bool(skipped)
    figures["profile"] = profile_files(c)
    key += f"; profile: {', '.join(figures['profile']) or 'none'}"
    return phase_status(runs), figures, key.strip("; "), lines, runs


def lm_figures(run, metrics, batch, seq_len):
    """A run's figures from the last line of its metrics.jsonl: the steady epoch's where there
    are two (the first pays the warm-up)."""
    f = dict(status="finished" if run.ok else str(run.status), batch=batch, seconds=run.seconds)
    if metrics:
        last = metrics[-1]
        f.update(epochs=len(metrics), steps=last["step"], mfu=last.get("mfu"))
        f["samples_per_second"] = last["samples_per_second"]
        f["tokens_per_second"] = last["samples_per_second"] * seq_len
        f["flops_per_second"] = last.get("flops_per_second")
        f["tflops"] = f["flops_per_second"] and f["flops_per_second"] / 1e12
    return f


FILE_LIMIT = 15 << 20  # bytes: each file under --out stays under 16 MiB, easy to copy off


def profile_files(c):
    """The profiled run's trace and CUDA memory snapshot, gzipped into --out (trace.json.gz,
    memory.pickle.gz); a snapshot too large keeps fewer stack frames, then fewer events."""
    written, folder = [], c.work / "profile"
    for source, target in (
        ("rank0.json", "trace.json.gz"),
        ("rank0_memory.pickle", "memory.pickle.gz"),
    ):
        if not (folder / source).exists():
            continue
        data = (folder / source).read_bytes()
        packed = gzip.compress(data, 6)
        if len(packed) > FILE_LIMIT and source.endswith(".pickle"):
            packed = shrink_snapshot(data)
        if len(packed) <= FILE_LIMIT:
            (c.out / target).write_bytes(packed)
            written.append(target)
    return written


def shrink_snapshot(data):
    """A memory snapshot (torch.cuda.memory._snapshot's dict) with 8 frames per stack, then
    the later half of its events only, until it packs under FILE_LIMIT."""
    import pickle

    snapshot = pickle.loads(data)
    frames = lambda x: isinstance(x, dict) and "frames" in x  # noqa: E731
    for trace in snapshot.get("device_traces", []):
        for event in filter(frames, trace):
            event["frames"] = event["frames"][:8]
    for segment in snapshot.get("segments", []):
        for block in filter(frames, segment.get("blocks", [])):
            block["frames"] = block["frames"][:8]
    while True:
        packed = gzip.compress(pickle.dumps(snapshot), 6)
        traces = snapshot.get("device_traces", [])
        if len(packed) <= FILE_LIMIT or not any(len(t) > 1 for t in traces):
            return packed
        snapshot["device_traces"] = [t[len(t) // 2 :] for t in traces]


# ---- f: tests/test_gpu.py

# The tests no GPU has run yet (the H100's run of 2026-11-27 stopped before them), the FSDP
# test of the CNN's offload fix among them, and the one that says TF32 is off in the runs.
NOT_REACHED = "comm_hook_fp16 or stop_and_resume or eval_only or two_processes_equal_one"
NOT_REACHED += " or mp_spawn or dp_train or bf16_note or dataparallel_replicas"
NOT_REACHED += " or one_stage_per_process or finetune or quantize_reads or fsdp_cpu_offload_keeps"
NOT_REACHED += " or fsdp_device_cpu or tensor_parallel_bf16 or without_tf32"


def tests_env(c):
    """pytest's environment: on the CPU GPU_TESTS_ON_CPU=1; FRESH_PROCESSES=1 where the fork
    server's children cannot use CUDA (fork_probe)."""
    env = c.env({"GPU_TESTS_ON_CPU": "1"} if not c.cuda else {})
    return env | ({"FRESH_PROCESSES": "1"} if c.fork_ok is False else {})


def phase_tests(c):
    fork = fork_probe(c)  # phase a's, or now
    env = tests_env(c)
    pytest = [PY, "-m", "pytest", "tests/test_gpu.py", "-v", "-p", "no:cacheprovider"]
    first = c.args.tests or NOT_REACHED
    runs = [c.run("targeted", [*pytest, "-k", first], 240, env, start_fresh)]
    if not c.args.tests:  # the rest, with the time left; 3 failures say enough
        rest = [*pytest, "--maxfail=3", "-k", f"not ({first})"]
        runs.append(c.run("rest", rest, 600, env, start_fresh))
    with open(c.out / "pytest.log", "w") as log:
        for run in runs:
            log.write(f"$ {show(run.cmd)}\n{run.status}\n{run.stdout[-2_000_000:]}\n")
            log.write(f"{run.stderr[-200_000:]}\n{run.stacks}\n\n")
    figures, key = dict(fork_server=fork), [f"fork server {fork.split(' (')[0]}"]
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
    return phase_status(runs), figures, "; ".join(key), lines, [*c.fork_runs, *runs]


PHASE_FUNCTIONS = dict(a=phase_versions, m=phase_levers, b=phase_fashion, c=phase_gpt)
PHASE_FUNCTIONS.update(d=phase_probes)
PHASE_FUNCTIONS.update(e=phase_fsdp, f=phase_tests)


# ----------------------------------------------------------------------------------------


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    out = os.environ.get("OUT") or "runs/gpu-check"
    add("--out", default=out, help="folder for the files (default: $OUT, else runs/gpu-check)")
    add("--cpu", action="store_true", help="dry mode: every phase small, on the CPU")
    add("--phases", default=FIRST, help=f"which phases, of {''.join(PHASES)}, e.g. 'cd'")
    add("--deadline", type=float, default=450, help="seconds for the whole check")
    bounds = ", ".join(f"{k}={v[1]}" for k, v in PHASES.items())
    add("--phase-timeout", action="append", default=[], metavar="P=S", help=f"({bounds})")
    add("--modes", default="on,off,repeat,det", help=f"phase d's modes, of {','.join(MODES)}")
    add("--parallel", type=int, help="phase d's runs at a time (default: 8 on a GPU, 2 on CPU)")
    add("--tests", help="phase f: this pytest -k expression only (default: those never run)")
    epochs = "phase b's epochs of each run, the next run only where one ends below 94%%"
    add("--fashion-epochs", default=FAST_EPOCHS, help=epochs)
    add("--fashion-seeds", default="0", help="phase b: the recipe with each seed, e.g. 1,2,3")
    add("--gz-dir", default=".gpudata", help="folder holding Fashion-MNIST's four .gz files")
    add("--data-dir", default="data", help="torchvision root to unpack Fashion-MNIST into")
    add("--work-dir", help="where the runs write (default: a temporary folder, removed)")
    forks = "start `python` commands from tests/forkserver.py (torch imported once; default: --cpu)"
    add("--fork-server", action=argparse.BooleanOptionalAction, help=forks)
    add("--stall", default="", help="for tests: these phases' commands sleep forever, e.g. 'c'")
    args = p.parse_args(argv)
    for name in ("fashion_epochs", "fashion_seeds"):
        if not re.fullmatch(r"\d+(,\d+)*", getattr(args, name)):
            p.error(f"--{name.replace('_', '-')}: whole numbers, comma-separated")
    if args.fork_server is None:
        args.fork_server = args.cpu
    if args.parallel is None:
        args.parallel = 2 if args.cpu else 8
    args.bounds = {k: v[1] for k, v in PHASES.items()}
    for item in args.phase_timeout:
        phase, _, seconds = item.partition("=")
        if phase not in PHASES or not seconds:
            p.error(f"--phase-timeout {item}: expected P=SECONDS, P one of {''.join(PHASES)}")
        args.bounds[phase] = float(seconds)
    if set(args.phases) - set(PHASES):
        p.error(f"--phases {args.phases}: letters of {''.join(PHASES)}")
    if set(args.modes.split(",")) - set(MODES):
        p.error(f"--modes: of {','.join(MODES)}")
    return args


def main(argv=None):
    args = get_args(argv)
    signal.signal(signal.SIGTERM, stop_live)
    c = Check(args)
    summary, results = [], dict(phases={})
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
    """summary.md and summary.json, rewritten after each phase: a check stopped from outside
    still leaves what it had. On a GPU, summary.json's headline figures also go into
    benchmarks/gpu/summary.json, merged with what an earlier check wrote there."""
    results = dict(headline(c, results["phases"]), seconds=c.elapsed(), **results)
    (c.out / "summary.json").write_text(json.dumps(results, indent=1, default=str))
    if c.cuda and not c.args.cpu:
        kept = ROOT / "benchmarks/gpu/summary.json"
        old = json.loads(kept.read_text()) if kept.exists() else {}
        new = {k: v for k, v in results.items() if k in HEADLINE and v is not None}
        kept.write_text(json.dumps(old | new, indent=1, default=str) + "\n")
    head = [f"# GPU check, {results['date']}", ""]
    head += markdown([["phase", "status", "seconds", "key figures"], *summary]) + [""]
    (c.out / "summary.md").write_text("\n".join(head + details) + "\n")
    files = sorted(c.work.glob("*/metrics.jsonl"))
    if files:  # every run's metrics.jsonl, as RUN/metrics.jsonl
        with tarfile.open(c.out / "metrics.tar.gz.part", "w:gz") as tar:
            for file in files:
                tar.add(file, arcname=str(file.relative_to(c.work)))
        (c.out / "metrics.tar.gz.part").rename(c.out / "metrics.tar.gz")


HEADLINE = ("device", "torch", "date", "commit", "gpt2_small_best_mfu", "gpt2_small_best_config")
HEADLINE += ("fashion_mnist_94_seconds", "fashion_mnist_94_warmup_seconds", "script_mfu")


def headline(c, phases):
    """summary.json's first keys: the device, PyTorch, date and commit; the GPT's best MFU (in
    percent) and its configuration (phase m); the training seconds to 94% (phase b, its
    warm-up apart); each script's MFU in percent (phase c). None where not measured."""
    figures = lambda p: phases.get(p, {}).get("figures", {})  # noqa: E731
    versions, levers, fashion = figures("a"), figures("m"), figures("b")
    h = dict(device=versions.get("gpu") or (c.device_name() if c.cuda else "CPU (dry run)"))
    h["torch"] = versions.get("torch") or torch_version()
    h["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(c.started))
    h["commit"] = git_commit()
    best = levers.get("best") or {}
    h["gpt2_small_best_mfu"] = best.get("mfu") and round(100 * best["mfu"], 1)
    keys = ("name", "batch", "fused", "sdpa", "params", "compile")
    h["gpt2_small_best_config"] = {k: best[k] for k in keys if k in best} or None
    if fashion.get("data") == "fashion-mnist":
        h["fashion_mnist_94_seconds"] = fashion.get("time_to_target")
        h["fashion_mnist_94_warmup_seconds"] = fashion.get("warmup_seconds")
    scripts = {n: f.get("mfu") for n, f in figures("c").items() if isinstance(f, dict)}
    h["script_mfu"] = {n: round(100 * m, 1) for n, m in scripts.items() if m} or None
    return {k: h.get(k) for k in HEADLINE}


def torch_version():
    import torch

    return torch.__version__


def git_commit():
    """The tree's commit, or "unknown" (a copy of the tree without its history)."""
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            text=True,
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return proc.stdout.strip() if proc.returncode == 0 else "unknown"


if __name__ == "__main__":
    sys.exit(main())
