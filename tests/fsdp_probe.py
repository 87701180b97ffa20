"""Run fsdp_train.main() under a launcher with instruments, and write what they saw to
REPORTS/rank{RANK}.json: `python -m torch.distributed.run ... tests/fsdp_probe.py MODE REPORTS
-- ARGS`. MODE may join several with "+" (collectives+clip).

MODE shards: per parameter, its whole shape, the shape of the shard this rank holds, and the
    shapes of its AdamW state on this rank, read off the local tensors at the end of training.
MODE collectives: FSDP's all-gathers and reduce-scatters, with their dtypes, in forward
    (outside autograd's backward pass) and in backward, per training step.
MODE recompute: calls of the ViT blocks' forward per training step.
MODE clip: the gradient norm that clip_grad_norm_ returned at each step.
MODE crash-in-save: the second checkpoint's shards are written, then the process dies.
MODE crash-in-async-save: the second background save is started, then the process dies.
MODE build: per fully_shard call, whether every parameter and buffer it got was on the meta
    device, and its mesh's device type; rank 0 also writes the whole model's state as built
    (gathered from the shards) to REPORTS/initial.pt.
MODE groups: the timeout, in seconds, of every process group fsdp_train.py makes itself.
MODE short-test: the test set cut to its first 24 samples (an evaluation of all 499 was 80% of
    a one-step bf16 ResNet-18 run on the CPU).
Every mode: the indices the training sampler gave this rank, a list per epoch ("order").
"""

import itertools
import json
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import data  # noqa: E402
import fsdp_train  # noqa: E402
import models  # noqa: E402

modes, reports, argv = sys.argv[1].split("+"), sys.argv[2], sys.argv[sys.argv.index("--") + 1 :]
seen = Counter()  # and lists
optimizers = []


def in_backward():
    return torch._C._current_graph_task_id() != -1


def count(name, kind):
    real = getattr(dist, name)

    def wrapper(*args, **kwargs):
        tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
        if not evaluating:
            phase = "backward" if in_backward() else "forward"
            seen[f"{kind} {phase} {str(tensor.dtype).split('.')[-1]}"] += 1
        return real(*args, **kwargs)

    setattr(dist, name, wrapper)


evaluating = False
real_evaluate = fsdp_train.evaluate


def evaluate(*args, **kwargs):  # its forwards are not training's
    global evaluating
    evaluating = True
    return real_evaluate(*args, **kwargs)


fsdp_train.evaluate = evaluate


class Sampler(data.DistributedSampler):
    def __iter__(self):
        order = list(super().__iter__())
        seen.setdefault("order", []).append(order)  # one per epoch
        return iter(order)


data.DistributedSampler = Sampler  # what data.shard_loaders makes

if "collectives" in modes:
    # FSDP2's collectives, named by PyTorch release.
    for name, kind in [
        ("all_gather_single", "all_gather"),
        ("all_gather_into_tensor", "all_gather"),
        ("reduce_scatter_single", "reduce_scatter"),
        ("reduce_scatter_tensor", "reduce_scatter"),
    ]:
        if hasattr(dist, name):
            count(name, kind)
if "recompute" in modes:
    real_forward = models.Block.forward

    def forward(self, x):
        seen["block forward"] += not evaluating and x.device.type != "meta"  # not the FLOP count
        return real_forward(self, x)

    models.Block.forward = forward
if "shards" in modes:
    real_adamw = torch.optim.AdamW

    def adamw(*args, **kwargs):
        optimizers.append(real_adamw(*args, **kwargs))
        return optimizers[-1]

    torch.optim.AdamW = adamw
if "clip" in modes:
    real_clip = torch.nn.utils.clip_grad_norm_

    def clip(*args, **kwargs):
        norm = real_clip(*args, **kwargs)
        whole = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        seen.setdefault("norms", []).append(whole.item())
        return norm

    torch.nn.utils.clip_grad_norm_ = clip
if "crash-in-save" in modes:
    import torch.distributed.checkpoint as dcp

    real_save = dcp.save

    def save(*args, **kwargs):
        real_save(*args, **kwargs)
        seen["saves"] += 1
        if seen["saves"] == 2:
            os._exit(9)  # every rank, after its shards and before meta.pt and the renames

    dcp.save = save  # what fsdp_train.py calls
if "crash-in-async-save" in modes:
    import torch.distributed.checkpoint as dcp

    real_async_save = dcp.async_save

    def async_save(*args, **kwargs):
        future = real_async_save(*args, **kwargs)
        seen["saves"] += 1
        if seen["saves"] == 2:
            os._exit(9)  # every rank, while its pieces may still be being written
        return future

    dcp.async_save = async_save
if "groups" in modes:
    real_new_group = dist.new_group

    def new_group(*args, **kwargs):
        timeout = kwargs.get("timeout")
        seen.setdefault("group_timeouts", []).append(timeout and timeout.total_seconds())
        return real_new_group(*args, **kwargs)

    fsdp_train.dist.new_group = new_group
if "build" in modes:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    real_fully_shard, real_fill = fsdp_train.fully_shard, fsdp_train.fill_initial

    def fully_shard(module, **kwargs):
        tensors = itertools.chain(module.parameters(), module.buffers())
        seen.setdefault("meta", []).append(all(t.is_meta for t in tensors))
        seen.setdefault("mesh", []).append(kwargs["mesh"].device_type)
        return real_fully_shard(module, **kwargs)

    def fill_initial(model, *args, **kwargs):  # the fill, after the meta build
        real_fill(model, *args, **kwargs)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)  # all ranks participate
        if not dist.is_initialized() or dist.get_rank() == 0:
            torch.save(state, os.path.join(reports, "initial.pt"))

    fsdp_train.fully_shard, fsdp_train.fill_initial = fully_shard, fill_initial

if "short-test" in modes:
    real_load = fsdp_train.load_datasets

    def load_datasets(*args, **kwargs):
        train_set, test_set, *rest = real_load(*args, **kwargs)
        return train_set, torch.utils.data.Subset(test_set, range(24)), *rest

    fsdp_train.load_datasets = load_datasets

real_cleanup = fsdp_train.cleanup


def report():
    if optimizers:
        (optimizer,) = optimizers
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        shapes = seen.setdefault("shapes", [])  # per parameter: (whole, local, local state)
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = [
                    list(local(optimizer.state[p][k]).shape) for k in ("exp_avg", "exp_avg_sq")
                ]
                shapes.append((list(p.shape), list(local(p).shape), state))
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(os.path.join(reports, f"rank{rank}.json"), "w") as f:
        json.dump(dict(rank=rank, **seen), f)
    real_cleanup()


fsdp_train.cleanup = report
fsdp_train.main(argv)
