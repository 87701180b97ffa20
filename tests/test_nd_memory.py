"""benchmarks/nd_memory.py at 2 processes on a GPT of 19.9 M parameters (80 MB of fp32
weights: above the 64 MiB up to which rank 0 reads model.pt back for its sample), one step of
nd_parallel.py --dp 2, a checkpoint and model.pt: no rank builds, fills or exports the whole
model, so rank 0's peak memory is the other rank's, within a quarter of the weights; and no rank
holds more than an idle process, its share and the activations it keeps for backward."""

import json

import pytest
from conftest import run_python

import models


@pytest.mark.slow
def test_rank_0_holds_no_more_than_the_others(tmp_path):
    report = tmp_path / "memory.json"
    shape = ["--dim", "640", "--depth", "4", "--heads", "8", "--seq-len", "64"]
    argv = ["benchmarks/nd_memory.py", "--nproc", "2", *shape, "--text-kb", "64"]
    run_python([*argv, "--layouts", "--dp 2", "--json", report], timeout=600)
    figures = json.loads(report.read_text())
    weights = 4 * sum(p.numel() for p in models.GPT(256, 64, 640, 4, 8).parameters())
    assert figures["params"] * 4 == weights
    (row,) = figures["rows"]
    rank0, rank1 = row["peaks"]
    assert abs(rank0 - rank1) < weights / 4, (rank0, rank1, weights)
    # Each rank: the idle process, its share (weights, gradients, AdamW: 16 bytes / 2), one
    # block gathered, and what autograd held for backward (counted on that rank, 87 MB here);
    # the step's temporaries besides within a tenth of the weights (the peak was 39-41 MB below).
    for peak, held in zip(row["peaks"], row["held"], strict=True):
        assert held > 0, figures
        assert peak < figures["idle"] + figures["share"] + held + weights / 10, figures
