"""Real data: ddp_train.py with its default hyper-parameters, 2 processes, on Fashion-MNIST.

The files come from Debian's dataset-fashion-mnist package (found through dpkg, with an
empty --data-dir) or from the repository's data/ folder. Absent, the test is skipped,
unless REQUIRE_FASHION_MNIST=1 (set by .ci/run) makes that a failure.
"""

import os

import pytest
from conftest import ROOT, read_metrics, torchrun

import common


def data_dir_for(tmp_path):
    if common._debian_fashion_mnist_dir() is not None:
        return tmp_path / "empty"  # exercise the package route: nothing under --data-dir
    raw = ROOT / "data" / "FashionMNIST" / "raw"
    if (raw / "train-images-idx3-ubyte").is_file() or (raw / "train-images-idx3-ubyte.gz").is_file():
        return ROOT / "data"
    message = (
        "Fashion-MNIST not found: apt-get install dataset-fashion-mnist, or put its files in data/FashionMNIST/raw"
    )
    if os.environ.get("REQUIRE_FASHION_MNIST") == "1":
        pytest.fail(message + " (REQUIRE_FASHION_MNIST=1)")
    pytest.skip(message)


def test_defaults_reach_90_percent(tmp_path):
    data_dir = data_dir_for(tmp_path)
    out = tmp_path / "out"
    proc = torchrun(2, ["ddp_train.py", "--device", "cpu", "--data-dir", data_dir, "--output-dir", out], timeout=540)
    metrics = read_metrics(out)
    assert len(metrics) == 5  # the default --epochs
    assert metrics[-1]["test_acc"] >= 0.90, proc.stdout
