"""Exact distributed evaluation: on the 499-sample synthetic test set (divisible by neither
2 nor 3) the loss and accuracy of N processes equal one process's. DistributedSampler
would pad the set with duplicates, and counting them would move both figures."""

import json
import re

import pytest
from conftest import (
    CNN_ARGS,
    DIST_TIMEOUT,
    MLP_ARGS,
    SYNTHETIC,
    read_metrics,
    single_process_eval,
    torchrun_workers,
)


@pytest.mark.slow
def test_training_run_evaluates_exactly(ddp_run):
    # metrics.jsonl keeps full precision: the 2-process figures of the last epoch were
    # computed on the very weights the checkpoint holds.
    out, _ = ddp_run
    last = read_metrics(out)[-1]
    loss, acc = single_process_eval(out / "checkpoint.pt", CNN_ARGS)
    assert last["world_size"] == 2
    assert last["test_loss"] == pytest.approx(loss, abs=1e-6)
    assert last["test_acc"] == acc  # a count over 499: exact or wrong


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_eval_only_matches_single_process(ddp_run, nproc):
    out, _ = ddp_run
    ckpt = out / "checkpoint.pt"
    proc = torchrun_workers(
        nproc, ["ddp_train.py", *SYNTHETIC, *DIST_TIMEOUT, "--eval-only", "--resume", ckpt]
    )
    found = re.findall(
        r"^eval .*: test_loss (\S+) test_acc (\S+) \((\d+) samples\)$", proc.stdout, re.M
    )
    assert len(found) == 1, proc.stdout  # printed by rank 0 only
    loss, acc, samples = found[0]
    ref_loss, ref_acc = single_process_eval(ckpt, SYNTHETIC)
    # The line prints 4 decimals: the figures agree to the last printed digit. One sample
    # of 499 moves the accuracy by 0.002, so a miscount shows.
    assert float(loss) == pytest.approx(ref_loss, abs=5e-5 + 1e-9)
    assert float(acc) == pytest.approx(ref_acc, abs=5e-5 + 1e-9)
    assert int(samples) == 499


@pytest.mark.slow
def test_three_processes_evaluate_exactly(tmp_path):
    # The MLP has no BatchNorm, so every rank holds rank 0's weights: the figures written at
    # full precision by 3 processes (shards of 167, 166, 166) are one process's.
    torchrun_workers(3, ["ddp_train.py", *MLP_ARGS, "--batch-size", "16", "--output-dir", tmp_path])
    [metrics] = read_metrics(tmp_path)
    loss, acc = single_process_eval(tmp_path / "checkpoint.pt", MLP_ARGS)
    assert metrics["world_size"] == 3
    assert metrics["test_loss"] == pytest.approx(loss, abs=1e-6)
    assert metrics["test_acc"] == acc


# One rank of a gloo group, started by the fork server (torchrun_workers: torch imported once,
# not in three fresh interpreters): evaluate a model that records which samples it is shown.
EVAL_RANK = """
import json, sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, "tests")
from conftest import built_loaders

import data
import training

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
# Sample i carries its index in its first pixel and has label i % 10; the "model" answers
# correctly for even indices only, so the exact accuracy is 250/499.
images = torch.zeros(499, 1, 2, 2)
images[:, 0, 0, 0] = torch.arange(499)
test_set = data.InMemoryDataset(images, torch.arange(499) % 10, range(10))
seen = []


class Recorder(torch.nn.Module):
    def forward(self, x):
        index = x[:, 0, 0, 0].long()
        seen.extend(index.tolist())
        answer = torch.where(index % 2 == 0, index % 10, (index + 1) % 10)
        return torch.nn.functional.one_hot(answer, 10).float()


datasets = (test_set, test_set, 10, 1)
_, _, test_loader = built_loaders(["--batch-size", "16"], world, rank, datasets)
_, acc = training.evaluate(Recorder(), test_loader, torch.device("cpu"))
(Path(sys.argv[1]) / f"{rank}.json").write_text(json.dumps(dict(seen=seen, acc=acc)))
dist.destroy_process_group()
"""


def test_each_rank_evaluates_its_share_and_together_the_set_once(tmp_path):
    torchrun_workers(3, ["-c", EVAL_RANK, tmp_path])
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    assert [len(r["seen"]) for r in ranks] == [167, 166, 166]
    assert sorted(i for r in ranks for i in r["seen"]) == list(range(499))
    assert all(r["acc"] == 250 / 499 for r in ranks)  # every rank gets the all-reduced figure
