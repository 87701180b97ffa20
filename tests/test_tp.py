"""tensor_parallel.py: TP 2 (with and without sequence parallelism) and 2-D (2 x 2) against
one unsplit process on the same global batch, across an epoch boundary (epoch 1's order is a
new one, the same at every layout), what each rank holds, resume at another degree, exact
evaluation, the single-file export and bad input. All on CPU with gloo."""

import functools
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    DIST_TIMEOUT,
    METRIC_KEYS,
    SYNTHETIC,
    docstring_launches_reach_the_mesh,
    last_json,
    one_line_errors,
    read_metrics,
    run_python,
    torchrun_workers,
)
from torch.utils.data import DistributedSampler

import common
import data
import models
import tensor_parallel
import training

GLOBAL_BATCH = 12  # 1 x 12; TP 2: one group of 12; 2 x 2: two groups of 6
# The probe cuts the training set to TRAIN samples: 2 steps an epoch, so that STEPS steps
# run two epochs, with an evaluation and a checkpoint between them.
TRAIN, STEPS = 24, 4
STEPS_PER_EPOCH = TRAIN // GLOBAL_BATCH
# AdamW steps that move the weights far beyond the tolerances, with clipping at work
# (the gradient norms are above 0.5) so that the global norm is checked as well.
FAST = [*SYNTHETIC, "--warmup", "0", "--lr", "0.5", "--clip-grad", "0.05", *DIST_TIMEOUT]


def probe_argv(reports, *flags, dp=1):
    """tests/tp_probe.py's command line: STEPS steps on TRAIN samples, into REPORTS/out."""
    argv = ["tests/tp_probe.py", reports, TRAIN, "--", *FAST, "--max-steps", STEPS]
    argv += ["--batch-size", GLOBAL_BATCH // dp, "--dp", dp, "--output-dir", Path(reports, "out")]
    return argv + list(flags)


def probe(nproc, reports, *flags, dp=1):
    """tests/tp_probe.py on nproc processes (one: a plain `python`, unsplit): rank 0's report
    and the output directory."""
    argv = probe_argv(reports, *flags, dp=dp)
    run_python(argv) if nproc == 1 else torchrun_workers(nproc, argv)
    return torch.load(Path(reports, "rank0.pt"), weights_only=False), Path(reports, "out")


@functools.cache
def train_labels():
    return data.load_datasets("synthetic", "data")[0].labels[:TRAIN]


def sampler_labels(step):
    """The labels of one process's batch at `step` (global batch 12) in DistributedSampler's
    order for the step's epoch: the order a single process takes, written down here."""
    labels = train_labels()
    sampler = DistributedSampler(range(TRAIN), 1, 0, seed=0, drop_last=True)
    epoch, at = divmod(step, STEPS_PER_EPOCH)
    sampler.set_epoch(epoch)
    return labels[list(sampler)[at * GLOBAL_BATCH : (at + 1) * GLOBAL_BATCH]]


def whole(out):
    return torch.load(out / "model.pt", map_location="cpu", weights_only=True)


def initial():
    models.seed_everything(0)  # what tensor_parallel.py builds first
    return models.ViT(1, 10, 28).state_dict()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One unsplit process, batch 12, STEPS steps."""
    return probe(1, tmp_path_factory.mktemp("tp_reference"))


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """TP 2 (2 processes, one batch of 12): a checkpoint in two processes' pieces."""
    tmp = tmp_path_factory.mktemp("tp2")
    return probe(2, tmp, "--export", tmp / "exported.pt")


def assert_same_steps(got, reference, dp=1):
    """Step by step: rank 0's logits and loss (under 2-D: of its half of the global batch, the
    even samples) and every parameter's whole gradient; then the weights saved at the end.
    Gradients and weights as whole tensors: the difference at most 1e-4 of the norm (Adam's
    division by the root of tiny squared gradients turns rounding into visible steps). Across
    the epoch boundary: epoch 1 takes a new order (every epoch repeating epoch 0's would not
    show in the weights against a reference that repeats it as well), the sampler's."""
    (seen, out), (ref, ref_out) = got, reference
    assert len(seen["losses"]) == len(ref["losses"]) == STEPS
    into_epoch_1 = STEPS - STEPS_PER_EPOCH
    epoch_0, epoch_1 = ref["labels"][:into_epoch_1], ref["labels"][STEPS_PER_EPOCH:]
    assert not torch.equal(torch.cat(epoch_1), torch.cat(epoch_0))
    for step in range(STEPS):
        assert torch.equal(ref["labels"][step], sampler_labels(step)), step
        logits, labels = ref["logits"][step][::dp], ref["labels"][step][::dp]
        assert torch.equal(seen["labels"][step], labels), step  # the same samples
        # Rounding that the steps amplify (--lr 0.5): 1.9e-5 at the 4th step here, 4e-6 with
        # another draw of the same initial distributions.
        torch.testing.assert_close(seen["logits"][step], logits, atol=3e-5, rtol=1e-4)
        loss = F.cross_entropy(logits, labels, label_smoothing=0.1).item()
        assert seen["losses"][step] == pytest.approx(loss, abs=1e-5), step
        grads, ref_grads = seen["grads"][step], ref["grads"][step]
        assert grads.keys() == ref_grads.keys()
        for name, g in ref_grads.items():
            assert g.norm() > 0, name  # the test can fail: every tensor has a gradient
            assert (grads[name] - g).norm() <= 1e-4 * g.norm(), (step, name)
    assert seen["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    # The evaluation after each epoch (2 x 2: each data-parallel group half of the test set).
    metrics, ref_metrics = read_metrics(out), read_metrics(ref_out)
    assert (
        [m["step"] for m in metrics] == [m["step"] for m in ref_metrics] == [STEPS_PER_EPOCH, STEPS]
    )
    for m, ref_m in zip(metrics, ref_metrics, strict=True):
        assert m["test_loss"] == pytest.approx(ref_m["test_loss"], abs=1e-4)
        assert m["test_acc"] == pytest.approx(ref_m["test_acc"], abs=1.1 / 499)
    assert min(ref["norms"]) > 0.5  # above --clip-grad: clipping scaled every step
    a, b, start = whole(out), whole(ref_out), initial()
    assert a.keys() == b.keys() == start.keys()
    for key in b:
        update = (b[key] - start[key]).norm()
        assert update > 1e-3, key  # the steps moved every tensor, well beyond the tolerance
        assert (a[key] - b[key]).norm() < 1e-3 * update, key


def test_tp2_takes_the_steps_of_one_process(tp2, reference):
    assert_same_steps(tp2, reference)
    seen, out = tp2
    assert seen["fused"] is True  # AdamW: one kernel for the DTensors, one for the rest
    assert read_metrics(out)[-1].keys() >= METRIC_KEYS | {"step", "world_size"}
    exported = torch.load(out.parent / "exported.pt", weights_only=True)
    assert exported.keys() == whole(out).keys()
    assert all(torch.equal(exported[k], whole(out)[k]) for k in exported)  # --export: the same


@pytest.mark.slow
def test_sequence_parallel_takes_the_steps_of_one_process(tmp_path, reference):
    assert_same_steps(probe(2, tmp_path, "--sequence-parallel"), reference)


@pytest.mark.slow
def test_2d_takes_the_steps_of_one_process_and_holds_its_part(tmp_path, reference):
    """2 x 2 against one process; and FSDP cuts each rank's TP piece again, by rows, over the
    two data-parallel groups, and every other tensor by rows in two."""
    run = probe(4, tmp_path, dp=2)
    assert_same_steps(run, reference, dp=2)
    for name, full, local, state in run[0]["shapes"]:
        expected = list(full)
        if split(name) is not None:
            expected[split(name)] //= 2
        expected[0] = -(-expected[0] // 2)  # rank 0: the first of two rows' chunks
        assert local == expected and state == [local, local], name


COUNT = """
import json, sys, torch, torch.distributed as dist
import common, models, tensor_parallel as tp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module
dist.init_process_group("gloo")
mesh, counts = init_device_mesh("cpu", (2,)), {}
for sp in (False, True):
    torch.manual_seed(0)
    model = models.ViT(1, 10, 28, depth=2)
    for block in model.blocks:
        parallelize_module(block, mesh, tp.block_plan(sp))
    if sp:
        cut, join = tp.move(tp.Replicate(), tp.Shard(1)), tp.move(tp.Shard(1), tp.Replicate())
        parallelize_module(model, mesh, {"blocks.0": cut, "norm": join})
    with CommDebugMode() as forward:
        loss = model(torch.randn(4, 1, 28, 28)).sum()
    with CommDebugMode() as backward:
        loss.backward()
    for phase, mode in (("forward", forward), ("backward", backward)):
        for op, n in mode.get_comm_counts().items():
            counts[f"{'sp' if sp else 'tp'} {phase} {str(op).split('.')[-1]}"] = n
if dist.get_rank() == 0:
    print(json.dumps(counts))
common.cleanup()  # also the mesh's groups (see common.cleanup)
"""


@pytest.mark.slow
def test_each_pair_of_split_layers_costs_one_collective_each_way():
    """Per block (2 here), TP 2: an all-reduce per pair in forward (of the outputs) and one in
    backward (of the input's gradient; q, k and v share their input). Sequence parallelism:
    instead, an all-gather before each pair and a reduce-scatter after it, and the other way
    round in backward; plus the first block's cut by token and the final norm's join."""
    proc = torchrun_workers(2, ["-c", COUNT])  # torchrun's 2 workers, forked
    counts = last_json(proc.stdout)
    assert counts == {
        "tp forward all_reduce": 4,
        "tp backward all_reduce": 4,
        "sp forward all_gather_into_tensor": 5,
        "sp forward reduce_scatter_tensor": 4,
        "sp backward all_gather_into_tensor": 5,
        "sp backward reduce_scatter_tensor": 4,
    }


def split(name):
    """How TP splits a block's parameter: the dimension cut, or None (whole)."""
    columns = ("attn.q.", "attn.k.", "attn.v.", "mlp.fc1.")
    if name.startswith("blocks.") and any(c in name for c in columns):
        return 0  # output features: the weight's rows and the bias
    if name.startswith("blocks.") and name.endswith(("attn.proj.weight", "mlp.fc2.weight")):
        return 1  # input features
    return None


@pytest.mark.slow
def test_each_rank_holds_its_part_of_every_split_weight(tp2):
    """TP 2: each rank holds half of every split weight (and of its AdamW state), the rest
    whole: 9 of the 17 tensors of each block are split (the row-split layers' biases are not)."""
    seen, _ = tp2
    assert len(seen["shapes"]) == len(initial())
    halves = 0
    for name, full, local, state in seen["shapes"]:
        expected = list(full)
        if split(name) is not None:
            expected[split(name)] //= 2
            halves += 1
        assert local == expected and state == [local, local], name
    assert halves == 9 * len(models.ViT(1, 10, 28).blocks)


@pytest.mark.slow
def test_resume_at_another_degree_ends_where_one_run_ends(tmp_path, reference):
    """TP 2 stops after 3 of 4 steps, in epoch 1; 2 x 2 goes on from its pieces with epoch 1's
    next batch (its order, its position) and ends with the uninterrupted process's weights."""
    torchrun_workers(2, probe_argv(tmp_path, "--max-steps", STEPS - 1))
    proc = torchrun_workers(4, probe_argv(tmp_path, dp=2))
    assert f"at epoch 1, step 1 of {STEPS_PER_EPOCH}" in proc.stdout, proc.stdout
    seen, ref = torch.load(tmp_path / "rank0.pt", weights_only=False), reference[0]
    assert len(seen["labels"]) == 1 and torch.equal(seen["labels"][0], ref["labels"][-1][::2])
    a, b = whole(tmp_path / "out"), whole(reference[1])
    for key, start in initial().items():
        assert (a[key] - b[key]).norm() < 1e-3 * (b[key] - start).norm(), key


def eval_only(nproc, checkpoint, *flags):
    # Test batches of 2 x 83: under --dp 3 the groups hold 167, 166 and 166 of the 499 test
    # samples, in 2, 1 and 1 batches: the groups with fewer run an empty one.
    argv = ["tensor_parallel.py", *SYNTHETIC, "--batch-size", "83", *flags]
    argv += ["--eval-only", "--resume", checkpoint]
    proc = run_python(argv) if nproc == 1 else torchrun_workers(nproc, argv)
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("eval ")]
    loss, acc = line.split("test_loss ")[1].split(" test_acc ")
    return float(loss), float(acc.split()[0])


@pytest.mark.slow
def test_evaluation_is_exact_at_every_degree_and_the_export_loads_alone(tp2):
    _, out = tp2
    model = models.ViT(1, 10, 28)
    model.load_state_dict(whole(out))
    _, test_set, _, _ = data.load_datasets("synthetic", "data")
    loader = torch.utils.data.DataLoader(test_set, 256, collate_fn=data.collate)
    loss, acc = training.evaluate(model, loader, torch.device("cpu"))
    assert read_metrics(out)[-1]["test_acc"] == acc
    assert read_metrics(out)[-1]["test_loss"] == pytest.approx(loss, abs=1e-6)
    expected = pytest.approx((round(loss, 4), round(acc, 4)), abs=1.1e-4)
    for nproc, flags in [(2, ["--sequence-parallel"]), (3, ["--dp", "3"])]:
        assert eval_only(nproc, out / "checkpoint", *flags) == expected, (nproc, flags)


@pytest.mark.slow
def test_sequence_parallel_over_uneven_tokens_is_one_line_on_every_rank():
    argv = [*FAST, "--heads", "6", "--sequence-parallel", "--dist-timeout", "100"]
    errors = one_line_errors("tensor_parallel.py", argv, world=3)
    assert all("TP degree 3 must divide the 16 tokens" in e for e in errors), errors


@pytest.mark.parametrize(
    "flags, world, expected",
    [
        (["--heads", "3"], 2, "TP degree 2 must divide the 3 heads"),
        (["--tp", "2"], 3, "--dp 1 x --tp 2 makes a mesh of 2 processes; 3 started"),
        (["--dp", "2"], 3, "--dp 2 x --tp 1 makes a mesh of 2 processes; 3 started"),
    ],
)
def test_impossible_mesh_is_refused_before_any_collective(no_launcher, flags, world, expected):
    """Checked by every rank alike before the mesh is made, so one pretended rank shows it."""
    info = common.DistInfo(True, 0, 0, world, world, torch.device("cpu"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tensor_parallel, "init_distributed_mode", lambda **_: info)
        patch.setattr(tensor_parallel, "init_device_mesh", None)  # reached: a TypeError
        with pytest.raises(SystemExit, match=expected):
            tensor_parallel.main([*FAST, *flags])


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_one_line_on_every_rank(tmp_path, tp2):
    """Asked of a checkpoint it does not fit. (A single-file checkpoint and a missing piece are
    checkpoint.find_checkpoint's checks, the same for the sharded scripts: test_fsdp.py.)"""
    out = tmp_path / "out"
    argv = [*FAST, "--dim", "64", "--resume", tp2[1] / "checkpoint", "--output-dir", out]
    argv += ["--batch-size", "12", "--dist-timeout", "100"]
    errors = one_line_errors("tensor_parallel.py", argv)
    assert "'blocks.0.attn.k.weight' is (96, 96) in the file, (64, 64)" in errors[0], errors
    assert len(set(errors)) == 1, errors  # the same line on every rank
    assert not out.exists() or not any(out.iterdir())  # nothing written


def test_docstring_launches_make_a_valid_mesh(no_launcher, monkeypatch):
    """Every torchrun command in the docstring passes the mesh and heads checks at its number
    of processes."""
    assert docstring_launches_reach_the_mesh(tensor_parallel, monkeypatch) == [2, 2, 4, 16]


def test_refusals(no_launcher):
    with pytest.raises(SystemExit, match="--dim 96 is not a whole number of --heads 5"):
        tensor_parallel.get_args(["--heads", "5"])
    with pytest.raises(SystemExit, match="--dp must be at least 1"):
        tensor_parallel.get_args(["--dp", "0"])


@pytest.mark.slow
def test_an_fsdp_checkpoint_of_the_vit_evaluates_the_same_under_tensor_parallelism(tmp_path):
    """fsdp_train.py's ViT shards (2 processes) read by TP 2: the same keys, other pieces."""
    out = tmp_path / "fsdp"
    argv = [*SYNTHETIC, "--batch-size", "83", "--max-steps", "2", "--output-dir", out]
    torchrun_workers(2, ["fsdp_train.py", *argv])
    last = read_metrics(out)[-1]
    expected = pytest.approx((last["test_loss"], last["test_acc"]), abs=1.1e-4)
    assert eval_only(2, out / "checkpoint") == expected


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_warmup_decay_rises_to_the_peak_then_decays_to_zero(decay):
    """The schedule the sharded scripts share (--decay), at 10 steps, warm-up 0.2: after the
    peak, a cosine or a straight line to zero (a step after the last)."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = training.warmup_decay(optimizer, 0.2, 10, decay=decay)
    rates = []
    for _ in range(11):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert rates[:3] == pytest.approx([0.5, 1.0, 1.0])  # 2 warm-up steps, then the peak
    done = [k / 8 for k in range(9)]  # steps 2..10: the fraction of the decay done
    shape = [1 - d if decay == "linear" else 0.5 * (1 + math.cos(math.pi * d)) for d in done]
    assert rates[2:] == pytest.approx(shape, abs=1e-12) and rates[-1] == 0


FUSED = """
import json, torch, torch.distributed as dist, torch.nn as nn
import common, models, training
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
dist.init_process_group("gloo")
mesh, calls, real = init_device_mesh("cpu", (2,)), [], torch._fused_adamw_
torch._fused_adamw_ = lambda params, *a, **k: (calls.append(len(params)), real(params, *a, **k))
def build():  # a split pair (DTensors) and a whole norm (plain), as TP leaves them
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8))
one, split = build(), build()  # each TP-split: the same sums, only the optimizer differs
for model in (one, split):
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
ref = torch.optim.AdamW(models.param_groups(one, 0.1), 0.1, foreach=False)  # tensor by tensor
fused = training.fused_adamw(models.param_groups(split, 0.1), 0.1, (0.9, 0.999))
for step in range(3):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    for model, optimizer in ((one, ref), (split, fused)):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        optimizer.param_groups[1]["lr"] = 0.05 / (step + 1)  # as a schedule sets it
whole = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
pairs = zip(split.parameters(), one.parameters())
worst = max((whole(p) - whole(q)).abs().max().item() for p, q in pairs)
groups = [len(g["params"]) for g in fused.state_dict()["param_groups"]]
if dist.get_rank() == 0:
    print(json.dumps(dict(worst=worst, calls=calls, groups=groups)))
common.cleanup()
"""


def test_fused_adamw_steps_each_kind_in_one_call_and_keeps_the_groups():
    """training.fused_adamw over a split pair (DTensors) and a whole norm (plain tensors): one
    fused call per group and kind (3 a step: decayed DTensors; undecayed DTensors; undecayed
    plain), the steps of torch's AdamW tensor by tensor on the same split model, a rate set
    between steps obeyed, and param_groups' two groups as saved."""
    out = last_json(torchrun_workers(2, ["-c", FUSED]).stdout)
    assert out["calls"] == [2, 2, 2] * 3, out  # weights; biases; the norm's weight and bias
    assert out["groups"] == [2, 4], out
    assert out["worst"] < 1e-5, out  # fused and per-tensor round alike to a few ulps
