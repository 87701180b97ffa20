"""Real data, Fashion-MNIST: ddp_train.py with its default hyper-parameters for 3 epochs (2
processes), and finetune.py's transfer from classes 0-4 to a few labels of classes 5-9.

The files are read from data/FashionMNIST/raw (where .ci/run unpacks them), or unpacked here
from Debian's dataset-fashion-mnist package. Absent, the tests are skipped, unless
REQUIRE_FASHION_MNIST=1 (set by .ci/run) makes that a failure.
"""

import gzip
import os
import shutil
from pathlib import Path

import pytest
from conftest import ROOT, clean_env, read_metrics, run_python, torchrun

pytestmark = pytest.mark.slow
FILES = [
    f"{s}-{k}-idx{d}-ubyte" for s in ("train", "t10k") for k, d in (("images", 3), ("labels", 1))
]
DEBIAN = Path("/usr/share/datasets/fashion-mnist")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A --data-dir holding FashionMNIST/raw/*-ubyte, torchvision's layout."""
    if all((ROOT / "data" / "FashionMNIST" / "raw" / f).is_file() for f in FILES):
        return ROOT / "data"
    if all((DEBIAN / f"{f}.gz").is_file() for f in FILES):
        root = tmp_path_factory.mktemp("data")
        (root / "FashionMNIST" / "raw").mkdir(parents=True)
        for f in FILES:
            with (
                gzip.open(DEBIAN / f"{f}.gz") as src,
                open(root / "FashionMNIST/raw" / f, "wb") as dst,
            ):
                shutil.copyfileobj(src, dst)
        return root
    message = "Fashion-MNIST not found: apt-get install dataset-fashion-mnist, or see README: Data"
    if os.environ.get("REQUIRE_FASHION_MNIST") == "1":
        pytest.fail(message + " (REQUIRE_FASHION_MNIST=1)")
    pytest.skip(message)


def test_three_epochs_of_the_defaults_reach_90_percent(tmp_path, data_dir):
    # Every default but --epochs (the schedule then fitted to 3): 91.4% here (2026-11-27), in
    # 3/5 of the defaults' training, whose 92.0% README's Results give (run_all.py); at 2
    # epochs 90.7%, too near the line for other CPUs' rounding.
    out = tmp_path / "out"
    argv = ["ddp_train.py", "--device", "cpu", "--data-dir", data_dir, "--output-dir", out]
    proc = torchrun(2, [*argv, "--epochs", "3"], timeout=540)
    metrics = read_metrics(out)
    assert len(metrics) == 3
    assert metrics[-1]["test_acc"] >= 0.90, proc.stdout


def cut_test_set(data_dir, root, count):
    """A --data-dir at root: data_dir's training files linked, its test files cut to their first
    `count` images and labels (an idx file: a header, then one fixed-size record a sample)."""
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for f in FILES:
        src = (data_dir / "FashionMNIST" / "raw" / f).resolve()
        if f.startswith("train"):
            (raw / f).symlink_to(src)
            continue
        data = src.read_bytes()
        header = 4 + 4 * int(f[-7])  # the magic number, then one 4-byte size a dimension
        record = (len(data) - header) // int.from_bytes(data[4:8], "big")
        cut = data[:4] + count.to_bytes(4, "big") + data[8 : header + count * record]
        (raw / f).write_bytes(cut)
    return root


def test_fine_tuning_from_other_classes_beats_training_from_scratch(tmp_path, data_dir):
    # A ResNet-18 learns classes 0-4 (T-shirt, trouser, pullover, dress, coat) from random
    # weights: one epoch over 1,000 training images of each (a sixth of them, for the suite's
    # time: its 78 steps of 64 are about 3/4 of the test's FLOPs, 156 were 7/8; the whole
    # base took 4 minutes here). Then classes 5-9 (sandal, shirt, sneaker, bag, ankle boot)
    # from 50 labelled images each, 20 steps of 12 in one epoch, starting from those weights
    # or from random ones. The flags are the same, and everything trains at one rate
    # (--trainable-layers 5 --backbone-lr-scale 1), so the start is the only difference. 64
    # pixels: at 32 a random network's features are about as good as learnt ones for this
    # pair (README.md, "Transfer"). Each run is evaluated on the first 2,000 test images
    # (about 1,000 of its classes): the three evaluations of all 5,000 cost a third of the
    # test's time (with a base of 2,000 a class), more than the few-shot runs' steps.
    data_dir = cut_test_set(data_dir, tmp_path / "data", 2000)

    def finetune(*flags, out):
        script = ["finetune.py", "--device", "cpu", "--data-dir", data_dir, "--image-size", "64"]
        script += ["--weight-decay", "1e-4"]  # benchmarks/transfer.py's setting
        # One process: let it use every core (the other tests' runs get one thread each).
        proc = run_python(
            [*script, *flags, "--output-dir", tmp_path / out], env=clean_env(None), timeout=600
        )
        return proc, read_metrics(tmp_path / out)[-1]

    base_flags = ["--weights", "none", "--classes", "0-4", "--train-per-class", "1000"]
    _, base = finetune(*base_flags, "--epochs", "1", out="base")
    assert base["test_acc"] >= 0.80  # it learnt its own classes (0.889 at seed 0; chance 0.2)
    few = ["--classes", "5-9", "--train-per-class", "50", "--batch-size", "12", "--epochs", "1"]
    few += ["--lr", "0.4", "--trainable-layers", "5", "--backbone-lr-scale", "1"]
    proc, tuned = finetune(*few, "--weights-file", tmp_path / "base" / "checkpoint.pt", out="tuned")
    # Everything but the 5-class head came from the file (the old head had the same shape).
    assert "loaded 120 of 122 tensors; random, trained: fc.weight, fc.bias;" in proc.stdout, (
        proc.stdout
    )
    _, scratch = finetune(*few, "--weights", "none", out="scratch")
    assert tuned["step"] == scratch["step"] == 20
    # With the whole base and 2 epochs of 25, over seeds 0-4: 0.876-0.918 fine-tuned against
    # 0.825-0.862 from scratch, each seed's gap at least 0.020 (benchmarks/results.md,
    # "Transfer", 2026-11-26); with this base (0.889 on classes 0-4) and these steps, seed 0:
    # 0.852 against 0.710, a gap of 0.142 (2026-11-27; with 2,000 a class: 0.908, then 0.871
    # against 0.752). Had nothing loaded, the two runs would be one and the same (same
    # seed): a gap of 0.
    assert tuned["test_acc"] >= scratch["test_acc"] + 0.03, (tuned, scratch)
