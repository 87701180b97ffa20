"""Run model_parallel.py's main() once per pipeline schedule, in the same processes, with
instruments: `python tests/pp_probe.py REPORTS SCHEDULE[,SCHEDULE...] -- ARGS` (one process:
the schedule "one", ARGS naming --devices). Each run writes REPORTS/SCHEDULE (its
--output-dir) and REPORTS/SCHEDULE.rank{RANK}.pt: per optimizer step, the mean of the training
losses this rank's last stage took (one per micro-batch; None on other ranks) and every
gradient this rank steps, by the whole model's names, as the optimizer is about to step; the
weights and AdamW moments as the first step finds them (a resumed run's: those it loaded); and
each of this rank's stages' activations held for backward (profiling.StageActivations: peak and
one micro-batch's bytes; mode 3 only). A SCHEDULE written NAME+K runs NAME stopped by
--max-steps K, then again in the same --output-dir (REPORTS/NAME+K): a resume after step K."""

import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import model_parallel  # noqa: E402
import profiling  # noqa: E402

reports, schedules = sys.argv[1], sys.argv[2].split(",")
argv = sys.argv[sys.argv.index("--") + 1 :]
seen, pending, names = {}, [], {}
real_loss, real_groups = model_parallel.loss_fn, model_parallel.param_groups
real_adamw, real_cleanup = torch.optim.AdamW, model_parallel.cleanup


def loss_fn(logits, labels):
    loss = real_loss(logits, labels)
    # Training's losses: not evaluation's, nor those of the stage's shape inference (on
    # uninitialised tensors, before the first step).
    inferring = any(f.name.endswith("_metadata_inference") for f in traceback.extract_stack())
    if not evaluating and not inferring:
        pending.append(loss.item())
    return loss


def param_groups(modules, weight_decay):  # the stages' parameters by the whole model's names
    names.update({id(p): n.split(".", 1)[1] for n, p in modules.named_parameters()})
    return real_groups(modules, weight_decay)


def adamw(groups, *args, **kwargs):
    optimizer = real_adamw(groups, *args, **kwargs)
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def before_step(*_):
        if not seen["grads"]:  # the first step: what the run started from (or loaded)
            weights = {names[id(p)]: p.detach().clone() for p in params}
            state = optimizer.state
            moments = {names[id(p)]: {k: v.clone() for k, v in state[p].items()} for p in params}
            seen["loaded"] = dict(weights=weights, moments=moments)
        seen["grads"].append({names[id(p)]: p.grad.clone() for p in params})
        seen["losses"].append(sum(pending) / len(pending) if pending else None)
        pending.clear()

    optimizer.register_step_pre_hook(before_step)
    return optimizer


def evaluate_stages(*args):
    evaluating.append(True)
    try:
        return real_evaluate(*args)
    finally:
        evaluating.clear()


def watch_pipeline(profiler, stages):  # every stage's activations counted, without --profile
    meters.append(profiling.StageActivations(stages))
    for stage in stages:
        profiling.name_pipeline_chunks(stage, meters[-1])


evaluating, real_evaluate, meters = [], model_parallel.evaluate_stages, []
profiling.Profiler.watch_pipeline = watch_pipeline
model_parallel.loss_fn, model_parallel.param_groups = loss_fn, param_groups
model_parallel.evaluate_stages = evaluate_stages
torch.optim.AdamW = adamw


def init_once(**kwargs):  # one process group for every run: no rendezvous between runs
    if not group:
        group.append(real_init(**kwargs))
    return group[0]


group, real_init = [], model_parallel.init_distributed_mode
model_parallel.init_distributed_mode = init_once
for schedule in schedules:
    seen.update(losses=[], grads=[], activations=None)

    def report(schedule=schedule):  # main()'s cleanup, which ends with a barrier
        rank = dist.get_rank() if dist.is_initialized() else 0
        if meters:
            meters[-1].stop()
            seen["activations"] = meters.pop().peaks()
        compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # --compile's graphs
        torch.save(
            dict(seen, compiled=compiled), os.path.join(reports, f"{schedule}.rank{rank}.pt")
        )

    model_parallel.cleanup = report
    name, *stop = schedule.split("+")
    flags = [] if name == "one" else ["--pipeline-schedule", name]
    flags += ["--output-dir", os.path.join(reports, schedule)]
    if stop:  # the run stopped after step K, whose checkpoint the next one resumes from
        model_parallel.cleanup = lambda: meters and meters.pop().stop()  # nothing reported
        model_parallel.main([*argv, *flags, "--max-steps", stop[0]])
        model_parallel.cleanup = report
        seen.update(losses=[], grads=[], activations=None)
    model_parallel.main([*argv, *flags])
real_cleanup()
