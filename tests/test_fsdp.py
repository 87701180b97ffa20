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
    torchrun_workers,
)

import checkpoint
import data
import fsdp_train
import models
import training

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
    if nproc == 1:  # DCP's save as one process, meant: without PyTorch's warning that it is
        assert "torch.distributed is disabled" not in run_python(argv).stderr
    else:
        torchrun_workers(nproc, argv)
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
    models.seed_everything(0)  # what fsdp_train.py builds first
    return models.build_model(model, 1, 10).state_dict()


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


@pytest.mark.parametrize(  # 2 processes: `sharded`
    "model, nproc", [("mlp", 3), pytest.param("vit", 3, marks=pytest.mark.slow)]
)
def test_sharded_training_equals_one_process(tmp_path, references, model, nproc):
    out = train(tmp_path, "run", nproc, model)
    assert read_metrics(out)[-1]["world_size"] == nproc
    assert_same_training(out, references[model], model)
    # metrics.jsonl's lr: the rate the last step took, the 5th of a cosine over 5 x 166 steps
    sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], 0.05 * GLOBAL_BATCH / 256)
    fifth = training.warmup_decay(sgd, 0.0, 5 * (2000 // GLOBAL_BATCH), 4).get_last_lr()[0]
    assert read_metrics(out)[-1]["lr"] == pytest.approx(fifth, rel=1e-9)


def probe(mode, nproc, *flags, steps=2):
    """tests/fsdp_probe.py MODE on the ViT at the global batch of 12: rank 0's report."""
    with tempfile.TemporaryDirectory() as reports:
        argv = ["tests/fsdp_probe.py", mode, reports, "--", *FAST, "--model", "vit", *flags]
        argv += ["--max-steps", str(steps), "--batch-size", str(GLOBAL_BATCH // nproc)]
        run_python(argv) if nproc == 1 else torchrun_workers(nproc, argv)
        return json.loads(Path(reports, "rank0.json").read_text())


@pytest.mark.slow
def test_clipping_uses_the_norm_of_the_whole_gradient():
    """Every step's gradient norm, over all shards, is the one process's, and larger than the
    clip: a rank that clipped by the norm of its own shard would scale by another factor."""
    reference = probe("clip", 1, "--clip-grad", "0.05", steps=3)["norms"]
    norms = probe("clip", 2, "--clip-grad", "0.05", steps=3)["norms"]
    assert len(norms) == 3 and min(norms) > 0.5
    assert norms == pytest.approx(reference, rel=1e-5)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    """The ViT built and sharded on 3 processes, one step: tests/fsdp_probe.py's build and
    shards reports, every rank's (one launch for the two tests below)."""
    tmp = tmp_path_factory.mktemp("fsdp_three")
    reports, _ = run_probe("build+shards", 3, tmp, "--max-steps", "1", batch=4)
    return reports, tmp


def test_each_rank_holds_a_third_of_every_parameter_and_of_the_optimizer_state(three_ranks):
    reports = {rank: report["shapes"] for rank, report in three_ranks[0].items()}
    assert sorted(reports) == [0, 1, 2]
    groups = models.param_groups(models.build_model("vit", 1, 10), 0.05)  # AdamW's order
    params = [p for group in groups for p in group["params"]]
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
    depth = len(models.build_model("vit", 1, 10).blocks)
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
    """Each block's forward runs twice a step: the second time in backward."""
    depth = len(models.build_model("vit", 1, 10).blocks)
    assert probe("recompute", 2, "--checkpoint-activations", steps=2)["block forward"] == 4 * depth


@pytest.mark.slow
def test_activation_checkpointing_trains_the_same(tmp_path, references):
    out = train(tmp_path, "run", 2, "vit", "--checkpoint-activations")
    assert_same_training(out, references["vit"], "vit")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # pytest resets the filters
def test_recomputation_leaves_batchnorm_statistics_as_one_forward_does(tmp_path, no_launcher):
    """--checkpoint-activations runs each ResNet stage's forward again in backward: its
    BatchNorms count the batch once (num_batches_tracked 1 after a step, not 2), and the
    saved model is the one of a run without it, bit for bit. In this process, one step of 4
    samples each, evaluation left out (it changes no statistics)."""
    no_launcher.setattr(fsdp_train, "evaluate", lambda *args: (0.0, 0.0))
    argv = [*SYNTHETIC, "--model", "resnet18", "--batch-size", "4", "--max-steps", "1"]
    for flags in ([], ["--checkpoint-activations"]):
        fsdp_train.main([*argv, "--output-dir", str(tmp_path / str(len(flags))), *flags])
    plain, recomputed = whole(tmp_path / "0"), whole(tmp_path / "1")
    assert recomputed["layer1.0.bn1.num_batches_tracked"] == 1
    assert plain.keys() == recomputed.keys()
    differ = [k for k in plain if not torch.equal(plain[k], recomputed[k])]
    assert not differ, differ


def eval_only(nproc, checkpoint):
    # Test batches of 2 x 83: 3 ranks hold 167, 166 and 166 of the 499 test samples, in 2, 1
    # and 1 batches, so the ranks with fewer run an empty one while rank 0 runs its second.
    argv = ["fsdp_train.py", *SYNTHETIC, "--model", "vit", "--batch-size", "83"]
    argv += ["--eval-only", "--resume", checkpoint]
    proc = run_python(argv) if nproc == 1 else torchrun_workers(nproc, argv)
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("eval ")]
    loss, acc = line.split("test_loss ")[1].split(" test_acc ")
    return float(loss), float(acc.split()[0])


@pytest.mark.slow
def test_evaluation_is_exact_at_1_2_and_3_processes_and_the_export_loads_alone(sharded):
    out = sharded
    # The export, loaded into the plain model in this process, evaluated by one process.
    model = models.build_model("vit", 1, 10)
    model.load_state_dict(whole(out))
    _, test_set, _, _ = data.load_datasets("synthetic", "data")
    loader = torch.utils.data.DataLoader(test_set, 256, collate_fn=data.collate)
    loss, acc = training.evaluate(model, loader, torch.device("cpu"))
    assert read_metrics(out)[-1]["test_acc"] == acc  # the 2 processes' evaluation
    assert read_metrics(out)[-1]["test_loss"] == pytest.approx(loss, abs=1e-6)
    for nproc in (1, 3):  # --eval-only of the 2 processes' checkpoint
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
    # 2000 samples / 200 a global batch: 10 steps an epoch (at --batch-size 6, 166 steps an
    # epoch took most of the test's time; two epochs of any length make the point).
    argv = [*FAST, "--model", "mlp", "--batch-size", "100", "--output-dir", out]
    argv += ["--epochs", "3", "--max-steps", "0"]
    probe = ["tests/fsdp_probe.py", "crash-in-save", tmp_path]
    proc = torchrun(2, [*probe, "--", *argv], check=False)
    assert proc.returncode != 0
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[1])["epoch"] == 1
    (out / "checkpoint").rename(out / "checkpoint.old")
    proc = torchrun_workers(2, ["fsdp_train.py", *argv, "--max-steps", "11"])
    assert "resumed from" in proc.stdout and "at epoch 1, step 0 of 10" in proc.stdout
    assert [m["epoch"] for m in read_metrics(out)] == [0, 1]
    assert not (out / "checkpoint.old").exists() and not (out / "checkpoint.tmp").exists()


def test_refusals(no_launcher):
    with pytest.raises(SystemExit, match="--cpu-offload keeps the shards in CPU memory"):
        fsdp_train.main([*SYNTHETIC, "--cpu-offload", "--max-steps", "1"])
    # A mesh that does not fit the processes: every rank stops before any collective.
    with pytest.raises(SystemExit, match="--replicate 2 does not divide the 1 processes"):
        fsdp_train.main([*SYNTHETIC, "--replicate", "2"])
    with pytest.raises(SystemExit, match="recomputes blocks; --model mlp has none"):
        fsdp_train.get_args(["--model", "mlp", "--checkpoint-activations"])
    with pytest.raises(SystemExit, match="need --output-dir"):
        fsdp_train.get_args(["--async-save"])


@pytest.mark.slow
def test_compiled_sharded_run_equals_eager_and_exports_plain_keys(tmp_path, references):
    out = train(tmp_path, "compiled", 2, "mlp", "--compile")
    assert set(whole(out)) == set(initial("mlp"))  # no "_orig_mod." prefixes
    assert_same_training(out, references["mlp"], "mlp")


# Built on no device whole, --init-from, --accum-steps, --replicate (HSDP), --save-every with
# --async-save, bf16 with BatchNorm, the order across epochs.
def run_probe(mode, nproc, tmp, *flags, model="vit", batch=None):
    """tests/fsdp_probe.py MODE with fsdp_train.py on nproc processes (FAST: 5 steps at the
    global batch of 12 unless `batch` per process is given), its output in TMP/out; returns
    every rank's report by rank and the output directory."""
    reports, out = tmp / "reports", tmp / "out"
    reports.mkdir(parents=True)
    argv = ["tests/fsdp_probe.py", mode, reports, "--", *FAST, "--model", model, *flags]
    argv += ["--batch-size", str(batch or GLOBAL_BATCH // nproc), "--output-dir", out]
    run_python(argv) if nproc == 1 else torchrun_workers(nproc, argv)
    found = [json.loads(p.read_text()) for p in reports.glob("rank*.json")]
    return {r["rank"]: r for r in found}, out


def test_no_rank_holds_the_whole_model_and_the_shards_start_as_one_process(three_ranks):
    """Every unit fully_shard gets is still on the meta device (no memory), on a CPU mesh, and
    the weights gathered right after the build are one process's seeded ones, exactly."""
    reports, tmp = three_ranks
    depth = len(models.build_model("vit", 1, 10).blocks)
    assert sorted(reports) == [0, 1, 2]
    for report in reports.values():
        assert report["meta"] == [True] * (depth + 1)  # the blocks, then the root
        assert report["mesh"] == ["cpu"] * (depth + 1)
    built = torch.load(tmp / "reports/initial.pt", weights_only=True)
    assert_state_close(built, initial("vit"), atol=0)


def weights_file(path, model, wrapped):
    """A state dict of `model` with values no seed gives (running variances positive), saved
    plain or as the 'model' of a checkpoint of these scripts."""
    state = {}
    for k, v in models.build_model(model, 1, 10).state_dict().items():
        state[k] = torch.randint_like(v, 1, 5) if not v.is_floating_point() else torch.rand_like(v)
    torch.save(dict(model=state, epoch=3) if wrapped else state, path)
    return state


INIT_CASES = [(1, "mlp", False), (2, "cnn", False)]
INIT_CASES.append(pytest.param(3, "vit", True, marks=pytest.mark.slow))


@pytest.mark.parametrize("nproc, model, wrapped", INIT_CASES)
def test_init_from_fills_the_shards_with_the_files_weights(tmp_path, nproc, model, wrapped):
    state = weights_file(tmp_path / "weights.pt", model, wrapped)
    flags = ["--init-from", tmp_path / "weights.pt", "--max-steps", "1"]
    run_probe("build", nproc, tmp_path, *flags, model=model)
    assert_state_close(
        torch.load(tmp_path / "reports/initial.pt", weights_only=True), state, atol=0
    )


def test_init_from_a_file_that_does_not_fit_is_one_line_on_every_rank(tmp_path):
    weights_file(tmp_path / "mlp.pt", "mlp", wrapped=False)
    out = tmp_path / "out"
    argv = [*FAST, "--model", "vit", "--init-from", tmp_path / "mlp.pt", "--output-dir", out]
    errors = one_line_errors("fsdp_train.py", [*argv, "--batch-size", "6"])
    assert (
        len(set(errors)) == 1 and "does not fit this model: the model has no '1.bias'" in errors[0]
    )
    assert not out.exists() or not any(out.iterdir())  # nothing written
    state = models.build_model("vit", 1, 10).state_dict()
    state["head.weight"] = state["head.weight"][:5]
    with pytest.raises(SystemExit, match=r"'head.weight' is \(5, 96\) in the file, \(10, 96\)"):
        checkpoint.check_weights(state, models.build_model("vit", 1, 10), "f.pt")


@pytest.mark.slow
def test_accumulation_reduce_scatters_once_per_step_and_equals_the_whole_batch(tmp_path):
    """2 micro-batches of 3 per rank at 2 processes: one step on 12, as one process takes it
    (gradient norms before clipping, weights), and one reduce-scatter per unit and step, not
    per micro-batch. The norms see a gradient summed over micro-batches instead of averaged,
    which AdamW's steps, scale-free, would not show."""
    clip = ["--clip-grad", "0.05"]
    one, one_out = run_probe("clip", 1, tmp_path / "1", *clip)
    seen, out = run_probe(
        "collectives+clip", 2, tmp_path / "2", *clip, "--accum-steps", "2", batch=3
    )
    depth = len(models.build_model("vit", 1, 10).blocks)
    assert seen[0]["reduce_scatter backward float32"] == 5 * (depth + 1)
    assert min(one[0]["norms"]) > 0.5  # clipping acts at every step
    assert seen[0]["norms"] == pytest.approx(one[0]["norms"], rel=1e-5)
    assert_same_training(out, one_out, "vit")


@pytest.mark.slow
def test_hsdp_2_by_2_trains_as_one_process_and_each_rank_holds_half(tmp_path, references):
    """4 processes as 2 replicas of 2 shards: each rank holds its replica's half of every
    parameter and of both AdamW moments, and the steps are one process's."""
    seen, out = run_probe("shards", 4, tmp_path, "--replicate", "2")
    groups = models.param_groups(models.build_model("vit", 1, 10), 0.05)  # AdamW's order
    params = [p for group in groups for p in group["params"]]
    assert sorted(seen) == [0, 1, 2, 3]
    for rank, report in seen.items():
        for p, (shape, local, state) in zip(params, report["shapes"], strict=True):
            pieces = torch.arange(p.shape[0]).chunk(2)  # ranks 0, 1 and 2, 3: one replica each
            rows = len(pieces[rank % 2]) if rank % 2 < len(pieces) else 0
            assert shape == list(p.shape) and local == [rows, *p.shape[1:]], rank
            assert state == [local, local]
    assert_same_training(out, references["vit"], "vit")


@pytest.mark.slow
def test_resume_at_other_numbers_of_processes_and_with_hsdp_is_exact(tmp_path, references):
    """FSDP on 2 processes stops after 2 of 5 steps, HSDP 2 x 2 goes on from its shards,
    mid-epoch, to step 4, FSDP on 3 processes does the last: the weights of the uninterrupted
    run (FSDP and HSDP checkpoints resume each other at any number of processes)."""
    out = tmp_path / "run"
    argv = ["fsdp_train.py", *FAST, "--model", "vit", "--output-dir", out]
    torchrun_workers(2, [*argv, "--batch-size", "6", "--max-steps", "2"])
    proc = torchrun_workers(4, [*argv, "--batch-size", "3", "--replicate", "2", "--max-steps", "4"])
    assert "resumed from" in proc.stdout and "at epoch 0, step 2 of" in proc.stdout, proc.stdout
    proc = torchrun_workers(3, [*argv, "--batch-size", "4"])
    assert "at epoch 0, step 4 of" in proc.stdout, proc.stdout
    assert_same_training(out, references["vit"], "vit", resumed=True)


def test_the_async_saves_gloo_group_ends_a_lost_peer_within_dist_timeout(tmp_path):
    """--async-save's own gloo group gets --dist-timeout (gloo's default: 30 minutes, during
    which a background save would wait for a dead peer)."""
    argv = ["tests/fsdp_probe.py", "groups", tmp_path, "--", *FAST, "--model", "mlp"]
    argv += ["--async-save", "--max-steps", "1", "--batch-size", "6"]
    torchrun_workers(2, [*argv, "--output-dir", tmp_path / "out"])
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["group_timeouts"] == [60.0], report  # FAST's --dist-timeout


@pytest.mark.slow
def test_a_crash_during_an_async_save_leaves_the_last_one_and_resume_is_exact(tmp_path):
    """--save-every 2 --async-save: the save at step 4 dies mid-write, after the one at step 2
    was published. Also left behind: a checkpoint.old half removed (a save killed there). The
    rerun resumes at step 2 mid-epoch, saves again, and ends as the uninterrupted run."""
    flags = ["--model", "mlp", "--save-every", "2", "--async-save"]
    reference = train(tmp_path, "reference", 2, "mlp", "--save-every", "2", "--async-save")
    proc_flags = [*flags, "--batch-size", "6"]
    reports, out = tmp_path / "reports", tmp_path / "out"
    reports.mkdir()
    argv = ["tests/fsdp_probe.py", "crash-in-async-save", reports, "--", *FAST, *proc_flags]
    assert torchrun(2, [*argv, "--output-dir", out], check=False).returncode != 0
    assert torch.load(out / "checkpoint/meta.pt", weights_only=True)["step"] == 2
    (out / "checkpoint.old").mkdir()
    (out / "checkpoint.old/__0_0.distcp").write_bytes(b"half removed")
    proc = torchrun_workers(2, ["fsdp_train.py", *FAST, *proc_flags, "--output-dir", out])
    assert "at epoch 0, step 2 of" in proc.stdout, proc.stdout
    assert torch.load(out / "checkpoint/meta.pt", weights_only=True)["step"] == 5
    assert not (out / "checkpoint.old").exists() and not (out / "checkpoint.tmp").exists()
    assert_same_training(out, reference, "mlp", resumed=True)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["cnn", "resnet18"])
def test_bf16_trains_every_model_with_batchnorm(tmp_path, model):
    """--amp bf16 on the models with BatchNorm (its own fp32 unit): the first step's loss is
    the fp32 loss of the same weights on the same batch, to bf16's precision. The evaluation
    runs in bf16 too, on 24 test samples (all 499 took 80% of the ResNet's run)."""
    _, out = run_probe("short-test", 2, tmp_path, "--amp", "bf16", "--max-steps", "1", model=model)
    torch.manual_seed(0)
    net = models.build_model(model, 1, 10).train()
    train_set, _, _, _ = data.load_datasets("synthetic", "data")
    sampler = torch.utils.data.DistributedSampler(train_set, 1, 0, seed=0, drop_last=True)
    images, labels = data.collate([train_set[i] for i in list(sampler)[:GLOBAL_BATCH]])
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(net(images), labels, label_smoothing=0.1)
    assert read_metrics(out)[-1]["train_loss"] == pytest.approx(loss.item(), abs=2e-2)


@pytest.mark.slow
def test_each_epoch_takes_a_new_order_and_the_global_batches_of_one_process(tmp_path):
    """The MLP over 2 epochs of 5 steps (global batch 400): every epoch a new permutation,
    and each step's samples over both ranks those of one process's step; its losses, weights."""
    flags = ["--max-steps", "0", "--epochs", "2", "--log-every", "5", "--lr", "0.003"]
    one, one_out = run_probe("order", 1, tmp_path / "1", *flags, model="mlp", batch=400)
    two, two_out = run_probe("order", 2, tmp_path / "2", *flags, model="mlp", batch=200)
    orders = one[0]["order"]
    assert len(orders) == 2 and orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1])
    for epoch, order in enumerate(orders):
        for step in range(5):
            pieces = [two[r]["order"][epoch][step * 200 : (step + 1) * 200] for r in (0, 1)]
            assert sorted(sum(pieces, [])) == sorted(order[step * 400 : (step + 1) * 400])
    losses = [[m["train_loss"] for m in read_metrics(out)] for out in (one_out, two_out)]
    assert len(losses[0]) == 2 and losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert_same_training(two_out, one_out, "mlp")


@pytest.mark.slow
def test_memory_benchmark_counts_the_shards_and_measures_each_rank(tmp_path):
    """benchmarks/fsdp_memory.py in a small form: DDP's ranks each hold the weights, their
    gradients and two AdamW moments whole, FSDP's half of each; every rank measured a peak."""
    small = ["--worlds", "2", "--dim", "64", "--depth", "2", "--heads", "2", "--steps", "1"]
    report = tmp_path / "rows.json"
    run_python(["benchmarks/fsdp_memory.py", *small, "--layouts", "ddp", "fsdp", "--json", report])
    rows = {r["layout"]: r for r in json.loads(report.read_text())}
    whole = 4 * 4 * rows["ddp"]["n_params"]  # fp32 weights, gradients, exp_avg, exp_avg_sq
    assert sum(rows["ddp"][k] for k in ("params", "grads", "optimizer")) == whole
    vit = models.ViT(1, 10, 28, dim=64, depth=2, heads=2)
    rank0 = sum(len(torch.arange(p.shape[0]).chunk(2)[0]) * p[0].numel() for p in vit.parameters())
    assert sum(rows["fsdp"][k] for k in ("params", "grads", "optimizer")) == 4 * 4 * rank0
    assert all(r["peak_kb"] > 0 and r["build_kb"] >= 0 for r in rows["fsdp"]["ranks"])


@pytest.mark.slow
def test_a_checkpoint_of_other_heads_or_depth_is_one_line(tmp_path):
    """--heads does not show in the weights' shapes, so resume checks it apart: a checkpoint
    of 2 heads resumed with 4 is one line, no traceback (it would train on, silently)."""
    out = tmp_path / "out"
    flags = [*SYNTHETIC, "--model", "vit", "--max-steps", "1"]
    run_python(["fsdp_train.py", *flags, "--heads", "2", "--output-dir", out])
    proc = run_python(["fsdp_train.py", *flags, "--heads", "4", "--output-dir", out], check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line == f"error: checkpoint {out / 'checkpoint'} holds a --heads 2, not 4", line
    # --depth too: its own line, before the names and shapes are compared
    proc = run_python(
        ["fsdp_train.py", *flags, "--heads", "2", "--depth", "3", "--output-dir", out], check=False
    )
    line = proc.stderr.strip().splitlines()[-1]
    assert line == f"error: checkpoint {out / 'checkpoint'} holds a --depth 4, not 3", line
