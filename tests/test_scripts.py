"""Each script end to end on synthetic data: it trains, writes the output contract
(metrics.jsonl and a checkpoint whose weights load into a plain model), and learns."""

import math
import re

import pytest
import torch
from conftest import (
    CNN_ARGS,
    METRIC_KEYS,
    MLP_ARGS,
    ROOT,
    SYNTHETIC,
    assert_state_close,
    load_ckpt,
    max_abs_diff,
    moe_vit,
    read_metrics,
    run_python,
    torchrun,
)

import models

CHECKPOINT_KEYS = {"model", "optimizer", "scheduler", "scaler", "epoch", "step", "rng"}
CHECKPOINT_KEYS |= {"steps_per_epoch", "world_size"}


def check_outputs(out_dir, stdout, world_size):
    metrics = read_metrics(out_dir)
    assert [m["epoch"] for m in metrics] == [0, 1, 2]
    for m in metrics:
        assert m.keys() >= METRIC_KEYS
        assert m["world_size"] == world_size
        assert 0 <= m["test_acc"] <= 1 and m["epoch_seconds"] > 0 and m["samples_per_second"] > 0
    # Chance is 0.1; the synthetic classes are easy to tell apart once learnt.
    assert metrics[-1]["test_acc"] > 0.8
    # One summary line per epoch: printed by rank 0 only.
    assert re.findall(r"^epoch (\d+):", stdout, re.M) == ["0", "1", "2"]

    ckpt = load_ckpt(out_dir)
    assert ckpt.keys() >= CHECKPOINT_KEYS
    assert (ckpt["epoch"], ckpt["world_size"]) == (3, world_size)
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in ckpt["model"])
    model = models.build_model("cnn", 1, 10)
    model.load_state_dict(ckpt["model"], strict=True)
    return ckpt


@pytest.mark.slow
def test_ddp_train_torchrun(ddp_run):
    out, proc = ddp_run
    assert "2 process(es)" in proc.stdout
    check_outputs(out, proc.stdout, world_size=2)


@pytest.mark.slow
def test_ddp_mp_spawn(ddp_run, tmp_path):
    proc = run_python(["ddp_mp_spawn.py", "--nprocs", "2", *CNN_ARGS, "--output-dir", tmp_path])
    assert "2 process(es)" in proc.stdout
    ckpt = check_outputs(tmp_path, proc.stdout, world_size=2)
    # The same training as under torchrun, only launched differently: the same weights.
    assert_state_close(ckpt["model"], load_ckpt(ddp_run[0])["model"], atol=1e-6)


@pytest.mark.slow
def test_dp_train(tmp_path):
    # --batch-size is DataParallel's whole batch: 256 matches 2 DDP processes of 128 each.
    proc = run_python(["dp_train.py", *CNN_ARGS, "--batch-size", "256", "--output-dir", tmp_path])
    assert "the CPU, no DataParallel" in proc.stdout
    check_outputs(tmp_path, proc.stdout, world_size=1)


@pytest.mark.slow  # compiling on CPU: few steps, but long
def test_compiled_run_saves_plain_weights_and_matches_eager(tmp_path):
    # torch.compile wraps the model in an OptimizedModule whose state_dict keys start with
    # "_orig_mod."; the checkpoint must still hold the plain module's keys, and the compiled
    # steps must compute what the eager ones do.
    steps = [*SYNTHETIC, "--model", "mlp", "--lr", "0.05", "--max-steps", "3"]
    compiled = ["--compile", "--output-dir", tmp_path / "compiled"]
    run_python(["ddp_train.py", *steps, *compiled], timeout=400)
    run_python(["ddp_train.py", *steps, "--output-dir", tmp_path / "eager"])
    compiled, eager = load_ckpt(tmp_path / "compiled"), load_ckpt(tmp_path / "eager")
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in compiled["model"])
    models.build_model("mlp", 1, 10).load_state_dict(compiled["model"], strict=True)
    assert_state_close(compiled["model"], eager["model"], atol=1e-5)


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_every_model_takes_cifar_sized_images(name):
    # 3 x 32 x 32 as well as Fashion-MNIST's 1 x 28 x 28: --model mlp --data cifar10 once
    # stopped with a shape error (its first layer was sized for 28 x 28 only).
    model = models.build_model(name, 3, 10, image_size=32).eval()
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.slow
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_mixed_precision_computes_in_its_dtype(tmp_path, amp):
    """A few MLP steps with autocast land near the fp32 steps but not on them; with fp16 the
    GradScaler has run (it counts the steps since the scale last changed)."""
    argv = ["ddp_train.py", *MLP_ARGS, "--batch-size", "32"]
    run_python([*argv, "--amp", amp, "--output-dir", tmp_path / amp])
    run_python([*argv, "--output-dir", tmp_path / "fp32"])
    ckpt, fp32 = load_ckpt(tmp_path / amp), load_ckpt(tmp_path / "fp32")
    assert 1e-5 < max_abs_diff(ckpt["model"], fp32["model"]) < 5e-2
    if amp == "fp16":
        assert ckpt["scaler"]["_growth_tracker"] == 5 and ckpt["scaler"]["scale"] == 2.0**16


def test_imagefolder_trains(tmp_path):
    """A user's own images (PNG files in class folders, read per sample by a DataLoader with
    workers): two colours are learnt perfectly."""
    from PIL import Image

    for split, count in (("train", 32), ("val", 8)):
        for c, colour in enumerate([(200, 30, 30), (30, 200, 30)]):
            (tmp_path / split / f"c{c}").mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (16, 16), tuple(v + 2 * i for v in colour)).save(
                    tmp_path / split / f"c{c}" / f"{i}.png"
                )
    argv = ["--data", "imagefolder", "--data-dir", tmp_path, "--device", "cpu", "--model", "mlp"]
    argv += ["--workers", "1", "--batch-size", "8", "--epochs", "3", "--lr", "1"]
    run_python(["ddp_train.py", *argv, "--output-dir", tmp_path / "o"])
    assert read_metrics(tmp_path / "o")[-1]["test_acc"] == 1.0


# The quick tier's real run of each newer sharded script: the three, one after another, in
# the same two torchrun processes (one start-up instead of three; each main() makes and ends
# its own process group).
THREE_RUNS = """
import sys
sys.path.insert(0, {root!r})
import context_parallel, expert_parallel, tensor_parallel
for script in (tensor_parallel, context_parallel, expert_parallel):
    out = f"{{sys.argv[1]}}/{{script.__name__}}"
    script.main([*sys.argv[2:], "--output-dir", out])
"""


@pytest.mark.slow
def test_tensor_context_and_expert_parallel_each_train_on_two_processes(tmp_path):
    """Two steps of 2 x 8 samples each, then evaluation and model.pt: metrics.jsonl says 2
    processes and a finite loss; model.pt loads into the script's model; expert_parallel.py's
    counts add up to every choice of every token over both processes, each counted once."""
    driver = tmp_path / "three.py"
    driver.write_text(THREE_RUNS.format(root=str(ROOT)))
    flags = [*SYNTHETIC, "--model", "vit", "--max-steps", "2", "--batch-size", "8"]
    flags += ["--dist-timeout", "60", "--log-every", "1"]
    proc = torchrun(2, [driver, tmp_path, *flags])
    # The lr logged at a step is the rate it took: in the linear warm-up, step 2's is twice
    # step 1's (not 3/2: the next step's), and metrics.jsonl's is the epoch's last step's.
    logged = re.findall(r"^epoch 0 step \d: loss \S+ lr (\S+)$", proc.stdout, re.M)
    rates = [float(r) for r in logged]  # 3 significant digits: within 1%
    for i, name in enumerate(("tensor_parallel", "context_parallel", "expert_parallel")):
        [record] = read_metrics(tmp_path / name)
        assert (record["step"], record["world_size"]) == (2, 2), name
        assert math.isfinite(record["train_loss"]) and 0 <= record["test_acc"] <= 1, name
        first, second = rates[2 * i : 2 * i + 2]
        assert second == pytest.approx(2 * first, rel=0.01), (name, rates)
        assert record["lr"] == pytest.approx(second, rel=0.01), (name, rates)

    def whole(out):
        return torch.load(out / "model.pt", map_location="cpu", weights_only=True)

    models.ViT(1, 10, 28).load_state_dict(whole(tmp_path / "tensor_parallel"))
    models.ViT(1, 10, 28, patch=(1, 28)).load_state_dict(whole(tmp_path / "context_parallel"))
    moe = moe_vit(8, 2, 1.25)
    moe.load_state_dict(whole(tmp_path / "expert_parallel"))
    choices = 2 * 16 * 16 * 2  # steps x global batch x tokens an image x top-k
    for took, dropped in zip(record["expert_tokens"], record["dropped_tokens"], strict=True):
        assert sum(took) + dropped == choices
