"""Local SGD (--local-sgd-period) and ZeRO (--zero) in ddp_comm.py, 2 processes on gloo.

Local SGD: between averaging steps the ranks' weights differ and nothing is sent; right after
one they are identical; over K steps it sends 1/K of plain DDP's bytes; with K = 1 it is plain
DDP; a resume goes on exactly. ZeRO: each rank keeps only its share of the momentum, the
steps are plain DDP's, and the checkpoint (the whole state, gathered on rank 0) resumes
exactly, also at another world size. And what ddp_comm.py prints it sends per step is what
its collectives were handed, counted.
"""

import itertools
import re

import pytest
import torch
from conftest import (
    DIST_TIMEOUT,
    MLP_ARGS,
    ROOT,
    SYNTHETIC,
    assert_state_close,
    load_ckpt,
    read_metrics,
    run_python,
    torchrun_workers,
)

import ddp_comm
import models

ATOL = 1e-5  # 2 processes against one: 5 steps of float rounding, as in test_parity.py

# Run under torchrun in place of ddp_comm.py, it records on each rank: the bytes handed to
# the collectives and the model's weights before each training forward, that is after 0, 1, 2,
# ... optimizer steps and whatever followed them (an averaging); with --zero, the numbers held
# in the optimizer's state after each step. Without a hook DDP all-reduces in C++, out of the
# count's reach: there the probe registers default_hooks.allreduce_hook, the same all-reduce
# through torch.distributed.all_reduce.
PROBE = f"""
import os, sys
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer
sys.path.insert(0, {str(ROOT)!r})
import common, ddp_comm, models

register = ddp_comm.register_comm_hook
def register_or_count(model, args, *rest):
    state = register(model, args, *rest)
    if args.comm_hook == "none" and not args.local_sgd_period:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    return state
ddp_comm.register_comm_hook = register_or_count

sent, records = [0], []
def counted(collective):
    def call(tensor, *args, **kwargs):
        sent[0] += tensor.numel() * tensor.element_size()
        return collective(tensor, *args, **kwargs)
    return call
dist.all_reduce, dist.broadcast = counted(dist.all_reduce), counted(dist.broadcast)
coalesced = dist._broadcast_coalesced
def broadcast_coalesced(group, tensors, *args):  # DDP's broadcast of rank 0's buffers
    sent[0] += sum(t.numel() * t.element_size() for t in tensors)
    return coalesced(group, tensors, *args)
dist._broadcast_coalesced = broadcast_coalesced

def before_forward(module, inputs):
    if isinstance(module, (models.MLP, models.SmallCNN)) and module.training:
        records.append((torch.cat([p.detach().reshape(-1) for p in module.parameters()]), sent[0]))
torch.nn.modules.module.register_module_forward_pre_hook(before_forward)

held, zero_step = [], ZeroRedundancyOptimizer.step
def step_and_count(self, *args, **kwargs):
    loss = zero_step(self, *args, **kwargs)
    states = self.optim.state.values()
    held.append(sum(t.numel() for s in states for t in s.values() if torch.is_tensor(t)))
    return loss
ZeroRedundancyOptimizer.step = step_and_count

ddp_comm.main(sys.argv[1:])
out = sys.argv[sys.argv.index("--output-dir") + 1]
torch.save(dict(records=records, held=held), os.path.join(out, f"rank{{os.environ['RANK']}}.pt"))
"""


def probe(tmp_path, nproc, args):
    """torchrun ddp_comm.py's `args` (--output-dir tmp_path) under PROBE; its output, and
    what each rank recorded."""
    (tmp_path / "probe.py").write_text(PROBE)
    proc = torchrun_workers(nproc, [tmp_path / "probe.py", *args, "--output-dir", tmp_path])
    return proc, [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(nproc)]


def sent_per_step(record):
    """The bytes a rank handed to the collectives in each step (between training forwards)."""
    sent = [b for _, b in record["records"]]
    return [after - before for before, after in itertools.pairwise(sent)]


def says_it_sends(proc):
    """The bytes per rank per step that ddp_comm.py prints."""
    said = re.search(r"sends: ([\d.]+) MB per rank per step", proc.stdout)
    assert said, proc.stdout
    return float(said[1]) * 2**20


MLP_BYTES = 4 * sum(p.numel() for p in models.build_model("mlp", 1, 10).parameters())


@pytest.mark.parametrize(
    "flags, share",
    [
        pytest.param([], 1, marks=pytest.mark.slow),
        pytest.param(["--comm-hook", "bf16"], 0.5, marks=pytest.mark.slow),
        (["--zero"], 2),  # the quick tier's: DDP's all-reduce and ZeRO's broadcast
    ],
)
def test_it_says_what_it_hands_to_the_collectives(tmp_path, flags, share):
    # Plain DDP all-reduces every fp32 gradient; bf16 sends 2 bytes a number; ZeRO then
    # broadcasts as many bytes of weights (each rank its share, every rank takes part).
    args = [*MLP_ARGS, "--batch-size", "16", "--log-every", "1000", *flags]
    proc, ranks = probe(tmp_path, 2, args)
    for rank in ranks:
        assert sent_per_step(rank) == [share * MLP_BYTES] * 4  # steps 1-4 of 5
    assert says_it_sends(proc) == pytest.approx(share * MLP_BYTES, abs=100)


@pytest.mark.slow
def test_local_sgd_averages_every_k_steps_and_sends_1_over_k(tmp_path):
    start, k, steps = 4, 4, 16
    flags = ["--local-sgd-period", k, "--local-sgd-start", start, "--log-every", 1000]
    # One step more than recorded: the last forward shows the weights after `steps` steps.
    proc, ranks = probe(
        tmp_path, 2, [*MLP_ARGS, "--batch-size", "16", *flags, "--max-steps", steps + 1]
    )
    weights = [[w for w, _ in rank["records"]] for rank in ranks]
    per_step = sent_per_step(ranks[0])  # step s + 1 is per_step[s]
    assert len(per_step) == steps

    for s in range(steps + 1):  # the weights after s steps
        same = torch.equal(weights[0][s], weights[1][s])
        if s <= start:
            assert same, f"step {s}: plain DDP steps keep the ranks equal"
        elif (s - start) % k == 0:
            assert same, f"step {s}: right after averaging every rank holds the same weights"
        else:
            gap = (weights[0][s] - weights[1][s]).abs().max().item()
            assert gap > 1e-4, (
                f"step {s}: between averagings each rank follows its own gradients ({gap})"
            )

    plain = per_step[:start]  # the DDP steps: every gradient all-reduced
    assert plain == [MLP_BYTES] * start
    local = per_step[start : start + 3 * k]  # three periods of local steps
    between = [b for i, b in enumerate(local) if (i + 1) % k]
    assert between == [0] * (3 * (k - 1))  # nothing sent between averagings
    assert sum(local) / len(local) == pytest.approx(plain[0] / k, rel=1e-9)
    # What the run says it sends is what was counted.
    assert says_it_sends(proc) == pytest.approx(plain[0] / k, abs=100)

    # It learns: chance is 0.1 on the synthetic set's 10 classes.
    assert read_metrics(tmp_path)[-1]["test_acc"] > 0.9


@pytest.mark.slow
def test_local_sgd_with_period_1_is_plain_ddp(tmp_path, mlp_reference):
    # Average after every step: the mean of the ranks' SGD steps is the step on the mean
    # gradient (weight decay and momentum are linear), that is DDP's, up to rounding.
    flags = ["--local-sgd-period", "1", "--local-sgd-start", "0"]
    torchrun_workers(
        2, ["ddp_comm.py", *MLP_ARGS, "--batch-size", "16", *flags, "--output-dir", tmp_path]
    )
    ckpt, reference = load_ckpt(tmp_path), load_ckpt(mlp_reference)
    assert ckpt["step"] == reference["step"] == 5
    assert_state_close(ckpt["model"], reference["model"], atol=ATOL)
    # The checkpoint holds the ranks' averaged momentum: DDP's, as all is linear.
    assert_state_close(ckpt["optimizer"]["state"], reference["optimizer"]["state"], atol=ATOL)


@pytest.mark.slow
def test_local_sgd_resume_goes_on_exactly(tmp_path):
    # A snapshot averages the momentum too and the step count sets the averaging schedule, so
    # stopping at the step-6 snapshot (mid-period: averaged at 8, 12) and resuming ends where a
    # run that saved at step 6 and went on does, bit for bit.
    args = [
        *MLP_ARGS,
        "--batch-size",
        "16",
        "--local-sgd-period",
        "4",
        "--local-sgd-start",
        "4",
        "--save-every",
        "6",
    ]
    torchrun_workers(
        2, ["ddp_comm.py", *args, "--max-steps", "12", "--output-dir", tmp_path / "straight"]
    )
    torchrun_workers(
        2, ["ddp_comm.py", *args, "--max-steps", "6", "--output-dir", tmp_path / "stopped"]
    )
    proc = torchrun_workers(
        2, ["ddp_comm.py", *args, "--max-steps", "12", "--output-dir", tmp_path / "stopped"]
    )
    assert "resumed from" in proc.stdout and "step 6 of" in proc.stdout
    straight, resumed = load_ckpt(tmp_path / "straight"), load_ckpt(tmp_path / "stopped")
    assert straight["step"] == resumed["step"] == 12
    assert_state_close(resumed["model"], straight["model"], atol=0)
    assert_state_close(resumed["optimizer"]["state"], straight["optimizer"]["state"], atol=0)


# ----------------------------------------------------------------------------------------
# ZeRO


@pytest.fixture(scope="module")
def zero_stopped(tmp_path_factory):
    """2 processes with --zero, stopped after 2 of MLP_ARGS's 5 steps."""
    out = tmp_path_factory.mktemp("zero_stopped")
    torchrun_workers(
        2,
        [
            "ddp_comm.py",
            *MLP_ARGS,
            "--batch-size",
            "16",
            "--zero",
            "--max-steps",
            "2",
            "--output-dir",
            out,
        ],
    )
    return out


@pytest.mark.slow
def test_zero_checkpoint_holds_the_whole_state(zero_stopped):
    ckpt = load_ckpt(zero_stopped)
    assert ckpt["step"] == 2
    params = models.build_model("mlp", 1, 10).state_dict()
    # Gathered from both ranks: a momentum buffer for every parameter, in the plain SGD format.
    momentum = [s["momentum_buffer"].shape for s in ckpt["optimizer"]["state"].values()]
    assert momentum == [p.shape for p in params.values()]


@pytest.mark.slow
def test_zero_resumed_equals_plain_ddp(tmp_path, zero_stopped, mlp_reference):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes((zero_stopped / "checkpoint.pt").read_bytes())
    proc = torchrun_workers(
        2, ["ddp_comm.py", *MLP_ARGS, "--batch-size", "16", "--zero", "--output-dir", out]
    )
    assert "resumed from" in proc.stdout and "at epoch 0, step 2" in proc.stdout
    ckpt, reference = load_ckpt(out), load_ckpt(mlp_reference)
    assert ckpt["step"] == 5
    # 2 steps, a stop, 3 more: one process's uninterrupted 5 steps of plain SGD, momentum too.
    assert_state_close(ckpt["model"], reference["model"], atol=ATOL)
    assert_state_close(ckpt["optimizer"]["state"], reference["optimizer"]["state"], atol=ATOL)


@pytest.mark.slow
def test_zero_checkpoint_loads_at_another_world_size(tmp_path, zero_stopped):
    # 3 processes with --zero (each takes its third of the gathered momentum) against one
    # process with plain SGD, the same global batch of 48. Another world size restarts the
    # epoch: both train 5 steps from the checkpoint's weights and momentum.
    resume = ["--resume", zero_stopped / "checkpoint.pt"]
    run_python(
        ["ddp_comm.py", *MLP_ARGS, "--batch-size", "48", *resume, "--output-dir", tmp_path / "one"]
    )
    proc = torchrun_workers(
        3,
        [
            "ddp_comm.py",
            *MLP_ARGS,
            "--batch-size",
            "16",
            "--zero",
            *resume,
            "--output-dir",
            tmp_path / "three",
        ],
    )
    assert "resumed from" in proc.stdout and "3 process(es)" in proc.stdout
    one, three = load_ckpt(tmp_path / "one"), load_ckpt(tmp_path / "three")
    assert one["step"] == three["step"] == 5
    assert_state_close(three["model"], one["model"], atol=ATOL)
    assert_state_close(three["optimizer"]["state"], one["optimizer"]["state"], atol=ATOL)
    # Had the momentum been dropped, the weights would be this far apart.
    assert (
        three["model"]["1.weight"] - load_ckpt(zero_stopped)["model"]["1.weight"]
    ).abs().max() > 100 * ATOL


@pytest.mark.slow
def test_zero_shards_the_momentum_also_with_powersgd(tmp_path):
    # The small CNN: ZeRO deals out whole tensors, largest first, each to the rank holding the
    # fewest numbers so far, so the split is as even as the tensors allow. PowerSGD compresses
    # the gradients that ZeRO then steps with (from the third step).
    args = [
        *SYNTHETIC,
        *DIST_TIMEOUT,
        "--max-steps",
        "4",
        "--log-every",
        "1000",
        "--zero",
        "--comm-hook",
        "powersgd",
        "--powersgd-start",
        "2",
    ]
    proc, ranks = probe(tmp_path, 2, args)
    held = [rank["held"] for rank in ranks]
    sizes = sorted((p.numel() for p in models.build_model("cnn", 1, 10).parameters()), reverse=True)
    expected = [0, 0]
    for size in sizes:
        expected[expected.index(min(expected))] += size
    assert held == [[expected[0]] * 4, [expected[1]] * 4]  # each rank's momentum, after each step
    assert sum(expected) == sum(sizes)
    assert max(expected) < 0.65 * sum(sizes)  # the largest tensor holds 63%
    assert "powersgd: 6.0x fewer" in proc.stdout  # rank 4 of the CNN's weight matrices
    # Step 3, the first compressed one: PowerSGD's factors, ZeRO's broadcast of the weights and
    # DDP's of BatchNorm's statistics, as it says.
    sent = sent_per_step(ranks[0])
    assert sent[2] < sent[1] and says_it_sends(proc) == pytest.approx(sent[2], abs=100)


# ----------------------------------------------------------------------------------------
# Combinations that cannot work


def error_line(main, argv):
    with pytest.raises(SystemExit) as excinfo:
        main([str(a) for a in argv])
    message = excinfo.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, (
        message
    )
    return message


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--local-sgd-period", "4"], "2 or more processes"),  # one process: nothing to average
        (["--local-sgd-period", "4", "--comm-hook", "fp16"], "--comm-hook"),
        (["--local-sgd-period", "4", "--zero"], "--zero"),
        (["--local-sgd-start", "3"], "needs --local-sgd-period"),
        (["--local-sgd-period", "0"], "--local-sgd-period must be at least 1"),
        (
            ["--local-sgd-period", "2", "--local-sgd-start", "-1"],
            "--local-sgd-start cannot be negative",
        ),
    ],
)
def test_bad_combination_is_one_line(tmp_path, flags, words):
    out = tmp_path / "out"
    assert words in error_line(
        ddp_comm.main, [*SYNTHETIC, "--max-steps", "1", *flags, "--output-dir", out]
    )
    assert not out.exists()  # refused before anything was written


@pytest.mark.parametrize("flags", [["--comm-hook", "powersgd"], ["--local-sgd-period", "4"]])
def test_fp16_is_refused_whatever_the_number_of_processes(flags):
    # PowerSGD's error feedback would keep an overflow's inf for good. Local SGD's ranks each
    # skip the steps their own fp16 gradients overflow, and only rank 0's scaler is saved: it
    # was accepted, under torchrun too. get_args refuses both before any process group.
    message = error_line(ddp_comm.get_args, [*flags, "--amp", "fp16"])
    assert "cannot take --amp fp16" in message
