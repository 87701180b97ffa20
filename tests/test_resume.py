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
    torchrun_workers,
)
from torch.optim.optimizer import register_optimizer_step_pre_hook

import checkpoint
import ddp_train
import models


@pytest.fixture(scope="module")
def stopped_run(ddp_run, tmp_path_factory):
    """ddp_run's command (2 processes, 3 epochs) stopped by --max-steps after epoch 0."""
    full, _ = ddp_run
    steps_per_epoch = load_ckpt(full)["steps_per_epoch"]
    out = tmp_path_factory.mktemp("stopped")
    argv = ["ddp_train.py", *CNN_ARGS, "--max-steps", steps_per_epoch, "--output-dir", out]
    torchrun_workers(2, argv)
    ckpt = load_ckpt(out)
    assert (ckpt["epoch"], ckpt["step"], ckpt["world_size"]) == (1, steps_per_epoch, 2)
    assert [m["epoch"] for m in read_metrics(out)] == [0]
    return out


@pytest.mark.slow
def test_resume_same_world_size_is_exact(ddp_run, stopped_run, tmp_path):
    full, _ = ddp_run
    out = tmp_path / "run"
    shutil.copytree(stopped_run, out)
    # The same command again, without --max-steps: it finds out/checkpoint.pt and goes on.
    proc = torchrun_workers(2, ["ddp_train.py", *CNN_ARGS, "--output-dir", out])
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_resume_on_another_world_size_rescales_lr(resumed_on_one_process):
    # One process, batch 128: the peak rate is 0.05 x 128 / 256, and the schedule continues
    # from the same point in epochs. The lr logged after each epoch is the fresh schedule's.
    out, _ = resumed_on_one_process
    args = ddp_train.get_args(CNN_ARGS)
    steps_per_epoch = load_ckpt(out)["steps_per_epoch"]
    optimizer = torch.optim.SGD(
        [torch.zeros(1, requires_grad=True)], lr=args.lr * args.batch_size / 256
    )
    scheduler = ddp_train.make_scheduler(optimizer, args, args.epochs * steps_per_epoch)
    expected = []
    for _ in range(args.epochs):
        for _ in range(steps_per_epoch):
            optimizer.step()
            scheduler.step()
        expected.append(scheduler.get_last_lr()[0])
    assert [m["lr"] for m in read_metrics(out)][1:] == pytest.approx(expected[1:], rel=1e-9)


@pytest.mark.slow
def test_resume_on_another_world_size_starts_from_the_checkpoint(stopped_run, tmp_path):
    """One step on one process after the 2-process checkpoint: the weights are the
    checkpoint's moved by one small step, far nearer to it than a fresh model is. (The
    accuracy at the end says little: a fresh model learns the synthetic set too.)"""
    out = tmp_path / "run"
    shutil.copytree(stopped_run, out)
    saved = load_ckpt(out)
    steps_per_epoch = (
        2000 // 128
    )  # one process, batch 128: the epoch starts again from its beginning
    run_python(
        [
            "ddp_train.py",
            *CNN_ARGS,
            "--max-steps",
            saved["epoch"] * steps_per_epoch + 1,
            "--output-dir",
            out,
        ]
    )
    after = load_ckpt(out)
    assert after["step"] == saved["epoch"] * steps_per_epoch + 1
    models.seed_everything(0)
    fresh = models.build_model("cnn", 1, 10).state_dict()
    weights = [k for k in saved["model"] if k.endswith("weight")]
    step = max((after["model"][k] - saved["model"][k]).abs().max().item() for k in weights)
    distance = max((fresh[k] - saved["model"][k]).abs().max().item() for k in weights)
    assert 0 < step < distance / 3  # a skipped load would leave about `distance` (0.13 here)


# 2000 samples: 62 steps per epoch at global batch 32, 125 at 16.
MLP_ARGS = [*SYNTHETIC, "--model", "mlp", "--epochs", "2", "--lr", "0.8", "--warmup", "0.3"]


def onecycle_rate(peak, total_steps, steps):
    """The rate after `steps` optimizer steps of MLP_ARGS's schedule with this peak."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, peak, total_steps, pct_start=0.3, cycle_momentum=False
    )
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return scheduler.get_last_lr()[0]


GLOBAL_32 = {
    "dp_train": ["dp_train.py", "--batch-size", "32"],
    "ddp_mp_spawn": ["ddp_mp_spawn.py", "--nprocs", "2", "--batch-size", "16", *DIST_TIMEOUT],
    "ddp_train": ["ddp_train.py", "--batch-size", "32"],  # one process
}


@pytest.fixture(scope="module")
def stopped_at_global_32(tmp_path_factory):
    """copy(script, folder): GLOBAL_32[script]'s run stopped after epoch 0 (62 steps), copied
    into folder. Each script's run is made once, when a test first asks for it, and shared by
    the tests that resume it (an mp.spawn launch starts 2 fresh interpreters)."""
    made = {}

    def copy(script, folder):
        if script not in made:
            made[script] = tmp_path_factory.mktemp(f"stopped_{script}")
            argv = [*GLOBAL_32[script], *MLP_ARGS, "--max-steps", "62"]
            run_python([*argv, "--output-dir", made[script]])
        shutil.copytree(made[script], folder, dirs_exist_ok=True)

    return copy


AT_GLOBAL_16 = {
    "dp_train": ["dp_train.py", "--batch-size", "16"],
    "ddp_mp_spawn": ["ddp_mp_spawn.py", "--nprocs", "1", "--batch-size", "16", *DIST_TIMEOUT],
}


@pytest.mark.slow
@pytest.mark.parametrize("script", AT_GLOBAL_16)
def test_resume_at_another_global_batch_takes_this_runs_rate(
    tmp_path, script, stopped_at_global_32
):
    """Stopped after epoch 0 at global batch 32, resumed at 16: epoch 1 follows a schedule
    made for batch 16 (peak 0.8 x 16 / 256), not the checkpoint's peak (twice that), which
    the optimizer's saved state carries. The replay of the schedule prints no warning."""
    stopped_at_global_32(script, tmp_path)
    proc = run_python([*AT_GLOBAL_16[script], *MLP_ARGS, "--output-dir", tmp_path])
    assert "resumed from" in proc.stdout and "Warning" not in proc.stderr, proc.stderr
    assert [m["epoch"] for m in read_metrics(tmp_path)] == [0, 1]
    assert read_metrics(tmp_path)[1]["lr"] == pytest.approx(
        onecycle_rate(0.8 * 16 / 256, 250, 250), rel=1e-9
    )


@pytest.mark.slow
@pytest.mark.parametrize("script", GLOBAL_32)
def test_resume_takes_this_runs_optimizer_flags(tmp_path, script, stopped_at_global_32):
    """Stopped after epoch 0, resumed with another --lr, --momentum and --weight-decay: epoch 1
    runs with the new ones (the optimizer's saved param groups hold the old), its rate on the
    schedule of the new --lr at the same point."""
    stopped_at_global_32(script, tmp_path)
    new = ["--lr", "0.4", "--momentum", "0.5", "--weight-decay", "0"]
    run_python([*GLOBAL_32[script], *MLP_ARGS, *new, "--output-dir", tmp_path])
    [group] = load_ckpt(tmp_path)["optimizer"]["param_groups"]
    assert (group["momentum"], group["weight_decay"]) == (0.5, 0)
    assert [m["epoch"] for m in read_metrics(tmp_path)] == [0, 1]
    assert read_metrics(tmp_path)[1]["lr"] == pytest.approx(
        onecycle_rate(0.4 * 32 / 256, 124, 124), rel=1e-9
    )


def test_first_step_after_a_resume_at_another_batch_takes_this_runs_rate(no_launcher, tmp_path):
    """A snapshot inside epoch 0 at batch 64, resumed at batch 32: the epoch starts again, and its
    very first step runs at step 0 of the batch-32 schedule, not at the rate the saved optimizer
    held (the schedule is only moved by the steps after it)."""
    ddp_train.main(
        list(
            map(
                str, [*MLP_ARGS, "--batch-size", "64", "--max-steps", "6", "--output-dir", tmp_path]
            )
        )
    )
    assert checkpoint.load_checkpoint(tmp_path / "checkpoint.pt")["step"] == 6
    rates = []
    hook = register_optimizer_step_pre_hook(
        lambda optimizer, *_: rates.append(optimizer.param_groups[0]["lr"])
    )
    try:
        ddp_train.main(
            list(
                map(
                    str,
                    [*MLP_ARGS, "--batch-size", "32", "--max-steps", "2", "--output-dir", tmp_path],
                )
            )
        )
    finally:
        hook.remove()
    assert rates == pytest.approx([onecycle_rate(0.8 * 32 / 256, 124, s) for s in (0, 1)], rel=1e-9)


@pytest.mark.slow
def test_checkpoints_of_one_schedule_pass_between_the_scripts(
    no_launcher, tmp_path, stopped_at_global_32
):
    """dp_train.py's checkpoint resumes in ddp_train.py (both one-cycle); a ddp_train.py
    checkpoint on --schedule cosine is refused by dp_train.py in one line, not continued on
    one-cycle."""
    dp, cosine = tmp_path / "dp", tmp_path / "cosine"
    stopped_at_global_32("dp_train", dp)  # dp_train.py --batch-size 32, epoch 0
    ddp_train.main(list(map(str, [*MLP_ARGS, "--batch-size", "32", "--output-dir", dp])))
    assert [m["epoch"] for m in read_metrics(dp)] == [0, 1]
    assert load_ckpt(dp)["step"] == 124
    argv = [*MLP_ARGS, "--batch-size", "32", "--max-steps", "62", "--output-dir", cosine]
    ddp_train.main(list(map(str, [*argv, "--schedule", "cosine"])))
    before = (cosine / "checkpoint.pt").read_bytes()
    proc = run_python(
        ["dp_train.py", *MLP_ARGS, "--batch-size", "32", "--output-dir", cosine], check=False
    )
    assert proc.returncode == 1
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "was trained with --schedule cosine; resume with the same, "
            "or start anew in another --output-dir"
        )
    ), proc.stderr
    assert (cosine / "checkpoint.pt").read_bytes() == before


@pytest.mark.parametrize(
    "change", [["--batch-size", "125"], ["--seed", "1"]], ids=["batch", "seed"]
)
@pytest.mark.slow
def test_mid_epoch_resume_with_another_sample_order_starts_the_epoch_again(
    no_launcher, tmp_path, capsys, change
):
    """Stopped after 6 of 16 steps at batch 120, resumed at batch 125 (still 16 steps per epoch)
    or another seed: the epoch's samples come in another order, so skipping "the first 6 steps'
    samples" would skip others than were trained. The epoch starts again instead."""
    argv = [*MLP_ARGS, "--batch-size", "120", "--output-dir", tmp_path]
    ddp_train.main(list(map(str, [*argv, "--max-steps", "6"])))
    assert checkpoint.load_checkpoint(tmp_path / "checkpoint.pt")["epoch_step"] == 6
    ddp_train.main(list(map(str, [*argv, *change, "--max-steps", "7"])))
    assert "at epoch 0, step 0 of 16" in capsys.readouterr().out


@pytest.mark.slow
def test_rerun_with_nothing_left_to_do_keeps_the_metrics(no_launcher, tmp_path):
    """--max-steps 20 twice (15 steps per epoch): the second run finds step 20 already done and
    trains nothing, so the line of the partial epoch 1 stays (only a run that trains it again
    replaces it)."""
    argv = list(
        map(str, [*MLP_ARGS, "--batch-size", "128", "--max-steps", "20", "--output-dir", tmp_path])
    )
    ddp_train.main(argv)
    lines = (tmp_path / "metrics.jsonl").read_text()
    assert [m["epoch"] for m in read_metrics(tmp_path)] == [0, 1]
    ddp_train.main(argv)
    assert (tmp_path / "metrics.jsonl").read_text() == lines
