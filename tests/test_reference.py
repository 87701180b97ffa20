"""ddp_train.py's training flags against a reference written here, independently of it.

Two processes (torchrun's workers), with every hyper-parameter away from its default, take the
steps that a plain single-process loop written out below takes on the whole global batch:
the same samples (DistributedSampler's permutation of (seed, epoch)), the same loss (label
smoothing), gradient accumulation, clipping of the whole gradient's norm, Nesterov SGD with
weight decay, and the cosine schedule with its linear warm-up, computed here from its
formula. A flag that did nothing, or did it on one rank's half of the gradient, shows.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DIST_TIMEOUT, SYNTHETIC, load_ckpt, max_abs_diff, torchrun_workers

import data
import models

STEPS = 12
FLAGS = dict(
    lr=0.6, momentum=0.8, weight_decay=2e-3, label_smoothing=0.2, warmup=0.1, seed=3, clip_grad=1.8
)
# --clip-grad 1.8 lies among the 12 steps' gradient norms (1.58 to 1.96): half the steps are
# clipped, half not. Were every step clipped, clipping would hide a gradient off by a factor
# (the micro-batches' losses summed, not averaged, passed this test at --clip-grad 0.5).
PER_RANK, ACCUM, WORLD, EPOCHS = 8, 2, 2, 1  # 62 steps/epoch, 6 of them warm-up


def reference_weights():
    train_set, _, _, _ = data.load_datasets("synthetic", "unused")
    torch.manual_seed(FLAGS["seed"])
    model = models.build_model("mlp", 1, 10)
    global_batch = PER_RANK * ACCUM * WORLD
    peak = FLAGS["lr"] * global_batch / 256  # the linear scaling rule
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=peak,
        momentum=FLAGS["momentum"],
        nesterov=True,
        weight_decay=FLAGS["weight_decay"],
    )
    steps_per_epoch = len(train_set) // WORLD // PER_RANK // ACCUM
    total = EPOCHS * steps_per_epoch
    warmup = int(FLAGS["warmup"] * total)
    # Epoch 0's order: what DistributedSampler shuffles; rank r takes order[r::WORLD], so one
    # step's samples over both ranks are order[32t : 32t + 32].
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(FLAGS["seed"]))
    norms = []
    for t in range(STEPS):
        # a linear warm-up to the peak, then a cosine decay to zero
        warm, decay = (
            (t + 1) / warmup,
            0.5 * (1 + math.cos(math.pi * (t - warmup) / (total - warmup))),
        )
        factor = warm if t < warmup else decay
        for group in optimizer.param_groups:
            group["lr"] = peak * factor
        images, labels = train_set[order[t * global_batch : (t + 1) * global_batch]]
        loss = F.cross_entropy(model(images), labels, label_smoothing=FLAGS["label_smoothing"])
        optimizer.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), FLAGS["clip_grad"]))
        optimizer.step()
    return model.state_dict(), norms


@pytest.mark.slow
def test_two_processes_take_the_reference_steps(tmp_path):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in FLAGS.items()]
    argv = [*SYNTHETIC, *DIST_TIMEOUT, "--model", "mlp", "--schedule", "cosine", *flags]
    argv += [
        "--batch-size",
        PER_RANK,
        "--accum-steps",
        ACCUM,
        "--epochs",
        EPOCHS,
        "--max-steps",
        STEPS,
    ]
    torchrun_workers(WORLD, ["ddp_train.py", *argv, "--output-dir", tmp_path])
    expected, norms = reference_weights()
    assert min(norms) < FLAGS["clip_grad"] < max(norms)  # some steps clipped, some not
    got = load_ckpt(tmp_path)["model"]
    assert max_abs_diff(got, expected) < 1e-5
    torch.manual_seed(FLAGS["seed"])
    assert max_abs_diff(models.build_model("mlp", 1, 10).state_dict(), expected) > 1e-3  # it moved
