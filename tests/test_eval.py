"""Exact distributed evaluation: on the 499-sample synthetic test set (divisible by neither
2 nor 3) the loss and accuracy of N processes equal one process's. DistributedSampler
would pad the set with duplicates, and counting them would move both figures."""

import re

import pytest
from conftest import CNN_ARGS, DIST_TIMEOUT, MLP_ARGS, SYNTHETIC, read_metrics, single_process_eval, torchrun


def test_training_run_evaluates_exactly(ddp_run):
    # metrics.jsonl keeps full precision: the 2-process figures of the last epoch were
    # computed on the very weights the checkpoint holds.
    out, _ = ddp_run
    last = read_metrics(out)[-1]
    loss, acc = single_process_eval(out / "checkpoint.pt", CNN_ARGS)
    assert last["world_size"] == 2
    assert last["test_loss"] == pytest.approx(loss, abs=1e-6)
    assert last["test_acc"] == acc  # a count over 499: exact or wrong


@pytest.mark.parametrize("nproc", [2, 3])
def test_eval_only_matches_single_process(ddp_run, nproc):
    out, _ = ddp_run
    ckpt = out / "checkpoint.pt"
    proc = torchrun(nproc, ["ddp_train.py", *SYNTHETIC, *DIST_TIMEOUT, "--eval-only", "--resume", ckpt])
    found = re.findall(r"^eval .*: test_loss (\S+) test_acc (\S+) \((\d+) samples\)$", proc.stdout, re.M)
    assert len(found) == 1, proc.stdout  # printed by rank 0 only
    loss, acc, samples = found[0]
    ref_loss, ref_acc = single_process_eval(ckpt, SYNTHETIC)
    # The line prints 4 decimals: the figures agree to the last printed digit. One sample
    # of 499 moves the accuracy by 0.002, so a miscount shows.
    assert float(loss) == pytest.approx(ref_loss, abs=5e-5 + 1e-9)
    assert float(acc) == pytest.approx(ref_acc, abs=5e-5 + 1e-9)
    assert int(samples) == 499


def test_three_processes_evaluate_exactly(tmp_path):
    # The MLP has no BatchNorm, so every rank holds rank 0's weights: the figures written at
    # full precision by 3 processes (shards of 167, 166, 166) are one process's.
    torchrun(3, ["ddp_train.py", *MLP_ARGS, "--batch-size", "16", "--output-dir", tmp_path])
    [metrics] = read_metrics(tmp_path)
    loss, acc = single_process_eval(tmp_path / "checkpoint.pt", MLP_ARGS)
    assert metrics["world_size"] == 3
    assert metrics["test_loss"] == pytest.approx(loss, abs=1e-6)
    assert metrics["test_acc"] == acc
