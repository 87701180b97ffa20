"""The copies of the data-parallel loop cannot drift apart unnoticed.

dp_train.py (one process, nn.DataParallel), ddp_mp_spawn.py (2 processes from mp.spawn),
ddp_train.py and ddp_comm.py (2 processes, torchrun's workers) each hold their own training
loop. From the same seed and the same global batch (32 = 2 x 16) they must take the same optimizer
steps: the same samples in each step (DistributedSampler's permutation, or dp_train's
RandomSampler reseeded the same way), the same scaled learning rate and schedule, the same
loss. The MLP has no BatchNorm, so 2 processes equal one up to float rounding. Checked
straight through 2 epochs and across a stop after the first epoch and a resume. And
ddp_comm.py keeps ddp_train.py's lines word for word, but for the options it leaves out.
"""

import difflib

import pytest
from conftest import (
    DIST_TIMEOUT,
    ROOT,
    SYNTHETIC,
    clean_env,
    free_port,
    load_ckpt,
    max_abs_diff,
    run_python,
    run_ranks,
    torchrun_workers,
)

import models

# 62 steps per epoch (2000 samples, global batch 32), 2 epochs. The rate is high enough that
# the weights move far more than the tolerance.
# Every shared hyper-parameter away from its default: a copy that ignored one would differ.
ARGS = [
    *SYNTHETIC,
    "--model",
    "mlp",
    "--epochs",
    "2",
    "--lr",
    "0.8",
    "--warmup",
    "0.1",
    "--seed",
    "3",
]
ARGS += ["--momentum", "0.8", "--weight-decay", "1e-3", "--label-smoothing", "0.2"]
EPOCH = ["--max-steps", "62"]
ATOL = 1e-4  # 124 steps of float rounding apart; the weights move by more than 0.05
TIMEOUT = 600  # a hang, not a loaded machine (62 steps took over 180 s at a load of 20 here)


def dp(out, *extra):
    run_python(
        ["dp_train.py", *ARGS, "--batch-size", "32", "--output-dir", out, *extra], timeout=TIMEOUT
    )


def mp_spawn(out, *extra):
    run_python(
        [
            "ddp_mp_spawn.py",
            "--nprocs",
            "2",
            *ARGS,
            *DIST_TIMEOUT,
            "--batch-size",
            "16",
            "--output-dir",
            out,
            *extra,
        ],
        timeout=TIMEOUT,
    )


def ddp(out, *extra):
    argv = [*ARGS, *DIST_TIMEOUT, "--batch-size", "16", "--output-dir", out, *extra]
    torchrun_workers(2, ["ddp_train.py", *argv], timeout=TIMEOUT)


def comm(out, *extra):  # no communication option: plain DDP
    argv = [*ARGS, *DIST_TIMEOUT, "--batch-size", "16", "--output-dir", out, *extra]
    torchrun_workers(2, ["ddp_comm.py", *argv], timeout=TIMEOUT)


LAUNCH = {"dp_train": dp, "ddp_mp_spawn": mp_spawn, "ddp_train": ddp, "ddp_comm": comm}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """dp_train.py through both epochs without a stop: the reference."""
    out = tmp_path_factory.mktemp("dp_straight")
    dp(out)
    return load_ckpt(out)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """ddp_train.py (2 processes) stopped after its first epoch."""
    out = tmp_path_factory.mktemp("ddp_stopped")
    ddp(out, *EPOCH)
    return out


@pytest.mark.slow
def test_the_weights_moved(straight):
    models.seed_everything(3)  # what every script does just before it builds the model
    initial = models.build_model("mlp", 1, 10).state_dict()
    assert max_abs_diff(initial, straight["model"]) > 50 * ATOL


# ddp_mp_spawn.py's straight run is test_scripts.py's (3 epochs, against ddp_train.py's);
# here it stops and resumes, and ends at dp_train.py's weights (below).
@pytest.mark.slow
@pytest.mark.parametrize("script", ["ddp_train", "ddp_comm"])
def test_same_weights_as_dataparallel(straight, tmp_path, script):
    LAUNCH[script](tmp_path)
    ckpt = load_ckpt(tmp_path)
    assert ckpt["step"] == straight["step"] == 124
    assert max_abs_diff(ckpt["model"], straight["model"]) < ATOL


# ddp_train.py's stop and resume: test_ranks_resume_from_rank_0s_checkpoint, below.
@pytest.mark.slow
@pytest.mark.parametrize("script", ["dp_train", "ddp_mp_spawn"])
def test_stop_and_resume_at_an_epoch_boundary(straight, tmp_path, script):
    LAUNCH[script](tmp_path, *EPOCH)
    first = load_ckpt(tmp_path)
    assert (first["epoch"], first["epoch_step"], first["step"]) == (1, 0, 62)
    LAUNCH[script](tmp_path)  # finds the checkpoint and goes on from epoch 1
    ckpt = load_ckpt(tmp_path)
    assert ckpt["step"] == 124
    assert max_abs_diff(ckpt["model"], straight["model"]) < ATOL


@pytest.mark.slow
def test_ranks_resume_from_rank_0s_checkpoint(straight, stopped, tmp_path):
    """Rank 0 finds a checkpoint, rank 1 sees an empty directory (an output directory that is
    not shared between nodes). Rank 0 alone decides, reads and sends the checkpoint: both
    resume from step 62 and finish as an uninterrupted run would. Had rank 1 looked for itself,
    it would start from step 0 and the ranks' collectives would not match. (Also ddp_train.py's
    stop at an epoch boundary and resume, as test_stop_and_resume_at_an_epoch_boundary.)"""
    port = str(free_port())
    envs = [
        clean_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        for r in range(2)
    ]
    first = load_ckpt(stopped)
    assert (first["epoch"], first["epoch_step"], first["step"]) == (1, 0, 62)
    empty = tmp_path / "rank1"
    argv = ["ddp_train.py", *ARGS, *DIST_TIMEOUT, "--batch-size", "16", "--output-dir"]
    rank0, _ = run_ranks([[*argv, stopped], [*argv, empty]], envs, timeout=TIMEOUT)
    assert "resumed from" in rank0.stdout
    ckpt = load_ckpt(stopped)
    assert ckpt["step"] == 124
    assert max_abs_diff(ckpt["model"], straight["model"]) < ATOL
    assert not (empty / "checkpoint.pt").exists()  # only rank 0 writes


# What ddp_comm.py leaves out of ddp_train.py (its docstring names it). Blocks: the lines
# opening each, with what is indented under them or closes their bracket. Words: the lines of
# ddp_train.py holding one (the options left out, and the lines that name them).
LEFT_OUT_BLOCKS = (
    "def random_crop_flip(",
    "if args.augment:",
    "if args.sync_bn",
    "if args.eval_only:",
    "if args.compile:",
    'if args.amp == "fp16" and device.type == "cpu":',
    "def factor(step):",  # the cosine schedule's
)
LEFT_OUT_WORDS = (
    "--image-size",
    '"image_size"',
    "args.image_size",
    "--augment",
    "--tta",
    "args.tta",
    "tta_model",
    "MirrorAveraged",
    "--sync-bn",
    "--eval-only",
    "args.eval_only",
    "--compile",
    '"cosine"',
    "LambdaLR",
    "warmup = max(1, int(args.warmup * total_steps))",
    'if args.schedule == "onecycle":',
)


def indentation(line):
    return len(line) - len(line.lstrip())


def left_out(lines):
    """The indices of `lines` that LEFT_OUT_BLOCKS and LEFT_OUT_WORDS cover."""
    out = set()
    for i, line in enumerate(lines):
        if any(word in line for word in LEFT_OUT_WORDS):
            out.add(i)
        if not line.strip().startswith(LEFT_OUT_BLOCKS):
            continue
        indent = indentation(line)
        j = i + 1
        while j < len(lines) and (not lines[j].strip() or indentation(lines[j]) > indent):
            j += 1
        if line.rstrip().endswith("("):  # a statement over several lines: and its closing line
            j += 1
        out.update(range(i, j))
    return out


def missing_from_ddp_comm(train, comm):
    """The lines of ddp_train.py's source `train` (after its docstring) that are not left out
    and that ddp_comm.py's `comm` lacks, compared in order, indentation aside."""
    body = train.index('"""', 1) + 1
    train, comm = train[body:], comm[comm.index('"""', 1) + 1 :]
    skip = left_out(train)
    a, b = [line.strip() for line in train], [line.strip() for line in comm]
    lost = []
    for tag, i1, i2, _, _ in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag in ("delete", "replace"):
            lost += [train[i] for i in range(i1, i2) if i not in skip and a[i]]
    return lost


def test_ddp_comm_keeps_every_line_of_ddp_train():
    """ddp_comm.py is ddp_train.py plus marked lines, minus what it leaves out: every other
    line of ddp_train.py appears in it, in order. A line changed in one copy alone shows here as
    a line of ddp_train.py that ddp_comm.py lacks."""
    train = (ROOT / "ddp_train.py").read_text().splitlines()
    comm = (ROOT / "ddp_comm.py").read_text().splitlines()
    assert missing_from_ddp_comm(train, comm) == []
    # It sees a comment changed in ddp_comm.py alone, and code changed in ddp_train.py alone.
    i = next(i for i, line in enumerate(comm) if "every epoch repeats epoch 0's order" in line)
    edited = [*comm[:i], comm[i].replace("epoch 0's", "the first"), *comm[i + 1 :]]
    assert missing_from_ddp_comm(train, edited) == [comm[i]]
    i = train.index("        lr = args.lr * global_batch / 256")
    edited = [*train[:i], train[i].replace("256", "128"), *train[i + 1 :]]
    assert missing_from_ddp_comm(edited, comm) == [edited[i]]
