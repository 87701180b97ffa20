"""Start `python ARGS` without paying for `import torch` each time: a server that has imported
torch once forks a child per command, and the child runs the script as `python` would.

Why: most of the suite's time went to process start-up. A fresh `python ddp_train.py` spends
about 2.7 s importing torch and torch._dynamo (which the first optimizer pulls in) before its
first step of 0.1 s, and the suite starts a few hundred. A forked child skips that and is
otherwise a real, separate process: its own pid, environment, working directory, argv,
sys.path, stdin/stdout/stderr, exit status, signals; `__main__` is the script, so
multiprocessing's spawn and torch.multiprocessing find it.

What differs from a fresh interpreter, and how it is handled:
- Variables read when torch is imported (TORCH_*, PYTORCH_*, OMP_* but OMP_NUM_THREADS, CUDA_*,
  PYTHON* but PYTHONPATH, NVIDIA_* such as NVIDIA_TF32_OVERRIDE, read by the CUDA libraries
  when they load, ...): a command whose environment changes one of them gets a fresh
  interpreter instead (`needs_fresh`).
- A sitecustomize module that the command's PYTHONPATH brings: the child imports it, as
  Python's start-up would (the server's own, imported before the fork, is not the child's).
- OMP_NUM_THREADS, read by OpenMP when torch loads: the child sets torch's threads from it.
- Python's `random` state, copied by fork: Python reseeds it in a forked child itself.
- The end: Python's own (threads joined, atexit handlers, streams flushed, the exit status of
  SystemExit or a traceback) less the teardown of every module, which in a child copies the
  server's pages (0.5 s) and which no script relies on.
- torch, torchvision and torch.distributed.checkpoint (which checkpoint.py, imported by every
  script that saves, imports itself) are already imported: a script that uses a submodule it
  never imports could pass here. The torchrun tests still start fresh interpreters (torchrun's
  workers), and test_forkserver.py compares forked children with fresh ones.

FRESH_PROCESSES=1 turns the server off: every command then starts a fresh interpreter.
"""

import atexit
import contextlib
import gc
import importlib
import importlib.machinery
import json
import os
import re
import runpy
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types

# Read when torch or Python starts: a change to one needs a fresh interpreter.
READ_AT_START = re.compile(
    r"(TORCH|PYTORCH|TORCHINDUCTOR|CUDA|NCCL|NVIDIA|KMP|MKL|GOMP|LD)_\w*|OMP_(?!NUM_THREADS$)\w+"
    r"|PYTHON(?!PATH$)\w*"
)
# The server's own PYTHONPATH entries: a child's sys.path takes those of its request instead.
BASE_PATH_EXTRA = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


# ---------------------------------------------------------------------------------------------
# The server: `python forkserver.py SOCKET` (started by `Server` below).


def serve(path):
    import torch  # noqa: F401 - what every child would import first
    import torch._dynamo  # noqa: F401 - the first optimizer imports it: 1.3 s of each start
    import torch.distributed.checkpoint._fsspec_filesystem  # noqa: F401 - the first save's
    import torch.distributed.checkpoint.state_dict  # noqa: F401 - checkpoint.py's: 0.7 s
    import torchvision  # noqa: F401

    # fork() copies one thread. The server runs no tensor operation, so OpenMP's pool is never
    # started; numpy's OpenBLAS starts a pool when imported and forms it again in a forked child
    # (its fork handler), as in DataLoader's forked workers.
    gc.freeze()  # the children's collections then leave the server's objects (and pages) alone
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # the name appears once the server takes connections
    parent, waiting = os.getppid(), {}  # child pid -> the connection to answer
    while os.getppid() == parent:  # ends with the test session
        ready, _, _ = select.select([listener], [], [], 0.02)
        if ready:
            conn, _ = listener.accept()
            request, fds = receive(conn)
            pid = os.fork() if request else None
            if pid == 0:
                listener.close()
                conn.close()
                child(request, fds)  # never returns
            for fd in fds:
                os.close(fd)
            if pid is None:  # the test went away before it had sent the whole request
                conn.close()
                continue
            with contextlib.suppress(OSError):  # a test that went away is not the server's end
                conn.sendall(b"%d\n" % pid)
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid)
            with contextlib.suppress(OSError):
                conn.sendall(b"%d\n" % os.waitstatus_to_exitcode(status))
            conn.close()


def receive(conn):
    """(request, its three file descriptors); request None if the connection ended first."""
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while not message.endswith(b"\n"):  # a stream may deliver the request in parts
        more = conn.recv(1 << 20)
        if not more:
            return None, fds
        message += more
    return json.loads(message), fds


def child(request, fds):
    """Become `python ARGS` in the request's directory and environment; exit as it would."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    if request.get("new_session"):  # as Popen(start_new_session=True): a group of its own
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    import torch

    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    args = request["args"]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = extra + [p for p in sys.path[1:] if p not in BASE_PATH_EXTRA]
    # what `python ARGS` has when sitecustomize runs (runpy then sets -m's argv[0] to the file)
    sys.orig_argv = [sys.executable, *args]
    sys.argv = [args[0], *args[2:]] if args[0] in ("-m", "-c") else list(args)
    code = 0
    try:
        sitecustomize(extra)
        if args[0] == "-m":
            sys.path.insert(0, os.getcwd())
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.path.insert(0, "")
            sys.modules["__main__"] = main = types.ModuleType("__main__")
            exec(compile(args[1], "<string>", "exec"), main.__dict__)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException as e:  # the traceback Python prints, from the script's frame on
        tb = e.__traceback__
        while tb and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        code = 1
    # Python's own ending, less the teardown of every module (see the top of this file).
    threading._shutdown()  # waits for the threads that are not daemons
    atexit._run_exitfuncs()
    if code is None or isinstance(code, int):
        code = code or 0
    else:
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code & 0xFF)


def sitecustomize(paths):
    """What Python's start-up does with a sitecustomize module that PYTHONPATH (`paths`) brings:
    import it, and on an error print one line and go on (site.execsitecustomize)."""
    if importlib.machinery.PathFinder.find_spec("sitecustomize", paths) is None:
        return
    sys.modules.pop("sitecustomize", None)
    try:
        importlib.import_module("sitecustomize")
    except Exception as err:
        sys.stderr.write(
            "Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
            f"{type(err).__name__}: {err}\n"
        )


# ---------------------------------------------------------------------------------------------
# The client: a Popen look-alike for the tests.


class Server:
    def __init__(self, env):
        self.path = os.path.join(tempfile.mkdtemp(), "forkserver.sock")
        self.env = dict(env)  # the environment the server imports torch in
        self.proc = subprocess.Popen(
            [sys.executable, __file__, self.path],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 180  # importing torch took over 60 s at a load of 30
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the fork server did not start")
            time.sleep(0.05)

    def needs_fresh(self, args, env):
        """True where a forked child could differ from `python ARGS` run fresh in `env`."""
        changed = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        if any(READ_AT_START.fullmatch(k) for k in changed):
            return True
        first = str(args[0])
        return first.startswith("-") and first not in ("-m", "-c")  # python -u, -X ...: fresh

    def popen(self, args, cwd, env, new_session=False):
        return Forked(self.path, args, cwd, env, new_session)

    def close(self):
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


class Forked:
    """What subprocess.Popen(ARGS, stdin=DEVNULL, stdout=PIPE, stderr=PIPE, text=True) gives,
    for a child of the fork server: pid, poll, wait, communicate, kill, send_signal.
    new_session: the child starts a session (and process group) of its own, as with
    Popen(start_new_session=True)."""

    def __init__(self, path, args, cwd, env, new_session=False):
        self.args, self.returncode = args, None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        self.conn = socket.socket(socket.AF_UNIX)
        self.conn.connect(path)
        request = dict(args=[str(a) for a in args[1:]], cwd=str(cwd), env=env)
        request["new_session"] = new_session
        socket.send_fds(self.conn, [json.dumps(request).encode() + b"\n"], [null, out_w, err_w])
        for fd in (null, out_w, err_w):
            os.close(fd)
        self.pipes = {out_r: [], err_r: []}  # what each pipe gave so far
        self.open = {out_r, err_r}
        self.out, self.err = out_r, err_r
        self.answer = b""
        self.pid = int(self._line())

    def _line(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.answer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self.conn.settimeout(left)
            try:
                data = self.conn.recv(64)
            except (TimeoutError, BlockingIOError):
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            if not data:
                raise RuntimeError("the fork server went away")
            self.answer += data
        line, self.answer = self.answer.split(b"\n", 1)
        return line

    def poll(self):
        if self.returncode is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.returncode = int(self._line(timeout=0))
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            self.returncode = int(self._line(timeout))
        return self.returncode

    def communicate(self, timeout=None):
        """Read stdout and stderr to their ends, then the exit status."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            for fd in self.open:
                sel.register(fd, selectors.EVENT_READ)
            while self.open:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in sel.select(left):
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        self.pipes[key.fd].append(data)
                    else:
                        sel.unregister(key.fd)
                        self.open.discard(key.fd)
                        os.close(key.fd)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.wait(left)
        self.conn.close()
        # as text=True gives it: universal newlines (tqdm's \r ends a line too)
        text = (b"".join(self.pipes[fd]).decode() for fd in (self.out, self.err))
        return tuple(t.replace("\r\n", "\n").replace("\r", "\n") for t in text)

    def __del__(self):  # a test that did not read both pipes to their ends
        for fd in getattr(self, "open", ()):
            os.close(fd)
        if hasattr(self, "conn"):
            self.conn.close()

    def send_signal(self, sig):
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def terminate(self):
        self.send_signal(signal.SIGTERM)


if __name__ == "__main__":
    serve(sys.argv[1])
