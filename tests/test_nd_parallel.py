"""nd_parallel.py: every layout of pipeline x data x context x tensor parallelism takes one
process's steps (the loss of each step, every gradient, the test loss), a checkpoint resumes
bit for bit at another layout and number of processes, and a bad layout is one line on every
rank. One launch of 8 Gloo processes builds every layout in turn (tests/nd_probe.py), one of 4
the pipeline schedules of several stages per process; the quick tier's, zbv over FSDP."""

import shutil
from pathlib import Path

import pytest
import torch
from conftest import DIST_TIMEOUT, one_line_errors, run_python, text_flags, torchrun_workers

import models

# nd_parallel.py refuses PyTorch before 2.10 in one line (pipelining's shape inference on gloo).
pytestmark = pytest.mark.skipif(
    tuple(map(int, torch.__version__.split(".")[:2])) < (2, 10), reason="needs PyTorch 2.10"
)
SEQ, GLOBAL_BATCH, STEPS = 16, 8, 3
TINY = ["--dim", "32", "--heads", "4", "--depth", "4", "--max-steps", STEPS, *DIST_TIMEOUT]
# AdamW steps at a rate whose rounding stays within the tolerances, with clipping at work.
FAST = ["--warmup", "0", "--lr", "0.05", "--clip-grad", "0.05", *TINY]
# pp, dp, cp, tp: at 8 processes every pp, cp, tp in {1, 2} with dp filling the rest, pp 4,
# tp 4 and dp 4 x cp 2 (among the first); then 2 x 2 x 2 (pp, dp, tp) saves after 2 steps
# and 1 x 4 x 2 (dp, cp) takes the third from its checkpoint.
LAYOUTS = [(pp, 8 // (pp * cp * tp), cp, tp) for pp in (1, 2) for cp in (1, 2) for tp in (1, 2)] + [
    (4, 2, 1, 1),
    (1, 2, 1, 4),
]
# Sequence parallelism on at (1, 2, 2, 2) (with CP) and under HSDP; off at the other tp layouts
# ((2, 1, 2, 2): CP and TP without it). At 4 processes: with the pipeline.
SP = ":--sequence-parallel"
SPECS = [",".join(map(str, x)) + (SP if x == (1, 2, 2, 2) else "") for x in LAYOUTS]
HSDP = f"1,4,1,2:--replicate=2{SP}"  # dp 4 as 2 replicas x 2 shards, each block over tp 2
SAVE, RESUME = "2,2,1,2,2", "1,4,2,1,3"
# At 4 processes: pp 2 x tp 2 (sequence parallel) and dp 2 x cp 2 (1F1B), then the schedules
# of several stages per process (4 stages of one block each); dualpipev at pp 2 x dp 2 saves
# after 2 steps (2 stages a process in a V), interleaved 1F1B at pp 2 x tp 2 (in a loop) takes
# the third from its checkpoint. The quick tier's launch: pp 2 x dp 2 in a V (zbv).
PS = ":--pipeline-schedule="  # nd_probe.py: the flags after a layout
FOUR = [f"2,1,1,2{SP}", "1,2,2,1", f"2,1,1,2{PS}interleaved-1f1b", f"2,1,2,1{PS}interleaved-zb"]
SAVE4, RESUME4 = f"2,2,1,1,2{PS}dualpipev", f"2,1,1,2,3{PS}interleaved-1f1b"
QUICK = f"2,2,1,1{PS}zbv"
BF16 = f"2,1,1,2{SP}:--amp=bf16"  # beside FOUR's first, which is the same in fp32


def probe(nproc, reports, corpus, specs, timeout=600):
    argv = ["tests/nd_probe.py", reports, GLOBAL_BATCH, *specs, "--"]
    argv += [*text_flags(corpus, SEQ), *FAST]
    if nproc == 1:
        return run_python(argv, timeout=300)
    return torchrun_workers(nproc, argv, timeout=timeout)


def report(reports, spec):
    """A layout's reports joined: the first rank of each pipeline stage (its whole gradients by
    name, merged over the stages), rank 0's losses, records and weights."""
    pp, dp, cp, tp = map(int, spec.split(":")[0].split(",")[:4])
    stages = [torch.load(Path(reports, spec, f"rank{s * dp * cp * tp}.pt")) for s in range(pp)]
    merged = dict(stages[0])
    merged["grads"] = [
        {k: v for stage in stages for k, v in stage["grads"][i].items()}
        for i in range(len(stages[0]["grads"]))
    ]
    return merged


def assert_same_steps(got, ref, first=0):
    """Steps first+1.. of `got` against the reference's: the loss (the mean over every rank,
    as logged), every gradient within 1e-4 of its norm (a floor of a millionth of the whole
    gradient's norm, for the nearly zero ones); if it ran to the reference's last step, the
    test loss within 1e-4 relative and the final weights. Returns the worst gradient
    difference, relative to its norm."""
    worst, steps = 0.0, len(got["grads"])
    if first == 0:
        assert got["losses"] == pytest.approx(ref["losses"][:steps], rel=1e-5)
    for i, grads in enumerate(got["grads"]):
        reference = ref["grads"][first + i]
        assert grads.keys() == reference.keys()
        floor = 1e-6 * torch.stack([r.norm() for r in reference.values()]).norm()
        for name, r in reference.items():
            assert r.norm() > 0, name  # the test can fail: every tensor has a gradient
            difference = (grads[name] - r).norm()
            assert difference <= 1e-4 * r.norm() + floor, (first + i, name)
            worst = max(worst, (difference / r.norm()).item())
    if first + steps < len(ref["grads"]):  # stopped early (to save): no final test loss
        return worst
    test_loss, ref_loss = got["records"][-1]["test_loss"], ref["records"][-1]["test_loss"]
    assert test_loss == pytest.approx(ref_loss, rel=1e-4)
    # The weights saved at the end: AdamW's steps (from its resumed moments, if resumed)
    # moved every tensor, and the same way, well within its update.
    start = initial()
    for key, b in ref["saved"].items():
        update = (b - start[key]).norm()
        assert update > 1e-3, key
        assert (got["saved"][key] - b).norm() < 1e-3 * update, key
    return worst


def assert_one_reduction_a_dimension(got, spec):
    """Clipping's collectives, each step: one all-reduce for each mesh dimension that splits
    the weights (FSDP's dp/R x cp, tp) and one over the pipeline, not one per tensor; under
    sequence parallelism without FSDP (whose reduction sums them) one more: the sums its norms'
    gradients still owe (Partial), all at once."""
    pp, dp, cp, tp = map(int, spec.split(":")[0].split(",")[:4])
    dp_shard = dp // (2 if "--replicate=2" in spec else 1)
    owed = "--sequence-parallel" in spec and dp_shard * cp == 1
    n = (dp_shard * cp > 1) + (tp > 1) + (pp > 1) + owed
    assert got["clip"] == [{"allreduce_": n} if n else {}] * len(got["grads"]), spec


def initial():
    models.seed_everything(0)  # what nd_parallel.py builds first, on rank 0
    return models.GPT(256, SEQ, 32, depth=4, heads=4).state_dict()


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key  # bit for bit


@pytest.fixture(scope="module")
def one(tmp_path_factory, small_text):
    """One process: the reference."""
    reports = tmp_path_factory.mktemp("one")
    probe(1, reports, small_text, ["1,1,1,1"])
    ref = report(reports, "1,1,1,1")
    assert len(ref["grads"]) == len(ref["losses"]) == STEPS
    return ref


@pytest.mark.slow
def test_every_layout_takes_the_steps_of_one_process(tmp_path, small_text, one):
    """8 processes, every layout in turn, against one process; then 2 x 2 x 2 -> 1 x 4 x 2 ->
    one process through the checkpoints, every weight loaded as it was saved."""
    specs = [*SPECS, HSDP]
    probe(8, tmp_path / "eight", small_text, [*specs, SAVE, RESUME])
    worst = {spec: assert_same_steps(report(tmp_path / "eight", spec), one) for spec in specs}
    for spec in [*specs, SAVE, RESUME]:
        assert_one_reduction_a_dimension(report(tmp_path / "eight", spec), spec)
    whole = sum(t.numel() for t in initial().values())
    held = {spec: report(tmp_path / "eight", spec)["held"] / whole for spec in specs}
    print("rank 0's share of the parameters:", held)
    for spec in specs:  # built on the meta device and cut: rank 0 holds pieces, never all
        assert held[spec] < 0.5, spec
    for spec in specs:  # model.pt: the whole model, every stage's, as rank 0 exported it
        whole_file = torch.load(tmp_path / "eight" / spec / "out" / "model.pt")
        assert_same_weights(whole_file, report(tmp_path / "eight", spec)["saved"])
    print("worst gradient difference / norm:", worst)
    saved, resumed = report(tmp_path / "eight", SAVE), report(tmp_path / "eight", RESUME)
    assert len(saved["grads"]) == 2 and len(resumed["grads"]) == 1
    assert_same_weights(resumed["loaded"], saved["saved"])  # 2 x 2 x 2 -> 1 x 4 x 2
    assert_same_steps(resumed, one, first=2)
    shutil.copytree(tmp_path / "eight" / "out", tmp_path / "one" / "out")  # 8 -> 1 process
    probe(1, tmp_path / "one", small_text, ["1,1,1,1,3"])  # loads, nothing left to train
    assert_same_weights(report(tmp_path / "one", "1,1,1,1,3")["loaded"], resumed["saved"])


def test_a_pipeline_in_a_v_over_fsdp_takes_the_steps_of_one_process(tmp_path, small_text, one):
    """The quick tier's parity: pp 2 x dp 2, zbv (2 stages per process in a V, rank 0 the first
    and the last), each stage's blocks FSDP-sharded over the 2 data-parallel processes."""
    probe(4, tmp_path, small_text, [QUICK])
    got = report(tmp_path, QUICK)
    print("worst gradient difference / norm:", assert_same_steps(got, one))
    assert_one_reduction_a_dimension(got, QUICK)
    assert got["fused"] is True  # AdamW: one kernel over this process's pieces
    # The FLOPs of a step, rank 0's count (the others skip it): the whole model's on the global
    # batch, whatever the layout, as one process counts them.
    flops = [r["records"][-1] for r in (got, one)]
    flops = [r["flops_per_second"] * r["epoch_seconds"] / STEPS for r in flops]
    assert flops[0] == pytest.approx(flops[1], rel=1e-9) and flops[0] > 0


@pytest.mark.slow
def test_four_processes_take_the_steps_of_one_process(tmp_path, small_text, one):
    """pp 2 x tp 2 with sequence parallelism and dp 2 x cp 2 (1F1B); then schedules of several
    stages per process (4 stages of one block): interleaved 1F1B at pp 2 x tp 2, interleaved
    zero bubble at pp 2 x cp 2, dualpipev at pp 2 x dp 2."""
    probe(4, tmp_path, small_text, [*FOUR, SAVE4, RESUME4, BF16])
    worst = {spec: assert_same_steps(report(tmp_path, spec), one) for spec in FOUR}
    # --amp bf16 at pp 2 x tp 2 (SP): the stages' sends and the tokens' gathers in bf16
    fp32, bf16 = (report(tmp_path, spec) for spec in (FOUR[0], BF16))
    for a, b in zip(fp32["sent"][1:], bf16["sent"][1:], strict=True):  # 1: shape inference
        assert b["pp"] * 2 == a["pp"]  # activations forward, their gradients back: all bf16
        assert b["tp"] < 0.6 * a["tp"]  # rank 0 (stage 0): all but the first block's input
    assert bf16["losses"] == pytest.approx(fp32["losses"], rel=2e-2)
    for spec in [*FOUR, SAVE4, RESUME4]:
        assert_one_reduction_a_dimension(report(tmp_path, spec), spec)
    saved, resumed = report(tmp_path, SAVE4), report(tmp_path, RESUME4)
    assert len(saved["grads"]) == 2 and len(resumed["grads"]) == 1
    worst[SAVE4] = assert_same_steps(saved, one)  # its 2 steps
    assert_same_weights(resumed["loaded"], saved["saved"])  # a V over FSDP -> a loop over TP
    worst[RESUME4] = assert_same_steps(resumed, one, first=2)
    print("worst gradient difference / norm:", worst)


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("gcc"), reason="inductor compiles C++ on the CPU: no gcc")
def test_compiled_blocks_take_the_steps_of_one_process(tmp_path, small_text, one):
    """--compile (each block through torch.compile, inductor's C++ on the CPU) at 2 processes,
    composed with FSDP (dp 2), TP (tp 2) and a pipeline (pp 2; 1F1B and zbv, whose backward
    takes the inputs' gradients first, the weights' later), each against the uncompiled
    process. Minutes: the first compile of each block's graph (on a loaded 2-core machine)."""
    specs = [f"{layout}:--compile" for layout in ("1,2,1,1", "1,1,1,2", "2,1,1,1")]
    specs.append(f"2,1,1,1:--compile{PS}zbv")  # zero bubble: each block's backward in two
    probe(2, tmp_path, small_text, specs, timeout=1500)
    worst = {spec: assert_same_steps(report(tmp_path, spec), one) for spec in specs}
    print("worst gradient difference / norm:", worst)


@pytest.mark.parametrize(
    "flags, world, expected",
    [
        (["--pp", "2", "--tp", "2"], 3, "--pp 2 x --dp 1 x --cp 1 x --tp 2 is 4 processes; 3"),
        (["--tp", "3"], 3, "--tp 3 must divide the 4 heads"),
        (["--pp", "3"], 3, "3 stages (--pp 3 x 1 per process) must divide the 4 blocks"),
        (["--pp", "2", "--microbatches", "1"], 2, "1f1b needs --microbatches >= stages (2); got 1"),
        (["--replicate", "2"], 3, "--replicate 2 does not divide --dp 3"),
        (["--cp", "3", "--seq-len", "15"], 3, "--cp 3 cuts each sequence into 6 chunks"),
        (["--tp", "2", "--sequence-parallel", "--seq-len", "15"], 2, "cuts the 15 tokens of each"),
        (["--sequence-parallel"], 1, "over --tp 1: tp must be over 1"),
        # One stage: a pipeline's flags would do nothing (they ran as 1f1b x 1 and said so).
        (["--microbatches", "4", "--pipeline-schedule", "zbv"], 2, "--microbatches shapes a"),
        (["--pipeline-schedule", "gpipe"], 1, "--pipeline-schedule shapes a pipeline: --pp 1"),
        (["--stages-per-rank", "2"], 2, "--stages-per-rank shapes a pipeline: --pp 1 has none"),
    ],
)
def test_a_bad_layout_is_one_line_on_every_rank(small_text, flags, world, expected):
    argv = [*text_flags(small_text, SEQ), *FAST, *flags, "--dist-timeout", "100"]
    errors = one_line_errors("nd_parallel.py", argv, world=world)
    assert all(expected in e for e in errors), errors
