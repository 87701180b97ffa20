"""Run expert_parallel.main() with instruments and write what each rank saw to
REPORTS/rank{RANK}.pt: `python -m torch.distributed.run ... tests/ep_probe.py REPORTS -- ARGS`.

Per training step: the logits and labels of this rank's batch, its cross-entropy loss, each
block's balancing loss (this rank's share), the norm that clip_grad_norm returned, and every
parameter's whole gradient as the optimizer is about to step (the experts gathered from their
processes: all ranks participate). Every routing (each block's forward): the experts chosen
per token and which choices fit. Every all-to-all of rows: the sizes sent and received. At
the end, per parameter: its whole shape, this rank's piece (and the shapes of its AdamW state);
and the device of each whole model built.
"""

import os
import sys
import types

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import expert_parallel  # noqa: E402

reports, argv = sys.argv[1], sys.argv[sys.argv.index("--") + 1 :]
seen = dict(logits=[], labels=[], losses=[], aux=[], norms=[], grads=[], routes=[], sizes=[])
seen["pieces"], seen["builds"] = [], []
optimizers, models = [], []


def whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def cross_entropy(logits, labels, **kwargs):  # the training loss only (evaluate has its own)
    loss = torch.nn.functional.cross_entropy(logits, labels, **kwargs)
    seen["logits"].append(logits.detach().clone())
    seen["labels"].append(labels.clone())
    seen["losses"].append(loss.item())
    return loss


expert_parallel.F = types.SimpleNamespace(
    cross_entropy=cross_entropy, gelu=torch.nn.functional.gelu
)
real_route = expert_parallel.MoE.route


def route(self, x):
    logits, expert, weight, kept = real_route(self, x)
    if self.training:
        seen["routes"].append((expert.clone(), kept.clone()))
    return logits, expert, weight, kept


expert_parallel.MoE.route = route
real_all_to_all = expert_parallel.all_to_all_single_autograd


def all_to_all(h, recv, send, group):
    seen["sizes"].append((list(send), list(recv)))
    return real_all_to_all(h, recv, send, group)


expert_parallel.all_to_all_single_autograd = all_to_all
real_clip = expert_parallel.clip_grad_norm


def clip(*args, **kwargs):
    norm = real_clip(*args, **kwargs)
    seen["norms"].append(norm.item())
    return norm


expert_parallel.clip_grad_norm = clip
real_adamw = torch.optim.AdamW


def adamw(params, *args, **kwargs):
    optimizer = real_adamw(params, *args, **kwargs)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    names = {id(p): n for n, p in models[-1].named_parameters()}

    def before_step(optimizer, *_):
        grads = {names[id(p)]: whole(p.grad).clone() for p in params}
        seen["grads"].append(grads)

    optimizer.register_step_pre_hook(before_step)
    optimizers.append(optimizer)
    return optimizer


torch.optim.AdamW = adamw
real_balance_loss = expert_parallel.balance_loss


def balance_loss(moes):
    aux = real_balance_loss(moes)
    seen["aux"].append([m.aux_loss.item() for m in moes])
    return aux


expert_parallel.balance_loss = balance_loss
real_with_experts = expert_parallel.with_experts


def with_experts(*args, **kwargs):
    model = real_with_experts(*args, **kwargs)
    seen["builds"].append(str(model.pos.device))  # where each whole model was built
    if not models:  # the first: the model trained (then the shapes its fill draws from)
        models.append(model)
    return model


expert_parallel.with_experts = with_experts
real_cleanup = expert_parallel.cleanup


def report():
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    if optimizers:
        (optimizer,) = optimizers
        for name, p in models[-1].named_parameters():
            state = [list(local(optimizer.state[p][k]).shape) for k in ("exp_avg", "exp_avg_sq")]
            seen["pieces"].append((name, list(p.shape), local(p).detach().clone(), state))
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.save(seen, os.path.join(reports, f"rank{rank}.pt"))
    real_cleanup()


expert_parallel.cleanup = report
expert_parallel.main(argv)
