"""context_parallel.py: CP 2 and 2-D (2 x 2) against one process on the same global batch for
both ways of attending (ring and all-gather), the ring against the all-gather, the sends and
collectives per attention layer, the activations each process saves, resume at another
degree, exact evaluation, the export, bad input and the benchmark. All on CPU with gloo."""

import json
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

import common
import context_parallel
import data
import models
import training

GLOBAL_BATCH = 12  # 1 x 12; CP 2: one group of 12; 2 x 2: two groups of 6
STEPS = 4
TRAIN = 24  # the resume test's training set: 2 steps an epoch, STEPS steps cross into epoch 1
# AdamW steps that move the weights far beyond the tolerances, with clipping at work
# (the gradient norms are above 0.5) so that the global norm is checked as well.
FAST = [*SYNTHETIC, "--model", "vit", "--warmup", "0", "--lr", "0.5", "--clip-grad", "0.05"]
FAST += DIST_TIMEOUT


def probe_argv(reports, *flags, dp=1, train=()):
    """tests/cp_probe.py's command line: STEPS steps (on the first `train` samples, if given),
    into REPORTS/out."""
    argv = ["tests/cp_probe.py", reports, *train, "--", *FAST, "--max-steps", STEPS]
    argv += ["--batch-size", GLOBAL_BATCH // dp, "--dp", dp, "--output-dir", Path(reports, "out")]
    return argv + list(flags)


def probe(nproc, reports, *flags, dp=1, train=()):
    """tests/cp_probe.py on nproc processes (one: a plain `python`, unsplit): rank 0's report
    and the output directory."""
    argv = probe_argv(reports, *flags, dp=dp, train=train)
    run_python(argv) if nproc == 1 else torchrun_workers(nproc, argv)
    return torch.load(Path(reports, "rank0.pt"), weights_only=False), Path(reports, "out")


def whole(out):
    return torch.load(out / "model.pt", map_location="cpu", weights_only=True)


def long_vit():
    return models.ViT(1, 10, 28, patch=(1, 28))  # each row a token, as context_parallel.py


def initial():
    models.seed_everything(0)  # what context_parallel.py builds first
    return long_vit().state_dict()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, batch 12, STEPS steps."""
    return probe(1, tmp_path_factory.mktemp("cp_reference"))


@pytest.fixture(scope="module")
def cp2(tmp_path_factory):
    """CP 2 with the ring (2 processes, one batch of 12): a checkpoint in two processes' shards."""
    tmp = tmp_path_factory.mktemp("cp2")
    return probe(2, tmp, "--export", tmp / "exported.pt")


def assert_same_steps(got, reference, dp=1):
    """Step by step: rank 0's logits and loss (under 2-D: of its half of the global batch, the
    even samples) and every parameter's whole gradient; then the weights saved at the end.
    The tolerances of tests/test_tp.py: gradients and weights within 1e-4 and 1e-3 of their
    norms (Adam's division by the root of tiny squared gradients turns rounding into steps)."""
    (seen, out), (ref, ref_out) = got, reference
    assert len(seen["losses"]) == len(ref["losses"]) == STEPS
    for step in range(STEPS):
        logits, labels = ref["logits"][step][::dp], ref["labels"][step][::dp]
        assert torch.equal(seen["labels"][step], labels), step  # the same samples
        torch.testing.assert_close(seen["logits"][step], logits, atol=1e-5, rtol=1e-4)
        loss = F.cross_entropy(logits, labels, label_smoothing=0.1).item()
        assert seen["losses"][step] == pytest.approx(loss, abs=1e-5), step
        grads, ref_grads = seen["grads"][step], ref["grads"][step]
        assert grads.keys() == ref_grads.keys() == initial().keys()
        for name, g in ref_grads.items():
            assert g.norm() > 0, name  # the test can fail: every tensor has a gradient
            assert (grads[name] - g).norm() <= 1e-4 * g.norm(), (step, name)
    assert seen["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    # The evaluation at the end (2 x 2: each data-parallel group half of the test set).
    last, ref_last = read_metrics(out)[-1], read_metrics(ref_out)[-1]
    assert last["test_loss"] == pytest.approx(ref_last["test_loss"], abs=1e-4)
    assert last["test_acc"] == pytest.approx(ref_last["test_acc"], abs=1.1 / 499)
    assert min(ref["norms"]) > 0.5  # above --clip-grad: clipping scaled every step
    a, b, start = whole(out), whole(ref_out), initial()
    assert a.keys() == b.keys() == start.keys()
    for key in b:
        update = (b[key] - start[key]).norm()
        assert update > 1e-3, key  # the steps moved every tensor, well beyond the tolerance
        assert (a[key] - b[key]).norm() < 1e-3 * update, key


def test_cp2_ring_takes_the_steps_of_one_process(cp2, reference):
    assert_same_steps(cp2, reference)
    seen, out = cp2
    assert read_metrics(out)[-1].keys() >= METRIC_KEYS | {"step", "world_size"}
    exported = torch.load(out.parent / "exported.pt", weights_only=True)
    assert exported.keys() == whole(out).keys()
    assert all(torch.equal(exported[k], whole(out)[k]) for k in exported)  # --export: the same


@pytest.mark.slow
def test_cp2_allgather_takes_the_steps_of_one_process(tmp_path, reference):
    assert_same_steps(probe(2, tmp_path, "--cp-impl", "allgather"), reference)


@pytest.mark.slow
def test_2d_takes_the_steps_of_one_process(tmp_path, reference):
    """2 x 2 with the ring (the all-gather's 2 x 2 forward: the evaluation test's)."""
    assert_same_steps(probe(4, tmp_path, dp=2), reference, dp=2)


COUNT = """
import json, sys, torch, torch.distributed as dist
import common, context_parallel as cp
from torch.distributed.tensor.debug import CommDebugMode
dist.init_process_group("gloo")
group, world, report = dist.group.WORLD, dist.get_world_size(), {}
sends = []
real_batch = dist.batch_isend_irecv
def batch(ops):
    sends.append(sum(op.op is dist.isend for op in ops))
    return real_batch(ops)
dist.batch_isend_irecv = batch

def saved_bytes(storages):  # as benchmarks/sharding.py: a storage once, no weights
    def pack(t):
        base = t if t._base is None else t._base
        if not (base.is_leaf and base.requires_grad):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

torch.manual_seed(1)
images = torch.randn(6, 1, 28, 28)
runs = {}
chunks = cp.layout(28, world, "contiguous")  # each process its rows
for impl in ("one", "ring", "allgather"):
    torch.manual_seed(0)
    split = impl != "one"
    mine = chunks[dist.get_rank()] if split else None
    model = cp.LongViT(1, 10, 28, 96, 4, 4, mine)
    if split:
        cp.split_attention(model, group, impl, chunks, causal=False)
    rows = cp.own(images, chunks[dist.get_rank()], 2) if split else images
    storages, sends[:] = {}, []
    with CommDebugMode() as forward, saved_bytes(storages):
        logits = model(rows)
    forward_sends = sum(sends)
    sends[:] = []
    with CommDebugMode() as backward:
        logits.square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    runs[impl] = logits.detach(), grads
    counts = dict(forward_sends=forward_sends, backward_sends=sum(sends))
    for phase, mode in (("forward", forward), ("backward", backward)):
        for op, n in mode.get_comm_counts().items():
            counts[f"{phase} {str(op).split('.')[-1]}"] = n
    report[impl] = dict(counts, activations=sum(storages.values()))
    with torch.no_grad():  # an empty batch (evaluation's padding) goes through as well
        assert model(rows[:0]).shape == (0, 10)
# With CP, each process's gradients are CP times its tokens' share (see LongViT.forward):
# summed over the group they are the whole one. The logits are whole on every process.
for impl in ("ring", "allgather"):
    logits, grads = runs[impl]
    report[impl]["logits"] = (logits - runs["one"][0]).abs().max().item()
    for name, g in grads.items():
        dist.all_reduce(g)
        g /= world
    worst = max(((g - runs["one"][1][n]).norm() / runs["one"][1][n].norm()).item()
                for n, g in grads.items())
    report[impl]["grads"] = worst
report["ring vs allgather"] = max(
    ((runs["ring"][1][n] - g).norm() / g.norm()).item() for n, g in runs["allgather"][1].items()
)
if dist.get_rank() == 0:
    print(json.dumps(report))
common.cleanup()
"""


@pytest.mark.slow
def test_ring_equals_allgather_and_what_each_sends_and_saves():
    """At CP 2, 4 blocks, a batch of 6, one forward and backward of each way against one
    process: the logits and the gradients (summed over the group); the ring's against the
    all-gather's; the sends and collectives per attention layer; the bytes saved for
    backward (half of one process's with the ring: every activation is per token, the ring
    keeps only this process's K/V); and an empty batch."""
    proc = torchrun_workers(2, ["-c", COUNT])  # torchrun's 2 workers, forked
    report = last_json(proc.stdout)
    one, ring, gather = report["one"], report["ring"], report["allgather"]
    for impl in (ring, gather):
        assert impl["logits"] < 1e-5 and impl["grads"] < 1e-5, report
    assert report["ring vs allgather"] < 1e-5, report
    # Per attention layer (4 blocks): the ring sends its K/V block once in forward (CP - 1),
    # in backward the block again and its gradients' accumulator home (CP); the all-gather
    # one all-gather of K and V together, then one reduce-scatter of their gradients. Both
    # add the one all-gather of the tokens' sums for the mean (and its reduce-scatter).
    depth = 4
    assert (ring["forward_sends"], ring["backward_sends"]) == (depth * 1, depth * (1 + 2))
    assert ring["forward all_gather_into_tensor"] == 1, ring
    assert ring["backward reduce_scatter_tensor"] == 1, ring
    assert (gather["forward_sends"], gather["backward_sends"]) == (0, 0)
    assert gather["forward all_gather_into_tensor"] == depth + 1, gather
    assert gather["backward reduce_scatter_tensor"] == depth + 1, gather
    # Activations: the ring saves half of one process's (and the pooled features, whole);
    # the all-gather saves the whole K and V of every layer, half of it beyond the ring.
    assert 0.5 <= ring["activations"] / one["activations"] < 0.52, report
    kv_half = depth * 2 * 6 * 14 * 96 * 4  # per layer: K and V of the other 14 tokens, fp32
    assert gather["activations"] - ring["activations"] == kv_half, report


@pytest.mark.slow
def test_resume_at_another_degree_ends_where_one_run_ends(tmp_path):
    """On TRAIN samples (2 steps an epoch): CP 2 (ring) stops after 3 of 4 steps, in epoch 1;
    2 x 2 (all-gather) goes on from its shards with epoch 1's next batch (its order, its
    position, the schedule's step) and ends with the uninterrupted process's weights."""
    ref, ref_out = probe(1, tmp_path / "one", train=[TRAIN])
    epoch_1 = torch.cat(ref["labels"][2:])
    assert not torch.equal(epoch_1, torch.cat(ref["labels"][:2]))  # a new order
    run = tmp_path / "run"
    torchrun_workers(2, probe_argv(run, "--max-steps", STEPS - 1, train=[TRAIN]))
    proc = torchrun_workers(4, probe_argv(run, "--cp-impl", "allgather", dp=2, train=[TRAIN]))
    assert "at epoch 1, step 1 of 2" in proc.stdout, proc.stdout
    seen = torch.load(run / "rank0.pt", weights_only=False)
    assert len(seen["labels"]) == 1 and torch.equal(seen["labels"][0], ref["labels"][-1][::2])
    a, b = whole(run / "out"), whole(ref_out)
    for key, start in initial().items():
        assert (a[key] - b[key]).norm() < 1e-3 * (b[key] - start).norm(), key


def eval_only(nproc, checkpoint, *flags):
    argv = ["context_parallel.py", *SYNTHETIC, "--model", "vit", "--batch-size", "83", *flags]
    argv += ["--eval-only", "--resume", checkpoint]
    proc = run_python(argv) if nproc == 1 else torchrun_workers(nproc, argv)
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("eval ")]
    loss, acc = line.split("test_loss ")[1].split(" test_acc ")
    return float(loss), float(acc.split()[0])


@pytest.mark.slow
def test_evaluation_is_exact_at_1_2_and_4_processes_and_the_export_loads_alone(cp2):
    """model.pt evaluated here by training.evaluate on the plain ViT; the checkpoint evaluated at
    1 process, CP 2 and 2 x 2, both with the all-gather (test batches of 166: 499 samples in 3
    and 2 x 2 batches)."""
    _, out = cp2
    model = long_vit()
    model.load_state_dict(whole(out))
    _, test_set, _, _ = data.load_datasets("synthetic", "data")
    loader = torch.utils.data.DataLoader(test_set, 256, collate_fn=data.collate)
    loss, acc = training.evaluate(model, loader, torch.device("cpu"))
    assert read_metrics(out)[-1]["test_acc"] == acc
    assert read_metrics(out)[-1]["test_loss"] == pytest.approx(loss, abs=1e-5)
    expected = pytest.approx((round(loss, 4), round(acc, 4)), abs=1.1e-4)
    for nproc, flags in [
        (1, []),
        (2, ["--cp-impl", "allgather"]),
        (4, ["--dp", "2", "--cp-impl", "allgather"]),
    ]:
        assert eval_only(nproc, out / "checkpoint", *flags) == expected, (nproc, flags)


@pytest.mark.slow
def test_cp_degree_that_does_not_divide_the_tokens_is_one_line_on_every_rank():
    errors = one_line_errors("context_parallel.py", [*FAST, "--dist-timeout", "100"], world=3)
    cut = "CP degree 3: --cp-balance contiguous cuts the 28 tokens into 3 chunks"
    assert all(cut in e for e in errors), errors


@pytest.mark.parametrize(
    "flags, world, expected",
    [
        (["--cp", "2"], 3, "--dp 1 x --cp 2 makes a mesh of 2 processes; 3 started"),
        (["--dp", "2"], 3, "--dp 2 x --cp 1 makes a mesh of 2 processes; 3 started"),
    ],
)
def test_impossible_mesh_is_refused_before_any_collective(no_launcher, flags, world, expected):
    """Checked by every rank alike before the mesh is made, so one pretended rank shows it."""
    info = common.DistInfo(True, 0, 0, world, world, torch.device("cpu"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(context_parallel, "init_distributed_mode", lambda **_: info)
        patch.setattr(context_parallel, "init_device_mesh", None)  # reached: a TypeError
        with pytest.raises(SystemExit, match=expected):
            context_parallel.main([*FAST, *flags])


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_one_line_on_every_rank(tmp_path, cp2):
    """Asked of a checkpoint it does not fit. (A single-file checkpoint and a missing piece are
    checkpoint.find_checkpoint's checks, the same for the sharded scripts: test_fsdp.py.)"""
    out = tmp_path / "out"
    argv = [*FAST, "--dim", "64", "--resume", cp2[1] / "checkpoint", "--output-dir", out]
    argv += ["--batch-size", "12", "--dist-timeout", "100"]
    errors = one_line_errors("context_parallel.py", argv)
    shape = "'blocks.0.attn.k.weight' is (96, 96) in the file, (64, 64) in the model"
    assert shape in errors[0] and len(set(errors)) == 1, errors
    assert not out.exists() or not any(out.iterdir())  # nothing written


def test_a_checkpoint_of_fsdp_trains_16_token_vit_is_one_line(tmp_path):
    """A real fsdp_train.py checkpoint of the ViT of 16 tokens (its positions do not fit 28
    rows): one line, no traceback. (Before, a KeyError: its meta.pt had no --dim.)"""
    out = tmp_path / "fsdp"
    run_python(["fsdp_train.py", *SYNTHETIC, "--max-steps", "1", "--output-dir", out])
    argv = [*SYNTHETIC, "--model", "vit", "--resume", out / "checkpoint"]
    proc = run_python(["context_parallel.py", *argv], check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {out / 'checkpoint'} does not fit this model: 'patch_embed.weight' is"
        " (96, 1, 7, 7) in the file, (96, 1, 1, 28) in the model"
    )


def test_docstring_launches_make_a_valid_mesh(no_launcher, monkeypatch):
    """Every torchrun command in the docstring passes the mesh and token checks at its number
    of processes."""
    real_load = context_parallel.load_datasets  # text: the default; images: synthetic ones

    def load(name, *a, **k):
        return real_load(name if name == "text" else "synthetic", *a, **k)

    monkeypatch.setattr(context_parallel, "load_datasets", load)
    worlds = docstring_launches_reach_the_mesh(context_parallel, monkeypatch, extra=[])
    assert worlds == [2, 2, 4, 8]


def test_refusals(no_launcher):
    with pytest.raises(SystemExit, match="--dim 128 is not a whole number of --heads 5"):
        context_parallel.get_args(["--heads", "5"])
    with pytest.raises(SystemExit, match="--cp must be at least 1"):
        context_parallel.get_args(["--cp", "0"])
    with pytest.raises(SystemExit, match=r"--betas are decays, each in \[0, 1\); got 0.9 1.0"):
        context_parallel.get_args(["--betas", "0.9", "1"])


@pytest.mark.slow
def test_benchmark_times_cp_beside_one_process_and_fsdp(tmp_path):
    """benchmarks/context_parallel.py, small: every row, ratios against one process, and the
    activations it reports per process (CP: about half of one process's)."""
    argv = ["benchmarks/context_parallel.py", "--global-batch", "8", "--steps", "1"]
    rows = [json.loads(ln) for ln in run_python(argv).stdout.splitlines() if ln.startswith("{")]
    by = {r["layout"]: r for r in rows}
    assert set(by) == {"1 process", "fsdp 2", "cp 2 ring", "cp 2 allgather"}, rows
    assert all(r["ms_per_step"] > 0 for r in rows)
    one = by["1 process"]["activations"]
    assert 0.5 <= by["cp 2 ring"]["activations"] / one < 0.52, rows
    assert 0.5 <= by["fsdp 2"]["activations"] / one < 0.52, rows  # half the batch each
    assert by["cp 2 allgather"]["activations"] > by["cp 2 ring"]["activations"], rows


RING = """
import json, sys, torch, torch.distributed as dist, torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
import context_parallel as cp
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
N, H, T, D = 2, 2, 32, 8
sent = [0]
real_batch = dist.batch_isend_irecv
def batch(ops):  # the bytes this process sends around the ring
    sends = [op.tensor for op in ops if op.op is dist.isend]
    sent[0] += sum(t.numel() * t.element_size() for t in sends)
    return real_batch(ops)
dist.batch_isend_irecv = batch
def run(mine, dout, group, chunks):
    sent[0] = 0
    with FlopCounterMode(display=False) as forward:
        out = cp.RingAttention.apply(*mine, group, chunks, True)
    forward_bytes, sent[0] = sent[0], 0
    with FlopCounterMode(display=False) as backward:
        out.backward(dout)
    flops = [forward.get_total_flops(), backward.get_total_flops()]
    return out, flops, [forward_bytes, sent[0]]
report = {}
for size in (2, 4):  # CP 2 twice side by side (ranks 0-1, 2-3), then CP 4
    groups = [dist.new_group(list(range(s, s + size))) for s in range(0, world, size)]
    group, me = groups[rank // size], rank % size
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(N, H, T, D) for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*whole, is_causal=True).backward(dout)
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for balance in ("contiguous", "zigzag"):
        chunks = cp.layout(T, size, balance)
        part = lambda t: cp.own(t, chunks[me], 2)
        mine = [part(t).requires_grad_() for t in (q, k, v)]
        out, flops, sent_fp32 = run(mine, part(dout), group, chunks)
        errors = [(out - part(reference)).abs().max().item()]
        errors += [(m.grad - part(w.grad)).abs().max().item() for m, w in zip(mine, whole)]
        half = [part(t).bfloat16().requires_grad_() for t in (q, k, v)]
        _, _, sent_bf16 = run(half, part(dout).bfloat16(), group, chunks)
        report[f"{size} {balance}"] = dict(flops=flops, error=max(errors))
        report[f"{size} {balance}"].update(fp32=sent_fp32, bf16=sent_bf16)
reports = [None] * world
dist.all_gather_object(reports, report)
if rank == 0:
    print(json.dumps(reports))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_causal_ring_computes_what_it_must_balances_and_sends_bf16():
    """The causal ring at CP 2 (two groups) and CP 4, both balances, a batch of 2 x 2 heads x 32
    tokens x 8: each rank's output and gradients equal one process's causal attention at its
    positions; its attention FLOPs are those of the blocks it must compute: a key chunk after
    a query chunk skipped, the diagonal computed under its mask. Per (query rows x key
    columns), 4 x N x H x D in forward (scores, weighted values), 10 in backward. Contiguous:
    process r computes r + 1 blocks of (T/CP)^2; zigzag: every process 2 CP + 1 of
    (T/2CP)^2, the same work. K/V travel in their dtype (bf16: half the bytes); the gradient
    accumulator that goes round in backward stays fp32."""
    proc = torchrun_workers(4, ["-c", RING])  # torchrun's 4 workers, forked
    reports = last_json(proc.stdout)
    n, h, t, d = 2, 2, 32, 8
    for rank, report in enumerate(reports):
        for size in (2, 4):
            me = rank % size
            for balance, cells in (
                ("contiguous", (me + 1) * (t // size) ** 2),
                ("zigzag", (2 * size + 1) * (t // (2 * size)) ** 2),
            ):
                got = report[f"{size} {balance}"]
                assert got["error"] < 1e-5, (rank, size, balance, got)
                assert got["flops"] == [4 * n * h * d * cells, 10 * n * h * d * cells], (rank, got)
                block = 2 * n * h * (t // size) * d  # K and V of one process, numbers
                fp32 = [4 * block * (size - 1), 4 * block * (size - 1) + 4 * block * size]
                assert got["fp32"] == fp32, (rank, size, balance, got)
                assert got["bf16"] == [fp32[0] // 2, 2 * block * (size - 1) + 4 * block * size]
