"""Run nd_parallel.py's train() at several layouts, one after another in the same processes
(one process group: a launch of 8 costs more than the steps), with instruments, and write what
each rank saw to REPORTS/LAYOUT/rank{RANK}.pt:

    python ... tests/nd_probe.py REPORTS GLOBAL_BATCH PP,DP,CP,TP[,STEPS][:--FLAG=VALUE]... -- ARGS

Each layout (with the flags after it, say 2,2,1,1:--pipeline-schedule=zbv) trains STEPS steps
(or ARGS' --max-steps) at --batch-size GLOBAL_BATCH / DP with --output-dir REPORTS/LAYOUT/out,
or REPORTS/out for a layout with STEPS (so that it resumes from the one before it). Per step:
the mean training loss over all ranks (log_loss's, --log-every 1), and the whole gradient of
each parameter this rank's stage holds, by name, as the optimizer is about to step (gathered
from its pieces: all ranks participate); per epoch its record (test_loss); the whole model's
weights (rank 0) as the run exports them at its end (model.pt's: the run saves once, at its
end, so these are also what its checkpoint holds) and after a checkpoint is read; the
elements of the parameters (the pieces) this rank holds. The 300-byte sample rank 0 draws at
the end is skipped (0.6 s of a layout's 10 here, while the other ranks wait): nothing reads it.
Per step also the collectives the gradient clipping called (benchmarks/nd_costs.py's count at
c10d's operators), by operator, and the bytes the step's forward and backward sent, by mesh
dimension; and whether AdamW steps fused.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import nd_parallel as module  # noqa: E402
from benchmarks.nd_costs import Sent  # noqa: E402

reports, global_batch, *layouts = sys.argv[1 : sys.argv.index("--")]
argv = sys.argv[sys.argv.index("--") + 1 :]
seen = {}
names = ("log_loss", "end_epoch", "clip_grad_norm")
real_forward_backward = module.forward_backward
real = {name: getattr(module.training, name) for name in names} | dict(
    param_groups=module.param_groups, export_whole=module.checkpoint.export_whole
)
real_adamw, real_save, real_load = torch.optim.AdamW, module.dcp.save, module.dcp.load
model = {}  # the stage being trained, and its parameters' names


def whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def param_groups(stage, weight_decay):
    model["stage"] = stage
    model["names"] = {id(p): name for name, p in stage.named_parameters()}
    local = [p.to_local() if hasattr(p, "to_local") else p for p in stage.parameters()]
    seen["held"] = sum(p.numel() for p in local)  # this rank's parameters' elements
    return real["param_groups"](stage, weight_decay)


def adamw(groups, *args, **kwargs):
    optimizer = real_adamw(groups, *args, **kwargs)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    seen["fused"] = optimizer.defaults["fused"]

    def before_step(optimizer, *_):
        names = model["names"]
        seen["grads"].append({names[id(p)]: whole(p.grad).clone() for p in params})

    optimizer.register_step_pre_hook(before_step)
    return optimizer


def log_loss(*args):
    seen["losses"].append(loss := real["log_loss"](*args))
    return loss


def end_epoch(metrics, record):
    seen["records"].append(record)
    return real["end_epoch"](metrics, record)


def forward_backward(*args):  # the bytes a step's forward and backward send, by mesh dimension
    sent.reset()
    sent.on, sent.label = True, None
    try:
        return real_forward_backward(*args)
    finally:
        sent.on = False
        seen["sent"].append(sent.bytes)


def clip_grad_norm(*args):
    sent.reset()
    sent.on, sent.label = True, "clip"
    try:
        return real["clip_grad_norm"](*args)
    finally:
        sent.on = False
        seen["clip"].append(sent.calls.get("clip", {}))


def read_back(path):  # rank 0: the whole model in the file export_whole wrote; None elsewhere
    first = not dist.is_initialized() or dist.get_rank() == 0
    return torch.load(path, weights_only=True) if first else None


def export_whole(*args):  # the run's last collective: its model.pt
    path = real["export_whole"](*args)
    seen["saved"] = read_back(path)
    return path


def load(*args, **kwargs):
    real_load(*args, **kwargs)
    seen["grads"].clear()  # set_state_dict's step of zero gradients, to make AdamW's state
    path = os.path.join(reports, "loaded.pt")  # every rank's pieces, written whole by rank 0
    seen["loaded"] = read_back(real["export_whole"](model["stage"], [path], model["pp_group"]))


real_parallelize = module.parallelize


def parallelize(stage, mesh, layout, *args):
    model["pp_group"] = mesh["pp"].get_group() if layout.pp > 1 else None
    return real_parallelize(stage, mesh, layout, *args)


module.param_groups, module.training.log_loss = param_groups, log_loss
module.training.end_epoch = end_epoch
module.parallelize, module.checkpoint.export_whole = parallelize, export_whole
module.training.clip_grad_norm, sent = clip_grad_norm, Sent()
module.forward_backward = forward_backward
module.generate = lambda *args: ""  # the sample: rank 0's 300 forward passes, read by no test
torch.optim.AdamW = adamw
module.dcp = type(module.dcp)("dcp")
module.dcp.save, module.dcp.load = real_save, load

info = module.common.init_distributed_mode(device="cpu", timeout_s=600)  # --compile: minutes
try:
    for spec in layouts:
        layout, *extra = spec.split(":")
        pp, dp, cp, tp, *steps = layout.split(",")
        seen.clear()
        seen.update(losses=[], grads=[], records=[], clip=[], sent=[])
        flags = ["--pp", pp, "--dp", dp, "--cp", cp, "--tp", tp, "--log-every", "1"]
        flags += ["--batch-size", str(int(global_batch) // int(dp))]
        folder = os.path.join(reports, spec)  # a layout with STEPS: the shared one
        flags += ["--output-dir", os.path.join(reports if steps else folder, "out")]
        flags += ["--max-steps", steps[0]] if steps else []
        flags += extra  # --pipeline-schedule=zbv, --replicate=2, ...
        model["pp_group"] = None
        module.train(module.get_args(argv + flags), info)
        os.makedirs(folder, exist_ok=True)
        torch.save(seen, os.path.join(folder, f"rank{info.rank}.pt"))
        if info.distributed:
            dist.barrier()
finally:
    module.common.cleanup()
