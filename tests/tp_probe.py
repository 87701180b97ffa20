"""Run tensor_parallel.main() with instruments and write what rank 0 saw to REPORTS/rank0.pt
(every rank: REPORTS/rank{RANK}.pt): `python -m torch.distributed.run ... tests/tp_probe.py
REPORTS [TRAIN] -- ARGS`. With TRAIN, the training set is cut to its first TRAIN samples, so
that an epoch lasts a few steps and a short run crosses an epoch boundary.

Per training step: the logits and labels of this rank's batch, the loss, the norm that
clip_grad_norm returned, and every parameter's whole gradient as the optimizer is about to
step (a split one gathered from its pieces: all ranks participate). At the end, per
parameter: its whole shape, the shape this rank holds, and the shapes of its AdamW state.
"""

import os
import sys
import types

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tensor_parallel  # noqa: E402

reports, *train = sys.argv[1 : sys.argv.index("--")]
argv = sys.argv[sys.argv.index("--") + 1 :]
seen = dict(logits=[], labels=[], losses=[], norms=[], grads=[], shapes=[])
optimizers = []


def whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def cross_entropy(logits, labels, **kwargs):  # the training loss only (evaluate has its own)
    loss = torch.nn.functional.cross_entropy(logits, labels, **kwargs)
    seen["logits"].append(logits.detach().clone())
    seen["labels"].append(labels.clone())
    seen["losses"].append(loss.item())
    return loss


real_load = tensor_parallel.load_datasets


def load_datasets(*args, **kwargs):
    train_set, *rest = real_load(*args, **kwargs)
    if train:
        n = int(train[0])
        train_set = torch.utils.data.Subset(train_set, range(n))  # images or text windows
    return train_set, *rest


tensor_parallel.load_datasets = load_datasets
tensor_parallel.F = types.SimpleNamespace(cross_entropy=cross_entropy)

real_clip = tensor_parallel.clip_grad_norm


def clip(*args, **kwargs):
    norm = real_clip(*args, **kwargs)
    seen["norms"].append(norm.item())
    return norm


tensor_parallel.clip_grad_norm = clip

real_adamw = torch.optim.AdamW


def adamw(params, *args, **kwargs):
    optimizer = real_adamw(params, *args, **kwargs)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    seen["fused"] = optimizer.defaults["fused"]
    names = {id(p): n for n, p in model_params[-1]} if model_params else {}

    def before_step(optimizer, *_):
        grads = {names.get(id(p), str(i)): whole(p.grad).clone() for i, p in enumerate(params)}
        seen["grads"].append(grads)

    optimizer.register_step_pre_hook(before_step)
    optimizers.append(optimizer)
    return optimizer


torch.optim.AdamW = adamw
model_params = []
real_build = tensor_parallel.build_model


def build_model(*args, **kwargs):
    model = real_build(*args, **kwargs)

    class Named(type(model)):
        def parameters(self, *args, **kwargs):  # called by the optimizer, after the split
            model_params[-1] = list(self.named_parameters())
            return super().parameters(*args, **kwargs)

    model.__class__ = Named
    model_params.append(None)  # filled when the optimizer is made
    return model


tensor_parallel.build_model = build_model
real_cleanup = tensor_parallel.cleanup


def report():
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    if optimizers:
        (optimizer,) = optimizers
        for name, p in model_params[-1]:
            state = [list(local(optimizer.state[p][k]).shape) for k in ("exp_avg", "exp_avg_sq")]
            seen["shapes"].append((name, list(p.shape), list(local(p).shape), state))
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.save(seen, os.path.join(reports, f"rank{rank}.pt"))
    real_cleanup()


tensor_parallel.cleanup = report
tensor_parallel.main(argv)
