"""finetune.py: frozen layers (weights AND BatchNorm statistics) come out exactly as they went
in, the head and the unfrozen stages train, 2 processes equal 1, weights load by name and
shape (from another class count, a ddp_train.py ResNet-18, through wrapper prefixes) and
another network is refused, and bad weights files or flags end in one line. The "pretrained"
weights are a seeded random ResNet-18 saved here, or runs made here: nothing is downloaded
(a stand-in shows that the ranks of a node download one after another). Transfer against
training from scratch, on real data, is in test_fashion_mnist.py."""

import random
import time

import pytest
import torch
import torchvision
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
    torchrun_workers,
)

import data
import finetune
import models

ATOL = 1e-5
# Tiny images and a high rate: a few steps move the head far more than the parity tolerance.
FAST = [*SYNTHETIC, "--image-size", "32", "--max-steps", "4", "--lr", "4", *DIST_TIMEOUT]
JUNK = random.Random(0).randbytes(4096)
# What finetune.py prints after loading a resnet18 backbone into a resnet18 with a new head.
LOADED = "loaded 120 of 122 tensors; random, trained: fc.weight, fc.bias;"


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
    argv = ["--weights-file", pretrained, "--trainable-layers", "0", "--batch-size", "32"]
    run_python(["finetune.py", *FAST, *argv, "--output-dir", out])
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_partial_finetune_trains_layer4_and_keeps_frozen_statistics(tmp_path, pretrained):
    argv = ["--weights-file", pretrained, "--trainable-layers", "1", "--batch-size", "32"]
    run_python(["finetune.py", *FAST, *argv, "--output-dir", tmp_path])
    before, after = check_frozen_and_trained(tmp_path, pretrained, ("fc.", "layer4."))
    # layer4's BatchNorm is trainable and in train mode: it counted the 4 batches.
    counted = "layer4.0.bn1.num_batches_tracked"
    assert after[counted] == before[counted] + 4
    groups = load_ckpt(tmp_path)["optimizer"]["param_groups"]
    backbone_lr_scale = groups[1]["initial_lr"] / groups[0]["initial_lr"]
    assert backbone_lr_scale == pytest.approx(0.1)  # the default


@pytest.mark.slow
def test_two_processes_match_single_process(tmp_path, probe, pretrained):
    # Head only: every BatchNorm is frozen (eval mode), so each sample's features do not
    # depend on the rest of its batch, and 2 x 16 equals 1 x 32 up to float rounding.
    argv = ["--weights-file", pretrained, "--trainable-layers", "0", "--batch-size", "16"]
    torchrun_workers(2, ["finetune.py", *FAST, *argv, "--output-dir", tmp_path])
    reference, ckpt = load_ckpt(probe), load_ckpt(tmp_path)
    assert ckpt["world_size"] == 2
    # The test can fail: the head moved far from its initial value, the same for both runs
    # (same seed), so half the rate or one rank's gradients alone would show.
    models.seed_everything(0)  # what finetune.py does before it builds the model
    start, _ = finetune.build_pretrained_resnet(
        finetune.get_args(["--weights", "none"]), num_classes=10
    )
    initial = start.fc.state_dict()
    moved = {k.removeprefix("fc."): v for k, v in reference["model"].items() if k.startswith("fc.")}
    assert max_abs_diff(moved, initial) > 1000 * ATOL
    assert_state_close(ckpt["model"], reference["model"], atol=ATOL)
    [two], [one] = read_metrics(tmp_path), read_metrics(probe)
    assert two["world_size"] == 2 and two["test_loss"] == pytest.approx(one["test_loss"], abs=1e-4)


def prefixed(state, prefix):
    return {prefix + k: v for k, v in state.items()}


def test_weights_load_by_name_and_shape(no_launcher, capsys, tmp_path, pretrained, probe):
    # A bare state_dict, a checkpoint of these scripts with a 10-class head, and a state_dict
    # saved through DDP and torch.compile wrappers all give the backbone bit for bit; the old
    # head is skipped and reported, the new one has this data set's classes.
    before = torch.load(pretrained, weights_only=True)
    wrapped = tmp_path / "wrapped.pt"
    torch.save(prefixed(prefixed(before, "_orig_mod."), "module."), wrapped)
    for path in (pretrained, probe / "checkpoint.pt", wrapped):
        args = finetune.get_args(["--weights-file", str(path)])
        model, new = finetune.build_pretrained_resnet(args, num_classes=5)
        assert model.fc.out_features == 5 and new == {"fc.weight", "fc.bias"}
        for key, value in model.state_dict().items():
            if not key.startswith("fc."):
                assert torch.equal(value, before[key]), key
        [summary] = capsys.readouterr().out.splitlines()
        assert summary.startswith(f"{path}: {LOADED}"), summary


def test_deeper_network_loads_what_fits(no_launcher, capsys, tmp_path):
    # resnet34 holds every name and shape of resnet18 and more: those load, the rest is counted.
    torch.manual_seed(0)
    state = torchvision.models.resnet34(weights=None).state_dict()
    torch.save(state, tmp_path / "resnet34.pt")
    args = finetune.get_args(["--weights-file", str(tmp_path / "resnet34.pt")])
    model, new = finetune.build_pretrained_resnet(args, 3)
    assert new == {"fc.weight", "fc.bias"}
    assert torch.equal(model.layer4[1].conv2.weight, state["layer4.1.conv2.weight"])
    assert "loaded 120 of 122 tensors" in capsys.readouterr().out


def test_fine_tunes_from_one_data_set_to_another(tmp_path, probe):
    # The probe learnt the 10 classes of the synthetic set; an ImageFolder of 3 classes of
    # RGB images starts from its checkpoint: everything but the head loads by name, and the
    # frozen stages (--trainable-layers 1: all but layer4) come out bit for bit.
    from PIL import Image

    for split in ("train", "val"):
        for c in range(3):
            (tmp_path / "images" / split / f"c{c}").mkdir(parents=True)
            for i in range(8):
                color = (80 * c, 10 * i, 255 - 80 * c)
                Image.new("RGB", (32, 32), color).save(
                    tmp_path / "images" / split / f"c{c}/{i}.png"
                )
    source = probe / "checkpoint.pt"
    argv = ["--data", "imagefolder", "--data-dir", tmp_path / "images", "--device", "cpu"]
    argv += ["--image-size", "32", "--batch-size", "8", "--weights-file", source]
    proc = run_python(["finetune.py", *argv, "--output-dir", tmp_path / "out"])
    assert f"{source}: {LOADED}" in proc.stdout, proc.stdout
    before, after = load_ckpt(probe)["model"], load_ckpt(tmp_path / "out")["model"]
    assert before["fc.weight"].shape == (10, 512) and after["fc.weight"].shape == (3, 512)
    for key, value in after.items():
        if not key.startswith(("fc.", "layer4.")):
            assert torch.equal(value, before[key]), key


@pytest.fixture(scope="module")
def ddp_resnet18(tmp_path_factory):
    """A ddp_train.py --model resnet18 checkpoint: a 3x3 stem on 1 channel, no prefixes."""
    out = tmp_path_factory.mktemp("ddp_resnet18")
    run_python(
        ["ddp_train.py", *SYNTHETIC, "--model", "resnet18", "--max-steps", "1", "--batch-size", "8"]
        + ["--output-dir", out]
    )
    return out / "checkpoint.pt"


@pytest.mark.slow
def test_ddp_train_resnet18_fine_tunes_on_other_classes(tmp_path, ddp_resnet18):
    # Its stem (3x3 on 1 channel, against 7x7 on 3) and its 10-class head are skipped and
    # reported; everything else loads. 5 classes here: another class count, by name.
    argv = ["--weights-file", ddp_resnet18, "--classes", "0-4", "--batch-size", "32"]
    proc = run_python(["finetune.py", *FAST, *argv, "--output-dir", tmp_path])
    loaded = "loaded 119 of 122 tensors; random, trained: conv1.weight ((64, 1, 3, 3) in the file)"
    assert (
        f"{ddp_resnet18}: {loaded}, fc.weight, fc.bias; 0 tensors of the file unused" in proc.stdout
    )
    source, after = load_ckpt(ddp_resnet18)["model"], load_ckpt(tmp_path)["model"]
    assert after["conv1.weight"].shape == (64, 3, 7, 7) and after["fc.weight"].shape == (5, 512)
    # --trainable-layers 1 (the default): the stem's BatchNorm and layer1-3 were loaded and
    # stayed frozen, bit for bit; layer4 trained.
    for key, value in after.items():
        if key.startswith(("bn1.", "layer1.", "layer2.", "layer3.")):
            assert torch.equal(value, source[key]), key
    assert not torch.equal(after["layer4.1.conv2.weight"], source["layer4.1.conv2.weight"])
    # The random stem trains, at the head's rate: [conv1.weight, fc.weight, fc.bias], then layer4.
    groups = load_ckpt(tmp_path)["optimizer"]["param_groups"]
    assert [len(g["params"]) for g in groups] == [3, 15]  # layer4: 2 blocks of 6, downsample 3


def test_select_classes_and_labels_per_class():
    dataset, _, _, _ = data.load_datasets("synthetic", "unused")
    labels = dataset.labels
    picked = finetune.select(dataset, [2, 7], 4, seed=0)
    assert picked.labels.bincount().tolist() == [4, 4] and picked.classes == ["class2", "class7"]
    # Each picked image is one of its class (relabelled 2 -> 0, 7 -> 1); a seed picks the same
    # ones again.
    for image, label in zip(picked.images, picked.labels, strict=True):
        [index] = [i for i in range(len(dataset)) if torch.equal(dataset.images[i], image)]
        assert dataset.labels[index] == [2, 7][label]
    assert torch.equal(finetune.select(dataset, [2, 7], 4, seed=0).images, picked.images)
    assert not torch.equal(finetune.select(dataset, [2, 7], 4, seed=1).images, picked.images)
    everything = finetune.select(dataset, [2, 7], 0, seed=0)  # 0: all images of those classes
    assert len(everything) == int(((labels == 2) | (labels == 7)).sum())


# ----------------------------------------------------------------------------------------
# Bad input: one line that starts with "error:", and nothing written


def fails(argv):
    with pytest.raises(SystemExit) as excinfo:
        finetune.main(argv)
    message = excinfo.value.code
    assert isinstance(message, str) and message.startswith("error: "), message
    assert "\n" not in message, message
    return message


def resnet50_file(path):
    torch.save({"model": torchvision.models.resnet50(weights=None).state_dict()}, path)


def small_cnn_file(path):  # what ddp_train.py --model cnn saves
    torch.save({"model": models.SmallCNN(1, 10).state_dict()}, path)


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.write_bytes(JUNK), "cannot read"),
        (lambda p: p.write_bytes(b""), "cannot read"),
        (lambda p: torch.save([1, 2, 3], p), "nor a state_dict"),
        (lambda p: torch.save({"model": {}, "obj": torch.nn.Identity()}, p), "unsafe"),
        # Another network, in one line that says what the file holds.
        (
            resnet50_file,
            "only 9 of its 21 weight tensors match by name and shape (the file holds 320",
        ),
        (
            small_cnn_file,
            "only 0 of its 21 weight tensors match by name and shape (the file holds 20",
        ),
    ],
    ids=["missing", "junk", "empty", "not-a-dict", "unsafe-pickle", "resnet50", "small-cnn"],
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
        (["--arch", "vgg16"], "--model"),
        (["--model", "vgg16"], "--model"),
        (["--classes", "5-3"], "--classes"),
        (["--classes", "0"], "at least 2 classes"),
        (["--classes", "0,1,1"], "each once"),
        (["--classes=-1,2"], "numbers and ranges"),
        (["--classes", "0-4-6"], "numbers and ranges"),
        (["--classes", "a"], "numbers and ranges"),
        (["--classes", "8-10"], "class 10 has 0 images"),
        (["--train-per-class", "-1"], "--train-per-class"),
        (["--train-per-class", "1000"], "(--classes, --train-per-class 1000)"),
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
    assert all(
        words in message for words in ("could not download", "--weights-file", "--weights none")
    )
    assert not (tmp_path / "out").exists()


def test_one_line_error_from_a_real_process(tmp_path):
    (tmp_path / "bad.pt").write_bytes(JUNK)
    out = tmp_path / "out"
    argv = ["finetune.py", *FAST, "--weights-file", tmp_path / "bad.pt", "--output-dir", out]
    proc = run_python(argv, check=False)
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    assert sum(line.startswith("error:") for line in lines) == 1 and proc.stdout == ""
    assert not out.exists()


def test_unwritable_output_dir_stops_every_rank_with_the_cause(tmp_path):
    """Rank 0 alone checks --output-dir; the other rank must stop with rank 0's error at once,
    not with "a peer died", and long before --dist-timeout."""
    (tmp_path / "file").write_text("a regular file: nothing can be created under it")
    port, argv = free_port(), ["finetune.py", *SYNTHETIC, "--weights", "none"]
    argv += ["--image-size", "32", "--max-steps", "1", "--dist-timeout", "120"]
    argv += ["--output-dir", tmp_path / "file" / "out"]
    envs = [
        clean_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2")
        | dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        for r in range(2)
    ]
    start = time.monotonic()
    procs = run_ranks(argv, envs, timeout=150, check=False)
    assert time.monotonic() - start < 60  # well below --dist-timeout 120
    errors = []
    for p in procs:
        assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
        errors.append([line for line in p.stderr.splitlines() if line.strip()][-1])
    assert errors[0] == errors[1], errors
    assert errors[0].startswith(f"error: output directory {tmp_path / 'file' / 'out'} is not")


# One rank of a gloo group of 3 on 2 "nodes" (ranks 0, 1 | 2), each node with its own hub
# cache folder, that builds the model with --weights DEFAULT: `python -c FETCH_RANK TMP` as
# torchrun's workers (forked: mp.spawn's children would each import torch anew). torchvision's
# download is replaced by a slow stand-in that logs when it starts and ends and whether the file
# was already in this node's cache.
FETCH_RANK = """
import os, sys, time, torch.distributed as dist, torchvision
from pathlib import Path
import finetune
rank, nodes, tmp = int(os.environ["RANK"]), [0, 0, 1], Path(sys.argv[1])
dist.init_process_group("gloo")
cached = tmp / f"node{nodes[rank]}" / "resnet18.pth"
def fake_get_state_dict(self, progress=True, check_hash=False):
    download = not cached.exists()
    with open(tmp / "log", "a") as f:
        f.write(f"{rank} {int(download)} start {time.time()}\\n")
    if download:
        time.sleep(0.5)
        cached.parent.mkdir(exist_ok=True)
        cached.write_bytes(b"weights")
    with open(tmp / "log", "a") as f:
        f.write(f"{rank} {int(download)} end {time.time()}\\n")
    return torchvision.models.resnet18().state_dict()
torchvision.models.ResNet18_Weights.get_state_dict = fake_get_state_dict
local_rank = nodes[: rank + 1].count(nodes[rank]) - 1
try:
    finetune.build_pretrained_resnet(finetune.get_args(["--weights", "DEFAULT"]), 10, local_rank)
finally:
    dist.destroy_process_group()
"""


@pytest.mark.slow
def test_weights_download_once_per_node_while_the_others_wait(tmp_path):
    """Processes downloading into one cache at once could spoil the file. Global rank 0
    downloads first, then the first process of the other node; rank 1 (node 0's second
    process) only reads the cache, after rank 0's download ended."""
    torchrun_workers(3, ["-c", FETCH_RANK, tmp_path])
    events = {}
    for line in (tmp_path / "log").read_text().splitlines():
        rank, download, what, when = line.split()
        assert (int(rank), what) not in events  # each rank fetches once
        events[(int(rank), what)] = (int(download), float(when))
    assert {r for (r, _), (d, _) in events.items() if d} == {0, 2}  # the downloaders
    assert events[(0, "end")][1] <= events[(2, "start")][1]  # one after the other
    assert events[(1, "start")][0] == 0 and events[(0, "end")][1] <= events[(1, "start")][1]
