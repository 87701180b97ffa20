"""finetune.py: frozen layers (weights AND BatchNorm statistics) come out exactly as they went
in, the head and the unfrozen stages train, 2 processes equal 1, and bad weights files or
flags end in one line. The "pretrained" weights are a seeded random ResNet-18 saved here:
nothing is downloaded."""

import random

import pytest
import torch
import torchvision
from conftest import DIST_TIMEOUT, METRIC_KEYS, SYNTHETIC, load_ckpt, max_abs_diff, read_metrics, run_python, torchrun

import common
import finetune

ATOL = 1e-5
# Tiny images and a high rate: a few steps move the head far more than the parity tolerance.
FAST = [*SYNTHETIC, "--image-size", "32", "--max-steps", "4", "--lr", "4", *DIST_TIMEOUT]
JUNK = random.Random(0).randbytes(4096)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A stand-in for ImageNet weights: resnet18's state_dict with 1000 classes, saved bare."""
    torch.manual_seed(1234)
    path = tmp_path_factory.mktemp("weights") / "resnet18.pt"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), path)
    return path


@pytest.fixture(scope="module")
def probe(tmp_path_factory, pretrained):
    """A linear probe (head only), one process, batch 32: also the reference for parity."""
    out = tmp_path_factory.mktemp("probe")
    run_python(
        ["finetune.py", *FAST, "--weights-file", pretrained, "--trainable-layers", "0", "--batch-size", "32"]
        + ["--output-dir", out]
    )
    return out


def split(state, trained_prefixes):
    """(trained, frozen) parts of a state dict, by key prefix."""
    trained = {k: v for k, v in state.items() if k.startswith(trained_prefixes)}
    return trained, {k: v for k, v in state.items() if k not in trained}


def check_frozen_and_trained(out, pretrained, trained_prefixes):
    before = torch.load(pretrained, weights_only=True)
    after = load_ckpt(out)["model"]
    trained, frozen = split(after, trained_prefixes)
    # Bit for bit: frozen weights, and BatchNorm running means, variances and batch counts,
    # which a frozen BatchNorm left in train mode would have moved.
    for key, value in frozen.items():
        assert torch.equal(value, before[key]), f"{key} changed, but it is frozen"
    assert any(".running_mean" in k for k in frozen)  # the statistics were among them
    # The trained parts moved, each by far more than rounding.
    for key in trained:
        if key.startswith("fc.") or key.endswith("num_batches_tracked"):
            continue  # the head is new (nothing to compare it with); counts are checked below
        assert not torch.equal(trained[key], before[key]), f"{key} did not train"
    assert (trained["fc.weight"].shape, trained["fc.bias"].shape) == ((10, 512), (10,))
    return before, after


def test_linear_probe_trains_the_head_only(probe, pretrained):
    _, after = check_frozen_and_trained(probe, pretrained, ("fc.",))
    # The checkpoint is a plain ResNet-18 with a 10-class head: it loads as it is.
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(after)
    [record] = read_metrics(probe)
    assert record.keys() >= METRIC_KEYS and (record["step"], record["world_size"]) == (4, 1)
    ckpt = load_ckpt(probe)
    # Only the head is in the optimizer (one group: no backbone parameters to give a rate).
    assert [len(g["params"]) for g in ckpt["optimizer"]["param_groups"]] == [2]


def test_partial_finetune_trains_layer4_and_keeps_frozen_statistics(tmp_path, pretrained):
    run_python(
        ["finetune.py", *FAST, "--weights-file", pretrained, "--trainable-layers", "1", "--batch-size", "32"]
        + ["--output-dir", tmp_path]
    )
    before, after = check_frozen_and_trained(tmp_path, pretrained, ("fc.", "layer4."))
    # layer4's BatchNorm is trainable and in train mode: it counted the 4 batches.
    assert after["layer4.0.bn1.num_batches_tracked"] == before["layer4.0.bn1.num_batches_tracked"] + 4
    groups = load_ckpt(tmp_path)["optimizer"]["param_groups"]
    assert groups[1]["initial_lr"] == pytest.approx(0.1 * groups[0]["initial_lr"])  # --backbone-lr-scale


def test_torchrun_matches_single_process(tmp_path, probe, pretrained):
    # Head only: every BatchNorm is frozen (eval mode), so each sample's features do not
    # depend on the rest of its batch, and 2 x 16 equals 1 x 32 up to float rounding.
    torchrun(
        2,
        ["finetune.py", *FAST, "--weights-file", pretrained, "--trainable-layers", "0", "--batch-size", "16"]
        + ["--output-dir", tmp_path],
    )
    reference, ckpt = load_ckpt(probe), load_ckpt(tmp_path)
    assert ckpt["world_size"] == 2
    # The test can fail: the head moved far from its initial value, the same for both runs
    # (same seed), so half the rate or one rank's gradients alone would show.
    common.seed_everything(0)  # what finetune.py does before it builds the model
    start = finetune.build_model(finetune.get_args(["--weights", "none"]), num_classes=10, is_main=True)
    initial = start.fc.state_dict()
    moved = {k.removeprefix("fc."): v for k, v in reference["model"].items() if k.startswith("fc.")}
    assert max_abs_diff(moved, initial) > 1000 * ATOL
    for key, value in reference["model"].items():
        torch.testing.assert_close(ckpt["model"][key], value, atol=ATOL, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
    [two], [one] = read_metrics(tmp_path), read_metrics(probe)
    assert two["world_size"] == 2 and two["test_loss"] == pytest.approx(one["test_loss"], abs=1e-4)


def test_weights_file_forms(no_launcher, tmp_path, pretrained, probe):
    # A bare state_dict and a checkpoint of these scripts (10-class head) both give the
    # backbone; the old head is dropped, the new one has this data set's classes.
    before = torch.load(pretrained, weights_only=True)
    for path in (pretrained, probe / "checkpoint.pt"):
        args = finetune.get_args(["--weights-file", str(path)])
        model = finetune.build_model(args, num_classes=7, is_main=True)
        assert model.fc.out_features == 7
        for key, value in model.state_dict().items():
            if not key.startswith("fc."):
                assert torch.equal(value, before[key]), key


# ----------------------------------------------------------------------------------------
# Bad input: one line that starts with "error:", and nothing written


def fails(argv):
    with pytest.raises(SystemExit) as excinfo:
        finetune.main(argv)
    message = excinfo.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
    return message


def resnet34_file(path):
    torch.save(torchvision.models.resnet34(weights=None).state_dict(), path)


def resnet50_file(path):
    torch.save({"model": torchvision.models.resnet50(weights=None).state_dict()}, path)


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.write_bytes(JUNK), "cannot read"),
        (lambda p: p.write_bytes(b""), "cannot read"),
        (lambda p: torch.save([1, 2, 3], p), "no state_dict"),
        (lambda p: torch.save({"model": {}, "obj": torch.nn.Identity()}, p), "unsafe"),
        (resnet34_file, "does not fit --arch resnet18"),  # more blocks: unexpected keys
        (resnet50_file, "does not fit --arch resnet18"),  # other shapes
    ],
    ids=["missing", "random-bytes", "empty", "not-a-dict", "unsafe-pickle", "resnet34", "resnet50"],
)
def test_bad_weights_file(no_launcher, tmp_path, make, words):
    path = tmp_path / "weights.pt"
    make(path)
    message = fails([*FAST, "--weights-file", str(path), "--output-dir", str(tmp_path / "out")])
    assert words in message and str(path) in message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--trainable-layers", "6"], "--trainable-layers"),
        (["--trainable-layers", "-1"], "--trainable-layers"),
        (["--arch", "vgg16"], "--arch"),
        (["--weights", "IMAGENET9K"], "IMAGENET1K_V1"),  # the choices are named
        (["--image-size", "16"], "--image-size"),
        (["--backbone-lr-scale", "0"], "--backbone-lr-scale"),
        (["--batch-size", "0"], "--batch-size"),
    ],
)
def test_impossible_flags(no_launcher, tmp_path, flags, words):
    assert words in fails([*FAST, *flags, "--output-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_failed_download_names_the_offline_routes(no_launcher, monkeypatch, tmp_path):
    def no_network(*args, **kwargs):
        raise OSError("<urlopen error [Errno -3] Temporary failure in name resolution>")

    monkeypatch.setattr(torchvision.models.ResNet18_Weights, "get_state_dict", no_network)
    message = fails([*FAST, "--output-dir", str(tmp_path / "out")])
    assert "could not download" in message and "--weights-file" in message and "--weights none" in message
    assert not (tmp_path / "out").exists()


def test_one_line_error_from_a_real_process(tmp_path):
    (tmp_path / "bad.pt").write_bytes(JUNK)
    out = tmp_path / "out"
    proc = run_python(["finetune.py", *FAST, "--weights-file", tmp_path / "bad.pt", "--output-dir", out], check=False)
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    assert sum(line.startswith("error:") for line in lines) == 1 and proc.stdout == ""
    assert not out.exists()
