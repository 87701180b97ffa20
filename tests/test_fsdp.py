"""fsdp_train.py: 2 and 3 sharded processes against one unsharded process on the same global
batch, resume at another number of processes, what each rank holds, exact evaluation, the
single-file export, bad input, and what each FSDP option changes. All on CPU with gloo."""

import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import (
    DIST_TIMEOUT,
    METRIC_KEYS,
    SYNTHETIC,
    assert_state_close,
    one_line_errors,
    read_metrics,
    run_python,
    torchrun,
)

import common
import fsdp_train

# Adam divides by the root of the squared gradients: an element whose gradient is nearly zero
# takes a step of nearly full size in a direction set by rounding, so a few elements of 10^5
# differ by more than rounding. So each tensor's update is compared as a whole: the difference
# of the two runs' updates at most RTOL of the update, and no element off by more than ATOL.
RTOL, ATOL = 1e-3, 1e-3
GLOBAL_BATCH = 12  # 1 x 12, 2 x 6, 3 x 4
# 5 steps at a rate that moves the weights far more than the tolerance; no warm-up.
FAST = [*SYNTHETIC, "--max-steps", "5", "--warmup", "0", "--lr", "0.05", *DIST_TIMEOUT]


def train(tmp_path, name, nproc, model, *extra):
    """fsdp_train.py on nproc processes (one: a plain `python`, unsharded) at the global
    batch of 12; returns its output directory."""
    out = tmp_path / name
    argv = ["fsdp_train.py", *FAST, "--model", model, "--output-dir", out, *extra]
    argv += ["--batch-size", str(GLOBAL_BATCH // nproc)]
    if nproc == 1:
        run_python(argv)
    else:
        torchrun(nproc, argv)
    return out


def whole(out):
    return torch.load(out / "model.pt", map_location="cpu", weights_only=True)


def assert_same_training(out, reference, model, resumed=False):
    """The same weights after the same steps (see RTOL) and the same logged training loss
    (a resumed run logs the loss of the steps it took itself)."""
    a, b, start = whole(out), whole(reference), initial(model)
    assert a.keys() == b.keys() == start.keys()
    for key in b:
        update = (b[key] - start[key]).norm()
        assert update > ATOL, key  # the test can fail: the steps moved every tensor
        assert (a[key] - b[key]).norm() < RTOL * update, key
        torch.testing.assert_close(a[key], b[key], atol=ATOL, rtol=0, msg=key)
    last, ref = read_metrics(out)[-1], read_metrics(reference)[-1]
    assert last["step"] == ref["step"]
    if not resumed:
        assert last["train_loss"] == pytest.approx(ref["train_loss"], abs=1e-5)


def initial(model):
    common.seed_everything(0)  # what fsdp_train.py builds first
    return common.build_model(model, 1, 10).state_dict()


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One unsharded process per model, batch 12, 5 steps."""
    tmp = tmp_path_factory.mktemp("fsdp_reference")
    return {m: train(tmp, m, 1, m) for m in ("mlp", "vit")}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The ViT on 2 processes (batch 2 x 6), 5 steps: a checkpoint of two shards."""
    tmp = tmp_path_factory.mktemp("fsdp_sharded")
    return train(tmp, "vit", 2, "vit", "--export", tmp / "exported.pt")


@pytest.mark.slow
def test_two_processes_train_the_vit_as_one_does(sharded, references):
    assert read_metrics(sharded)[-1].keys() >= METRIC_KEYS | {"step", "world_size"}
    assert read_metrics(sharded)[-1]["world_size"] == 2
    exported = torch.load(sharded.parent / "exported.pt", weights_only=True)
    assert_state_close(exported, whole(sharded), atol=0)  # --export: the same file
    assert_same_training(sharded, references["vit"], "vit")


@pytest.mark.parametrize("model, nproc", [("mlp", 2), ("mlp", 3), ("vit", 3)])
@pytest.mark.slow
def test_sharded_training_equals_one_process(tmp_path, references, model, nproc):
    out = train(tmp_path, "run", nproc, model)
    assert read_metrics(out)[-1]["world_size"] == nproc
    assert_same_training(out, references[model], model)


def probe(mode, nproc, *flags, steps=2):
    """tests/fsdp_probe.py MODE on the ViT at the global batch of 12: rank 0's report."""
    with tempfile.TemporaryDirectory() as reports:
        argv = ["tests/fsdp_probe.py", mode, reports, "--", *FAST, "--model", "vit", *flags]
        argv += ["--max-steps", str(steps), "--batch-size", str(GLOBAL_BATCH // nproc)]
        run_python(argv) if nproc == 1 else torchrun(nproc, argv)
        return json.loads(Path(reports, "rank0.json").read_text())


@pytest.mark.slow
def test_clipping_uses_the_norm_of_the_whole_gradient():
    """Every step's gradient norm, over all shards, is the one process's, and larger than the
    clip: a rank that clipped by the norm of its own shard would scale by another factor."""
    reference = probe("clip", 1, "--clip-grad", "0.05", steps=3)["norms"]
    norms = probe("clip", 2, "--clip-grad", "0.05", steps=3)["norms"]
    assert len(norms) == 3 and min(norms) > 0.5
    assert norms == pytest.approx(reference, rel=1e-5)


@pytest.mark.slow
def test_resume_at_another_number_of_processes_ends_where_one_run_ends(tmp_path, references):
    """2 processes stop after 3 of 5 steps; 3 processes go on from their shards, mid-epoch,
    and end with the weights of the uninterrupted run."""
    out = tmp_path / "run"
    argv = ["fsdp_train.py", *FAST, "--model", "vit", "--output-dir", out]
    torchrun(2, [*argv, "--batch-size", "6", "--max-steps", "3"])
    proc = torchrun(3, [*argv, "--batch-size", "4"])
    assert "resumed from" in proc.stdout and "at epoch 0, step 3 of" in proc.stdout, proc.stdout
    assert_same_training(out, references["vit"], "vit", resumed=True)


def test_each_rank_holds_a_third_of_every_parameter_and_of_the_optimizer_state(tmp_path):
    argv = ["tests/fsdp_probe.py", "shards", tmp_path, "--", *FAST, "--model", "vit"]
    torchrun(3, [*argv, "--max-steps", "1", "--batch-size", "4"])
    reports = [json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")]
    reports = {r["rank"]: r["shapes"] for r in reports}
    assert sorted(reports) == [0, 1, 2]
    params = list(common.build_model("vit", 1, 10).parameters())
    held = 0
    for rank, shapes in reports.items():
        assert [whole for whole, _, _ in shapes] == [list(p.shape) for p in params]
        for whole, local, state in shapes:
            # Rows cut into 3 pieces as torch.chunk cuts them (the last ones may be empty).
            pieces = torch.arange(whole[0]).chunk(3)
            rows = len(pieces[rank]) if rank < len(pieces) else 0
            assert local == [rows, *whole[1:]] and state == [local, local]
            held += math.prod(local)
    assert held == sum(p.numel() for p in params)  # together, every element once


@pytest.mark.slow
def test_mixed_precision_gathers_bf16_and_reduces_fp32_and_resharding_gathers_again():
    depth = len(common.build_model("vit", 1, 10).blocks)
    steps = 2
    seen = probe("collectives", 2, steps=steps)
    # Forward gathers every unit (the blocks and the root); backward the blocks again, which
    # forward freed (and the root too, from PyTorch 2.7 or so: older ones keep the root's).
    assert seen["all_gather forward float32"] == steps * (depth + 1)
    assert steps * depth <= seen["all_gather backward float32"] <= steps * (depth + 1)
    assert seen["reduce_scatter backward float32"] == steps * (depth + 1)

    seen = probe("collectives", 2, "--no-reshard-after-forward", steps=steps)
    assert seen["all_gather forward float32"] == steps * (depth + 1)
    assert not any("all_gather backward" in k for k in seen)

    seen = probe("collectives", 2, "--amp", "bf16", steps=steps)
    assert seen["all_gather forward bfloat16"] == steps * (depth + 1)
    assert seen["reduce_scatter backward float32"] == steps * (depth + 1)
    assert not any("reduce_scatter" in k and "bfloat16" in k for k in seen)


@pytest.mark.slow
def test_activation_checkpointing_runs_each_block_again_in_backward():
    depth = len(common.build_model("vit", 1, 10).blocks)
    assert probe("recompute", 2, steps=2)["block forward"] == 2 * depth
    assert probe("recompute", 2, "--checkpoint-activations", steps=2)["block forward"] == 4 * depth


@pytest.mark.slow
def test_activation_checkpointing_trains_the_same(tmp_path, references):
    out = train(tmp_path, "run", 2, "vit", "--checkpoint-activations")
    assert_same_training(out, references["vit"], "vit")


def eval_only(nproc, checkpoint):
    # Test batches of 2 x 83: 3 ranks hold 167, 166 and 166 of the 499 test samples, in 2, 1
    # and 1 batches, so the ranks with fewer run an empty one while rank 0 runs its second.
    argv = ["fsdp_train.py", *SYNTHETIC, "--model", "vit", "--batch-size", "83"]
    argv += ["--eval-only", "--resume", checkpoint]
    proc = run_python(argv) if nproc == 1 else torchrun(nproc, argv)
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("eval ")]
    loss, acc = line.split("test_loss ")[1].split(" test_acc ")
    return float(loss), float(acc.split()[0])


@pytest.mark.slow
def test_evaluation_is_exact_at_1_2_and_3_processes_and_the_export_loads_alone(sharded):
    out = sharded
    # The export, loaded into the plain model in this process, evaluated by one process.
    model = common.build_model("vit", 1, 10)
    model.load_state_dict(whole(out))
    _, test_set, _, _ = common.load_datasets("synthetic", "data")
    loader = torch.utils.data.DataLoader(test_set, 256, collate_fn=common.collate)
    loss, acc = common.evaluate(model, loader, torch.device("cpu"))
    assert read_metrics(out)[-1]["test_acc"] == acc
    assert read_metrics(out)[-1]["test_loss"] == pytest.approx(loss, abs=1e-6)
    for nproc in (1, 2, 3):
        got = eval_only(nproc, out / "checkpoint")
        assert got == pytest.approx((round(loss, 4), round(acc, 4)), abs=1.1e-4), nproc


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ddp-file", "other-model", "missing-shard", "truncated-shard"])
def test_bad_checkpoint_is_one_line_on_every_rank(tmp_path, sharded, case):
    bad = tmp_path / "checkpoint"
    shutil.copytree(sharded / "checkpoint", bad)
    model = "vit"
    if case == "ddp-file":
        bad = tmp_path / "checkpoint.pt"
        torch.save(dict(model=initial("cnn")), bad)
    elif case == "other-model":
        model = "mlp"
    elif case == "missing-shard":
        (bad / "__1_0.distcp").unlink()  # rank 1's: rank 0 could read its own part
    else:
        data = (bad / "__1_0.distcp").read_bytes()
        (bad / "__1_0.distcp").write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    argv = [*FAST, "--model", model, "--resume", bad, "--output-dir", out]
    errors = one_line_errors("fsdp_train.py", [*argv, "--batch-size", "6", "--dist-timeout", "100"])
    expected = {
        "ddp-file": "is a single-file checkpoint",
        "other-model": "holds a --model vit, not mlp",
        "missing-shard": "cannot read checkpoint",
        "truncated-shard": "cannot read checkpoint",
    }[case]
    assert expected in errors[0] and len(set(errors)) == 1, errors
    assert not out.exists() or not any(out.iterdir())  # nothing written


@pytest.mark.slow
def test_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path):
    """The second save dies after every rank wrote its shards; the rerun resumes from the
    first checkpoint. So does one that finds only checkpoint.old (a crash between the renames)."""
    out = tmp_path / "out"
    argv = [*FAST, "--model", "mlp", "--batch-size", "6", "--output-dir", out]
    argv += ["--epochs", "3", "--max-steps", "0"]
    epoch = ["--data", "synthetic"]  # 2000 samples / 12: 166 steps an epoch
    probe = ["tests/fsdp_probe.py", "crash-in-save", tmp_path]
    proc = torchrun(2, [*probe, "--", *argv, *epoch], check=False)
    assert proc.returncode != 0
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[1])["epoch"] == 1
    (out / "checkpoint").rename(out / "checkpoint.old")
    proc = torchrun(2, ["fsdp_train.py", *argv, "--max-steps", "167"])
    assert "resumed from" in proc.stdout and "at epoch 1, step 0 of 166" in proc.stdout
    assert [m["epoch"] for m in read_metrics(out)] == [0, 1]
    assert not (out / "checkpoint.old").exists() and not (out / "checkpoint.tmp").exists()


def test_refusals(no_launcher):
    with pytest.raises(SystemExit, match="--cpu-offload keeps the shards in CPU memory"):
        fsdp_train.main([*SYNTHETIC, "--cpu-offload", "--max-steps", "1"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fsdp_train, "fully_shard", None)
        with pytest.raises(SystemExit, match="needs PyTorch 2.6 or newer"):
            fsdp_train.main([*SYNTHETIC])


@pytest.mark.slow
def test_compiled_sharded_run_equals_eager_and_exports_plain_keys(tmp_path, references):
    out = train(tmp_path, "compiled", 2, "mlp", "--compile")
    assert set(whole(out)) == set(initial("mlp"))  # no "_orig_mod." prefixes
    assert_same_training(out, references["mlp"], "mlp")
