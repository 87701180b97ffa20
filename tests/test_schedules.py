"""The learning-rate schedules, seen where the optimizer uses them: the rate of each step.

--warmup 0 means no warm-up: the first step at the peak rate, in every copy of the loop
(one-cycle used to turn 0 into 0.1% of the run, which started at 1/25 of the peak once the run
had 1000 steps or more, and divided by zero at exactly 1000). model_parallel.py and
ddp_train.py --schedule cosine take training.warmup_decay's rates, step after step."""

import math

import pytest
import torch
from conftest import SYNTHETIC

import common
import ddp_comm
import ddp_mp_spawn
import ddp_train
import dp_train
import model_parallel

MAINS = {
    "dp_train": dp_train.main,
    "ddp_train": ddp_train.main,
    "ddp_comm": ddp_comm.main,
    # its main() spawns children: here its training function runs in this process
    "ddp_mp_spawn": lambda argv: ddp_mp_spawn.train(
        ddp_mp_spawn.get_args(argv), common.init_distributed_mode(device="cpu")
    ),
}
LR = 0.8  # per 256 samples


@pytest.fixture
def rates(monkeypatch):
    """The rate of the first parameter group at every optimizer step, as the step saw it."""
    seen = []
    step = torch.optim.SGD.step

    def spy(self, *args, **kwargs):
        seen.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.SGD, "step", spy)
    return seen


# 2000 synthetic samples in batches of 40: 50 steps an epoch. 0 became 0.1% of the run: at
# 21 epochs (1050 steps) the first step at 1/25 of the peak; at 20 (1000 steps) exactly one
# warm-up step, where OneCycleLR divides by zero (--warmup 0.001 too).
@pytest.mark.parametrize("script", sorted(MAINS))
@pytest.mark.parametrize("warmup, epochs", [("0", "21"), ("0.001", "20")])
def test_no_warmup_starts_at_the_peak(no_launcher, rates, script, warmup, epochs):
    argv = [*SYNTHETIC, "--model", "mlp", "--batch-size", "40", "--epochs", epochs]
    argv += ["--max-steps", "2", "--lr", str(LR), "--warmup", warmup]
    MAINS[script](argv)
    peak = LR * 40 / 256
    assert len(rates) == 2
    assert rates[0] == pytest.approx(peak, rel=1e-4), rates  # was peak / 25, or a crash
    assert rates[1] < rates[0]  # and decays from there


def cosine(peak, total, warm):
    """Linear warm-up over `warm` steps, then cosine decay to zero at `total`."""
    rates = [peak * (s + 1) / warm for s in range(warm)]
    done = [(s - warm) / (total - warm) for s in range(warm, total)]
    return rates + [peak * 0.5 * (1 + math.cos(math.pi * d)) for d in done]


@pytest.mark.parametrize("script", ["ddp_train", "ddp_comm"])
def test_cosine_schedule_rates(no_launcher, rates, script):
    """--schedule cosine: 62 steps (2000 / 32, one epoch), 10 of them warming up linearly;
    the first 20 taken."""
    argv = [*SYNTHETIC, "--model", "mlp", "--batch-size", "32", "--epochs", "1"]
    argv += ["--lr", str(LR), "--warmup", "0.17", "--schedule", "cosine", "--max-steps", "20"]
    MAINS[script](argv)
    assert rates == pytest.approx(cosine(LR * 32 / 256, 62, 10)[:20], rel=1e-6)  # int(0.17 * 62)


@pytest.mark.slow
def test_model_parallel_rates_and_resume(no_launcher, rates, tmp_path):
    """model_parallel.py's rates are the warm-up and cosine of the others, and a run resumed
    at an epoch goes on with the rates where it stopped (the schedule moved to its step)."""
    argv = [*SYNTHETIC, "--devices", "cpu", "--batch-size", "500", "--epochs", "2"]
    argv += ["--lr", "0.4", "--warmup", "0.25", "--output-dir", str(tmp_path)]
    info = common.DistInfo(False, 0, 0, 1, 1, torch.device("cpu"))
    model_parallel.train(model_parallel.get_args([*argv, "--max-steps", "4"]), info)
    model_parallel.train(model_parallel.get_args(argv), info)  # resumes at epoch 1
    assert rates == pytest.approx(cosine(0.4 * 500 / 256, 8, 2), rel=1e-6)  # 4 steps an epoch
