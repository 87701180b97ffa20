"""model_parallel.py: 2 pipeline stages (real torchrun processes, gloo on CPU) take the same
steps as one process holding the whole model, evaluate exactly, and write a checkpoint that
loads into the unsplit model; bad input stops with one line.

The parity holds only if the stages pass the right activations and gradients, every stage
reads the same batch, the micro-batch gradients are averaged (not summed), and the model has
no BatchNorm (whose statistics would depend on the micro-batch).
"""

import pytest
import torch
from conftest import (
    DIST_TIMEOUT,
    METRIC_KEYS,
    SYNTHETIC,
    assert_state_close,
    load_ckpt,
    max_abs_diff,
    read_metrics,
    run_python,
    torchrun,
)
from torch.utils.data import DataLoader

import common
import model_parallel

ATOL = 1e-5
# 5 steps of batch 32 at a rate high enough that the weights move far more than the tolerance.
ARGS = [*SYNTHETIC, "--epochs", "1", "--max-steps", "5", "--batch-size", "32", "--lr", "0.5", *DIST_TIMEOUT]
# (schedule, micro-batches): naive model parallelism (one micro-batch) and a real pipeline.
CONFIGS = {"naive-gpipe": ("gpipe", "1"), "1f1b-4": ("1f1b", "4")}


@pytest.fixture(scope="session")
def mp_reference(tmp_path_factory):
    """One process, the whole model, the whole batch: the reference."""
    out = tmp_path_factory.mktemp("mp_reference")
    run_python(["model_parallel.py", *ARGS, "--output-dir", out])
    return out


@pytest.fixture(scope="session")
def mp_runs(tmp_path_factory):
    """2 stages under torchrun, one run per configuration, made on first use."""
    runs = {}

    def get(config):
        if config not in runs:
            schedule, microbatches = CONFIGS[config]
            out = tmp_path_factory.mktemp(f"mp_{config}")
            flags = ["--schedule", schedule, "--microbatches", microbatches, "--output-dir", out]
            runs[config] = out, torchrun(2, ["model_parallel.py", *ARGS, *flags])
        return runs[config]

    return get


def initial_weights():
    common.seed_everything(0)  # what model_parallel.py starts from (--seed 0)
    return model_parallel.build_model(1, 10).state_dict()


@pytest.mark.parametrize("config", list(CONFIGS))
def test_two_stages_match_one_process(mp_runs, mp_reference, config):
    out, _ = mp_runs(config)
    reference = load_ckpt(mp_reference)["model"]
    # Can fail: 5 steps moved the weights by far more than the tolerance, so a stage that
    # did not step, summed micro-batch gradients or a shuffled batch would show.
    assert max_abs_diff(reference, initial_weights()) > 1000 * ATOL
    assert_state_close(load_ckpt(out)["model"], reference, atol=ATOL)
    # The training loss comes from the last stage and reaches rank 0's metrics.
    [metrics], [ref] = read_metrics(out), read_metrics(mp_reference)
    assert metrics["train_loss"] == pytest.approx(ref["train_loss"], abs=1e-5)


def test_output_contract(mp_runs):
    out, proc = mp_runs("1f1b-4")
    [metrics] = read_metrics(out)
    assert metrics.keys() >= METRIC_KEYS | {"world_size", "step"}
    assert (metrics["epoch"], metrics["step"], metrics["world_size"]) == (0, 5, 2)
    assert metrics["epoch_seconds"] > 0 and metrics["samples_per_second"] > 0
    # The checkpoint holds the WHOLE model (both stages' weights, original names), not a stage.
    ckpt = load_ckpt(out)
    model = model_parallel.build_model(1, 10)
    model.load_state_dict(ckpt["model"], strict=True)
    assert list(ckpt["model"]) == list(model.state_dict())
    assert (ckpt["epoch"], ckpt["step"]) == (1, 5)
    # Rank 0 alone prints: one summary line, and the split of the model into 2 stages.
    assert proc.stdout.count("epoch 0: train_loss") == 1
    assert "stage 0: layers" in proc.stdout and "stage 1: layers" in proc.stdout


def test_evaluation_equals_one_process(mp_runs):
    """The pipeline's test loss and accuracy (last stage, a padded last batch) are one
    process's on the same weights, over every one of the 499 test samples."""
    out, _ = mp_runs("1f1b-4")
    _, test_set, num_classes, in_channels = common.load_datasets("synthetic", "data")
    model = model_parallel.build_model(in_channels, num_classes)
    model.load_state_dict(load_ckpt(out)["model"])
    loss, acc = common.evaluate(model, DataLoader(test_set, 100, collate_fn=common.collate), torch.device("cpu"))
    [metrics] = read_metrics(out)
    assert metrics["test_loss"] == pytest.approx(loss, abs=1e-5)
    assert metrics["test_acc"] == pytest.approx(acc, abs=1e-9)
    assert len(test_set) % 32  # the last batch is partial: the padding is exercised


def test_balanced_split():
    # The slowest stage sets the pace: the cuts minimise the most expensive stage.
    assert model_parallel.balanced_split([1, 5, 5, 1, 1], 2) == [(0, 2), (2, 5)]
    assert model_parallel.balanced_split([1, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize(
    "flags, world, words",
    [
        (["--batch-size", "32", "--microbatches", "3"], 1, "does not divide"),
        (["--microbatches", "0"], 1, "--microbatches"),
        (["--schedule", "1f1b", "--microbatches", "1"], 2, "--microbatches >= stages"),
        ([], 6, "6 stages for a model of 5 layers"),
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


def test_bad_input_real_processes(tmp_path):
    # What a user sees under torchrun: every rank stops with the same line, non-zero exit.
    argv = ["model_parallel.py", *ARGS, "--schedule", "1f1b", "--microbatches", "1", "--output-dir", tmp_path / "o"]
    proc = torchrun(2, argv, timeout=120, check=False)
    assert proc.returncode != 0
    assert "error: 1f1b needs --microbatches >= stages (2)" in proc.stderr
    assert "]: Traceback" not in proc.stderr  # no worker traceback ("[rank1]: Traceback ...")
    assert not (tmp_path / "o").exists()
