"""Resume: a run stopped after its first epoch and started again with the same command
ends exactly where the uninterrupted run ends; at another world size it runs to the end."""

import shutil

import pytest
import torch
from conftest import (
    CNN_ARGS,
    DIST_TIMEOUT,
    SYNTHETIC,
    assert_state_close,
    load_ckpt,
    read_metrics,
    run_python,
    torchrun,
)

import common
import ddp_train


@pytest.fixture(scope="module")
def stopped_run(ddp_run, tmp_path_factory):
    """ddp_run's command (2 processes, 3 epochs) stopped by --max-steps after epoch 0."""
    full, _ = ddp_run
    steps_per_epoch = load_ckpt(full)["steps_per_epoch"]
    out = tmp_path_factory.mktemp("stopped")
    torchrun(2, ["ddp_train.py", *CNN_ARGS, "--max-steps", steps_per_epoch, "--output-dir", out])
    ckpt = load_ckpt(out)
    assert (ckpt["epoch"], ckpt["step"], ckpt["world_size"]) == (1, steps_per_epoch, 2)
    assert [m["epoch"] for m in read_metrics(out)] == [0]
    return out


def test_resume_same_world_size_is_exact(ddp_run, stopped_run, tmp_path):
    full, _ = ddp_run
    out = tmp_path / "run"
    shutil.copytree(stopped_run, out)
    # The same command again, without --max-steps: it finds out/checkpoint.pt and goes on.
    proc = torchrun(2, ["ddp_train.py", *CNN_ARGS, "--output-dir", out])
    assert "resumed from" in proc.stdout and "at epoch 1" in proc.stdout
    expected, resumed = load_ckpt(full), load_ckpt(out)
    # Weights, BatchNorm statistics and momentum continue as if never stopped.
    assert_state_close(resumed["model"], expected["model"], atol=1e-6)
    assert_state_close(resumed["optimizer"]["state"], expected["optimizer"]["state"], atol=1e-6)
    assert (resumed["epoch"], resumed["step"]) == (expected["epoch"], expected["step"])
    # Every epoch once, with the uninterrupted run's figures.
    got, want = read_metrics(out), read_metrics(full)
    assert [m["epoch"] for m in got] == [0, 1, 2]
    for g, w in zip(got, want, strict=True):
        for key in ("step", "train_loss", "test_loss", "test_acc", "lr"):
            assert g[key] == pytest.approx(w[key], abs=1e-6), key


@pytest.fixture(scope="module")
def resumed_on_one_process(stopped_run, tmp_path_factory):
    """The 2-process checkpoint taken over by a single process."""
    out = tmp_path_factory.mktemp("one_process") / "run"
    shutil.copytree(stopped_run, out)
    proc = run_python(["ddp_train.py", *CNN_ARGS, "--output-dir", out])
    return out, proc


def test_resume_on_another_world_size_runs(stopped_run, resumed_on_one_process):
    out, proc = resumed_on_one_process
    assert "resumed from" in proc.stdout and "1 process(es)" in proc.stdout
    metrics = read_metrics(out)
    assert [m["epoch"] for m in metrics] == [0, 1, 2]
    assert metrics[0] == read_metrics(stopped_run)[0]  # epoch 0 kept as the 2 processes wrote it
    assert [m["world_size"] for m in metrics] == [2, 1, 1]
    ckpt = load_ckpt(out)
    assert (ckpt["epoch"], ckpt["world_size"], ckpt["step"]) == (3, 1, 3 * ckpt["steps_per_epoch"])
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
    assert metrics[-1]["test_acc"] > 0.5  # training went on from the checkpoint, not from scratch


def test_resume_on_another_world_size_rescales_lr(resumed_on_one_process):
    # One process, batch 128: the peak rate is 0.05 x 128 / 256, and the schedule continues
    # from the same point in epochs. The lr logged after each epoch is the fresh schedule's.
    out, _ = resumed_on_one_process
    args = ddp_train.get_args(CNN_ARGS)
    steps_per_epoch = load_ckpt(out)["steps_per_epoch"]
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=args.lr * args.batch_size / 256)
    scheduler = ddp_train.make_scheduler(optimizer, args, args.epochs * steps_per_epoch)
    expected = []
    for _ in range(args.epochs):
        for _ in range(steps_per_epoch):
            optimizer.step()
            scheduler.step()
        expected.append(scheduler.get_last_lr()[0])
    assert [m["lr"] for m in read_metrics(out)][1:] == pytest.approx(expected[1:], rel=1e-9)


def test_resume_on_another_world_size_starts_from_the_checkpoint(stopped_run, tmp_path):
    """One step on one process after the 2-process checkpoint: the weights are the
    checkpoint's moved by one small step, far nearer to it than a fresh model is. (The
    accuracy at the end says little: a fresh model learns the synthetic set too.)"""
    out = tmp_path / "run"
    shutil.copytree(stopped_run, out)
    saved = load_ckpt(out)
    steps_per_epoch = 2000 // 128  # one process, batch 128: the epoch starts again from its beginning
    run_python(["ddp_train.py", *CNN_ARGS, "--max-steps", saved["epoch"] * steps_per_epoch + 1, "--output-dir", out])
    after = load_ckpt(out)
    assert after["step"] == saved["epoch"] * steps_per_epoch + 1
    common.seed_everything(0)
    fresh = common.build_model("cnn", 1, 10).state_dict()
    weights = [k for k in saved["model"] if k.endswith("weight")]
    step = max((after["model"][k] - saved["model"][k]).abs().max().item() for k in weights)
    distance = max((fresh[k] - saved["model"][k]).abs().max().item() for k in weights)
    assert 0 < step < distance / 3  # a skipped load would leave about `distance` (0.13 here)


# 2000 samples: 62 steps per epoch at global batch 32, 125 at 16.
MLP_ARGS = [*SYNTHETIC, "--model", "mlp", "--epochs", "2", "--lr", "0.8", "--warmup", "0.3"]
GLOBAL_32_THEN_16 = {
    "dp_train": (["dp_train.py", "--batch-size", "32"], ["dp_train.py", "--batch-size", "16"]),
    "ddp_mp_spawn": (
        ["ddp_mp_spawn.py", "--nprocs", "2", "--batch-size", "16", *DIST_TIMEOUT],
        ["ddp_mp_spawn.py", "--nprocs", "1", "--batch-size", "16", *DIST_TIMEOUT],
    ),
}


@pytest.mark.parametrize("script", GLOBAL_32_THEN_16)
def test_resume_at_another_global_batch_takes_this_runs_rate(tmp_path, script):
    """Stopped after epoch 0 at global batch 32, resumed at 16: epoch 1 follows a schedule
    made for batch 16 (peak 0.8 x 16 / 256), not the checkpoint's peak (twice that), which
    the optimizer's saved state carries. The replay of the schedule prints no warning."""
    first, second = GLOBAL_32_THEN_16[script]
    run_python([*first, *MLP_ARGS, "--max-steps", "62", "--output-dir", tmp_path])
    proc = run_python([*second, *MLP_ARGS, "--output-dir", tmp_path])
    assert "resumed from" in proc.stdout and "Warning" not in proc.stderr, proc.stderr
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.8 * 16 / 256)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, 0.8 * 16 / 256, total_steps=250, pct_start=0.3, cycle_momentum=False
    )
    for _ in range(250):
        optimizer.step()
        scheduler.step()
    assert [m["epoch"] for m in read_metrics(tmp_path)] == [0, 1]
    assert read_metrics(tmp_path)[1]["lr"] == pytest.approx(scheduler.get_last_lr()[0], rel=1e-9)
