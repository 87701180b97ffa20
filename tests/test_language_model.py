"""The language model: the byte-level text data (windows, labels, the held-out tail), the
causal GPT, and each sharded script training it on N processes as one process does (every
step's logits, labels, loss and whole gradients, the final weights and evaluation), with
causal context parallelism (ring and all-gather, zigzag and contiguous), resume at another
degree and exact evaluation at 1, 2 and 4 processes. On CPU with gloo, real processes."""

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    DIST_TIMEOUT,
    read_metrics,
    run_python,
    text_flags,
    torchrun_workers,
)

import context_parallel
import data
import models

SEQ, GLOBAL_BATCH, STEPS = 32, 12, 4
TRAIN = 24  # the resume test's training set: 2 steps an epoch, STEPS steps cross into epoch 1
# AdamW steps that move the weights far beyond the tolerances, with clipping at work.
FAST = ["--warmup", "0", "--lr", "0.05", "--clip-grad", "0.05", *DIST_TIMEOUT]


def lm_probe(script, nproc, reports, corpus, *flags, batch=GLOBAL_BATCH, train=()):
    """tests/lm_probe.py: SCRIPT on nproc processes (one: a plain `python`), STEPS steps of
    its GPT on `corpus`: rank 0's report and the output directory."""
    argv = ["tests/lm_probe.py", script, reports, *train, "--", *text_flags(corpus, SEQ), *FAST]
    argv += ["--max-steps", STEPS, "--batch-size", batch, "--output-dir", Path(reports, "out")]
    argv += list(flags)
    proc = run_python(argv) if nproc == 1 else torchrun_workers(nproc, argv)
    return torch.load(Path(reports, "rank0.pt"), weights_only=False), Path(reports, "out"), proc


def whole(out):
    return torch.load(out / "model.pt", map_location="cpu", weights_only=True)


def initial():
    models.seed_everything(0)  # what the scripts build first, on rank 0
    return models.GPT(256, SEQ, 96, heads=4).state_dict()


@pytest.fixture(scope="module")
def dense(tmp_path_factory, small_text):
    """One process of fsdp_train.py (nothing to shard): the reference for the dense GPT of
    fsdp_train.py, tensor_parallel.py and context_parallel.py, which build the same one."""
    return lm_probe("fsdp_train.py", 1, tmp_path_factory.mktemp("dense"), small_text)


@pytest.fixture(scope="module")
def moe(tmp_path_factory, small_text):
    """One process of expert_parallel.py: every expert."""
    return lm_probe("expert_parallel.py", 1, tmp_path_factory.mktemp("moe"), small_text)


@pytest.fixture(scope="module")
def cp2(tmp_path_factory, small_text):
    """CP 2, the ring, zigzag (the default): a checkpoint in two processes' shards."""
    return lm_probe("context_parallel.py", 2, tmp_path_factory.mktemp("cp2"), small_text)


def assert_same_steps(got, reference, samples=slice(None), mine=None, start=None):
    """Step by step, rank 0's tokens against the reference's same tokens: its samples of each
    global batch (`samples`: every world-th for data parallelism), its chunks of each sequence
    (`mine`, context parallelism), their labels, logits and loss; every parameter's whole
    gradient (clipped); then the final evaluation and weights. Tolerances of the images'
    parity tests (tests/test_tp.py)."""
    (seen, out, _), (ref, ref_out, _) = got, reference
    assert len(seen["losses"]) == len(ref["losses"]) == STEPS
    for step in range(STEPS):
        n = ref["labels"][step].numel() // SEQ
        logits = ref["logits"][step].view(n, SEQ, -1)[samples]
        labels = ref["labels"][step].view(n, SEQ)[samples]
        if mine:  # this process's chunks of each sequence, in order
            logits, labels = (torch.cat([t[:, s:e] for s, e in mine], 1) for t in (logits, labels))
        logits, labels = logits.flatten(0, 1), labels.flatten()
        assert torch.equal(seen["labels"][step], labels), step  # the same tokens' labels
        torch.testing.assert_close(seen["logits"][step], logits, atol=1e-5, rtol=1e-4)
        assert seen["losses"][step] == pytest.approx(F.cross_entropy(logits, labels).item())
        # Some tensors' gradients are nearly zero (a saturated softmax's queries): their
        # tolerance has a floor, a millionth of the whole gradient's norm.
        floor = 1e-6 * torch.stack([r.norm() for r in ref["grads"][step]]).norm()
        pairs = zip(seen["grads"][step], ref["grads"][step], strict=True)
        for i, (g, r) in enumerate(pairs):
            assert r.norm() > 0, i  # the test can fail: every tensor has a gradient
            assert (g - r).norm() <= 1e-4 * r.norm() + floor, (step, i)
    last, ref_last = read_metrics(out)[-1], read_metrics(ref_out)[-1]
    assert last["test_loss"] == pytest.approx(ref_last["test_loss"], abs=1e-4)
    assert last["test_acc"] == pytest.approx(ref_last["test_acc"], abs=1e-4)
    a, b = whole(out), whole(ref_out)
    start = start or initial()
    assert a.keys() == b.keys() == start.keys()
    for key in b:
        update = (b[key] - start[key]).norm()
        assert update > 1e-3, key  # the steps moved every tensor, well beyond the tolerance
        assert (a[key] - b[key]).norm() < 1e-3 * update, key


def zigzag(cp, rank):
    return context_parallel.layout(SEQ, cp, "zigzag")[rank]


def test_fsdp_takes_the_steps_of_one_process(tmp_path, small_text, dense):
    got = lm_probe("fsdp_train.py", 2, tmp_path, small_text, batch=GLOBAL_BATCH // 2)
    assert_same_steps(got, dense, samples=slice(None, None, 2))


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--sequence-parallel"]])
def test_tensor_parallel_takes_the_steps_of_one_process(tmp_path, small_text, dense, flags):
    """The embedding and the head whole on every process, attention and MLP split."""
    assert_same_steps(lm_probe("tensor_parallel.py", 2, tmp_path, small_text, *flags), dense)


def test_causal_ring_with_zigzag_takes_the_steps_of_one_process(cp2, dense):
    """CP 2: rank 0 holds chunks 0 and 3 of 4 (positions 0-7 and 24-31), their labels too; at
    the end, rank 0 prints a sample of text from the whole trained model."""
    assert_same_steps(cp2, dense, mine=zigzag(2, 0))
    assert "\nsample: def " in cp2[2].stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, mine",
    [
        (["--cp-balance", "contiguous"], [(0, 16)]),
        (["--cp-impl", "allgather"], [(0, 8), (24, 32)]),
        (["--cp-impl", "allgather", "--cp-balance", "contiguous"], [(0, 16)]),
    ],
)
def test_causal_context_parallelism_takes_the_steps_of_one_process(
    tmp_path, small_text, dense, flags, mine
):
    got = lm_probe("context_parallel.py", 2, tmp_path, small_text, *flags)
    assert_same_steps(got, dense, mine=mine)


@pytest.mark.slow
def test_causal_2d_takes_the_steps_of_one_process(tmp_path, small_text, dense):
    """2 x 2: rank 0 the even samples of each global batch, chunks 0 and 3 of each."""
    got = lm_probe("context_parallel.py", 4, tmp_path, small_text, "--dp", "2", batch=6)
    assert_same_steps(got, dense, samples=slice(None, None, 2), mine=zigzag(2, 0))


def test_expert_parallelism_takes_the_steps_of_one_process(tmp_path, small_text, moe):
    """EP 2 against one process holding every expert: capacity per sequence, so each
    sequence's routing is the same however the batch is split."""
    models.seed_everything(0)
    import expert_parallel

    dense_gpt = models.GPT(256, SEQ, 96, heads=4)
    start = expert_parallel.with_experts(dense_gpt, 8, 2, 1.25).state_dict()
    got = lm_probe("expert_parallel.py", 2, tmp_path, small_text, batch=GLOBAL_BATCH // 2)
    assert_same_steps(got, moe, samples=slice(None, None, 2), start=start)


@pytest.mark.slow
def test_resume_at_another_degree_ends_where_one_run_ends(tmp_path, small_text):
    """On TRAIN windows (2 steps an epoch): CP 2 (ring, zigzag) stops after 3 of 4 steps, in
    epoch 1; CP 4 (all-gather, contiguous) goes on from its shards with epoch 1's next batch
    and ends with the uninterrupted process's weights."""
    train, two = [TRAIN], ["--epochs", 2]  # STEPS steps: 2 epochs
    _, ref_out, _ = lm_probe("fsdp_train.py", 1, tmp_path / "one", small_text, *two, train=train)
    run = tmp_path / "run"
    lm_probe("context_parallel.py", 2, run, small_text, *two, "--max-steps", STEPS - 1, train=train)
    flags = [*two, "--cp-impl", "allgather", "--cp-balance", "contiguous"]
    _, out, proc = lm_probe("context_parallel.py", 4, run, small_text, *flags, train=train)
    assert "at epoch 1, step 1 of 2" in proc.stdout, proc.stdout
    a, b = whole(out), whole(ref_out)
    for key, start in initial().items():
        assert (a[key] - b[key]).norm() < 1e-3 * (b[key] - start).norm(), key


@pytest.mark.slow
def test_evaluation_is_exact_at_1_2_and_4_processes(small_text, cp2):
    """The CP 2 checkpoint evaluated by one process, CP 2 (ring, zigzag), CP 4 (all-gather,
    zigzag), and by fsdp_train.py on 2 processes: every validation token once, the same
    loss in nats per byte and the same next-byte accuracy."""
    checkpoint = cp2[1] / "checkpoint"
    results = []
    for script, nproc, flags in [
        ("context_parallel.py", 1, []),
        ("context_parallel.py", 2, []),
        ("context_parallel.py", 4, ["--cp-impl", "allgather"]),
        ("fsdp_train.py", 2, []),
    ]:
        argv = [script, *text_flags(small_text, SEQ), *flags, "--batch-size", "5"]
        argv += ["--eval-only", "--resume", checkpoint]
        proc = run_python(argv) if nproc == 1 else torchrun_workers(nproc, argv)
        (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("eval ")]
        results.append(line.split(": ", 1)[1])
    assert len(set(results)) == 1, results
    last = read_metrics(cp2[1])[-1]
    assert results[0] == f"test_loss {last['test_loss']:.4f} test_acc {last['test_acc']:.4f}"


# ----------------------------------------------------------------------------------------
# The data and the model


def test_text_windows_their_labels_and_the_held_out_tail(small_text):
    """Sample i is bytes i x SEQ to (i + 1) x SEQ - 1, its labels the bytes one further on;
    the validation set is the last 5% of the bytes (800 of 16,000), never trained on."""
    raw = torch.tensor(list(small_text.read_bytes()))
    train, val, classes, channels = data.load_datasets("text", str(small_text), seq_len=SEQ)
    assert (classes, channels, len(train), len(val)) == (256, None, 474, 24)
    x, y = train.__getitems__([0, 473])
    assert torch.equal(x[1], raw[473 * SEQ : 474 * SEQ]) and torch.equal(
        y[1], raw[473 * SEQ + 1 :][:SEQ]
    )
    assert torch.equal(x[0], raw[:SEQ]) and torch.equal(y[0], raw[1 : SEQ + 1])
    vx, vy = val.__getitems__([0])
    assert torch.equal(vx[0], raw[-800 : -800 + SEQ]) and torch.equal(vy[0], raw[-799:][:SEQ])
    assert 474 * SEQ < 16000 - 800  # training windows end before the tail begins


def test_text_defaults_to_the_standard_library_and_refuses_bad_input(tmp_path):
    """No --data-dir: the standard library's top-level sources, in sorted order; a folder: its
    files in sorted order; a missing path, bytes that are not UTF-8 or too few bytes: one line."""
    lib = Path(os.__file__).parent
    assert data.stdlib_sources() == sorted(lib.glob("*.py")) and len(data.stdlib_sources()) > 50
    (tmp_path / "b.txt").write_text("second " * 100)
    (tmp_path / "a.txt").write_text("first " * 100)
    train, _, _, _ = data.load_datasets("text", str(tmp_path), seq_len=8)
    assert bytes(train[0][0].tolist()) == b"first fi"
    for path, says in [
        (tmp_path / "nothing", "does not exist"),
        (tmp_path / "a.txt", "too few"),
    ]:
        with pytest.raises(SystemExit, match=says):
            data.load_datasets("text", str(path), seq_len=4096)
    with pytest.raises(SystemExit, match="bytes in the standard library's sources .the default"):
        data.load_datasets("text", None, seq_len=10**8)  # the source named, not "None"
    (tmp_path / "c.bin").write_bytes(b"\xff\xfe" * 100)
    with pytest.raises(SystemExit, match="c.bin is not UTF-8 text"):
        data.load_datasets("text", str(tmp_path), seq_len=8)


@pytest.mark.slow
def test_the_gpt_is_causal_and_samples_text():
    """A position's logits do not change with the bytes after it; they do with those before.
    generate() continues a prompt with the seq_len bytes before each new one, reproducibly."""
    models.seed_everything(0)
    gpt = models.GPT(256, 16, 32, depth=2, heads=2).eval()
    a = torch.randint(0, 256, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 256
    with torch.no_grad():
        la, lb = gpt(a), gpt(b)
    torch.testing.assert_close(la[0, :10], lb[0, :10])
    assert not torch.allclose(la[0, 10:], lb[0, 10:])
    text = models.generate(gpt, prompt="ab", length=40)
    assert text.startswith("ab") and text == models.generate(gpt, prompt="ab", length=40)


def test_the_gpt_starts_as_gpt_2_does_near_a_uniform_guess(small_text):
    """GPT-2's initialisation: weights N(0, 0.02), biases 0, each block's two residual
    projections (attention's proj, the MLP's fc2) 1/sqrt(2 x depth) of that, q and k
    N(0, 1/sqrt(dim)) (scores of variance 1); so the first loss on real text is within 0.1
    of a uniform guess, ln 256 (PyTorch's default Linear init started at 5.80)."""
    models.seed_everything(0)
    gpt = models.GPT(256, SEQ, 96, depth=8, heads=4)
    for name, p in gpt.named_parameters():
        std = 0.02 / 4 if name.endswith(("proj.weight", "fc2.weight")) else 0.02
        std = 96**-0.5 if name.endswith(("q.weight", "k.weight")) else std
        if name.endswith("bias"):
            assert not p.any(), name
        elif "norm" not in name:
            assert p.std().item() == pytest.approx(std, rel=0.1), name
    train, _, _, _ = data.load_datasets("text", str(small_text), seq_len=SEQ)
    x, y = train.__getitems__(list(range(16)))
    loss = F.cross_entropy(gpt(x).flatten(0, 1), y.flatten()).item()
    assert abs(loss - torch.log(torch.tensor(256.0)).item()) < 0.1, loss


def test_weight_decay_falls_on_the_matrices_only():
    """models.param_groups, AdamW's groups in every script that trains the GPT: decay on
    every Linear's weight and the experts' w1 and w2, none on biases, norms, the embedding,
    the positions or the experts' biases."""
    import expert_parallel

    gpt = expert_parallel.with_experts(models.GPT(256, SEQ, 32, depth=2, heads=2), 4, 2, 1.0)
    names = {id(p): n for n, p in gpt.named_parameters()}
    decay, rest = models.param_groups(gpt, 0.1)
    assert (decay["weight_decay"], rest["weight_decay"]) == (0.1, 0.0)
    decayed = sorted(names[id(p)] for p in decay["params"])
    matrices = [n for n, p in gpt.named_parameters() if n.endswith(("q.weight", "k.weight"))]
    matrices += [n for n in names.values() if n.endswith(("v.weight", "proj.weight"))]
    matrices += [n for n in names.values() if n.endswith(("router.weight", "w1", "w2"))]
    assert decayed == sorted([*matrices, "head.weight"])
    assert len(decay["params"]) + len(rest["params"]) == len(names)


def test_the_scripts_decay_no_embedding_row(dense):
    """End to end: the rows of the embedding for bytes the corpus never holds (>= 128: it is
    ASCII) get no gradient; decayed, AdamW would shrink them each step, undecayed they are
    the initial weights exactly after the run's steps."""
    _, out, _ = dense
    start, end = initial()["embed.weight"], whole(out)["embed.weight"]
    assert torch.equal(end[128:], start[128:])
    assert not torch.equal(end[:128], start[:128])


def test_text_runs_take_gpt3s_betas_by_default(dense, moe):
    """No --betas on text: both of AdamW's groups decay the second moment by 0.95 (GPT-3's,
    nanoGPT's), not PyTorch's 0.999, in fsdp_train.py and expert_parallel.py (tensor_parallel.py
    and context_parallel.py take fsdp_train.py's steps: their parity tests)."""
    for report, *_ in (dense, moe):
        assert report["betas"] == [(0.9, 0.95), (0.9, 0.95)]
        assert report["fused"] is True  # and AdamW fused: one kernel over many tensors


def test_text_runs_decay_the_rate_in_a_straight_line_by_default(dense, moe):
    """No --decay on text: after the warm-up (none here) the rate falls by the same amount
    each step to zero at the epoch's end, not by a cosine's slow start, in fsdp_train.py and
    expert_parallel.py (tensor_parallel.py and context_parallel.py: their parity tests)."""
    for report, *_ in (dense, moe):
        rates = report["rates"][1:]  # after step 0, the warm-up's one step
        falls = [a - b for a, b in zip(rates, rates[1:], strict=False)]
        assert falls[0] > 0 and falls == pytest.approx([falls[0]] * len(falls), rel=1e-6)


def test_a_resumed_optimizer_keeps_this_runs_settings_group_by_group():
    """checkpoint.TrainState: the saved moments load into this run's optimizer, whose groups
    keep their own settings (a new --lr and --weight-decay; the no-decay group at 0), not the
    saved ones nor AdamW's defaults."""
    import checkpoint

    def run(lr, decay):
        models.seed_everything(0)
        gpt = models.GPT(256, SEQ, 32, depth=1, heads=2)
        return gpt, torch.optim.AdamW(models.param_groups(gpt, decay), lr)

    gpt, optimizer = run(1e-3, 0.1)
    gpt(torch.zeros(1, SEQ, dtype=torch.long)).sum().backward()
    optimizer.step()
    saved = checkpoint.TrainState(gpt, optimizer).state_dict()
    gpt, optimizer = run(5e-3, 0.2)
    checkpoint.TrainState(gpt, optimizer).load_state_dict(saved)
    settings = [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups]
    assert settings == [(5e-3, 0.2), (5e-3, 0.0)]
    moments = [optimizer.state[p]["exp_avg"] for p in gpt.parameters()]
    assert all(m.any() for m in moments[:1]) and len(moments) == len(list(gpt.parameters()))
