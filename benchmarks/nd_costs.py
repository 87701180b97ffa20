"""What each layout of nd_parallel.py costs: what rank 0 holds, and the bytes each dimension of
the mesh sends per step, for every layout of 8 processes, side by side.

    python benchmarks/nd_costs.py                   # 11 layouts of 8 processes; a table
    python benchmarks/nd_costs.py --layouts 2,2,1,2 1,4,2,1 --json rows.json

One torchrun launch of --world processes runs nd_parallel.py's train() for each layout
(PP,DP,CP,TP) in turn, in the same processes, --steps steps each at the same global batch
(--global-batch sequences, --batch-size global/DP per data-parallel row), on a small text
(argparse.py's, cut: a short evaluation, see corpus()), the GPT --depth 8 --dim 256 --heads
4 in fp32, unclipped (--clip-grad 0: the norm's few-byte all-reduces are not in the
formulas). Nothing in nd_parallel.py changes: the benchmark wraps what it calls from
outside. Counted (rank 0, from its tensors: a DTensor's local piece): its parameters; its
gradients as the optimizer is about to step; AdamW's state after the step; the activations
autograd saves for backward (weights not counted), the most alive at once in the last step
above what was alive at its start (a pipeline frees a micro-batch's after its backward).
Measured: rank 0's peak resident memory (Linux's VmHWM, reset through /proc/self/clear_refs)
above its level before the layout, over the build, and over the steps (the first layout runs
once before, unreported: no layout's peak holds the libraries' one-time allocations). Sent:
every collective and point-to-point call of the last step, caught where every path ends
(c10d's operators, whose kernels this process wraps: FSDP's, DTensor's, the pipeline's and
the functional collectives end there), booked to the mesh dimension of its process group, as
the bytes a ring algorithm sends from each rank: all-reduce 2(n-1)/n of the tensor,
all-gather n-1 times the piece, reduce-scatter (n-1)/n of the input, send the tensor. Beside
them, each dimension's formula (plan.formulas, which plan.py scales to any cluster).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from sharding import local_bytes, resident_kb  # noqa: E402

from plan import formulas  # noqa: E402  (the formulas, said once: plan.py)

# Layouts of 8 processes: pp, cp, tp in {1, 2} with dp the rest; pp 4, tp 4, dp 4 x cp 2.
LAYOUTS = [(pp, 8 // (pp * cp * tp), cp, tp) for pp in (1, 2) for cp in (1, 2) for tp in (1, 2)]
LAYOUTS += [(4, 2, 1, 1), (1, 2, 1, 4), (1, 4, 2, 1)]
DIMS = ("pp", "dp_shard_cp", "cp", "tp")  # the mesh's groups (FSDP's: dp x cp flattened)
GATHER = ("_allgather_base_", "allgather_", "allgather_coalesced_")
GATHER += ("allgather_into_tensor_coalesced_",)
SCATTER = ("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_")


def tensors(arg):
    if isinstance(arg, torch.Tensor):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [t for a in arg for t in tensors(a)]
    return []


def sent_bytes(name, args, n):
    """The bytes a ring algorithm sends from this rank for c10d operator `name` on a group of n:
    args are the operator's (its first tensors the outputs, its second the inputs, if two)."""
    first, *rest = [tensors(a) for a in args if tensors(a)]
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    if name.startswith("allreduce"):
        return 2 * (n - 1) * size(first) / n
    if name in GATHER:
        return (n - 1) * size(rest[0])
    if name in SCATTER or name.startswith("alltoall"):
        return (n - 1) * size(rest[0]) / n
    return size(first) if name in ("send", "broadcast_") else 0  # recv_: received, not sent


class Sent:
    """Wraps c10d's operators (a kernel ahead of their own, at the BackendSelect key every call
    passes) to add up, while `on`, the bytes sent and the calls per mesh dimension (`dims`: the
    groups' names' dimension, for a dimension of all processes, which is the default group;
    DeviceMesh's other groups by their description, mesh_tp): self.bytes["tp"],
    self.calls["tp"]["allreduce_"]."""

    def __init__(self):
        from torch._C._distributed_c10d import ProcessGroup

        self.on, self.bytes, self.calls, self.label, self.dims = False, {}, {}, None, {}
        self.lib = torch.library.Library("c10d", "IMPL")  # kept: the kernels live with it
        backend_select = torch._C.DispatchKey.BackendSelect
        for name in (*GATHER, *SCATTER, "allreduce_", "allreduce_coalesced_", "alltoall_"):
            self.wrap(name, ProcessGroup, backend_select)
        for name in ("alltoall_base_", "broadcast_", "send", "recv_", "recv_any_source_"):
            self.wrap(name, ProcessGroup, backend_select)

    def wrap(self, name, ProcessGroup, key):
        op = getattr(torch.ops.c10d, name).default

        def kernel(keyset, *args, **kwargs):
            if self.on:
                box = next(a for a in args if isinstance(a, torch.ScriptObject))
                group = ProcessGroup.unbox(box)
                desc = group.group_desc.removeprefix("mesh_")  # DeviceMesh's groups: mesh_tp
                where = self.label or self.dims.get(group.group_name, desc)
                self.bytes[where] = self.bytes.get(where, 0) + sent_bytes(name, args, group.size())
                calls = self.calls.setdefault(where, {})
                calls[name] = calls.get(name, 0) + 1
            return op.redispatch(keyset.remove(key), *args, **kwargs)

        self.lib.impl(name, kernel, "BackendSelect", with_keyset=True)

    def reset(self):
        self.bytes, self.calls = {}, {}


class Saved:
    """saved_tensors_hooks that keep count of the bytes autograd holds for backward, alive now
    (`live`) and at most since the last reset (`peak`): a storage once, no weights (leaves that
    require grad, or views of them), nothing on the meta device (FLOP counting)."""

    def __init__(self):
        self.live = self.peak = 0
        self.refs = {}  # storage address: [bytes, saved tensors holding it]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t):
        base = t if t._base is None else t._base
        if (base.is_leaf and base.requires_grad) or t.device.type == "meta":
            return t
        inner = getattr(t, "_local_tensor", None)  # a DTensor's piece
        storage = (getattr(t, "elem", t) if inner is None else inner).untyped_storage()
        # Detached: an output saved for backward would hold its own grad_fn through `Held`,
        # a cycle that keeps the graph (and what it saved) alive after its backward ran.
        return Held(self, t.detach(), storage.data_ptr(), storage.nbytes())

    def unpack(self, held):
        return held.tensor if isinstance(held, Held) else held


class Held:
    """A saved tensor, counted while autograd keeps it (until its backward has run)."""

    def __init__(self, saved, tensor, key, nbytes):
        self.saved, self.tensor, self.key = saved, tensor, key
        entry = saved.refs.setdefault(key, [nbytes, 0])
        if entry[1] == 0:
            saved.live += nbytes
            saved.peak = max(saved.peak, saved.live)
        entry[1] += 1

    def __del__(self):
        entry = self.saved.refs[self.key]
        entry[1] -= 1
        if entry[1] == 0:
            self.saved.live -= entry[0]
            del self.saved.refs[self.key]


def corpus(args):
    """A text of argparse.py's bytes whose held-out twentieth (data.load_text) is exactly 16
    sequences: a short evaluation, the same number of batches in every data-parallel row."""
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"nd_costs_{os.getpid()}.txt"  # each its own
    text = Path(argparse.__file__).read_bytes() * (1 + args.seq_len // 256)
    path.write_bytes(text[: 20 * (16 * args.seq_len + 1)])
    return path


def measure(nd, layout, args, info, sent, saved):
    import gc

    pp, dp, cp, tp = layout
    argv = ["--pp", pp, "--dp", dp, "--cp", cp, "--tp", tp, "--depth", args.depth]
    argv += ["--dim", args.dim, "--heads", args.heads, "--seq-len", args.seq_len]
    argv += ["--batch-size", args.global_batch // dp, "--max-steps", args.steps]
    argv += ["--data-dir", args.corpus, "--device", "cpu", "--dist-timeout", "600"]
    argv += ["--clip-grad", "0"]  # text's default clips: a scalar all-reduce per mesh dimension
    run_args = nd.get_args([str(a) for a in argv])
    held, steps = dict(left=saved.live), []  # saved tensors still alive: not this layout's
    real_groups, real_log, real_adamw = nd.param_groups, nd.training.log_loss, torch.optim.AdamW
    real_mesh, meshes = nd.init_device_mesh, []

    def init_device_mesh(*a, **kw):
        meshes.append(real_mesh(*a, **kw))
        return meshes[-1]

    def param_groups(stage, weight_decay):  # the stage built, parallelized and filled
        held["weights"] = local_bytes(stage.parameters())
        for dim in reversed(DIMS) if meshes else ():  # a group two dimensions share: the first's
            sent.dims[meshes[0][dim].get_group().group_name] = dim
        held["build_peak"] = 1024 * (resident_kb("VmHWM") - before)
        Path("/proc/self/clear_refs").write_text("5")  # from here on: the steps' peak
        return real_groups(stage, weight_decay)

    def adamw(groups, *a, **kw):
        optimizer = real_adamw(groups, *a, **kw)
        params = [p for group in optimizer.param_groups for p in group["params"]]

        def before_step(*_):
            held["grads"] = local_bytes(p.grad for p in params)

        def after_step(*_):
            states = optimizer.state.values()
            held["optimizer"] = local_bytes(v for s in states for v in s.values())
            step = dict(sent=dict(sent.bytes), calls=sent.calls, left=held["left"])
            steps.append(dict(step, saved=saved.peak - held["left"]))
            held["peak"] = 1024 * (resident_kb("VmHWM") - before)
            sent.reset()
            held["left"] = saved.peak = saved.live  # the next step's: above what is left

        optimizer.register_step_pre_hook(before_step)
        optimizer.register_step_post_hook(after_step)
        return optimizer

    def log_loss(*a):  # the loss printed, all-reduced over every process: not a dimension's
        sent.label = "loss"
        try:
            return real_log(*a)
        finally:
            sent.label = None

    gc.collect()  # the layout before's tensors go before this one's peak is measured
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = resident_kb("VmRSS")
    nd.param_groups, nd.training.log_loss, torch.optim.AdamW = param_groups, log_loss, adamw
    nd.init_device_mesh, sent.dims = init_device_mesh, {}
    nd.generate = lambda *a, **kw: "(not sampled)"
    saved.peak, sent.on, start = saved.live, True, time.perf_counter()
    try:
        with saved.hooks():
            nd.train(run_args, info)
    finally:
        sent.on = False
        nd.param_groups, nd.training.log_loss = real_groups, real_log
        torch.optim.AdamW = real_adamw
        nd.init_device_mesh = real_mesh
    last = steps[-1]
    by_dim = {dim: last["sent"].pop(dim, 0) for dim in DIMS}
    return dict(
        layout=dict(zip(("pp", "dp", "cp", "tp"), layout, strict=True)),
        weights=held["weights"], grads=held["grads"], optimizer=held["optimizer"],
        activations=last["saved"], saved_left=last["left"],
        build_peak=held["build_peak"], peak=held["peak"],
        sent=by_dim, sent_elsewhere=last["sent"], calls=last["calls"],
        formula=formulas(layout, args), seconds=time.perf_counter() - start,
    )  # fmt: skip


def worker(args):
    import nd_parallel as nd
    from common import cleanup, init_distributed_mode

    info = init_distributed_mode(device="cpu", timeout_s=600)
    sent, saved, args.corpus = Sent(), Saved(), corpus(args)
    try:
        if args.warmup:  # the libraries' one-time allocations, outside every layout's peak
            measure(nd, args.layouts[0], args, info, sent, saved)
        for layout in args.layouts:
            row = measure(nd, layout, args, info, sent, saved)
            if info.rank == 0:
                print(json.dumps(row), flush=True)
    finally:
        args.corpus.unlink()
        cleanup()


def table(rows):
    mb = lambda b: "-" if b is None else f"{b / 2**20:.2f}"  # noqa: E731
    lines = [
        "| pp x dp x cp x tp | weights | grads | AdamW | activations | peak build | peak steps"
        " | sent pp | dp x cp (FSDP) | cp | tp | formula pp / dp x cp / cp / tp |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [" x ".join(str(v) for v in r["layout"].values())]
        cells += [mb(r[k]) for k in ("weights", "grads", "optimizer", "activations")]
        cells += [f"{r['build_peak'] / 2**20:.0f}", f"{r['peak'] / 2**20:.0f}"]
        cells += [mb(r["sent"][d]) for d in DIMS]
        cells.append(" / ".join(mb(r["formula"][d]) for d in DIMS))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    layout = lambda s: tuple(int(v) for v in s.split(","))  # noqa: E731
    p.add_argument("--layouts", nargs="+", type=layout, default=LAYOUTS, help="PP,DP,CP,TP ...")
    p.add_argument("--world", type=int, default=8, help="processes (each layout's product)")
    p.add_argument("--depth", type=int, default=8, help="the GPT's blocks")
    p.add_argument("--dim", type=int, default=256, help="the GPT's width")
    p.add_argument("--heads", type=int, default=4, help="attention heads (tp must divide them)")
    p.add_argument("--seq-len", type=int, default=256, help="bytes per sequence")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step, all rows")
    p.add_argument("--steps", type=int, default=2, help="steps per layout (the last measured)")
    p.add_argument("--json", help="also write the rows to this file")
    help = "run the first layout once more before, unreported (default: on)"
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True, help=help)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    for lay in args.layouts:
        if len(lay) != 4 or lay[0] * lay[1] * lay[2] * lay[3] != args.world:
            p.error(f"--layouts {lay}: four degrees whose product is --world {args.world}")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    # Blocks of 64 kB and more go back to the system when freed: a layout's peak is its own,
    # not lower where it reuses what glibc kept of the layouts before (sharding.py: 1 MB).
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={args.world}", __file__, "--worker", *sys.argv[1:]]
    start, rows = time.perf_counter(), []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:  # each layout's row as it comes (a long run's part kept)
            if line.startswith("{"):
                rows.append(json.loads(line))
                print(f"{len(rows)}/{len(args.layouts)}: {rows[-1]['layout']}", flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps(rows, indent=1))
    if proc.returncode:
        sys.exit(f"error: {' '.join(cmd)} failed (exit {proc.returncode}); its output above")
    print(table(rows))
    print(f"{len(rows)} layouts in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
