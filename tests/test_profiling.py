"""--profile and the FLOP count (profiling.py): a trace per rank with the collectives in it and
one line per rank, the same training with and without it; FLOPs against a count by hand; the
peak table and MFU; the in-memory data set moved by InMemoryDataset.to keeps its batches."""

import json
import re
import time

import pytest
import torch
import torch.nn as nn
from conftest import (
    MLP_ARGS,
    ROOT,
    SYNTHETIC,
    load_ckpt,
    one_line_errors,
    read_metrics,
    run_python,
    text_flags,
    torchrun,
    torchrun_workers,
)
from torch.utils.data import DataLoader, DistributedSampler

import models
import profiling
from data import InMemoryDataset, collate, eval_shard


def mlp_flops(batch, pixels=784, hidden=256, classes=10, first_trains=True):
    """One forward and backward of models.MLP by hand: a linear layer of n inputs and k outputs
    on m rows costs 2 m n k forward; backward the same again for the weight's gradient, and
    again for the input's where one is needed (not for the images, nor below a frozen layer)."""
    layers = [(pixels, hidden), (hidden, classes)]
    forward = sum(2 * batch * n * k for n, k in layers)
    weights = sum(2 * batch * n * k for n, k in (layers if first_trains else layers[1:]))
    inputs = 2 * batch * hidden * classes if first_trains else 0  # layer 2's, for layer 1
    return forward + weights + inputs


def test_step_flops_of_the_mlp_and_a_convolution_are_the_hand_counts():
    assert profiling.step_flops(models.MLP(), (32, 1, 28, 28)) == mlp_flops(32)
    frozen = models.MLP()
    frozen[1].requires_grad_(False)  # backward stops at layer 2: its weight's gradient only
    assert profiling.step_flops(frozen, (32, 1, 28, 28)) == mlp_flops(32, first_trains=False)
    conv = nn.Conv2d(3, 8, 3, padding=1)  # 8 x 3 x 3 x 3 multiply-adds per output pixel
    forward = 2 * 4 * 16 * 16 * 8 * 3 * 9
    assert profiling.step_flops(conv, torch.zeros(4, 3, 16, 16)) == 2 * forward


def test_step_flops_of_the_gpt_are_the_hand_count():
    """A GPT's step by hand: every Linear 2 m n k forward and twice that backward (the byte
    embedding's output needs a gradient, so every layer sends one back); attention's two
    products 2 x 2 B T^2 d a layer forward and twice that backward, counted whole although
    the mask makes half of them zeros (as FlopCounterMode counts them, and as MFU is usually
    reported); the embedding lookup none."""
    B, T, d, L, V = 4, 32, 32, 4, 256
    linears = 3 * 2 * B * T * (12 * d * d * L + d * V)  # q, k, v, proj: 4 d^2; MLP: 8 d^2
    attention = 3 * L * 4 * B * T * T * d
    tokens = torch.zeros(B, T, dtype=torch.long)
    assert profiling.step_flops(models.GPT(V, T, d, heads=2), tokens) == linears + attention


def test_step_flops_changes_nothing_of_the_model():
    """Counted on the meta device: the weights, BatchNorm's running statistics, the gradients,
    the RNG and each module's train/eval mode are what they were."""
    model = models.build_model("cnn", 1, 10)
    model.train()
    model.features[1].eval()  # a module left in eval mode stays there
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    assert profiling.step_flops(model, (8, 1, 28, 28)) > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())
    assert model.training and not model.features[1].training and model.features[0].training


def test_peak_table_and_mfu(monkeypatch):
    cuda = torch.device("cuda", 0)
    name = "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: name)
    assert profiling.peak_flops(cuda, torch.bfloat16) == 989e12
    name = "NVIDIA H100 PCIe"  # not the SXM's figure
    assert profiling.peak_flops(cuda, torch.float16) == 756e12
    name = "NVIDIA A100-SXM4-80GB"
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert profiling.peak_flops(cuda) == 19.5e12
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")  # TF32 matmuls
    assert profiling.peak_flops(cuda) == 156e12
    name = "Tesla V100-SXM2-16GB"
    assert profiling.peak_flops(cuda, torch.bfloat16) is None  # no bf16 units
    name = "Some Future GPU"
    assert profiling.peak_flops(cuda, torch.bfloat16) is None
    assert profiling.peak_flops(cuda, torch.bfloat16, peak_tflops=100) == 100e12
    cpu = torch.device("cpu")
    assert profiling.flop_rates(3e12, 2, cpu) == {"flops_per_second": 1.5e12}  # no MFU on a CPU
    rates = profiling.flop_rates(3e12, 2, cpu, None, peak_tflops=0.5, devices=6)
    assert rates == {"flops_per_second": 1.5e12, "mfu": 0.5}  # 1.5 of 6 x 0.5 TFLOP/s


def test_a_gpu_trace_is_read_on_the_gpus_side(tmp_path):
    """On CUDA the CPU only queues the kernels: the step is where its kernels ran, and the wait
    is NCCL's kernel time with no compute kernel beside it. A trace of that shape, written
    here (no GPU on the machines that run the tests)."""

    def x(name, cat, ts, dur):
        return dict(ph="X", name=name, cat=cat, ts=ts, dur=dur, tid=1)

    events = [
        x("ProfilerStep#4", "user_annotation", 0, 100),  # the CPU queues the step
        x("aten::mm", "cpu_op", 0, 10),
        x("c10d::allreduce_", "cpu_op", 10, 2),
        x("ProfilerStep#4", "gpu_user_annotation", 50, 200),  # the GPU runs it
        x("sm90_gemm", "kernel", 50, 100),
        x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 120, 80),
        x("sm90_gemm", "kernel", 220, 30),
    ]
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps(dict(traceEvents=events)))
    trace = profiling.read_trace(path)
    assert trace["gpu"] and trace["steps"] == [(50.0, 250.0)]
    assert [name for *_, name, _ in trace["collectives"]] == [events[5]["name"]]
    # NCCL runs 120-200, compute until 150: 50 of the step's 200 us waiting
    assert profiling.step_time_and_waiting(trace) == (0.2, 0.25)


def test_a_collective_called_inside_an_operator_is_waiting_not_compute(tmp_path):
    """On the CPU an operator can call its collective inside itself (DTensor's operators wait
    in wait_tensor, the ring's attention in its sends): that time is waiting, the rest of the
    operator compute. A trace of that shape, written here."""

    def x(name, ts, dur):
        return dict(ph="X", name=name, cat="cpu_op", ts=ts, dur=dur, tid=1)

    events = [
        dict(x("ProfilerStep#4", 0, 200), cat="user_annotation"),
        x("aten::mm", 0, 50),
        x("PythonSubclass", 50, 150),  # a DTensor linear: its all-reduce's wait inside
        x("_c10d_functional::wait_tensor", 100, 80),
        x("aten::add", 180, 20),
    ]
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps(dict(traceEvents=events)))
    trace = profiling.read_trace(path)
    assert [name for *_, name, _ in trace["collectives"]] == ["_c10d_functional::wait_tensor"]
    assert profiling.union(trace["compute"]) == [(0.0, 100.0), (180.0, 200.0)]
    assert profiling.step_time_and_waiting(trace) == (0.2, 0.4)  # 100-180 of the step's 200 us


def profiled_run(out, profile=None):
    """ddp_train.py's MLP, 2 processes x 16, 5 steps (the window of steps 4-6 cut short by the
    run's end); with --profile DIR if given."""
    argv = ["ddp_train.py", *MLP_ARGS, "--max-steps", "5", "--batch-size", "16"]
    argv += ["--output-dir", out] + (["--profile", profile] if profile else [])
    return torchrun_workers(2, argv)


@pytest.mark.slow
def test_profile_writes_a_trace_per_rank_and_training_is_unchanged(tmp_path):
    proc = profiled_run(tmp_path / "profiled", tmp_path / "trace")
    profiled_run(tmp_path / "plain")
    # The same weights to the last bit: the profiler only watches.
    plain, profiled = load_ckpt(tmp_path / "plain"), load_ckpt(tmp_path / "profiled")
    assert all(torch.equal(plain["model"][k], v) for k, v in profiled["model"].items())
    for rank in range(2):
        path = tmp_path / "trace" / f"rank{rank}.json"
        names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
        assert {"gloo:all_reduce", "c10d::allreduce_", "ProfilerStep#4"} <= names
        trace = profiling.read_trace(path)
        # Steps 4 and 5: not a third holding the evaluation, checkpoint and export after them
        assert len(trace["steps"]) == 2 and trace["compute"] and trace["collectives"]
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(f"rank {rank}: profile")]
        assert len(lines) == 1, proc.stdout  # one line per rank
        assert "ms a step" in lines[0] and "% of it waiting in collectives" in lines[0]
        top = lines[0].split("largest per step: ")[1].split("; ")[0].split(", ")
        assert len(top) == 3 and all(re.fullmatch(r"\S.* \d+\.\d ms", op) for op in top)
    # The FLOP rate is the hand count of a step of the global batch (32) x steps / seconds.
    (record,) = read_metrics(tmp_path / "profiled")
    flops = record["flops_per_second"] * record["epoch_seconds"] / record["step"]
    assert flops == pytest.approx(mlp_flops(32), rel=1e-9) and "mfu" not in record


def test_the_window_holds_training_steps_only(tmp_path):
    """Profiler.step(last=True): an evaluation comes next (here a sleep of 0.3 s). Inside the
    window (steps 4-6) it ends the window, written as it is, also at its first step ("first");
    just before, it puts the window off a step; so no profiled step holds it (it was the open
    step until stop())."""

    def steps(name, last_steps, steps):
        profiler = profiling.Profiler(tmp_path / name)
        for step in range(1, steps + 1):
            torch.ones(64, 64) @ torch.ones(64, 64)  # the training step
            profiler.step(step in last_steps)
            if step in last_steps:
                time.sleep(0.3)  # the evaluation
        profiler.stop()
        return profiling.read_trace(tmp_path / name / "rank0.json")["steps"]

    cases = [("short", {5}, 5, 2), ("first", {4}, 4, 1), ("epochs", {3, 6}, 8, 2)]
    for name, last_steps, runs, profiled in cases:
        found = steps(name, last_steps, runs)
        assert len(found) == profiled, (name, found)  # "epochs": steps 5 and 6
        assert all(end - start < 0.25e6 for start, end in found), (name, found)  # microseconds


def test_a_run_shorter_than_the_window_says_so_and_writes_nothing(tmp_path):
    argv = ["ddp_train.py", *MLP_ARGS, "--max-steps", "2", "--profile", tmp_path / "trace"]
    proc = run_python(argv)
    assert "rank 0: profile: 2 steps, none profiled (from step 4): nothing written" in proc.stdout
    assert list((tmp_path / "trace").iterdir()) == []


@pytest.mark.slow
def test_an_unwritable_profile_dir_is_one_line_on_every_rank(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    out = tmp_path / "out"
    argv = [*SYNTHETIC, "--max-steps", "1", "--output-dir", out]
    errors = one_line_errors("ddp_train.py", [*argv, "--profile", tmp_path / "file" / "trace"])
    assert all(e.startswith(f"error: --profile {tmp_path}/file/trace") for e in errors), errors
    assert not out.exists()  # refused before anything is written
    errors = one_line_errors("ddp_train.py", [*argv, "--peak-tflops", "0"])
    assert errors == ["error: --peak-tflops must be positive, got 0.0"] * 2


def test_a_data_set_moved_by_to_gives_the_same_batches_in_the_same_order():
    """What the DDP-family scripts do on a GPU, on the CPU: the set moved with .to(), indexed by
    the same DistributedSampler, yields the plain set's batches; the test shard too."""
    g = torch.Generator().manual_seed(0)
    data = InMemoryDataset(torch.randn(50, 1, 4, 4, generator=g), torch.arange(50), range(3))
    moved = data.to(torch.device("cpu"))
    assert moved.classes == data.classes
    meta = data.to(torch.device("meta"))  # both tensors go
    assert meta.images.is_meta and meta.labels.is_meta and meta.images.shape == (50, 1, 4, 4)
    for dataset in (data, moved):
        sampler = DistributedSampler(dataset, 2, 1, seed=3, drop_last=True)
        sampler.set_epoch(2)
        loader = DataLoader(dataset, 4, sampler=sampler, drop_last=True, collate_fn=collate)
        shard = DataLoader(eval_shard(dataset, 1, 2), 8, collate_fn=collate)
        batches = [*loader, *shard]
        if dataset is data:
            expected = batches
    for (x, y), (ex, ey) in zip(batches, expected, strict=True):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    # and they are the sampler's samples: labels are the indices here
    assert torch.equal(expected[0][1], torch.tensor(list(sampler)[:4]))


FAST = [*SYNTHETIC, "--max-steps", "5", "--batch-size", "8", "--dist-timeout", "60"]
COPIES = {  # script: (command line, processes started by the test's launcher)
    "dp_train.py": ([*FAST, "--model", "mlp"], 1),
    "ddp_comm.py": ([*FAST, "--model", "mlp"], 2),
    "ddp_mp_spawn.py": ([*FAST, "--model", "mlp", "--nprocs", "2"], 1),
    "finetune.py": ([*FAST, "--weights", "none", "--image-size", "32"], 2),
}
SLOW = pytest.mark.slow
SLOW_ONES = ("ddp_mp_spawn.py", "finetune.py")  # fresh interpreters (mp.spawn); a ResNet-18


@pytest.mark.parametrize(
    "script",
    ["dp_train.py", "ddp_comm.py", *(pytest.param(s, marks=SLOW) for s in SLOW_ONES)],
)
@pytest.mark.slow
def test_every_copy_profiles_and_logs_its_flop_rate(tmp_path, script):
    """The other scripts of the DDP family take --profile and log flops_per_second like
    ddp_train.py (model_parallel.py's traces: test_pictures.py)."""
    argv, world = COPIES[script]
    argv = [script, *argv, "--output-dir", tmp_path / "out", "--profile", tmp_path / "trace"]
    proc = torchrun_workers(2, argv) if world == 2 else run_python(argv)
    ranks = 1 if script == "dp_train.py" else 2
    for rank in range(ranks):
        trace = profiling.read_trace(tmp_path / "trace" / f"rank{rank}.json")
        # 2 steps: the window (steps 4-6) ends with the run, not in its evaluation
        assert len(trace["steps"]) == 2 and bool(trace["collectives"]) == (ranks == 2)
        assert proc.stdout.count(f"rank {rank}: profile of 2 steps") == 1, proc.stdout
    (record,) = read_metrics(tmp_path / "out")
    assert record["flops_per_second"] > 0


# Four of the five sharded scripts (not nd_parallel.py), one after another in the same two
# torchrun processes (one start-up instead of four; each main() makes and ends its own process
# group), each on the GPT. Without the sample of 300 bytes each writes at its end (a forward
# pass a byte: a quarter of this test's time), which test_language_model.py reads.
FOUR_RUNS = """
import sys
sys.path.insert(0, {root!r})
import context_parallel, expert_parallel, fsdp_train, tensor_parallel
out, argv = sys.argv[1], sys.argv[2:]
for script in (fsdp_train, tensor_parallel, context_parallel, expert_parallel):
    script.generate = lambda *args, **kwargs: "(not drawn in this test)"
    name = script.__name__
    trace = ["--profile", f"{{out}}/trace/{{name}}"]
    script.main([*argv, "--output-dir", f"{{out}}/{{name}}", *trace])
"""


@pytest.mark.slow
def test_the_sharded_scripts_profile_and_log_their_flop_rate(tmp_path, small_text):
    """fsdp_train.py, tensor_parallel.py, context_parallel.py and expert_parallel.py on 2
    processes with --profile: a trace per rank with the collectives of their strategy in it,
    one line per rank, and flops_per_second in metrics.jsonl. --max-steps 4: the last step is
    the window's first, so the window ends there, one step, the evaluation not in it."""
    driver = tmp_path / "four.py"
    driver.write_text(FOUR_RUNS.format(root=str(ROOT)))
    flags = [*text_flags(small_text), "--dim", "32", "--max-steps", "4", "--batch-size", "4"]
    # Real torchrun (as test_scripts.py's three runs): its store outlives each main()'s group.
    proc = torchrun(2, [driver, tmp_path, *flags, "--dist-timeout", "60"], timeout=300)
    for name in ("fsdp_train", "tensor_parallel", "context_parallel", "expert_parallel"):
        for rank in range(2):
            trace = profiling.read_trace(tmp_path / "trace" / name / f"rank{rank}.json")
            assert len(trace["steps"]) == 1 and trace["collectives"], (name, rank)  # step 4
            _, waiting = profiling.step_time_and_waiting(trace)
            assert waiting > 0, (name, rank)  # DTensor's collectives too, inside its operators
        (record,) = read_metrics(tmp_path / name)
        assert record["flops_per_second"] > 0, name
    for rank in range(2):
        assert proc.stdout.count(f"rank {rank}: profile of 1 steps") == 4, proc.stdout
