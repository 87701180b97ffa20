"""The scripts' CUDA paths, run for a few steps on a real GPU: NCCL under torchrun, autocast
with bf16 and with fp16 (GradScaler, clipping after unscale), channels_last, torch.compile,
SyncBatchNorm, a stop and a resume that continues bit for bit, --eval-only, DataParallel's
replicas, mp.spawn, pipeline stages, fine-tuning, and int8 quantization of a checkpoint saved
from CUDA. Every run must keep the output contract, and its checkpoint must load and evaluate
on the CPU (where quantize.py, or a laptop, reads it).

Skipped without CUDA. GPU_TESTS_ON_CPU=1 runs the same tests with --device cpu (gloo; checks
that need CUDA skip), which proves the harness, flags and assertions on a machine without a GPU;
the default suite does not do that (the other test files cover the CPU paths).

    python -m pytest tests/test_gpu.py -q                      # a machine with CUDA
    GPU_TESTS_ON_CPU=1 python -m pytest tests/test_gpu.py -q   # anywhere: the harness itself

Tests marked "2 GPUs" skip on a one-GPU machine: NCCL refuses two ranks on one device. With
GPU_TESTS_ON_CPU=1 they run as 2 CPU processes (gloo).

Every run the tests start is bounded (BOUND): one that outlives its bound is stopped with
everything it started, after its Python stacks (and native ones, where py-spy or gdb is
installed) are taken, and the test fails with them, instead of hanging the suite. Every run has
TF32 off (ENV). benchmarks/gpu/check.py runs these tests among its phases, after measuring what
they compare; its README says what to do with the figures.
"""

import atexit
import contextlib
import functools
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import threading

import conftest
import forkserver
import pytest
import torch
import torch.nn as nn
from conftest import (
    DIST_TIMEOUT,
    METRIC_KEYS,
    ROOT,
    assert_state_close,
    clean_env,
    load_ckpt,
    max_abs_diff,
    read_metrics,
)
from torch.utils.data import DataLoader

import data
import models
import training

ON_CPU = os.environ.get("GPU_TESTS_ON_CPU") == "1"
if not ON_CPU and not torch.cuda.is_available():
    pytest.skip(
        "no CUDA device: the GPU tests need one (GPU_TESTS_ON_CPU=1 runs their logic on the CPU)",
        allow_module_level=True,
    )

CUDA = not ON_CPU
DEVICE = "cuda" if CUDA else "cpu"
# On the CPU, 2 gloo processes stand in for 2 GPUs.
GPUS = torch.cuda.device_count() if CUDA else 2
cuda_only = pytest.mark.skipif(not CUDA, reason="needs CUDA (GPU_TESTS_ON_CPU=1 runs on the CPU)")
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs: NCCL refuses two ranks on one GPU")

# Seconds a run may take before it is stopped: a few steps with CUDA's start-up, and with
# torch.compile's. Without a bound one stalled run hung for over 330 s on an H200 (2026-11-26:
# test_fsdp_bf16_and_cpu_offload).
BOUND, COMPILE_BOUND = 120, 240
DATA = ["--data", "synthetic", "--device", DEVICE]
BASE = [*DATA, *DIST_TIMEOUT]
# The MLP has no BatchNorm: its runs compare closely across devices, precisions and world
# sizes. 5 steps at a high rate (no warm-up) move the weights far more than any tolerance below.
MLP_STEPS = ["--model", "mlp", "--epochs", "1", "--batch-size", "32", "--max-steps", "5"]
MLP_STEPS += ["--lr", "0.8", "--warmup", "0"]
MLP = [*BASE, *MLP_STEPS]
CNN = [
    *BASE,
    "--model",
    "cnn",
    "--epochs",
    "1",
    "--batch-size",
    "32",
    "--max-steps",
    "5",
    "--lr",
    "0.4",
]
# Tolerances, as relative_error() (distance between two runs' weights over the distance they
# moved from the start; a run that did not train, or trained something else, is near 1). On
# the CPU: bf16 against fp32 0.017, fp16 with its GradScaler 0.008, fp16 gradient compression
# 0.0003, compiled CNN against eager 0.0002, NHWC against NCHW 0.000003. On a GPU cuDNN picks
# other kernels per layout and device. With TF32 on (cuDNN's default for convolutions), an H200
# measured NHWC against NCHW at 0.025 and model_parallel.py's CNN over cuda:0 and the CPU at
# 0.066 (2026-11-26): TF32 rounds to 10 bits of mantissa, differently in each kernel. The runs
# have TF32 off (ENV): on an H100 (PyTorch 2.11, 2026-11-27, benchmarks/gpu/check.py's phase d)
# the same comparisons gave 1.1e-6 (NHWC), 5.4e-7 (model_parallel.py), 1.0e-6 (compiled) and
# 8.7e-7 (SyncBatchNorm), the noise of one run repeated 8e-7 to 1e-6, under the deterministic
# algorithms at most 1.7e-6. CONV_TOL: 10x the largest, far below TF32's 0.018-0.066 (on the
# CPU, GPU_TESTS_ON_CPU=1, the compiled CNN's 0.0002 above).
AMP_TOL, CONV_TOL = 0.05, 2e-5 if CUDA else 2e-3
# Keys of ddp_train.py's checkpoint (README, output contract).
CKPT_KEYS = {
    "model",
    "optimizer",
    "scheduler",
    "scaler",
    "epoch",
    "epoch_step",
    "step",
    "steps_per_epoch",
}
CKPT_KEYS |= {"world_size", "rng", "args"}
# Environment of every run. TF32 off, on both sides of every comparison: NVIDIA_TF32_OVERRIDE=0
# turns it off in cuBLAS and cuDNN, which read it when they load (so a command with it starts
# from a server that has it too, or fresh: forkserver.READ_AT_START). cuBLAS gives the same
# bits run after run only with a fixed workspace. NCCL_DEBUG=VERSION makes NCCL print one line
# when it creates a communicator.
ENV = {"NVIDIA_TF32_OVERRIDE": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_DEBUG": "VERSION"}

# benchmarks/gpu/check.py: bounded runs, their process trees and their stacks.
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks/gpu/check.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)
_server = None  # a fork server of ENV's own (conftest's has pytest's environment)


def start(cmd, cwd, env):
    """Start CMD in a process group of its own (check.stop_tree ends its group and tree):
    forked from a server that imported torch with ENV where the command allows (forkserver.py),
    else a fresh interpreter."""
    global _server
    if _server is None and not conftest.FRESH:
        _server = forkserver.Server(conftest.SERVER_ENV | ENV)
        atexit.register(_server.close)
    forked = _server and cmd[0] == sys.executable and not _server.needs_fresh(cmd[1:], env)
    conftest.STARTS[bool(forked)] += 1
    if forked:
        return _server.popen(cmd, cwd, env, new_session=True)
    return check.start_fresh(cmd, cwd, env)


def bounded(cmd, env, bound=BOUND, grace=check.GRACE):
    """Run CMD for at most `bound` s (check.run_bounded); fails with its output, and where it
    was stopped with every process's Python stacks."""
    run = check.run_bounded(cmd, bound, env, cwd=ROOT, start=start, grace=grace)
    command = " ".join(run.cmd)
    if run.status == "timed out":
        stacks = run.stacks[:30_000] or "(none written)"
        raise AssertionError(
            f"stopped after its bound of {bound:.0f} s ({run.seconds:.0f} s with the stop):\n"
            f"{command}\n--- Python stacks when stopped\n{stacks}\n{run.tail()}"
        )
    if run.status != 0:
        raise AssertionError(f"command failed:\n{command}\nexit {run.status}\n{run.tail()}")
    return subprocess.CompletedProcess(run.cmd, run.status, run.stdout, run.stderr)


def launch(script, flags, out=None, nproc=None, env=None, bound=None):
    """`python SCRIPT FLAGS`, or under torchrun --standalone with nproc processes; bounded."""
    cmd = [script, *flags] + (["--output-dir", out] if out else [])
    if nproc:
        cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *cmd]
    bound = bound or (COMPILE_BOUND if "--compile" in cmd else BOUND)
    return bounded([sys.executable, *map(str, cmd)], clean_env(**ENV, **(env or {})), bound)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """run(script, flags, nproc=None) -> (output dir, CompletedProcess), made once per module
    for each distinct command: several tests read the same run. A run that failed or was
    stopped fails every test that reads it, without being started again."""
    made = {}

    def get(script, flags, nproc=None):
        key = (script, tuple(map(str, flags)), nproc)
        if key not in made:
            out = tmp_path_factory.mktemp(script.removesuffix(".py"))
            try:
                made[key] = out, launch(script, flags, out, nproc)
            except AssertionError as e:
                made[key] = e
        if isinstance(made[key], AssertionError):
            raise AssertionError(f"(a run made for an earlier test) {made[key]}")
        return made[key]

    return get


STALL = """
import time
def stalled_on_purpose():
    while True:
        time.sleep(1)
stalled_on_purpose()
"""


@pytest.mark.skipif(CUDA, reason="the harness's own test: GPU_TESTS_ON_CPU=1 runs it")
def test_a_stalled_launch_is_stopped_within_its_bound_with_its_stacks(tmp_path):
    """A run that never ends, here a worker under torchrun (which starts it in a process group of
    its own) that sleeps forever, is stopped at its bound with the worker, and the failure holds
    the Python stacks of both torchrun and the worker."""
    script = tmp_path / "stall.py"
    script.write_text(STALL)
    with pytest.raises(AssertionError, match="stopped after its bound of 8 s") as failure:
        launch(script, [], nproc=1, bound=8)
    message = str(failure.value)
    # 8 s, 1 s for the stacks, the native ones where a debugger is installed (check.NATIVE_BOUND
    # at most), SIGTERM (SIGKILL after check.GRACE)
    took = int(re.search(r"\((\d+) s with the stop\)", message)[1])
    native = check.NATIVE_BOUND if check.native_tool() else 0
    assert took < 8 + 1 + native + check.GRACE + 2, message
    assert 'stall.py", line 5 in stalled_on_purpose' in message, message
    assert "torch/distributed/elastic" in message, message  # torchrun's own stack
    worker = re.search(r"pid (\d+): \S+ -u \S*stall\.py|pid (\d+): \S+ \S*stall\.py", message)
    assert worker and not check.alive(int(worker[1] or worker[2])), "the worker outlived the stop"


TF32_PROBE = """
import os, torch
import torch.nn.functional as F
print(os.environ.get("NVIDIA_TF32_OVERRIDE"))
if torch.cuda.is_available():  # an fp32 convolution against float64: TF32 leaves about 1e-3
    torch.manual_seed(0)
    x, w = torch.randn(8, 64, 28, 28), torch.randn(64, 64, 3, 3)
    got = F.conv2d(x.cuda(), w.cuda(), padding=1).cpu().double()
    exact = F.conv2d(x.double(), w.double(), padding=1)
    print(((got - exact).norm() / exact.norm()).item())
"""


def test_runs_compute_without_tf32():
    """Every run has TF32 off (ENV), forked or fresh: on a GPU an fp32 convolution in a run is
    exact to fp32's rounding (cuDNN's default, TF32, would leave about 1e-3)."""
    proc = launch("-c", [TF32_PROBE])
    lines = proc.stdout.split()
    assert lines[0] == "0", "a run without NVIDIA_TF32_OVERRIDE=0"
    if CUDA:
        assert float(lines[1]) < 1e-5, f"TF32 in a run's convolution: error {lines[1]}"


# ----------------------------------------------------------------------------------------
# Reading and comparing what the runs wrote


@functools.cache
def synthetic_test_loader():
    _, test_set, _, _ = data.load_datasets("synthetic", "data")
    return DataLoader(test_set, batch_size=100, collate_fn=data.collate)


def check_contract(out, model, loss_tol=5e-3, acc_tol=2 / 499, keys=()):
    """The output contract of one run: metrics lines with the usual keys and finite values,
    and a checkpoint that loads on the CPU (map_location, weights_only) into `model`, a plain
    CPU module, and evaluates there to what the run itself measured on its device: to two
    test samples in 499 for fp32 (TF32 convolutions on the GPU round), wider under autocast."""
    records = read_metrics(out)
    assert records and all(r.keys() >= METRIC_KEYS for r in records)
    assert all(
        math.isfinite(r[k])
        for r in records
        for k in ("train_loss", "test_loss", "samples_per_second")
    )
    ckpt = load_ckpt(out)  # map_location="cpu", weights_only=True: what a CPU-only machine does
    assert set(keys) <= ckpt.keys(), f"checkpoint lacks {set(keys) - ckpt.keys()}"
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in ckpt["model"]), (
        "wrapper prefixes saved"
    )
    model.load_state_dict(ckpt["model"], strict=True)
    loss, acc = training.evaluate(model, synthetic_test_loader(), torch.device("cpu"))
    assert loss == pytest.approx(records[-1]["test_loss"], abs=loss_tol, rel=loss_tol)
    assert acc == pytest.approx(records[-1]["test_acc"], abs=acc_tol)
    return ckpt, records


def tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors(value)


def ddp_model(name):
    return models.build_model(name, 1, 10)


def weights(state):
    """The trained parameters of a state dict as one vector (BatchNorm's running statistics
    and counters left out: they are not what the optimizer moves)."""
    keys = sorted(k for k in state if not any(s in k for s in ("running_", "num_batches")))
    return torch.cat([state[k].double().flatten() for k in keys])


def relative_error(state, reference, initial):
    """|state - reference| / |reference - initial|: how far two runs' weights are apart,
    measured against how far training moved them. Near 0 when both took the same steps; near
    1 (or more) when one of them did not train, or trained something else."""
    moved = (weights(reference) - weights(initial)).norm()
    assert moved > 1e-3, "the reference run barely moved: the comparison would prove nothing"
    return ((weights(state) - weights(reference)).norm() / moved).item()


def assert_same_training(state, reference, initial, tol):
    error = relative_error(state, reference, initial)
    assert error < tol, (
        f"the weights differ by {error:.3g} of what training moved them (tolerance {tol})"
    )


def initial(run, model):
    """The weights a run starts from: one step at a rate too small to change a float32
    weight (the script's own seeding and initialization, whatever order it uses)."""
    flags = MLP if model == "mlp" else CNN
    out, _ = run("ddp_train.py", [*flags, "--max-steps", "1", "--lr", "1e-12"], nproc=1)
    return load_ckpt(out)["model"]


# ----------------------------------------------------------------------------------------
# ddp_train.py under torchrun, one process on one GPU (NCCL)


def test_nccl_under_torchrun(run):
    """ddp_train.py under torchrun --nproc_per_node=1 on the GPU: the output contract, and an
    NCCL communicator, so that DDP's CUDA path (NCCL all-reduce) runs on a one-GPU machine too."""
    out, proc = run("ddp_train.py", MLP, nproc=1)
    ckpt, _ = check_contract(out, ddp_model("mlp"), keys=CKPT_KEYS)
    assert ckpt["world_size"] == 1 and ckpt["step"] == 5
    assert re.search(r"1 process\(es\) on " + DEVICE, proc.stdout), proc.stdout[-2000:]
    if CUDA:
        # NCCL_DEBUG=VERSION: NCCL printed its version, so a communicator was made and DDP's
        # gradient all-reduce ran through it, even with one process.
        assert "NCCL version" in proc.stdout + proc.stderr, (
            "no NCCL communicator was made: with one process ddp_train.py starts no process group "
            "(common.init_distributed_mode: world_size > 1), so DDP and NCCL never run on one GPU"
        )


def test_gpu_equals_cpu(run):
    """The same MLP steps on the GPU and on the CPU (one process each) agree to float
    rounding: the device changes the arithmetic's order, not the training. fp32 rounding
    leaves about 1e-6 (relative); TF32 matmuls, if a script turned them on, about 1e-3; a
    step lost, a gradient scaled twice or a batch on the wrong device, about 1."""
    gpu, _ = run("ddp_train.py", MLP, nproc=1)
    cpu, _ = run("ddp_train.py", [*MLP, "--device", "cpu"])  # the last --device wins
    got, expected = load_ckpt(gpu)["model"], load_ckpt(cpu)["model"]
    assert_same_training(got, expected, initial(run, "mlp"), 0.01)


def test_bf16_autocast(run):
    """bf16 autocast: fp32 master weights, no loss scaling, and the same training as fp32
    within bf16's rounding (8 bits of mantissa)."""
    out, _ = run("ddp_train.py", [*MLP, "--amp", "bf16"], nproc=1)
    ckpt, _ = check_contract(out, ddp_model("mlp"), loss_tol=0.02, acc_tol=0.02)
    assert all(t.dtype == torch.float32 for t in ckpt["model"].values())
    assert not ckpt["scaler"], "bf16 needs no GradScaler, but its state was saved"
    fp32, _ = run("ddp_train.py", MLP, nproc=1)
    assert_same_training(ckpt["model"], load_ckpt(fp32)["model"], initial(run, "mlp"), AMP_TOL)


def test_fp16_gradscaler_clips_after_unscale(run):
    """fp16 autocast with a GradScaler, and --clip-grad: the scaler is active (saved state,
    loss scale a power of 2), and the clip acts on the true gradients. Clipping the scaled
    ones (65536x too large) would cut every step to 1/65536 of its size: the weights would
    hardly move, and their change would be far from fp32's with the same clip."""
    clip = ["--clip-grad", "0.5", "--weight-decay", "0"]
    out, _ = run("ddp_train.py", [*MLP, *clip, "--amp", "fp16"], nproc=1)
    ckpt, _ = check_contract(out, ddp_model("mlp"), loss_tol=0.02, acc_tol=0.02)
    scale = ckpt["scaler"].get("scale")
    assert scale and math.isfinite(scale) and math.log2(scale).is_integer(), (
        f"no active GradScaler: {ckpt['scaler']}"
    )
    assert all(t.dtype == torch.float32 for t in ckpt["model"].values())
    fp32, _ = run("ddp_train.py", [*MLP, *clip], nproc=1)
    unclipped, _ = run("ddp_train.py", [*MLP, "--weight-decay", "0"], nproc=1)
    start = initial(run, "mlp")
    reference = load_ckpt(fp32)["model"]
    assert_same_training(ckpt["model"], reference, start, AMP_TOL)
    # The clip was binding: without it the same steps go elsewhere.
    error = relative_error(load_ckpt(unclipped)["model"], reference, start)
    assert error > 0.2, (
        f"--clip-grad 0.5 changed the steps by {error:.3g} only: the clip did not bind"
    )


def test_channels_last(run):
    """--channels-last (the default) trains the CNN in NHWC: its conv kernels are saved in that
    layout, and it computes what NCHW does."""
    out, _ = run("ddp_train.py", [*CNN, "--channels-last"], nproc=1)
    ckpt, _ = check_contract(out, ddp_model("cnn"))
    plain, _ = run("ddp_train.py", [*CNN, "--no-channels-last"], nproc=1)
    nchw = load_ckpt(plain)["model"]
    # A kernel with more than one input channel and a 3x3 window, whose layouts differ.
    name = next(
        k for k, v in ckpt["model"].items() if v.dim() == 4 and v.shape[1] > 1 and v.shape[2] > 1
    )
    assert ckpt["model"][name].is_contiguous(memory_format=torch.channels_last)
    assert not nchw[name].is_contiguous(memory_format=torch.channels_last)
    assert_same_training(ckpt["model"], nchw, initial(run, "cnn"), CONV_TOL)


def test_compile(run):
    """torch.compile on the device: plain keys in the checkpoint, the eager steps' result."""
    out, _ = run("ddp_train.py", [*CNN, "--compile"], nproc=1)
    ckpt, _ = check_contract(out, ddp_model("cnn"))
    eager, _ = run("ddp_train.py", [*CNN, "--channels-last"], nproc=1)
    assert_same_training(ckpt["model"], load_ckpt(eager)["model"], initial(run, "cnn"), CONV_TOL)


@cuda_only
def test_sync_bn_one_gpu(run):
    """--sync-bn converts BatchNorm to SyncBatchNorm: the checkpoint keeps BatchNorm's keys
    (loads into the plain CNN) and, with one process, trains exactly like BatchNorm."""
    out, _ = run("ddp_train.py", [*CNN, "--sync-bn"], nproc=1)
    ckpt, _ = check_contract(out, ddp_model("cnn"))
    plain, _ = run("ddp_train.py", [*CNN, "--channels-last"], nproc=1)
    assert_same_training(ckpt["model"], load_ckpt(plain)["model"], initial(run, "cnn"), CONV_TOL)


@cuda_only
@two_gpus
def test_sync_bn_two_gpus_equal_one(run):
    """With SyncBatchNorm, 2 GPUs x 16 normalise over the global batch of 32, as one GPU
    does with all 32 (plain BatchNorm would use each GPU's 16 and differ)."""
    two, _ = run("ddp_train.py", [*CNN, "--batch-size", "16", "--sync-bn"], nproc=2)
    one, _ = run("ddp_train.py", [*CNN, "--channels-last"], nproc=1)
    assert_same_training(
        load_ckpt(two)["model"], load_ckpt(one)["model"], initial(run, "cnn"), CONV_TOL
    )


def test_comm_hook_fp16(run):
    """--comm-hook on the device's all-reduce: as many processes as GPUs (at most 2) with
    the global batch of 32 take one process's steps; fp16 compression rounds the gradient to
    about 3 digits, no more."""
    nproc = min(GPUS, 2)
    out, _ = run(
        "ddp_comm.py", [*MLP, "--batch-size", str(32 // nproc), "--comm-hook", "fp16"], nproc=nproc
    )
    ckpt, _ = check_contract(out, ddp_model("mlp"))
    assert ckpt["world_size"] == nproc
    reference, _ = run("ddp_train.py", MLP, nproc=1)
    assert_same_training(ckpt["model"], load_ckpt(reference)["model"], initial(run, "mlp"), 0.01)


def test_stop_and_resume_bit_for_bit(run, tmp_path):
    """A run stopped in the middle of its second epoch and rerun with the same --output-dir
    ends with exactly the weights, optimizer state and loss scale of a run never stopped.
    --augment draws random crops on the device, so the device's RNG state must come back too
    (a checkpoint saved on CUDA once crashed on resume: its RNG states were mapped to the GPU)."""
    flags = [
        *BASE,
        "--model",
        "mlp",
        "--epochs",
        "2",
        "--batch-size",
        "64",
        "--lr",
        "0.4",
        "--augment",
    ]
    flags += ["--amp", "fp16", "--clip-grad", "1"]
    whole, _ = run("ddp_train.py", flags, nproc=1)
    launch("ddp_train.py", [*flags, "--max-steps", "40"], tmp_path, nproc=1)
    stopped = load_ckpt(tmp_path)
    assert (stopped["epoch"], stopped["epoch_step"], stopped["step"]) == (
        1,
        40 - stopped["steps_per_epoch"],
        40,
    )
    proc = launch("ddp_train.py", flags, tmp_path, nproc=1)
    assert "resumed" in proc.stdout
    resumed, expected = load_ckpt(tmp_path), load_ckpt(whole)
    for part in ("model", "optimizer", "scaler"):
        pairs = zip(tensors(resumed[part]), tensors(expected[part]), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs), f"{part} differs after the resume"
    assert resumed["scaler"] == expected["scaler"]
    assert resumed["step"] == expected["step"] == 2 * expected["steps_per_epoch"]
    got, want = read_metrics(tmp_path), read_metrics(whole)
    assert [r["epoch"] for r in got] == [0, 1]
    assert [r["test_loss"] for r in got] == [r["test_loss"] for r in want]


def test_eval_only(run):
    """--eval-only on the device reproduces the test loss and accuracy the run measured."""
    out, _ = run("ddp_train.py", [*CNN, "--channels-last"], nproc=1)
    proc = launch("ddp_train.py", [*CNN, "--eval-only", "--resume", out / "checkpoint.pt"], nproc=1)
    found = re.search(r"test_loss ([\d.]+) test_acc ([\d.]+)", proc.stdout)
    assert found, proc.stdout[-2000:]
    [record] = read_metrics(out)
    assert float(found[1]) == pytest.approx(record["test_loss"], abs=1e-3)
    assert float(found[2]) == pytest.approx(record["test_acc"], abs=1 / 499)


@two_gpus
def test_two_processes_equal_one(run):
    """DDP over 2 GPUs (NCCL) with 2 x 16 takes the steps of one GPU with 32."""
    two, proc = run("ddp_train.py", [*MLP, "--batch-size", "16"], nproc=2)
    one, _ = run("ddp_train.py", MLP, nproc=1)
    assert_same_training(
        load_ckpt(two)["model"], load_ckpt(one)["model"], initial(run, "mlp"), 0.01
    )
    assert not CUDA or "NCCL version" in proc.stdout + proc.stderr


# ----------------------------------------------------------------------------------------
# The other launchers and strategies on the device


def test_mp_spawn_one_process(run):
    """ddp_mp_spawn.py --nprocs 1 on the device: torchrun's training, launched differently."""
    out, proc = run("ddp_mp_spawn.py", ["--nprocs", "1", *MLP])
    ckpt, _ = check_contract(out, ddp_model("mlp"))
    reference, _ = run("ddp_train.py", MLP, nproc=1)
    assert max_abs_diff(ckpt["model"], load_ckpt(reference)["model"]) < 1e-5


def test_dp_train_bf16(run):
    """dp_train.py with --amp bf16 over every visible GPU: the output contract, and the same
    training as one DDP process within bf16's rounding."""
    # One process: no --dist-timeout.
    out, _ = run("dp_train.py", [*DATA, *MLP_STEPS, "--amp", "bf16"])
    ckpt, _ = check_contract(out, ddp_model("mlp"), loss_tol=0.02, acc_tol=0.02)
    reference, _ = run("ddp_train.py", MLP, nproc=1)
    assert_same_training(ckpt["model"], load_ckpt(reference)["model"], initial(run, "mlp"), AMP_TOL)


def test_dp_train_device_cpu_beside_gpus(run):
    """dp_train.py --device cpu on a machine with GPUs trains on the CPU: nn.DataParallel,
    which takes every visible GPU whatever the model's device, is not built (it moved the model
    to cuda:0, and with two GPUs refused it). The same training as ddp_train.py on the CPU."""
    flags = ["--data", "synthetic", *MLP_STEPS, "--device", "cpu"]
    out, proc = run("dp_train.py", flags)
    assert "the CPU, no DataParallel" in proc.stdout
    ckpt, _ = check_contract(out, ddp_model("mlp"))
    reference, _ = run("ddp_train.py", [*MLP, "--device", "cpu"])
    assert max_abs_diff(ckpt["model"], load_ckpt(reference)["model"]) < 1e-5


@cuda_only
def test_bf16_note_only_before_ampere(run):
    """--amp bf16 prints the emulation note on a GPU before Ampere (compute capability 8.0)
    and nothing on a later one: this GPU's answer, as the run sees it."""
    _, proc = run("ddp_train.py", [*MLP, "--amp", "bf16"], nproc=1)
    before_ampere = torch.cuda.get_device_capability(0)[0] < 8
    assert ("is emulated and slow" in proc.stdout) == before_ampere, proc.stdout


@contextlib.contextmanager
def output_dtypes(module):
    """Collects the dtypes that the Linear and Conv2d layers inside `module` output, from
    every thread (DataParallel's replicas share their original's hooks)."""
    seen, lock = set(), threading.Lock()

    def record(_module, _inputs, output):
        with lock:
            seen.add(output.dtype)

    hooks = [
        m.register_forward_hook(record)
        for m in module.modules()
        if isinstance(m, (nn.Linear, nn.Conv2d))
    ]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def replica_dtypes(module, inputs, device):
    """What `module` computes in when run the way DataParallel runs its replicas:
    parallel_apply, one thread per replica (here all on one device)."""
    with output_dtypes(module) as seen:
        if device.type == "cuda":
            nn.parallel.parallel_apply(
                [module] * len(inputs), inputs, devices=[device.index] * len(inputs)
            )
        else:
            # parallel_apply needs an accelerator. Its worker, as in torch/nn/parallel/
            # parallel_apply.py: a new thread re-enters autocast with `enabled` alone, so the
            # dtype falls back to the thread's default (CUDA: float16, CPU: bfloat16).
            enabled = torch.is_autocast_enabled(device.type)

            def worker(x):
                with torch.no_grad(), torch.amp.autocast(device.type, enabled=enabled):
                    module(x)

            threads = [threading.Thread(target=worker, args=(x,)) for x in inputs]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    return seen


def test_dataparallel_replicas_compute_in_the_asked_dtype():
    """DataParallel's replica threads re-enter autocast with `enabled` only, which on CUDA
    means float16 even when bfloat16 was asked for. dp_train.Autocast re-enters it inside
    each replica with the dtype asked for. Shown both ways; on the CPU, whose threads default
    to bfloat16, the same holds with float16 asked for."""
    import dp_train

    device = torch.device(DEVICE, 0) if CUDA else torch.device("cpu")
    asked, default = (torch.bfloat16, torch.float16) if CUDA else (torch.float16, torch.bfloat16)
    model = models.build_model("cnn", 1, 10).to(device)
    inputs = [torch.randn(4, 1, 28, 28, device=device) for _ in range(2)]
    with torch.no_grad(), torch.autocast(device.type, dtype=asked):
        bare = replica_dtypes(model, inputs, device)
        wrapped = replica_dtypes(dp_train.Autocast(model, asked), inputs, device)
    assert bare == {default}, f"without the wrapper the replicas computed in {bare}"
    assert wrapped == {asked}, f"with dp_train.Autocast the replicas computed in {wrapped}"
    if CUDA and GPUS >= 2:
        # The real thing: nn.DataParallel with one replica on each of 2 GPUs.
        x = torch.randn(8, 1, 28, 28, device=device)
        for net, expected in ((model, default), (dp_train.Autocast(model, asked), asked)):
            with output_dtypes(model) as seen, torch.no_grad(), torch.autocast("cuda", dtype=asked):
                nn.DataParallel(net, device_ids=[0, 1])(x)
            assert seen == {expected}, f"DataParallel({type(net).__name__}) computed in {seen}"


@functools.cache
def has_devices_flag():
    """Whether model_parallel.py has its one-process mode (--devices) in this version."""
    cmd = [sys.executable, "model_parallel.py", "--help"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    return "--devices" in proc.stdout


# --lr 4: a peak of 0.5 at batch 32 (the rate is per 256 samples).
MP_ARGS = [*BASE, "--epochs", "1", "--max-steps", "5", "--batch-size", "32", "--lr", "4"]


def mp_reference(run):
    """model_parallel.py's reference: the whole model on one device, one process."""
    if not has_devices_flag():
        pytest.skip("model_parallel.py has no --devices (one-process) mode in this version")
    return run("model_parallel.py", [*MP_ARGS, "--devices", "cuda:0" if CUDA else "cpu"])[0]


def mp_check(out, reference):
    """A pipelined run took the reference's steps (within TF32's rounding where stages sit on
    different devices), and saved the whole model, which loads and evaluates on the CPU."""
    import model_parallel

    models.seed_everything(0)  # what model_parallel.py starts from (--seed 0)
    start = model_parallel.build_pipeline_cnn(1, 10).state_dict()
    ckpt, _ = check_contract(out, model_parallel.build_pipeline_cnn(1, 10))
    assert_same_training(ckpt["model"], load_ckpt(reference)["model"], start, CONV_TOL)


@pytest.mark.parametrize("devices", ["cuda:0,cuda:0", "cuda:0,cpu"] if CUDA else ["cpu,cpu"])
def test_model_parallel_devices(run, devices):
    """model_parallel.py in one process, 2 stages on the given devices, 4 micro-batches."""
    reference = mp_reference(run)
    out, proc = run("model_parallel.py", [*MP_ARGS, "--devices", devices, "--microbatches", "4"])
    mp_check(out, reference)


@two_gpus
@pytest.mark.skipif(
    tuple(map(int, torch.__version__.split(".")[:2])) < (2, 10),
    reason="model_parallel.py's one stage per process needs PyTorch 2.10 or newer",
)
def test_model_parallel_one_stage_per_process(run):
    """Two stages under torchrun, one GPU each (NCCL send/recv between them)."""
    reference = mp_reference(run)
    out, _ = run("model_parallel.py", MP_ARGS, nproc=2)
    mp_check(out, reference)


def test_finetune(run):
    """finetune.py on the device (random weights: no download): the bare ResNet with its new
    head is saved, loads into torchvision's resnet18 on the CPU and evaluates there as on
    the device."""
    import torchvision

    import finetune

    flags = [
        *BASE,
        "--model",
        "resnet18",
        "--weights",
        "none",
        "--image-size",
        "32",
        "--max-steps",
        "3",
    ]
    out, _ = run("finetune.py", [*flags, "--batch-size", "16", "--epochs", "1"])
    model = torchvision.models.get_model("resnet18", num_classes=10)
    net = nn.Sequential(finetune.ToImageNetInput(32), model)
    ckpt = load_ckpt(out)  # map_location="cpu", weights_only=True: what a CPU-only machine does
    model.load_state_dict(ckpt["model"], strict=True)
    [record] = read_metrics(out)
    assert record.keys() >= METRIC_KEYS
    loss, acc = training.evaluate(net, synthetic_test_loader(), torch.device("cpu"))
    # TF32 convolutions on the GPU round.
    assert loss == pytest.approx(record["test_loss"], abs=5e-3, rel=5e-3)
    assert acc == pytest.approx(record["test_acc"], abs=2 / 499)


def test_quantize_reads_a_cuda_checkpoint(run, tmp_path):
    """quantize.py, in a process that sees no GPU (a CPU-only machine), quantizes the CNN
    trained on the device; its fp32 row's accuracy is the run's own."""
    out, _ = run("ddp_train.py", [*CNN, "--channels-last"], nproc=1)
    report = tmp_path / "q.json"
    flags = [
        "--checkpoint",
        out / "checkpoint.pt",
        "--data",
        "synthetic",
        "--model",
        "cnn",
        "--runs",
        "2",
    ]
    cmd = [sys.executable, "quantize.py", *map(str, flags), "--json", str(report)]
    bounded(cmd, clean_env(**ENV, CUDA_VISIBLE_DEVICES=""))
    rows = {r["method"]: r for r in json.loads(report.read_text())["results"]}
    [record] = read_metrics(out)
    assert rows["fp32"]["accuracy"] == pytest.approx(record["test_acc"], abs=2 / 499)


# ----------------------------------------------------------------------------------------
# fsdp_train.py


def test_fsdp_bf16_and_cpu_offload(run):
    """fsdp_train.py under torchrun on the device (NCCL on a GPU): bf16 through
    MixedPrecisionPolicy and, on CUDA, the shards kept in CPU memory; its model.pt loads on the
    CPU, evaluates there to what the run measured, and is the CPU fp32 run's within bf16's
    rounding (Adam's steps do not depend on the gradients' scale, so the tolerance is AMP's)."""
    vit = [*DIST_TIMEOUT, "--data", "synthetic", "--model", "vit", "--batch-size", "32"]
    # Clipping all-reduces the offloaded (CPU) gradients' norm: NCCL alone cannot.
    vit += ["--max-steps", "5", "--warmup", "0", "--lr", "0.05", "--clip-grad", "1"]
    flags = [*vit, "--device", DEVICE, "--amp", "bf16"]
    flags += ["--cpu-offload"] * CUDA + ["--save-every", "2", "--async-save"]
    out, proc = run("fsdp_train.py", flags, nproc=1)
    assert re.search(r"1 process\(es\) on " + DEVICE, proc.stdout), proc.stdout[-2000:]
    assert (out / "checkpoint" / ".metadata").is_file()
    state = torch.load(out / "model.pt", map_location="cpu", weights_only=True)
    model = models.build_model("vit", 1, 10)
    model.load_state_dict(state)
    loss, acc = training.evaluate(model, synthetic_test_loader(), torch.device("cpu"))
    record = read_metrics(out)[-1]
    assert record["step"] == 5 and acc == pytest.approx(record["test_acc"], abs=0.02)
    assert loss == pytest.approx(record["test_loss"], abs=0.02, rel=0.02)
    cpu, _ = run("fsdp_train.py", [*vit, "--device", "cpu"])
    start, _ = run("fsdp_train.py", [*vit, "--device", "cpu", "--max-steps", "1", "--lr", "1e-12"])
    reference = torch.load(cpu / "model.pt", map_location="cpu", weights_only=True)
    initial = torch.load(start / "model.pt", map_location="cpu", weights_only=True)
    assert_same_training(state, reference, initial, AMP_TOL)


@cuda_only
def test_fsdp_cpu_offload_keeps_batchnorm_statistics_on_the_gpu(run):
    """--cpu-offload with the CNN: the shards in CPU memory, BatchNorm's running statistics
    (buffers, not offloaded by FSDP) on the GPU, where the forward runs and updates them.
    Before: the meta build's to_empty on the CPU put them there, and the forward failed."""
    flags = [*DIST_TIMEOUT, "--data", "synthetic", "--model", "cnn", "--batch-size", "32"]
    flags += ["--max-steps", "3", "--device", DEVICE, "--cpu-offload"]
    out, _ = run("fsdp_train.py", flags, nproc=1)  # torchrun: FSDP, even on one process
    state = torch.load(out / "model.pt", map_location="cpu", weights_only=True)
    moved = [k for k in state if "running_mean" in k]
    assert moved and all(state[k].abs().sum() > 0 for k in moved)  # the statistics were updated


def test_fsdp_device_cpu_init_from_and_bf16_batchnorm(run):
    """--device cpu on a machine with GPUs: the mesh, and so every shard, on the CPU (gloo; the
    default mesh would be CUDA's). --init-from a model.pt on the device: the shards filled from
    the file a tensor at a time (every rank reads it) equal it. The CNN's BatchNorm in bf16."""
    mlp = [*DIST_TIMEOUT, "--data", "synthetic", "--model", "mlp", "--max-steps", "3"]
    cpu, proc = run("fsdp_train.py", [*mlp, "--device", "cpu"], nproc=2)
    assert "2 process(es) on cpu" in proc.stdout, proc.stdout[-2000:]
    flags = [*mlp, "--device", DEVICE, "--init-from", cpu / "model.pt", "--lr", "1e-12"]
    out, _ = run("fsdp_train.py", [*flags, "--max-steps", "1"], nproc=GPUS)
    start = torch.load(cpu / "model.pt", weights_only=True)
    got = torch.load(out / "model.pt", weights_only=True)
    assert_state_close(got, start, atol=1e-6)  # a step at 1e-12 leaves fp32 weights as they are
    cnn = [*DIST_TIMEOUT, "--data", "synthetic", "--model", "cnn", "--max-steps", "3"]
    out, _ = run("fsdp_train.py", [*cnn, "--device", DEVICE, "--amp", "bf16"], nproc=GPUS)
    assert math.isfinite(read_metrics(out)[-1]["train_loss"])


# ----------------------------------------------------------------------------------------
# tensor_parallel.py


def test_tensor_parallel_bf16_sequence_parallel(run):
    """tensor_parallel.py under torchrun on the device: TP over 2 GPUs (1 where there is one)
    with --sequence-parallel and autocast bf16; its model.pt loads on the CPU, evaluates there
    to what the run measured, and is the CPU fp32 run's within bf16's rounding."""
    vit = [*DIST_TIMEOUT, "--data", "synthetic", "--batch-size", "32"]
    vit += ["--max-steps", "5", "--warmup", "0", "--lr", "0.05"]
    tp = min(GPUS, 2)
    flags = [*vit, "--device", DEVICE, "--amp", "bf16", "--sequence-parallel"]
    out, proc = run("tensor_parallel.py", flags, nproc=tp)
    assert f"1 x {tp} (dp x tp) process(es) on {DEVICE}" in proc.stdout, proc.stdout[-2000:]
    state = torch.load(out / "model.pt", map_location="cpu", weights_only=True)
    model = models.ViT(1, 10, 28)
    model.load_state_dict(state)
    loss, acc = training.evaluate(model, synthetic_test_loader(), torch.device("cpu"))
    record = read_metrics(out)[-1]
    assert record["step"] == 5 and acc == pytest.approx(record["test_acc"], abs=0.02)
    assert loss == pytest.approx(record["test_loss"], abs=0.02, rel=0.02)
    cpu, _ = run("tensor_parallel.py", [*vit, "--device", "cpu"])
    flags = [*vit, "--device", "cpu", "--max-steps", "1", "--lr", "1e-12"]
    start, _ = run("tensor_parallel.py", flags)
    reference = torch.load(cpu / "model.pt", map_location="cpu", weights_only=True)
    initial = torch.load(start / "model.pt", map_location="cpu", weights_only=True)
    assert_same_training(state, reference, initial, AMP_TOL)
