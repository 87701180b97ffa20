"""The pictures of docs/pictures.md, each drawn from real runs on this machine.

    python benchmarks/pictures.py                           # all three (about 10 minutes here)
    python benchmarks/pictures.py --only accuracy           # from benchmarks/results.json
    python benchmarks/pictures.py --only timelines --strategies ddp fsdp
    python benchmarks/pictures.py --only pipeline
    python benchmarks/pictures.py --only timelines --traces "DDP, 8 GPUs=runs/prof"   # yours

timelines.png: one training step per rank, compute against collectives, read from each
script's --profile traces (a script that does not take --profile yet is skipped, and said so).
pipeline.png: model_parallel.py's GPT under GPipe, 1F1B, interleaved 1F1B and ZBV on 2 and 4
processes, each process's forwards, backwards and weight gradients of each micro-batch as they
ran, the idle time hatched, its share measured beside the formula's, and the bytes of activations
each stage held for backward (profiling.StageActivations). memory.png: what one rank
holds under each strategy, counted from its tensors, and its measured peak
(benchmarks/sharding.py --json). Runs write to benchmarks/runs/pictures/ (git-ignored);
--traces LABEL=DIR draws traces made elsewhere (on GPUs, say) instead. Needs matplotlib
(requirements-dev.txt). A trace without what a picture draws (no collectives, no pipeline
stages) is refused in one line, not drawn empty. accuracy_vs_time.png: run_all.py's
time-to-accuracy curves, redrawn from the results.json it wrote. Each picture's title says the
machine, the date and the load average when its runs started (--where: the machine of --traces
made elsewhere).
"""

import argparse
import bisect
import itertools
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from common import fail  # noqa: E402
from profiling import read_trace, step_time_and_waiting, union  # noqa: E402

RUNS = ROOT / "benchmarks" / "runs" / "pictures"
QUICK = ["--data", "synthetic", "--device", "cpu", "--max-steps", "6", "--dist-timeout", "120"]
TEXT = ["--data", "text", "--model", "gpt"]
# One step of each strategy, 2 processes each (nd_parallel.py's 8): what their collectives overlap.
STRATEGIES = {
    # DDP on an image model (its script's job), so its step is not comparable with the others'.
    "ddp": (
        "DDP, ResNet-18 on images, 8 a process",
        "ddp_train.py",
        ["--model", "resnet18", "--batch-size", "8"],
    ),
    # The sharded ones on their language-model job: the GPT on text (a window of 256 bytes).
    "fsdp": ("FSDP, the GPT on text", "fsdp_train.py", TEXT),
    "tp": ("tensor parallel, the GPT on text", "tensor_parallel.py", TEXT),
    "cp": ("context parallel (ring, zigzag), the GPT on text", "context_parallel.py", TEXT),
    "ep": ("expert parallel, the GPT with 8 experts a block", "expert_parallel.py", TEXT),
    # The strategies composed, 8 processes, on a short text (argparse.py: a quick evaluation).
    "nd": (
        "pp 2 x dp 2 x tp 2, the GPT on text",
        "nd_parallel.py",
        [*TEXT, "--data-dir", argparse.__file__, "--pp", "2", "--dp", "2", "--tp", "2"],
    ),
}
NPROC = {"nd": 8}  # processes per strategy (the others: 2)
PHASE_COLORS = {
    "forward": "tab:blue",
    "backward": "tab:orange",
    "optimizer": "tab:green",
    "GPU kernels": "tab:blue",
}
COLLECTIVE_COLORS = {
    "all-reduce": "tab:red",
    "all-gather": "tab:purple",
    "reduce-scatter": "tab:brown",
    "all-to-all": "tab:pink",
    "send/recv": "tab:olive",
    "broadcast": "tab:cyan",
    "other collective": "tab:gray",
}
KINDS = [
    ("all-reduce", ("all_reduce", "allreduce")),
    ("all-gather", ("all_gather", "allgather")),
    ("reduce-scatter", ("reduce_scatter", "reducescatter")),
    ("all-to-all", ("all_to_all", "alltoall")),
    ("send/recv", ("send", "recv")),
    ("broadcast", ("broadcast",)),
]
CHUNK = re.compile(r"stage(\d+) (forward|backward|weight) mb(\d+)")


def this_machine():
    """'AMD EPYC 7B13, 2 cores': what a reader needs to weigh a time measured here."""
    cpu = platform.processor() or platform.machine()
    try:
        names = [ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln]
        cpu = names[0].split(":", 1)[1].strip() if names else cpu
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def stamp(where=None):
    """Machine, date and load average now (before a picture's runs start): said in its title,
    since times drift with the machine and its load."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    day = time.strftime("%Y-%m-%d", time.gmtime())
    return f"{where or this_machine()}, {day}, load {load:.1f}"


def collective_kind(name):
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other collective")


def inside(spans, point):
    """Whether `point` lies in one of `spans`, sorted and disjoint (union's output)."""
    i = bisect.bisect_right([s for s, _ in spans], point) - 1
    return i >= 0 and point <= spans[i][1]


def rank_traces(trace_dir):
    paths = sorted(
        Path(trace_dir).glob("rank*.json*"), key=lambda p: int(re.sub(r"\D", "", p.name))
    )
    if not paths:
        fail(f"{trace_dir}: no rank*.json traces (run the script with --profile {trace_dir})")
    return paths


def one_step(trace_dir, need_collectives=True):
    """Every rank's last profiled step: [(rank, trace, (start, end))], checked for what the
    timeline draws."""
    out = []
    for rank, path in enumerate(rank_traces(trace_dir)):
        trace = read_trace(path)
        if not trace["steps"]:
            fail(f"{path}: no ProfilerStep in the trace: profiler.step() was never called")
        if need_collectives and not trace["collectives"]:
            what = "no collective events (gloo:, nccl:, c10d::, record_param_comms)"
            fail(f"{path}: {what}; a one-process run has nothing to draw against compute")
        out.append((rank, trace, trace["steps"][-1]))
    return out


def phases(trace, window):
    """{phase: union of compute intervals} in `window`: backward inside autograd's
    evaluate_function, optimizer inside Optimizer.step or zero_grad, the rest forward."""
    clip = lambda s, e: (max(s, window[0]), min(e, window[1]))  # noqa: E731
    compute = [clip(s, e) + (n,) for s, e, n, _ in trace["compute"] if e > window[0]]
    compute = [c for c in compute if c[0] < c[1]]
    if trace["gpu"]:
        return {"GPU kernels": union(compute)}
    backward = union(c for c in compute if c[2].startswith("autograd::engine::evaluate_function"))
    optimizer = union(a for a in trace["annotations"] if a[2].startswith("Optimizer."))
    out = {"forward": [], "backward": [], "optimizer": []}
    for s, e, _ in compute:
        mid = (s + e) / 2
        phase = "backward" if inside(backward, mid) else "forward"
        out["optimizer" if inside(optimizer, mid) else phase].append((s, e))
    return {k: union(v) for k, v in out.items()}


def draw_timelines(runs, path, where=""):
    """runs: [(label, trace_dir)]; one panel per run, two lanes per rank; where: the stamp."""
    import matplotlib.pyplot as plt

    steps = [(label, one_step(d)) for label, d in runs]
    heights = [1 + 0.6 * len(ranks) for _, ranks in steps]
    fig, axes = plt.subplots(
        len(steps), 1, figsize=(12, sum(heights) + 0.8), squeeze=False,
        gridspec_kw=dict(height_ratios=heights),  # a lane pair per rank, 2 ranks or 8
    )  # fmt: skip
    fig.subplots_adjust(hspace=0.9)
    used = set()
    for ax, (label, ranks) in zip(axes[:, 0], steps, strict=True):
        start = min(w[0] for _, _, w in ranks)
        end = max(w[1] for _, _, w in ranks)
        ticks = []
        for rank, trace, window in ranks:
            y = 2 * (len(ranks) - 1 - rank)
            for phase, spans in phases(trace, window).items():
                bars = [((s - start) / 1e3, (e - s) / 1e3) for s, e in spans]
                ax.broken_barh(bars, (y + 1.05, 0.8), color=PHASE_COLORS[phase])
                used.add(("phase", phase)) if bars else None
            for kind in COLLECTIVE_COLORS:
                spans = union(
                    (max(s, window[0]), min(e, window[1]))
                    for s, e, n, _ in trace["collectives"]
                    if collective_kind(n) == kind and e > window[0] and s < window[1]
                )
                bars = [((s - start) / 1e3, (e - s) / 1e3) for s, e in spans]
                ax.broken_barh(bars, (y + 0.1, 0.8), color=COLLECTIVE_COLORS[kind])
                used.add(("collective", kind)) if bars else None
            ticks += [(y + 0.5, f"rank {rank} collectives"), (y + 1.45, f"rank {rank} compute")]
        ms, waiting = step_time_and_waiting(dict(ranks[0][1], steps=[ranks[0][2]]))
        ax.set_title(
            f"{label}: one step, {ms:.0f} ms on rank 0, {waiting:.0%} of it waiting in"
            " collectives (a collective in flight, no compute running)",
            fontsize=10,
            loc="left",
        )
        ax.set_yticks([t for t, _ in ticks], [n for _, n in ticks], fontsize=8)
        ax.set_xlim(0, (end - start) / 1e3)
        ax.set_ylim(0, 2 * len(ranks))
    axes[-1, 0].set_xlabel("ms since the step's start (ranks on one clock: one machine)")
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=(PHASE_COLORS | COLLECTIVE_COLORS)[name])
        for _, name in sorted(used)
    ]
    names = [name for _, name in sorted(used)]
    fig.legend(handles, names, loc="lower center", bbox_to_anchor=(0.5, 0.99), ncol=6)
    fig.suptitle(f"One training step per rank; each panel its own model and batch: {where}",
                 y=1.0 + 0.9 / fig.get_figheight(), fontsize=10)  # fmt: skip
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def pipeline_chunks(trace_dir):
    """[(rank, [(start, end, kind, micro-batch, stage)] of its last profiled step)], one per
    rank; kind forward, backward (a zero-bubble schedule's: the input's gradient) or weight."""
    ranks = []
    for rank, trace, (start, end) in one_step(trace_dir, need_collectives=False):
        chunks = []
        for s, e, name in trace["annotations"]:
            if (m := CHUNK.fullmatch(name)) and start <= s and e <= end:
                chunks.append((s, e, m[2], int(m[3]), int(m[1])))
        if not chunks:
            fail(
                f"{trace_dir}: no 'stageN forward mbM' ranges in the last profiled step: not a"
                " trace of model_parallel.py under torchrun (one stage per process)"
            )
        ranks.append((rank, sorted(chunks)))
    return ranks


def alive_peak(chunks):
    """{stage: the most micro-batches whose activations it held at once}: from the start of a
    micro-batch's forward to the end of its last backward (or weight) chunk on that stage."""
    spans = {}
    for s, e, _, mb, stage in chunks:
        a, b = spans.get((stage, mb), (s, e))
        spans[stage, mb] = (min(a, s), max(b, e))
    peaks = {}
    for stage in {st for st, _ in spans}:
        events = sorted(
            (t, d) for (st, _), (a, b) in spans.items() if st == stage for t, d in ((a, 1), (b, -1))
        )
        peaks[stage] = max(itertools.accumulate(d for _, d in events))
    return peaks


def stage_activations(trace_dir):
    """{stage: {"peak": bytes, "micro_batch": bytes}} of the activations each stage held for
    backward (model_parallel.py --profile's activations.rank{R}.json); {} for traces without."""
    held = {}
    for path in sorted(Path(trace_dir).glob("activations.rank*.json")):
        held.update({int(s): h for s, h in json.loads(path.read_text()).items()})
    return held


def draw_pipelines(runs, path, where=""):
    """runs: [(label, trace_dir)] of model_parallel.py under torchrun, one panel each: a row
    per process, its measured idle share beside the formula's, the micro-batches each stage
    held at once."""
    import matplotlib.pyplot as plt

    panels = [(label, pipeline_chunks(d), stage_activations(d)) for label, d in runs]
    rows = sum(len(ranks) for _, ranks, _ in panels)
    height = 1.6 + 1.0 * rows + 0.3 * len(panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, height), squeeze=False)
    fig.subplots_adjust(hspace=1.1)
    colors = {"forward": "tab:blue", "backward": "tab:orange", "weight": "tab:green"}
    for ax, (label, ranks, activations) in zip(axes[:, 0], panels, strict=True):
        every = [c for _, chunks in ranks for c in chunks]
        start, end = min(c[0] for c in every), max(c[1] for c in every)
        micro, stages = 1 + max(c[3] for c in every), 1 + max(c[4] for c in every)
        n, busy, peaks = len(ranks), 0.0, {}
        for rank, chunks in ranks:
            y = n - 1 - rank
            idle = dict(facecolor="none", edgecolor="0.6", hatch="///", linewidth=0)
            ax.broken_barh([(0, (end - start) / 1e3)], (y + 0.1, 0.8), **idle)
            for s, e, kind, mb, _ in chunks:
                ax.broken_barh(
                    [((s - start) / 1e3, (e - s) / 1e3)], (y + 0.1, 0.8), color=colors[kind]
                )
                x = (s + e) / 2e3 - start / 1e3
                ax.text(x, y + 0.5, str(mb), ha="center", va="center", fontsize=6, color="white")
            busy += sum(e - s for s, e, *_ in chunks)
            peaks.update(alive_peak(chunks))
        v = stages // n  # stages per process
        measured, formula = 1 - busy / (n * (end - start)), (n - 1) / (v * micro + n - 1)
        held = " ".join(str(peaks[s]) for s in range(stages))
        # The bytes each stage's autograd graphs held at most, and in its micro-batches' worth.
        saved = [activations.get(s, dict(peak=0, micro_batch=0)) for s in range(stages)]
        kib = " ".join(f"{h['peak'] / 1024:.0f}" for h in saved) if activations else "not measured"
        worth = " ".join(f"{h['peak'] / max(1, h['micro_batch']):.1f}" for h in saved)
        ax.set_title(
            f"{label}: {n} processes x {v} stage(s), {micro} micro-batches: idle {measured:.0%}"
            f" measured, {formula:.0%} by (P-1)/(VM+P-1); micro-batches held at once, per"
            f" stage: {held}\nactivations held for backward at most, KiB per stage: {kib}"
            + (f" ({worth} micro-batches' worth)" if activations else ""),
            fontsize=9,
            loc="left",
        )
        ax.set_yticks([n - 0.5 - r for r, _ in ranks], [f"rank {r}" for r, _ in ranks])
        ax.set_xlim(0, (end - start) / 1e3)
        ax.set_ylim(0, n)
        print(
            f"{label}, {n} processes: idle {measured:.3f} measured, {formula:.3f} formula;"
            f" held per stage {held}; activations KiB {kib}",
            flush=True,
        )
    axes[-1, 0].set_xlabel("ms since the step's first forward (numbers: the micro-batch)")
    names = ["forward", "backward (zero bubble: the input's gradient)", "weight gradient", "idle"]
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="none", edgecolor="0.6", hatch="///"))
    top = axes[0, 0].get_position().y1 + 0.45 / fig.get_figheight()  # above the first title
    fig.legend(handles, names, loc="lower center", bbox_to_anchor=(0.5, top), ncol=4)
    fig.suptitle(where, y=top + 0.5 / fig.get_figheight(), fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# One launch each, so that each peak is its own process's: sharding.py's --wrappers.
MEMORY = {
    "ddp": "DDP",
    "ddp+zero": "ZeRO-1",
    "fsdp": "FSDP",
    "hsdp": "HSDP 2x2",
    "tp": "TP",
    "tp+sp": "TP + SP",
    "2-d": "TP 2 x FSDP 2",
    "cp": "CP (ring)",
    "ep": "EP (MoE)",
}
COUNTED = {"params": "weights", "grads": "gradients", "optimizer": "AdamW state"}
COUNTED["activations"] = "saved activations"
MEMORY_ARGS = ["--worlds", "4", "--models", "vit", "--vit-dim", "768", "--steps", "1"]


def memory_runs():
    """benchmarks/sharding.py at 4 processes, one launch per strategy: its JSON files."""
    paths = []
    RUNS.mkdir(parents=True, exist_ok=True)
    for wrapper in MEMORY:
        path = RUNS / f"memory-{wrapper}.json"
        cmd = [sys.executable, "benchmarks/sharding.py", *MEMORY_ARGS, "--wrappers", wrapper]
        proc = subprocess.run([*cmd, "--json", path], cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            fail(f"{' '.join(map(str, cmd))} failed:\n{proc.stderr[-3000:]}")
        print(f"ran sharding.py --wrappers {wrapper}: {path}", flush=True)
        paths.append(path)
    return paths


def draw_memory(sources, path, where=""):
    """Stacked bars of what rank 0 holds per strategy (counted), its measured peak beside them;
    sources: sharding.py --json files (a path or a list of them)."""
    import matplotlib.pyplot as plt

    rows = []
    for source in [sources] if isinstance(sources, (str, Path)) else sources:
        for row in json.loads(Path(source).read_text()):
            missing = [k for k in (*COUNTED, "peak", "wrapper") if k not in row]
            if missing:
                fail(f"{source}: a row without {', '.join(missing)}: not sharding.py --json's")
            rows.append(row)
    rows.sort(key=lambda r: list(MEMORY).index(r["wrapper"]) if r["wrapper"] in MEMORY else 99)
    fig, ax = plt.subplots(figsize=(12, 5))
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for (key, name), color in zip(COUNTED.items(), ("C0", "C1", "C2", "C7"), strict=True):
        mb = [r[key] / 2**20 for r in rows]
        ax.bar(x, mb, 0.6, bottom=bottom, label=f"{name} (counted)", color=color)
        bottom = [b + m for b, m in zip(bottom, mb, strict=True)]
    peaks = [r["peak"] / 2**20 for r in rows]
    ax.scatter(x, peaks, marker="_", s=900, linewidths=3, color="black", zorder=3)
    ax.scatter([], [], marker="_", s=200, linewidths=3, color="black", label="measured peak")
    for i, p in zip(x, peaks, strict=True):
        ax.annotate(f"{p:.0f}", (i, p), textcoords="offset points", xytext=(0, 6), ha="center")
    ax.set_xticks(list(x), [MEMORY.get(r["wrapper"], r["wrapper"]) for r in rows])
    ax.set_ylabel("MB on rank 0")
    world = "/".join(sorted({str(r["world"]) for r in rows}))
    model = "/".join(sorted({r["model"] for r in rows}))
    moe = (
        " (EP: its mixture of experts, 8 experts a block)"
        if any(r["wrapper"] == "ep" for r in rows)
        else ""
    )
    whole = next((r["params"] for r in rows if r["wrapper"] == "ddp"), None)
    size = f" of {whole / 4e6:.1f} M parameters" if whole else ""  # DDP's: every fp32 weight
    ax.set_title(
        f"What rank 0 holds, {world} processes, AdamW, {model}{size}{moe}; the peak includes"
        f" the library's one-time buffers\n{where}",
        fontsize=10,
        loc="left",
    )
    ax.set_ylim(0, 1.15 * max(max(peaks), max(bottom)))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=5)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def draw_accuracy(source, path):
    """Test accuracy against training seconds, per configuration of run_all.py's section a,
    from the results.json it wrote: the machine, date and load of those runs in the title."""
    import matplotlib.pyplot as plt

    results = json.loads(Path(source).read_text())
    try:
        configs = results["sections"]["a_time_to_accuracy"]["configurations"]
        machine, day = results["machine"], results["date"][:10]
    except KeyError as e:
        fail(f"{source}: no {e} (run_all.py --sections a writes it)")
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for label, config in configs.items():
        epochs = config["per_epoch"]
        seconds = list(itertools.accumulate(e["epoch_seconds"] for e in epochs))
        ax.plot(seconds, [100 * e["test_acc"] for e in epochs], marker="o", label=label)
    for level in (90, 91):
        ax.axhline(level, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("training seconds (sum of epoch_seconds)")
    ax.set_ylabel("test accuracy (%)")
    load = machine.get("load_average_at_start", float("nan"))
    ax.set_title(
        "Fashion-MNIST: test accuracy against training time\n"
        f"{machine['cpu']}, {machine['cores']} cores, no GPU, torch {machine['torch']}, {day},"
        f" load {load:.1f}: {results['command']}",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def takes_profile(script):
    help_text = subprocess.run(
        [sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    return "--profile" in help_text


def torchrun(nproc, script, argv, trace_dir):
    """SCRIPT under torchrun on this machine's CPU with --profile trace_dir; its output on error."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={nproc}", script, *QUICK, *argv, "--profile", str(trace_dir)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        fail(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    print(f"ran {script} {' '.join(argv)}: {trace_dir}", flush=True)


def timeline_runs(strategies):
    runs = []
    for key in strategies:
        label, script, argv = STRATEGIES[key]
        if not takes_profile(script):
            print(f"skipped {label}: {script} does not take --profile yet", flush=True)
            continue
        nproc = NPROC.get(key, 2)
        torchrun(nproc, script, argv, RUNS / key)
        runs.append((f"{label} ({script}, {nproc} processes, CPU)", RUNS / key))
    return runs


PIPELINES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "interleaved 1F1B"}
PIPELINES["zbv"] = "zero bubble (ZBV)"


def pipeline_runs():
    """model_parallel.py's GPT (8 blocks of 96, 128 bytes a sample, 16 a batch in 8
    micro-batches) under each schedule, on 2 and 4 processes."""
    corpus = Path(argparse.__file__)  # a file of text every Python has
    gpt = [*TEXT, "--data-dir", str(corpus), "--seq-len", "128", "--depth", "8"]
    gpt += ["--batch-size", "16", "--microbatches", "8"]
    runs = []
    for stages in (2, 4):
        for schedule, label in PIPELINES.items():
            where = RUNS / f"pipeline-{schedule}-{stages}"
            torchrun(stages, "model_parallel.py", [*gpt, "--pipeline-schedule", schedule], where)
            runs.append((label, where))
    return runs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = ("timelines", "pipeline", "memory", "accuracy")
    p.add_argument("--only", choices=what, help="one picture (default: all four)")
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    p.add_argument("--traces", nargs="+", metavar="LABEL=DIR", help="draw these traces instead")
    p.add_argument("--memory-json", help="draw memory.png from this sharding.py --json file")
    p.add_argument(
        "--results-json",
        default=str(ROOT / "benchmarks" / "results.json"),
        help="accuracy_vs_time.png's source: run_all.py's results.json",
    )
    p.add_argument("--where", help="the machine named in the titles (default: this one's CPU)")
    p.add_argument("--out", default=str(ROOT / "benchmarks"), help="where the PNGs go")
    args = p.parse_args(argv)
    if args.traces and args.only not in ("timelines", "pipeline"):
        fail("--traces needs --only timelines or --only pipeline: which picture they are for")
    given = [tuple(t.split("=", 1)) for t in args.traces or []]
    if any(len(t) != 2 for t in given):
        fail("--traces takes LABEL=DIR pairs")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "timelines"):
        where = stamp(args.where)  # the load before the runs, not after them
        runs = given or timeline_runs(args.strategies)
        if runs:
            draw_timelines(runs, out / "timelines.png", where)
            print(f"wrote {out / 'timelines.png'}")
    if args.only in (None, "pipeline"):
        where = stamp(args.where)
        draw_pipelines(given or pipeline_runs(), out / "pipeline.png", where)
        print(f"wrote {out / 'pipeline.png'}")
    if args.only in (None, "memory"):
        where = stamp(args.where)
        source = args.memory_json or memory_runs()
        draw_memory(source, out / "memory.png", where)
        print(f"wrote {out / 'memory.png'}")
    if args.only in (None, "accuracy"):
        draw_accuracy(args.results_json, out / "accuracy_vs_time.png")
        print(f"wrote {out / 'accuracy_vs_time.png'}")


if __name__ == "__main__":
    main()
