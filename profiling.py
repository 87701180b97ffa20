"""Where the time goes: a profiler trace of a few steps per rank, and the model's FLOPs.

    profiler = Profiler(args.profile, rank, device)  # all ranks; a no-op when the dir is None
    for images, labels in loader:
        ...                                          # forward, backward, optimizer step
        profiler.step(last)                          # once per optimizer step; last: see below
    profiler.stop()                                  # after the loop: a short run's window ends

Profiler(trace_dir, rank, device, wait=1, warmup=2, active=3) records steps wait+warmup+1 to
wait+warmup+active (training steps only: step(last=True) says an evaluation, a checkpoint or
the run's end comes next, which ends a window begun, as it is, and puts off one about to
begin by a step), then writes trace_dir/rank{R}.json, a Chrome trace (open it in
ui.perfetto.dev or chrome://tracing), on CUDA also rank{R}_memory.pickle, a memory snapshot
(pytorch.org/memory_viz), and prints one line: the step's time, the share of it spent waiting
in collectives, the largest operations by self time. add_flags(parser) adds --profile DIR and
--peak-tflops, the same in every script.
FLOPs: step_flops(model, example) counts one forward and backward of a batch shaped like
`example` (a tensor or a shape) on the meta device: nothing computed, no weight, buffer,
gradient or RNG state touched, no collective. count_flops(fn) counts what fn() runs (a sharded
model's step, which needs its collectives). flop_rates(flops, seconds, device, dtype,
peak_tflops, devices) gives metrics.jsonl's "flops_per_second" and, where the device's peak is
known (PEAK_TFLOPS, or --peak-tflops), "mfu": the share of `devices` devices' peak.
read_trace(path) reads a trace back into steps, compute and collective intervals (what
benchmarks/pictures.py draws, and the printed line measures); name_pipeline_chunks(stage)
names each micro-batch's forward and backward on a pipeline stage in it; StageActivations(stages)
counts the bytes each stage holds for backward (Profiler.watch_pipeline(stages): both).
"""

import gzip
import json
import os
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from common import fail, together

# Dense peaks of one device in TFLOP/s (tensor cores, no sparsity), from NVIDIA's data sheets.
# Matched against torch.cuda.get_device_name() in this order (H100 PCIe before H100, A100
# before A10). A10G: no data sheet; the A10's figures, the same chip.
PEAK_TFLOPS = {
    "H200": dict(bf16=989, fp16=989, tf32=495, fp32=67),
    "H100 PCIe": dict(bf16=756, fp16=756, tf32=378, fp32=51),
    "H100 NVL": dict(bf16=835, fp16=835, tf32=418, fp32=60),
    "H100": dict(bf16=989, fp16=989, tf32=495, fp32=67),  # SXM
    "A100": dict(bf16=312, fp16=312, tf32=156, fp32=19.5),
    "A10G": dict(bf16=125, fp16=125, tf32=62.5, fp32=31.2),
    "A10": dict(bf16=125, fp16=125, tf32=62.5, fp32=31.2),
    "L40S": dict(bf16=362, fp16=362, tf32=183, fp32=91.6),
    "L4": dict(bf16=121, fp16=121, tf32=60, fp32=30.3),
    "V100": dict(fp16=125, fp32=15.7),  # SXM2; no bf16 or tf32 units
    "RTX 4090": dict(bf16=165, fp16=165, tf32=82.6, fp32=82.6),  # fp32 accumulate
    "RTX 3090": dict(bf16=71, fp16=71, tf32=35.6, fp32=35.6),
}
# What the traces name collectives: gloo's and NCCL's own spans, c10d's calls, the functional
# collectives that DTensor uses (tensor parallelism waits in their wait_tensor), NCCL's kernels.
COLLECTIVES = ("gloo:", "nccl:", "c10d::", "_c10d_functional::", "record_param_comms")
COLLECTIVES += ("ncclDevKernel", "ncclKernel")


def add_flags(parser):
    add = parser.add_argument
    add("--profile", metavar="DIR", help="profile a few steps: a trace per rank in DIR")
    add("--peak-tflops", type=float, help="the device's peak TFLOP/s for MFU (default: a table)")


class Profiler:
    """torch.profiler over steps wait+warmup+1 .. wait+warmup+active; see the module's text."""

    def __init__(self, trace_dir, rank=0, device=None, wait=1, warmup=2, active=3):
        self.prof, self.activations, self.steps, self.first = None, None, 0, wait + warmup + 1
        self.warmup, self.active = warmup, active
        if trace_dir is None:
            return
        self.dir, self.rank = Path(trace_dir), rank
        self.cuda = device is not None and device.type == "cuda"
        together(self._make_dir)  # all ranks participate: a bad DIR stops every rank at once
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # Kineto's notes, not every start
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            # Every allocation from now on, with its Python stack, for the memory snapshot. Python
            # frames only: C++ frames are symbolized when the snapshot is dumped, minutes for a
            # model's steps (torchtitan measured 461 s against 4 s).
            torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
        self.prof = torch.profiler.profile(
            activities=activities, schedule=self._action, on_trace_ready=self._write
        )
        self.prof.start()

    def _make_dir(self):
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".rank{self.rank}"  # writable? (mkdir passes for a read-only dir)
            probe.touch()
            probe.unlink()
        except OSError as e:
            fail(f"--profile {self.dir}: {e.strerror or e}")

    def _action(self, n):
        """torch.profiler's schedule: what to do in the span from the n-th step() (0: start())
        to the next, the span of training step n + 1; recorded: steps first .. first+active-1."""
        action, start = torch.profiler.ProfilerAction, self.first - 1
        if n < start - self.warmup or n >= start + self.active:
            return action.NONE
        if n < start:
            return action.WARMUP
        return action.RECORD_AND_SAVE if n == start + self.active - 1 else action.RECORD

    def step(self, last=False):
        """At the end of each optimizer step. last: not a training step comes next but an
        evaluation, a checkpoint or the end: a window begun ends here (written as it is), one
        that would begin with the next span begins a step later (the span is not recorded)."""
        if self.prof:
            self.steps += 1
            if last and self.steps >= self.first:
                return self.stop()
            if last and self.steps == self.first - 1:
                self.first += 1
            self.prof.step()

    def watch_pipeline(self, stages):
        """This process's torch.distributed.pipelining stages: each micro-batch's forward and
        backward named in the trace (name_pipeline_chunks); profiling, each stage's activations
        counted (StageActivations), written at stop() to activations.rank{R}.json."""
        self.activations = StageActivations(stages) if self.prof else None
        for stage in stages:
            name_pipeline_chunks(stage, self.activations)

    def stop(self):
        if meter := self.activations:  # each stage's bytes held for backward, until now
            meter.stop()
            self.activations, peaks = None, meter.peaks()
            (self.dir / f"activations.rank{self.rank}.json").write_text(json.dumps(peaks))
            held = ", ".join(f"stage {s} {p['peak'] / 2**20:.2f}" for s, p in peaks.items())
            print(f"rank {self.rank}: activations held at most, MiB: {held}", flush=True)
        if self.prof:
            if self.steps < self.first:
                print(
                    f"rank {self.rank}: profile: {self.steps} steps, none profiled (from step "
                    f"{self.first}): nothing written",
                    flush=True,
                )
            self.prof.stop()  # a window cut short by the end of the run is written as it is
            self.prof = None

    def _write(self, prof):
        path = self.dir / f"rank{self.rank}.json"
        prof.export_chrome_trace(str(path))
        if self.cuda:
            torch.cuda.memory._dump_snapshot(str(self.dir / f"rank{self.rank}_memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        trace = read_trace(path)
        steps = len(trace["steps"])
        # Self time: in the operation itself, not in what it calls; on CUDA, the GPU's time.
        key = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        ops = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
        ops = sorted(ops, key=lambda e: getattr(e, key), reverse=True)[:3]
        top = ", ".join(f"{e.key} {getattr(e, key) / 1000 / steps:.1f} ms" for e in ops)
        step_ms, waiting = step_time_and_waiting(trace)
        print(
            f"rank {self.rank}: profile of {steps} steps: {step_ms:.1f} ms a step, "
            f"{waiting:.0%} of it waiting in collectives; largest per step: {top}; {path}",
            flush=True,
        )


def name_pipeline_chunks(stage, meter=None):
    """Name each micro-batch's forward and backward on a torch.distributed.pipelining stage in
    a trace ("stage1 forward mb3"; read_trace's annotations): the schedule, as it ran; "weight"
    a zero-bubble schedule's weight gradients, apart from backward (the input's). Without a
    profiler, a record_function costs about a microsecond. meter: a StageActivations, told
    whose forward runs."""
    for method in ("forward", "backward", "backward_weight"):
        run, kind = getattr(stage, f"{method}_one_chunk"), method.removeprefix("backward_")

        def named(chunk, *args, run=run, kind=kind, **kwargs):
            if meter:
                meter.attribute(stage.stage_index if kind == "forward" else None)
            with torch.profiler.record_function(f"stage{stage.stage_index} {kind} mb{chunk}"):
                return run(chunk, *args, **kwargs)

        setattr(stage, f"{method}_one_chunk", named)


class StageActivations:
    """Bytes of activations each pipeline stage holds for its backward, by saved-tensor hooks:
    every tensor autograd saves while a stage's forward (and, on the last, the loss after it) runs,
    its bytes once, until its graph is freed (after the backward; zero bubble: the weights' pass).
    Parameters, which matmuls save too, are left out: held anyway. The memory a schedule decides,
    on any device (a CPU has no max_memory_allocated); not counted: an operation's temporaries.
    peaks(): {stage: {"peak": the most bytes held at once, "micro_batch": one forward's}}."""

    def __init__(self, stages):
        params = (p for stage in stages for p in stage.submod.parameters())
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.stage, self.start, self.saved = None, 0, {}  # key: [stage, bytes, times saved]
        self.alive, self.peak, self.one = ({s.stage_index: 0 for s in stages} for _ in range(3))
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _Saved.unpack)
        self.hooks.__enter__()  # till stop(): the loss is saved outside the stage's forward

    def attribute(self, stage):
        """What autograd saves from now on is `stage`'s (the index of a stage whose forward
        begins; None: nobody's), name_pipeline_chunks(stage, self) says."""
        if self.stage is not None:  # the forward (and the loss) just ended: one micro-batch's
            self.one[self.stage] = max(self.one[self.stage], self.alive[self.stage] - self.start)
        self.stage, self.start = stage, self.alive.get(stage, 0)

    def _pack(self, tensor):
        tensor, ptr = tensor.detach(), tensor.untyped_storage().data_ptr()  # detach: see _Saved
        nbytes = tensor.numel() * tensor.element_size()
        if self.stage is None or ptr in self.skip or not nbytes:
            return tensor
        key = (ptr, tensor.storage_offset(), nbytes)  # the same bytes saved twice: counted once
        entry = self.saved.setdefault(key, [self.stage, nbytes, 0])
        if entry[2] == 0:
            self.alive[entry[0]] += entry[1]
            self.peak[entry[0]] = max(self.peak[entry[0]], self.alive[entry[0]])
        entry[2] += 1
        return _Saved(tensor, lambda: self._release(key))

    def _release(self, key):
        entry = self.saved[key]
        entry[2] -= 1
        if entry[2] == 0:
            self.alive[entry[0]] -= entry[1]
            del self.saved[key]

    def peaks(self):
        return {s: dict(peak=self.peak[s], micro_batch=self.one[s]) for s in sorted(self.peak)}

    def stop(self):
        self.attribute(None)
        self.hooks.__exit__(None, None, None)


class _Saved:
    """A tensor autograd saved, detached (an output's grad_fn would hold the node that holds it:
    a cycle, never freed), that tells StageActivations when autograd lets it go."""

    def __init__(self, tensor, release):
        self.tensor, self.release = tensor, release

    def __del__(self):
        self.release()

    def unpack(saved):  # saved_tensors_hooks' unpack: a _Saved or a tensor left as it was
        return saved.tensor if isinstance(saved, _Saved) else saved


def read_trace(path):
    """A Chrome trace written by torch.profiler (.json or .json.gz) as a dict of intervals in
    microseconds on the trace's clock: "steps" [(start, end)] of each ProfilerStep; "compute"
    and "collectives" [(start, end, name, lane)], lane "cpu" (the threads that run operators)
    or "gpu" (kernels); "annotations" [(start, end, name)] (record_function's ranges); "gpu":
    whether it holds kernels. With kernels, the GPU's side of each: where the step's kernels,
    NCCL's among them, ran (the CPU only queued them)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    span = lambda e: (float(e["ts"]), float(e["ts"]) + float(e["dur"]))  # noqa: E731
    gpu = any(e.get("cat") == "kernel" for e in events)
    out = dict(steps=[], compute=[], collectives=[], annotations=[], gpu=gpu)
    comm_spans = {}  # thread -> collective calls on it: what runs inside them is not compute
    for e in events:
        if e["name"].startswith(COLLECTIVES):
            lane = "gpu" if e.get("cat") == "kernel" else "cpu"
            out["collectives"].append((*span(e), e["name"], lane))
            comm_spans.setdefault(e.get("tid"), []).append(span(e))
    for e in events:
        name, cat, (start, end) = e["name"], e.get("cat"), span(e)
        if name.startswith("ProfilerStep#"):  # on a GPU: the step's extent in kernels
            out["steps"].append((start, end, cat == "gpu_user_annotation"))
        elif cat == ("gpu_user_annotation" if gpu else "user_annotation"):
            out["annotations"].append((start, end, name))
        elif name.startswith(COLLECTIVES):
            continue
        elif cat in (("kernel", "gpu_memcpy", "gpu_memset") if gpu else ("cpu_op",)):
            # An operator's time inside a collective it calls (DTensor's ops call theirs) is
            # waiting, not compute: only the parts outside its thread's collectives count.
            # (Kernels do not nest: a stream's kernels run one after another.)
            spans = () if gpu else comm_spans.get(e.get("tid"), ())
            calls = [(a, b) for a, b in spans if a < end and b > start]
            for part in subtract([(start, end)], calls) if calls else [(start, end)]:
                out["compute"].append((*part, name, "gpu" if gpu else "cpu"))
    on_gpu = [s for s in out["steps"] if s[2]]
    out["steps"] = sorted(s[:2] for s in on_gpu or out["steps"])
    nccl = [c for c in out["collectives"] if c[3] == "gpu"]
    out["collectives"] = nccl or out["collectives"]
    return out


def union(intervals):
    """Sorted, non-overlapping (start, end) covering the given ones."""
    merged = []
    for start, end in sorted((i[0], i[1]) for i in intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals):
    return sum(end - start for start, end in intervals)


def subtract(intervals, minus):
    """The parts of union(intervals) that union(minus) does not cover."""
    out, minus = [], union(minus)
    for start, end in union(intervals):
        for a, b in minus:
            if b <= start or a >= end:
                continue
            if a > start:
                out.append((start, a))
            start = max(start, b)
        if start < end:
            out.append((start, end))
    return out


def step_time_and_waiting(trace):
    """(mean ms a step, share of the steps' time when a collective runs and no compute does):
    the time the step waits on the network rather than hiding it behind work."""
    steps = trace["steps"]
    if not steps:
        raise ValueError("the trace has no ProfilerStep: was profiler.step() called?")
    total = length(union(steps))
    window = steps[0][0], steps[-1][1]
    clip = lambda xs: [(max(s, window[0]), min(e, window[1])) for s, e, *_ in xs]  # noqa: E731
    comm = [i for i in clip(trace["collectives"]) if i[0] < i[1]]
    waiting = length(subtract(comm, clip(trace["compute"])))
    return total / 1000 / len(steps), waiting / total


def step_flops(model, example):
    """FLOPs of one forward and backward of `model` on a batch shaped like `example` (a tensor
    or a shape), counted on the meta device: its parameters and buffers are swapped for meta
    tensors of the same shapes, so nothing is computed and nothing of the model changes
    (BatchNorm's running statistics, .grad, the RNG). Backward as in training: only towards
    the parameters that require a gradient (frozen layers send none back)."""

    def meta(t):
        return torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)

    if isinstance(example, torch.Tensor):
        x = torch.empty(example.shape, dtype=example.dtype, device="meta")
    else:
        x = torch.empty(tuple(example), device="meta")
    tensors = {n: meta(t) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    trainable = [t for t in tensors.values() if t.requires_grad]

    def forward_backward():
        out = torch.func.functional_call(model, tensors, (x,))
        out = out[0] if isinstance(out, tuple) else out
        if trainable:
            torch.autograd.grad(out.float().sum(), trainable)

    # In eval mode: the same products, without SyncBatchNorm's collectives or dropout's draws.
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        return count_flops(forward_backward)
    finally:
        for m, training in modes.items():
            m.training = training


def count_flops(fn):
    """FLOPs of what fn() runs (matrix products, convolutions, attention), by FlopCounterMode."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def peak_flops(device, dtype=None, peak_tflops=None):
    """One device's peak FLOP/s for `dtype` (None: fp32, or tf32 where matmuls may use it), or
    None where unknown: a CPU or a GPU not in PEAK_TFLOPS, without peak_tflops."""
    if peak_tflops:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    kind = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    if kind == "fp32" and torch.get_float32_matmul_precision() != "highest":
        kind = "tf32"
    gpu = next((peaks for key, peaks in PEAK_TFLOPS.items() if key in name), {})
    return gpu[kind] * 1e12 if kind in gpu else None


def flop_rates(flops, seconds, device, dtype=None, peak_tflops=None, devices=1):
    """{"flops_per_second": flops / seconds} (flops: what every device computed together) and,
    where the peak is known, "mfu": that rate over `devices` times one device's peak."""
    rates = dict(flops_per_second=flops / seconds)
    peak = peak_flops(device, dtype, peak_tflops)
    if peak:
        rates["mfu"] = rates["flops_per_second"] / (devices * peak)
    return rates
