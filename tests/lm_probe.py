"""Run a sharded script's main() (its GPT on text) with instruments and write what each rank
saw to REPORTS/rank{RANK}.pt: `python ... tests/lm_probe.py SCRIPT REPORTS [TRAIN] -- ARGS`.
With TRAIN, the training set is cut to its first TRAIN windows, so that an epoch lasts a few
steps and a short run crosses an epoch boundary.

Per training step: the logits and labels the loss was taken of (this rank's tokens, one row
each), the loss, the rate, and every parameter's whole gradient as the optimizer is about to
step, in the optimizer's order (a split or sharded one gathered from its pieces: all ranks
participate). The same instruments serve fsdp_train.py, tensor_parallel.py,
context_parallel.py and expert_parallel.py.
"""

import importlib
import os
import sys
import types

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

script, reports, *train = sys.argv[1 : sys.argv.index("--")]
argv = sys.argv[sys.argv.index("--") + 1 :]
module = importlib.import_module(script.removesuffix(".py"))
seen = dict(logits=[], labels=[], losses=[], grads=[], rates=[])


def whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def cross_entropy(logits, labels, **kwargs):  # the training loss only (evaluate has its own)
    loss = torch.nn.functional.cross_entropy(logits, labels, **kwargs)
    seen["logits"].append(logits.detach().clone())
    seen["labels"].append(labels.clone())
    seen["losses"].append(loss.item())
    return loss


module.F = types.SimpleNamespace(**dict(vars(torch.nn.functional), cross_entropy=cross_entropy))
real_load = module.load_datasets


def load_datasets(*args, **kwargs):
    train_set, *rest = real_load(*args, **kwargs)
    if train:
        train_set = torch.utils.data.Subset(train_set, range(int(train[0])))
    return train_set, *rest


module.load_datasets = load_datasets
real_adamw = torch.optim.AdamW


real_param_groups = module.param_groups
order = []  # the model's parameters in its own order: a script may split AdamW's groups


def param_groups(model, *args, **kwargs):
    order[:] = list(model.parameters())
    return real_param_groups(model, *args, **kwargs)


def adamw(params, *args, **kwargs):
    optimizer = real_adamw(params, *args, **kwargs)
    seen["betas"] = [tuple(group["betas"]) for group in optimizer.param_groups]
    seen["fused"] = optimizer.defaults["fused"]

    def before_step(optimizer, *_):
        seen["grads"].append([whole(p.grad).clone() for p in order])
        seen["rates"].append(optimizer.param_groups[0]["lr"])

    optimizer.register_step_pre_hook(before_step)
    return optimizer


torch.optim.AdamW, module.param_groups = adamw, param_groups
real_cleanup = module.cleanup


def report():
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.save(seen, os.path.join(reports, f"rank{rank}.pt"))
    real_cleanup()


module.cleanup = report
module.main(argv)
