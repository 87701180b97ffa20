"""Run context_parallel.main() with instruments and write what rank 0 saw to REPORTS/rank0.pt
(every rank: REPORTS/rank{RANK}.pt): `python -m torch.distributed.run ... tests/cp_probe.py
REPORTS [TRAIN] -- ARGS`. With TRAIN, the training set is cut to its first TRAIN samples, so
that an epoch lasts a few steps and a short run crosses an epoch boundary.

Per training step: the logits and labels of this rank's batch, the loss, the norm that
clip_grad_norm_ returned, and every parameter's whole gradient as the optimizer is about to
step (a sharded one gathered from its shards: all ranks participate).
"""

import os
import sys
import types

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import context_parallel  # noqa: E402

reports, *train = sys.argv[1 : sys.argv.index("--")]
argv = sys.argv[sys.argv.index("--") + 1 :]
seen = dict(logits=[], labels=[], losses=[], norms=[], grads=[])
names = {}


def whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def cross_entropy(logits, labels, **kwargs):  # the training loss only (evaluate has its own)
    loss = torch.nn.functional.cross_entropy(logits, labels, **kwargs)
    seen["logits"].append(logits.detach().clone())
    seen["labels"].append(labels.clone())
    seen["losses"].append(loss.item())
    return loss


def clip_grad_norm_(*args, **kwargs):
    norm = torch.nn.utils.clip_grad_norm_(*args, **kwargs)
    seen["norms"].append(whole(norm).item())
    return norm


real_load = context_parallel.load_datasets


def load_datasets(*args, **kwargs):
    train_set, *rest = real_load(*args, **kwargs)
    if train:
        n = int(train[0])
        train_set = torch.utils.data.Subset(train_set, range(n))  # images or text windows
    return train_set, *rest


context_parallel.load_datasets = load_datasets
functional = vars(torch.nn.functional) | dict(cross_entropy=cross_entropy)
context_parallel.F = types.SimpleNamespace(**functional)
context_parallel.nn = types.SimpleNamespace(
    utils=types.SimpleNamespace(clip_grad_norm_=clip_grad_norm_)
)
real_adamw = torch.optim.AdamW


def adamw(params, *args, **kwargs):
    optimizer = real_adamw(params, *args, **kwargs)
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def before_step(optimizer, *_):
        seen["grads"].append({names[id(p)]: whole(p.grad).clone() for p in params})

    optimizer.register_step_pre_hook(before_step)
    return optimizer


torch.optim.AdamW = adamw


def named(model_class):
    class Named(model_class):
        def parameters(self, *args, **kwargs):  # called by the optimizer, after fully_shard
            names.update({id(p): n for n, p in self.named_parameters()})
            return super().parameters(*args, **kwargs)

    return Named


context_parallel.LongViT = named(context_parallel.LongViT)
context_parallel.LongGPT = named(context_parallel.LongGPT)
real_cleanup = context_parallel.cleanup


def report():
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.save(seen, os.path.join(reports, f"rank{rank}.pt"))
    real_cleanup()


context_parallel.cleanup = report
context_parallel.main(argv)
