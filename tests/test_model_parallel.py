"""model_parallel.py in its three modes, each against the unsplit model on one device:
1. naive (one process, stages on cpu,cpu), 2. micro-batched in one process, 3. one process
per stage (gloo on CPU; torchrun's workers, forked, or real torchrun where a test names it).
Each takes the same steps, evaluates exactly, writes a checkpoint that loads into the unsplit
model and resumes in any mode; bad input stops with one line, on every rank.

The parity holds only if the stages pass the right activations and gradients, every stage
reads the same batch, the micro-batch gradients are averaged (not summed), and the model has
no BatchNorm (whose statistics would depend on the micro-batch).
"""

import argparse
import copy
import gc
import itertools
import random
import re
import shutil
import time
import types
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    DIST_TIMEOUT,
    METRIC_KEYS,
    SYNTHETIC,
    assert_state_close,
    clean_env,
    free_port,
    load_ckpt,
    max_abs_diff,
    read_metrics,
    run_python,
    run_ranks,
    text_flags,
    torchrun,
    torchrun_workers,
)
from torch.utils.data import DataLoader

import common
import data
import model_parallel
import models
import training

ATOL = 1e-5
# 5 steps of batch 128 at a peak rate of 0.1 (0.2 per 256 samples): the weights move far more
# than the tolerance, and the loss goes down.
ARGS = [*SYNTHETIC, "--epochs", "1", "--max-steps", "5", "--batch-size", "128", "--lr", "0.2"]
ARGS += DIST_TIMEOUT
# Every mode: (processes, flags). "naive" leaves --devices to its default (cpu,cpu with
# --device cpu).
RUNS = {
    "one device": (1, ["--devices", "cpu"]),  # the reference: the unsplit model
    "naive": (1, []),
    "micro-4": (1, ["--devices", "cpu,cpu", "--microbatches", "4"]),
    "naive-gpipe": (2, ["--pipeline-schedule", "gpipe", "--microbatches", "1"]),
    "1f1b-4": (2, ["--pipeline-schedule", "1f1b", "--microbatches", "4"]),
}
MODES = {"naive": 1, "micro-4": 2, "naive-gpipe": 3, "1f1b-4": 3}
# Mode 3 (one stage per process) needs PyTorch 2.10, and model_parallel.py refuses an older one
# in one line (test_one_stage_per_process_needs_torch_2_10); there its tests skip.
PIPELINING = tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 10)
needs_2_10 = pytest.mark.skipif(not PIPELINING, reason="mode 3 needs PyTorch 2.10 or newer")


def mode_3_needs_2_10(names):
    """pytest parameters for run names, the mode-3 ones skipped before PyTorch 2.10."""
    return [pytest.param(n, marks=needs_2_10) if MODES.get(n) == 3 else n for n in names]


def rank_envs(world, **extra):
    """One environment per rank for plain processes that form a group of `world` on this host."""
    port = str(free_port())
    return [
        clean_env(
            RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world)
        )
        | dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra)
        for r in range(world)
    ]


@pytest.fixture(scope="session")
def mp_runs(tmp_path_factory):
    """One short run per entry of RUNS, made on first use: (output dir, CompletedProcess)."""
    runs = {}

    def get(name):
        if name not in runs:
            nproc, flags = RUNS[name]
            out = tmp_path_factory.mktemp("mp_" + name.replace(" ", "_"))
            argv = ["model_parallel.py", *ARGS, *flags, "--output-dir", out]
            runs[name] = out, (torchrun_workers(nproc, argv) if nproc > 1 else run_python(argv))
        return runs[name]

    return get


def moments(ckpt):
    """The checkpoint's optimizer state (SGD's momentum, AdamW's moments), one flat dict."""
    return {f"{n}.{k}": v for n, state in ckpt["optimizer"].items() for k, v in state.items()}


def initial_model():
    torch.manual_seed(0)  # what model_parallel.py starts from (--seed 0)
    return model_parallel.build_pipeline_cnn(1, 10)


@pytest.mark.slow
def test_default_devices_are_two_stages_on_cpu(mp_runs):
    _, proc = mp_runs("naive")
    assert "mode 1: one process, 2 stages, 1 micro-batch(es), bubble 50%" in proc.stdout
    assert "stage 0: layers 0-1 on cpu" in proc.stdout
    assert "stage 1: layers 2-4 on cpu" in proc.stdout


def split_model(model, devices):
    costs = model_parallel.layer_costs(model, torch.zeros(1, 1, 28, 28))
    cuts = model_parallel.balanced_split(costs, len(devices))
    pairs = zip(cuts, devices, strict=True)
    plain = types.SimpleNamespace(compile=False, amp="none")  # neither --compile nor --amp
    return [model_parallel.make_stage(model, a, b, d, plain) for (a, b), d in pairs]


@pytest.mark.parametrize("stages, microbatches", [(2, 1), (3, 4)])
def test_split_matches_unsplit_model(stages, microbatches):
    """Same weights, same batch: the split model's logits, gradients, and parameters after an
    optimizer step are the unsplit model's. (3, 4): a middle stage and a pipeline of 4 pieces."""
    reference = initial_model()
    split = copy.deepcopy(reference)
    devices = [torch.device("cpu")] * stages
    stages_ = split_model(split, devices)
    images, labels = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (reference, split)]
    expected = reference(images)
    F.cross_entropy(expected, labels).backward()
    logits = model_parallel.pipeline_forward(stages_, devices, images, microbatches)
    F.cross_entropy(logits, labels).backward()
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    grads = {name: p.grad for name, p in split.named_parameters()}
    assert_state_close(grads, {name: p.grad for name, p in reference.named_parameters()}, atol=ATOL)
    for optimizer in optimizers:
        optimizer.step()
    assert_state_close(split.state_dict(), reference.state_dict(), atol=ATOL)


def test_amp_sends_bf16_between_stages():
    """--amp bf16: a stage sends its activations in bf16 (half the bytes), the next takes them
    back to fp32 for its residual stream; the logits are the unsplit model's under autocast."""
    torch.manual_seed(0)
    model, cpu = models.GPT(256, 16, 32, 2, 2), torch.device("cpu")
    amp = types.SimpleNamespace(compile=False, amp="bf16")
    first, second = (model_parallel.make_stage(model, a, a + 1, cpu, amp) for a in (0, 1))
    received = []
    second.blocks[1].register_forward_pre_hook(lambda _, xs: received.append(xs[0].dtype))
    tokens = torch.randint(0, 256, (2, 16))
    with torch.autocast("cpu", torch.bfloat16):
        sent = first(tokens)
        logits, whole = second(sent), model(tokens)
    assert sent.dtype == torch.bfloat16 and received == [torch.float32]
    assert torch.allclose(logits.float(), whole.float(), atol=0.05)


def test_microbatches_form_a_wavefront():
    """At tick t stage s works on piece t-s: stage 0 takes piece k+1 before stage 1 has done
    piece k (one piece after another through all stages would be naive, 4 times over)."""
    model = initial_model()
    stages = split_model(model, [torch.device("cpu")] * 3)
    calls = []
    for s, stage in enumerate(stages):
        stage.register_forward_hook(lambda *_, s=s: calls.append(s))
    model_parallel.pipeline_forward(stages, [torch.device("cpu")] * 3, torch.randn(8, 1, 28, 28), 4)
    assert calls == [0, 0, 1, 0, 1, 2, 0, 1, 2, 1, 2, 2]


@pytest.mark.slow
@pytest.mark.parametrize("name", mode_3_needs_2_10(["naive", "micro-4", "naive-gpipe", "1f1b-4"]))
def test_mode_matches_one_device(mp_runs, name):
    reference = load_ckpt(mp_runs("one device")[0])["model"]
    # Can fail: 5 steps moved the weights by far more than the tolerance, so a stage that did
    # not step, summed micro-batch gradients or a shuffled batch would show.
    assert max_abs_diff(reference, initial_model().state_dict()) > 1000 * ATOL
    out, _ = mp_runs(name)
    assert_state_close(load_ckpt(out)["model"], reference, atol=ATOL)
    # The training loss comes from the last stage and reaches rank 0's metrics.
    [metrics], [ref] = read_metrics(out), read_metrics(mp_runs("one device")[0])
    assert metrics["train_loss"] == pytest.approx(ref["train_loss"], abs=ATOL)


@pytest.mark.slow
def test_microbatches_match_naive(mp_runs):
    naive, micro = (load_ckpt(mp_runs(name)[0]) for name in ("naive", "micro-4"))
    assert_state_close(micro["model"], naive["model"], atol=ATOL)
    assert_state_close(moments(micro), moments(naive), atol=ATOL)


@pytest.fixture(scope="session")
def initial_test_loss():
    _, test_set, _, _ = data.load_datasets("synthetic", "data")
    loader = DataLoader(test_set, 100, collate_fn=data.collate)
    return training.evaluate(initial_model(), loader, torch.device("cpu"))[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", mode_3_needs_2_10(["naive", "micro-4", "1f1b-4"]))
def test_output_contract(mp_runs, initial_test_loss, name):
    out, proc = mp_runs(name)
    [metrics] = read_metrics(out)
    assert metrics.keys() >= METRIC_KEYS | {"world_size", "step", "lr", "stages", "microbatches"}
    world = RUNS[name][0]
    got = (metrics["epoch"], metrics["step"], metrics["world_size"], metrics["stages"])
    assert got == (0, 5, world, 2)
    assert metrics["lr"] > 0 and metrics["epoch_seconds"] > 0 and metrics["samples_per_second"] > 0
    assert metrics["test_loss"] < initial_test_loss  # it learnt
    # The checkpoint holds the WHOLE model (both stages' weights, original names), not a stage.
    ckpt = load_ckpt(out)
    model = model_parallel.build_pipeline_cnn(1, 10)
    model.load_state_dict(ckpt["model"], strict=True)
    assert list(ckpt["model"]) == list(model.state_dict())
    assert sorted(ckpt["optimizer"]) == sorted(name for name, _ in model.named_parameters())
    assert (ckpt["epoch"], ckpt["step"]) == (0, 5)  # 5 steps of a 15-step epoch: epoch 0 again
    # Rank 0 alone prints: the mode, the split into 2 stages and one summary line.
    assert proc.stdout.count(f"mode {MODES[name]}: ") == 1
    assert proc.stdout.count("stage 1: layers") == 1
    assert proc.stdout.count("epoch 0: train_loss") == 1


@pytest.mark.parametrize(
    "name", ["micro-4", pytest.param("1f1b-4", marks=[needs_2_10, pytest.mark.slow])]
)
def test_evaluation_equals_one_process(mp_runs, name):
    """The split model's test loss and accuracy (last stage, a padded last batch) are one
    process's on the same weights, over every one of the 499 test samples."""
    out, _ = mp_runs(name)
    _, test_set, num_classes, in_channels = data.load_datasets("synthetic", "data")
    model = model_parallel.build_pipeline_cnn(in_channels, num_classes)
    model.load_state_dict(load_ckpt(out)["model"])
    loader = DataLoader(test_set, 100, collate_fn=data.collate)
    loss, acc = training.evaluate(model, loader, torch.device("cpu"))
    [metrics] = read_metrics(out)
    assert metrics["test_loss"] == pytest.approx(loss, abs=1e-5)
    assert metrics["test_acc"] == pytest.approx(acc, abs=1e-9)
    assert len(test_set) % 128  # the last batch is partial: the padding is exercised


# Resume: 2 epochs of 7 steps, micro-batched in one process.
RESUME_ARGS = [*SYNTHETIC, "--epochs", "2", "--batch-size", "256", "--microbatches", "4"]
ONE_PROCESS = ["--devices", "cpu,cpu"]
# One stage per process: GPipe (1f1b needs as many micro-batches as stages: 4 >= 2 would do).
PER_PROCESS = ["--pipeline-schedule", "gpipe", *DIST_TIMEOUT]


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    """The whole run, and the same command stopped by --max-steps after epoch 0."""
    full, stopped = tmp_path_factory.mktemp("mp_full"), tmp_path_factory.mktemp("mp_stopped")
    run_python(["model_parallel.py", *RESUME_ARGS, *ONE_PROCESS, "--output-dir", full])
    argv = ["model_parallel.py", *RESUME_ARGS, *ONE_PROCESS, "--max-steps", "7"]
    run_python([*argv, "--output-dir", stopped])
    assert (load_ckpt(stopped)["epoch"], [m["epoch"] for m in read_metrics(stopped)]) == (1, [0])
    return full, stopped


def check_resumed(out, full, proc, atol):
    assert "resumed from" in proc.stdout and "at epoch 1, step 0 of 7" in proc.stdout
    expected, resumed = load_ckpt(full), load_ckpt(out)
    assert (resumed["epoch"], resumed["step"]) == (expected["epoch"], expected["step"]) == (2, 14)
    assert_state_close(resumed["model"], expected["model"], atol=atol)
    assert_state_close(moments(resumed), moments(expected), atol=atol)
    got, want = read_metrics(out), read_metrics(full)
    assert [m["epoch"] for m in got] == [0, 1]  # each epoch once
    assert got[1]["test_loss"] == pytest.approx(want[1]["test_loss"], abs=atol)
    assert got[1]["test_loss"] < got[0]["test_loss"]


@pytest.mark.slow
def test_resume_same_mode_is_exact(resume_runs, tmp_path):
    full, stopped = resume_runs
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    # The same command again.
    proc = run_python(["model_parallel.py", *RESUME_ARGS, *ONE_PROCESS, "--output-dir", out])
    check_resumed(out, full, proc, atol=1e-6)


@pytest.mark.slow
@needs_2_10
def test_resume_one_process_checkpoint_under_torchrun(resume_runs, tmp_path):
    """Mode 3 takes the one-process checkpoint: each stage loads its slice of the weights and
    momentum by the unsplit names, and goes on as the one process would have."""
    full, stopped = resume_runs
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    proc = torchrun(2, ["model_parallel.py", *RESUME_ARGS, *PER_PROCESS, "--output-dir", out])
    assert "mode 3: 2 processes (torchrun), gpipe" in proc.stdout
    # Rounding differs between processes and grows with every step (~1e-7 here); a resume that
    # lost the momentum is off by 1e-2, one that misplaced a stage's weights by more.
    check_resumed(out, full, proc, atol=1e-4)


def test_gpt_takes_the_sharded_scripts_text_recipe():
    """--data text: the text defaults of fsdp_train.py and the other sharded scripts."""
    import fsdp_train

    text = ["--data", "text", "--model", "gpt"]
    mine, theirs = model_parallel.get_args(text), fsdp_train.get_args(text)
    recipe = ("epochs", "lr", "betas", "decay", "clip_grad", "warmup", "weight_decay")
    for name in (*recipe, "dim", "depth", "heads", "seq_len"):
        assert getattr(mine, name) == getattr(theirs, name), name
    assert (mine.betas, mine.decay, mine.clip_grad, mine.dim, mine.depth) == (
        (0.9, 0.95),
        "linear",
        1.0,
        128,
        2,
    )


def test_resume_after_max_steps_mid_epoch_ends_where_a_straight_run_ends(
    no_launcher, monkeypatch, tmp_path, small_text
):
    """Stopped by --max-steps after step 2 of an epoch of 29 and rerun to step 4: the epoch's
    batches done are skipped and the schedule goes on, so the checkpoint is bit for bit the
    one of 4 steps straight (weights and AdamW's moments and step count); micro-batched on 2
    stages in this process (mode 3's schedules: test_gpt_every_schedule_*'s resumed runs).
    The straight run steps with the text recipe: AdamW's betas 0.9 0.95, the gradients
    clipped to a norm of 1, the rate falling in a straight line after 2 steps of warm-up; and
    the whole GPT built to be cut is gone by then (the stages hold copies of their blocks).
    Then a resume with another --decay (the linear default saved) stops in one line, nothing
    trained or written."""
    flags = [*text_flags(small_text), "--dim", "32", "--heads", "2", "--depth", "2"]
    flags += ["--batch-size", "16", "--devices", "cpu,cpu", "--microbatches", "4"]
    straight, out = str(tmp_path / "straight"), str(tmp_path / "resumed")
    seen, adamw, built = [], torch.optim.AdamW, []

    class GPT(models.GPT):  # deep copies (the stages) are not built: only the whole model is
        def __init__(self, *args):
            super().__init__(*args)
            built.append(weakref.ref(self))

    def instrumented(*args, **kwargs):
        optimizer = adamw(*args, **kwargs)
        params = [p for group in optimizer.param_groups for p in group["params"]]

        def before_step(*_):
            gc.collect()
            assert len(built) == 1 and built[0]() is None  # nothing holds the whole GPT
            norm = torch.stack([p.grad.norm() for p in params]).norm().item()
            [betas] = {g["betas"] for g in optimizer.param_groups}
            seen.append((optimizer.param_groups[0]["lr"], norm, betas, optimizer.defaults["fused"]))

        optimizer.register_step_pre_hook(before_step)
        return optimizer

    monkeypatch.setattr(torch.optim, "AdamW", instrumented)
    monkeypatch.setattr(model_parallel, "GPT", GPT)
    model_parallel.main([*flags, "--max-steps", "4", "--output-dir", straight])
    monkeypatch.undo()
    rates, norms, betas, fused = zip(*seen, strict=True)
    assert set(betas) == {(0.9, 0.95)} and set(fused) == {True}
    assert all(n <= 1 + 1e-5 for n in norms) and max(n for n in norms) > 0.99  # clipped at 1
    peak = 0.14 * 16 / 256  # --lr per 256 samples
    want = [peak / 2, peak, peak, peak * (1 - 1 / 27)]  # warm-up: int(0.1 x 29) steps
    assert rates == pytest.approx(want, rel=1e-9), rates
    model_parallel.main([*flags, "--max-steps", "2", "--output-dir", out])
    model_parallel.main([*flags, "--max-steps", "4", "--output-dir", out])
    want, got = load_ckpt(straight), load_ckpt(out)
    assert (got["step"], got["epoch"], got["steps_per_epoch"]) == (4, 0, 29)
    assert want["model"].keys() == got["model"].keys()
    assert all(torch.equal(v, got["model"][k]) for k, v in want["model"].items())
    for name, state in want["optimizer"].items():
        assert all(torch.equal(v, got["optimizer"][name][k]) for k, v in state.items()), name
    assert [m["step"] for m in read_metrics(out)] == [4]  # the epoch's line once
    before = {p.name: p.read_bytes() for p in Path(out).iterdir()}
    with pytest.raises(SystemExit) as excinfo:
        model_parallel.main([*flags, "--max-steps", "6", "--decay", "cosine", "--output-dir", out])
    message = excinfo.value.code
    assert message.startswith("error: ") and "\n" not in message
    assert "was trained with --decay linear; resume with the same" in message
    assert {p.name: p.read_bytes() for p in Path(out).iterdir()} == before


@pytest.mark.slow
@needs_2_10
def test_ranks_resume_from_rank_0s_checkpoint(tmp_path):
    """A 2-process run stopped after epoch 0, rerun where rank 0 finds the checkpoint and rank 1
    sees an empty directory (an output directory not shared between nodes). Rank 0 alone
    decides and reads, and sends the checkpoint: both stages resume at epoch 1 and finish
    exactly as an uninterrupted run. Had rank 1 looked for itself, it would start anew at
    epoch 0 with fresh weights, and the stages' send/recv would not match."""
    argv = ["model_parallel.py", *RESUME_ARGS, *PER_PROCESS, "--output-dir"]
    straight, out, empty = tmp_path / "straight", tmp_path / "rank0", tmp_path / "rank1"
    run_ranks([[*argv, straight], [*argv, empty]], rank_envs(2))
    stop = ["--max-steps", "7"]
    run_ranks([[*argv, out, *stop], [*argv, empty, *stop]], rank_envs(2))
    assert load_ckpt(out)["epoch"] == 1 and not empty.exists()  # rank 0 alone writes
    rank0, _ = run_ranks([[*argv, out], [*argv, empty]], rank_envs(2), timeout=150)
    # The same processes' rounding as the straight run: equal but for the order of sums.
    check_resumed(out, straight, rank0, atol=1e-6)
    assert not empty.exists()


@pytest.mark.slow
@needs_2_10
def test_unwritable_output_dir_stops_every_rank_with_the_cause(tmp_path):
    """Rank 0 alone checks --output-dir; the other stage must stop with rank 0's error at once,
    not with "a peer died", and long before --dist-timeout."""
    (tmp_path / "file").write_text("a regular file: nothing can be created under it")
    argv = ["model_parallel.py", *SYNTHETIC, "--max-steps", "1", "--dist-timeout", "120"]
    argv += ["--output-dir", tmp_path / "file" / "out"]
    start = time.monotonic()
    procs = run_ranks(argv, rank_envs(2), timeout=150, check=False)
    assert time.monotonic() - start < 60  # well below --dist-timeout 120
    errors = []
    for p in procs:
        assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
        errors.append([line for line in p.stderr.splitlines() if line.strip()][-1])
    assert errors[0] == errors[1], errors
    assert errors[0].startswith(f"error: output directory {tmp_path / 'file' / 'out'} is not")


def every_cut(costs, stages):
    """The cut by brute force: every one tried (C(layers - 1, stages - 1) of them), the first
    (in itertools.combinations' order) of those whose slowest stage is cheapest."""
    prefix = [0, *itertools.accumulate(costs)]
    cuts = itertools.combinations(range(1, len(costs)), stages - 1)
    splits = [list(itertools.pairwise((0, *cut, len(costs)))) for cut in cuts]
    return min(splits, key=lambda runs: max(prefix[b] - prefix[a] for a, b in runs))


def test_balanced_split():
    # The slowest stage sets the pace: the cuts minimise the most expensive stage.
    assert model_parallel.balanced_split([1, 5, 5, 1, 1], 2) == [(0, 2), (2, 5)]
    assert model_parallel.balanced_split([1, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]
    # The dynamic program makes brute force's cut, ties (equal costs) and floats included.
    rng = random.Random(0)
    for _ in range(500):
        costs = [rng.choice([1, 2, 3, 0.1, 1e6, rng.random()]) for _ in range(rng.randint(1, 9))]
        stages = rng.randint(1, len(costs))
        assert training.balanced_split(costs, stages) == every_cut(costs, stages), (costs, stages)
    # 96 blocks in 8 stages: 1.1e10 cuts by brute force, here at once, each stage 12 blocks.
    start = time.perf_counter()
    split = training.balanced_split([1] * 96, 8)
    assert time.perf_counter() - start < 2 and split == [(a, a + 12) for a in range(0, 96, 12)]


def docstring_launches():
    """(processes, flags) of each torchrun command in model_parallel.py's docstring."""
    doc = model_parallel.__doc__.replace("\\\n", " ")
    for command in re.findall(r"torchrun (.*?model_parallel\.py[^#\n]*)", doc):
        nodes = re.search(r"--nnodes=(\d+)", command)
        world = int(nodes[1] if nodes else 1) * int(
            re.search(r"--nproc_per_node=(\d+)", command)[1]
        )
        yield world, command.split("model_parallel.py")[1].split()


@needs_2_10
def test_docstring_launches_make_a_valid_number_of_stages(no_launcher, monkeypatch, tmp_path):
    """Every torchrun command in the docstring makes at most as many stages as the model has
    layers (the GPT: blocks), and its flags pass every check for that many stages: a pretended
    world of that size gets to building its stages (which needs the real processes)."""
    launches = list(docstring_launches())
    assert len(launches) == 3 and max(w for w, _ in launches) > 2  # one node, and several
    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x\n" * 200)

    class Reached(Exception):
        pass

    def make_stage(*_):
        raise Reached

    monkeypatch.setattr(model_parallel, "make_stage", make_stage)
    for world, flags in launches:
        if "text" in flags:
            flags = [*flags, "--data-dir", tmp_path / "corpus.txt", "--seq-len", "32"]
        info = common.DistInfo(True, 0, 0, world, world, torch.device("cpu"))
        with pytest.raises(Reached):
            model_parallel.train(model_parallel.get_args([*SYNTHETIC, *map(str, flags)]), info)


@pytest.mark.slow
@needs_2_10
def test_multi_node_launch_runs(tmp_path):
    """The docstring's multi-node layout (2 nodes x 2 processes) as 4 processes on one node."""
    world = max(w for w, _ in docstring_launches())
    argv = ["model_parallel.py", *ARGS, "--max-steps", "2", "--output-dir", tmp_path]
    proc = torchrun_workers(world, argv, timeout=240)
    assert f"mode 3: {world} processes (torchrun), 1f1b, {world} stages" in proc.stdout
    assert read_metrics(tmp_path)[0]["stages"] == world


@pytest.mark.parametrize(
    "flags, world, words",
    [
        (
            ["--batch-size", "32", "--microbatches", "3"],
            1,
            "--microbatches 3 does not divide --batch-size 32",
        ),
        (["--microbatches", "0"], 1, "--microbatches must be at least 1"),
        pytest.param(
            *(
                ["--pipeline-schedule", "1f1b", "--microbatches", "1"],
                2,
                "--microbatches >= stages",
            ),
            marks=needs_2_10,
        ),
        pytest.param(*([], 6, "6 stages for a model of 5 layers: at most 5"), marks=needs_2_10),
        (["--devices", ",".join(["cpu"] * 6)], 1, "6 stages for a model of 5 layers: at most 5"),
        (["--devices", "cpu,cuda:99"], 1, "--devices: cuda:99 does not exist"),
        (["--devices", "cpu,gpu"], 1, "--devices: 'gpu' is not a device"),
        (["--devices", "cpu,cpu"], 2, "--devices is for one process"),
        (["--warmup", "1"], 1, "--warmup is a fraction of the run"),
        (["--momentum", "0"], 1, "--momentum must be positive"),
    ],
)
def test_bad_input(no_launcher, tmp_path, flags, world, words):
    """One-line errors, nothing written. The stage-count checks come before the first
    collective, so a pretended world size tests them without starting its processes."""
    info = common.DistInfo(world > 1, 0, 0, world, world, torch.device("cpu"))
    argv = [*SYNTHETIC, *flags, "--output-dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as excinfo:
        model_parallel.train(model_parallel.get_args(argv), info)
    message = excinfo.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message
    assert words in message, message
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_one_stage_per_process_needs_torch_2_10(no_launcher, monkeypatch):
    """torch.distributed.pipelining before 2.10 does not run mode 3 (before 2.9 it lacks what
    mode 3 uses; on 2.9.0 gloo stops with a message size mismatch): one line naming the
    version. Modes 1 and 2 still run there (pipelining is imported only for mode 3); 2.10 is
    newer than 2.9, not older (a string comparison would say otherwise)."""
    one, two = (common.DistInfo(w > 1, 0, 0, w, w, torch.device("cpu")) for w in (1, 2))
    args = model_parallel.get_args([*SYNTHETIC, "--max-steps", "1", "--batch-size", "32"])
    monkeypatch.setattr(torch, "__version__", "2.9.0")
    with pytest.raises(SystemExit) as excinfo:
        model_parallel.train(args, two)
    assert (
        excinfo.value.code
        == "error: one stage per process needs PyTorch 2.10 or newer (this is 2.9.0)"
    )
    model_parallel.train(args, one)  # mode 1 trains a step on 2.9
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    bad = model_parallel.get_args([*SYNTHETIC, "--batch-size", "32", "--microbatches", "3"])
    with pytest.raises(SystemExit, match="does not divide"):  # past the version check
        model_parallel.train(bad, two)


def test_import_leaves_pipelining_unloaded():
    code = "import sys, model_parallel; print('torch.distributed.pipelining' in sys.modules)"
    assert run_python(["-c", code]).stdout.strip() == "False"


def test_resume_refuses_a_checkpoint_without_momentum(no_launcher, tmp_path):
    state = {"model": initial_model().state_dict(), "epoch": 1, "step": 5}
    torch.save(state, tmp_path / "checkpoint.pt")
    info = common.DistInfo(False, 0, 0, 1, 1, torch.device("cpu"))
    args = model_parallel.get_args([*SYNTHETIC, "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="holds no optimizer state"):
        model_parallel.train(args, info)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


@pytest.mark.slow
@needs_2_10
def test_bad_input_real_processes(tmp_path):
    # What a user sees under torchrun: every rank stops with the same line, non-zero exit.
    argv = ["model_parallel.py", *ARGS, "--pipeline-schedule", "1f1b", "--microbatches", "1"]
    proc = torchrun(2, [*argv, "--output-dir", tmp_path / "o"], timeout=120, check=False)
    assert proc.returncode != 0
    assert "error: 1f1b needs --microbatches >= stages (2)" in proc.stderr
    assert "]: Traceback" not in proc.stderr  # no worker traceback ("[rank1]: Traceback ...")
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_each_epoch_takes_a_new_order(no_launcher, monkeypatch):
    """One process, 2 epochs of 2 steps: each step trains on the batch that a loader reseeded
    with --seed + epoch gives, so epoch 1 takes a new order (every epoch repeating epoch 0's
    passed the rest of this file: its references repeat it as well)."""
    seen = []

    def cross_entropy(logits, labels, **kwargs):
        if "reduction" not in kwargs:  # training; evaluation sums
            seen.append(labels.clone())
        return torch.nn.functional.cross_entropy(logits, labels, **kwargs)

    monkeypatch.setattr(model_parallel, "F", types.SimpleNamespace(cross_entropy=cross_entropy))
    model_parallel.main([*SYNTHETIC, "--devices", "cpu", "--epochs", "2", "--batch-size", "1000"])
    labels = data.load_datasets("synthetic", "unused")[0].labels
    expected = []
    for epoch in range(2):
        g = torch.Generator().manual_seed(0 + epoch)
        expected += list(DataLoader(labels, 1000, shuffle=True, drop_last=True, generator=g))
    assert len(seen) == 4 and not torch.equal(seen[2], seen[0])
    assert all(torch.equal(a, b) for a, b in zip(seen, expected, strict=True))


# The GPT through every schedule (tests/pp_probe.py): 3 AdamW steps of 16 sequences of 32
# bytes in 8 micro-batches, 8 blocks (8 stages at 4 processes x 2). --lr 0.05, not 0.2: with
# GPT-2's small weights Adam's full steps at 0.2 amplify rounding past 1e-4.
GPT_ARGS = ["--dim", "32", "--heads", "2", "--depth", "8", "--batch-size", "16", "--warmup", "0"]
GPT_ARGS += ["--lr", "0.05", "--max-steps", "3", "--microbatches", "8", *DIST_TIMEOUT]
SCHEDULES = list(training.PIPELINE_SCHEDULES)


def gpt_probe(tmp_path, corpus, nproc, schedules, resumed=(), flags=()):
    """pp_probe.py's reports {schedule: (per-step losses, per-step gradients by name, output
    directory, {stage: its activations' peak and one micro-batch's bytes})}: one process
    (schedules ["one"], the unsplit GPT) or nproc, every schedule in turn in the same processes.
    Then each of `resumed` stopped after step 1 and run again: its checkpoint after step 3 is
    bit for bit its straight run's (the epoch's batches done skipped, the schedule going on)."""
    again = [f"{name}+1" for name in resumed]
    argv = ["tests/pp_probe.py", tmp_path, ",".join([*schedules, *again]), "--"]
    argv += [*text_flags(corpus), *GPT_ARGS, *(["--devices", "cpu"] if nproc == 1 else []), *flags]
    run_python(argv) if nproc == 1 else torchrun_workers(nproc, argv, timeout=400)
    for name in resumed:
        want, got = load_ckpt(tmp_path / name), load_ckpt(tmp_path / f"{name}+1")
        assert got["step"] == want["step"] == 3 and want["steps_per_epoch"] > 3, name
        for key in ("model", "optimizer"):
            flat = [torch.utils._pytree.tree_flatten(c[key]) for c in (want, got)]
            assert flat[0][1] == flat[1][1], (name, key)  # the same names and layout
            assert all(map(torch.equal, flat[0][0], flat[1][0])), (name, key)
    reports = {}
    for name in schedules:
        ranks = [torch.load(tmp_path / f"{name}.rank{r}.pt") for r in range(nproc)]
        [losses] = [r["losses"] for r in ranks if r["losses"][0] is not None]  # the last stage's
        grads = [{k: v for r in ranks for k, v in r["grads"][step].items()} for step in range(3)]
        held = {k: v for r in ranks for k, v in (r["activations"] or {}).items()}
        reports[name] = losses, grads, tmp_path / name, held
    return reports


@pytest.fixture(scope="module")
def gpt_one(tmp_path_factory, small_text):
    return gpt_probe(tmp_path_factory.mktemp("gpt_one"), small_text, 1, ["one"])["one"]


def parity(report, reference):
    """(worst loss difference, worst gradient difference over its norm, test loss relative
    difference) of a pipelined run against one process."""
    (losses, grads, out, _), (ref_losses, ref_grads, ref_out, _) = report, reference
    assert len(losses) == len(ref_losses) == 3
    loss = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    grad = 0.0
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.keys() == want.keys()  # every parameter, once
        grad = max(grad, *((got[k] - w).abs().max() / w.norm() for k, w in want.items()))
    [test], [ref_test] = read_metrics(out), read_metrics(ref_out)
    return loss, float(grad), abs(test["test_loss"] / ref_test["test_loss"] - 1)


def check_schedules(reports, reference, corpus):
    figures = {name: parity(report, reference) for name, report in reports.items()}
    print(figures)  # -s shows them
    # Can fail: 3 steps move the loss and gradients far beyond the tolerances.
    assert abs(reference[0][0] - reference[0][-1]) > 1e-2
    for name, (loss, grad, test) in figures.items():
        assert loss < 1e-5 and grad < 1e-4 and test < 1e-4, (name, loss, grad, test)
    # Exact evaluation: each schedule's test loss is one process's on its checkpoint's weights,
    # over every held-out byte (24 windows, the last batch of 16 padded).
    _, test_set, _, _ = data.load_datasets("text", corpus, seq_len=32)
    for name, (_, _, out, _) in reports.items():
        model = models.GPT(256, 32, 32, 8, 2)
        model.load_state_dict(load_ckpt(out)["model"])
        loader = DataLoader(test_set, 16, collate_fn=data.collate)
        loss, acc = training.evaluate(model, loader, torch.device("cpu"))
        [metrics] = read_metrics(out)
        assert metrics["schedule"] == name  # the schedule asked for ran
        assert metrics["test_loss"] == pytest.approx(loss, rel=1e-6), name
        assert metrics["test_acc"] == pytest.approx(acc, abs=1e-9), name
    assert len(test_set) % 16
    # Each stage's activations held for backward (profiling.StageActivations), in its own
    # micro-batches: GPipe keeps all M = 8, 1F1B S - s on stage s of S; no schedule over M.
    held = {
        n: {s: h["peak"] / h["micro_batch"] for s, h in r[3].items()} for n, r in reports.items()
    }
    print(held)
    if "gpipe" in held:  # the launch of GPipe and 1F1B
        stages = range(len(held["1f1b"]))
        assert held["gpipe"] == {s: 8 for s in stages}
        assert held["1f1b"] == {s: len(stages) - s for s in stages}
        assert reports["gpipe"][3][0]["peak"] > reports["1f1b"][3][0]["peak"]
    assert all(0 < h <= 8 for stage in held.values() for h in stage.values()), held


# The quick tier's launch: GPipe, 1F1B and a V (ZBV); the others in one more launch (slow).
QUICK_SCHEDULES = ["gpipe", "1f1b", "zbv"]


@needs_2_10
@pytest.mark.parametrize(
    "schedules",
    [
        QUICK_SCHEDULES,
        pytest.param([s for s in SCHEDULES if s not in QUICK_SCHEDULES], marks=pytest.mark.slow),
    ],
    ids=["gpipe-1f1b-zbv", "the-others"],
)
def test_gpt_every_schedule_on_two_processes_takes_one_process_steps(
    gpt_one, tmp_path, small_text, schedules
):
    """Every schedule on 2 processes (interleaved, V: 4 stages), in two launches: each step's
    loss, every gradient, the test loss and its exact evaluation are one process's. Resumed
    after step 1 (mid-epoch), bit for bit a straight run: ZBV, and in the slow launch each."""
    resumed = ["zbv"] if "zbv" in schedules else schedules  # a V, whose rank 0 holds 2 ends
    check_schedules(gpt_probe(tmp_path, small_text, 2, schedules, resumed), gpt_one, small_text)


@pytest.mark.slow
@needs_2_10
def test_gpt_every_schedule_on_four_processes_takes_one_process_steps(
    gpt_one, tmp_path, small_text
):
    """The same on 4 processes: 4 stages, 8 interleaved or in a V; GPipe and 1F1B resumed."""
    reports = gpt_probe(tmp_path, small_text, 4, SCHEDULES, ["gpipe", "1f1b"])
    check_schedules(reports, gpt_one, small_text)


@pytest.mark.slow
@needs_2_10
@pytest.mark.skipif(not shutil.which("gcc"), reason="torch.compile on the CPU needs gcc")
def test_gpt_compiled_blocks_on_two_processes_take_one_process_steps(gpt_one, tmp_path, small_text):
    """--compile (each block compiled on its own, inside the pipeline's stages): 1F1B and zbv
    (zero bubble: each backward in two, the inputs' gradients first) on 2 processes take the
    uncompiled one process's steps, within the same tolerances."""
    reports = gpt_probe(tmp_path, small_text, 2, ["1f1b", "zbv"], flags=["--compile"])
    check_schedules(reports, gpt_one, small_text)
    for rank in range(2):  # the blocks ran compiled: graphs were made on each rank
        assert torch.load(tmp_path / f"1f1b.rank{rank}.pt")["compiled"] > 0, rank


@pytest.mark.parametrize(
    "flags, world, words",
    [
        (["--stages-per-rank", "2"], 2, "1f1b places 1 stage(s) per process, not 2"),
        (["--pipeline-schedule", "zbv", "--stages-per-rank", "3"], 2, "2 (a V) stage(s) per"),
        (["--pipeline-schedule", "dualpipev", "--microbatches", "2"], 2, ">= stages (4); got 2"),
        (
            [
                "--pipeline-schedule",
                "interleaved-1f1b",
                "--batch-size",
                "20",
                "--microbatches",
                "5",
            ],
            2,
            "interleaved-1f1b: --microbatches 5 is not 2 rounds of 2",
        ),
        (
            ["--pipeline-schedule", "interleaved-zb"],
            4,
            "8 stages for a model of 4 blocks: at most 4",
        ),
        (["--stages-per-rank", "2"], 1, "--stages-per-rank is for torchrun"),
        (["--data", "synthetic"], 1, "--model gpt does not train on --data synthetic"),
        # Stages that do not divide the blocks (which a cut by FLOPs would run): refused.
        (["--depth", "6"], 4, "4 stages do not divide the GPT's 6 blocks (--depth)"),
        (["--pipeline-schedule", "zbv", "--depth", "6"], 2, "4 stages do not divide the GPT's 6"),
        (["--devices", "cpu,cpu,cpu"], 1, "3 stages do not divide the GPT's 4 blocks"),
    ],
)
@needs_2_10
def test_bad_pipeline_input(no_launcher, tmp_path, small_text, flags, world, words):
    """The GPT's pipelines: the same line on the first and the last rank, nothing written,
    before any collective (a pretended world size tests them without its processes)."""
    messages = []
    for rank in sorted({0, world - 1}):
        info = common.DistInfo(world > 1, rank, rank, world, world, torch.device("cpu"))
        argv = [*text_flags(small_text), *flags, "--output-dir", str(tmp_path / "out")]
        with pytest.raises(SystemExit) as excinfo:
            model_parallel.train(model_parallel.get_args(argv), info)
        messages.append(excinfo.value.code)
    message = messages[0]
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message
    assert words in message and set(messages) == {message}, messages
    assert not (tmp_path / "out").exists()


@needs_2_10
def test_a_schedule_this_pytorch_lacks_is_one_line(no_launcher, monkeypatch, small_text):
    """PyTorch 2.9 and 2.10 lack some schedules (ScheduleDualPipeV came later): one line."""
    import torch.distributed.pipelining as pipelining

    monkeypatch.delattr(pipelining, "ScheduleDualPipeV")
    info = common.DistInfo(True, 0, 0, 2, 2, torch.device("cpu"))
    argv = [*text_flags(small_text), "--pipeline-schedule", "dualpipev"]
    with pytest.raises(SystemExit) as excinfo:
        model_parallel.train(model_parallel.get_args(argv), info)
    lacks = f"needs ScheduleDualPipeV, which PyTorch {torch.__version__} lacks"
    assert excinfo.value.code == f"error: --pipeline-schedule dualpipev {lacks}"


@pytest.mark.slow
@needs_2_10
def test_gpt_resumes_at_another_number_of_stages_and_schedule(tmp_path):
    """A GPT checkpoint of 2 processes' GPipe (2 stages) resumes on 4 processes' interleaved
    1F1B (8 stages, 2 per process) and ends as one process run straight through: each stage
    takes its blocks and their AdamW moments by the whole model's names, bit for bit."""
    corpus = tmp_path / "corpus.txt"  # 77 training windows: 9 steps of 8 an epoch
    corpus.write_bytes(Path(argparse.__file__).read_bytes()[:2600])
    flags = [*text_flags(corpus), "--dim", "32", "--heads", "2", "--depth", "8"]
    flags += ["--batch-size", "8", "--microbatches", "4", "--epochs", "2", "--warmup", "0"]
    argv = ["model_parallel.py", *flags, *DIST_TIMEOUT, "--output-dir"]
    # The resumed run is pp_probe.py's, which writes to probe/interleaved-1f1b.
    straight, out = tmp_path / "straight", tmp_path / "probe" / "interleaved-1f1b"
    run_python([*argv, straight, "--devices", "cpu"])
    torchrun_workers(2, [*argv, out, "--pipeline-schedule", "gpipe", "--max-steps", "9"])
    stopped = load_ckpt(out)
    assert (stopped["epoch"], stopped["step"]) == (1, 9)
    probe = ["tests/pp_probe.py", tmp_path / "probe", "interleaved-1f1b", "--", *flags]
    proc = torchrun_workers(4, [*probe, *DIST_TIMEOUT])
    assert "resumed from" in proc.stdout and "interleaved-1f1b, 8 stages" in proc.stdout
    # Bit for bit: the weights and AdamW moments each stage's first step found are the saved.
    loaded = [torch.load(out.parent / f"interleaved-1f1b.rank{r}.pt")["loaded"] for r in range(4)]
    weights = {k: v for r in loaded for k, v in r["weights"].items()}
    assert sorted(weights) == sorted(stopped["optimizer"])  # every parameter, on one stage
    assert all(torch.equal(v, stopped["model"][k]) for k, v in weights.items())
    for name, state in ((k, v) for r in loaded for k, v in r["moments"].items()):
        assert state.keys() == stopped["optimizer"][name].keys(), name
        assert all(torch.equal(v, stopped["optimizer"][name][k]) for k, v in state.items()), name
    expected, resumed = load_ckpt(straight), load_ckpt(out)
    assert resumed["step"] == expected["step"] == 18
    # Can fail: the 9 steps after the resume move the weights by more than the tolerance.
    assert max_abs_diff(resumed["model"], stopped["model"]) > 1e-3
    assert_state_close(resumed["model"], expected["model"], atol=1e-4)
    assert_state_close(moments(resumed), moments(expected), atol=1e-4)
    got, want = read_metrics(out), read_metrics(straight)
    assert [m["epoch"] for m in got] == [0, 1]
    assert got[1]["test_loss"] == pytest.approx(want[1]["test_loss"], rel=1e-4)
