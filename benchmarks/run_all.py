"""Every benchmark of the repository in one run, printed as a markdown table.

    python benchmarks/run_all.py            # the full run: about 20 minutes on 2 CPU cores
    python benchmarks/run_all.py --quick    # smoke pass: a few steps of everything, ~2 minutes

Writes benchmarks/results.md, benchmarks/results.json and, when matplotlib is installed,
benchmarks/accuracy_vs_time.png (--quick writes them under benchmarks/runs/ instead, so a
smoke pass never replaces real figures). Logs and outputs of every run stay in
benchmarks/runs/.

Sections: (a) time to accuracy on Fashion-MNIST, ddp_train.py against the classic recipe;
(b) ddp_train.py's step time against a bare DDP loop, and the input pipeline's share;
(c) launchers and strategies: mp.spawn against torchrun, DataParallel against DDP, 1 -> 2
processes; (d) the other strategies: DDP communication hooks (d1), pipeline parallelism (d2),
int8 quantization (d3); (e) one GPU: ResNet-18 to 94% on Fashion-MNIST, bf16 and channels_last,
with and without torch.compile, against a bare loop on the same GPU. On a machine with CUDA:

    python benchmarks/run_all.py --sections e    # writes benchmarks/gpu/results.md and .json

Runs are sequential, each with a timeout; compare figures as ratios within one run.
"""

import argparse
import contextlib
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run"]  # the `torchrun` command, with this Python
RAW_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


OTHERS = "# Figures measured outside `run_all.py`"  # where results.md's other part begins


def log(message):
    """Progress goes to stderr; stdout carries only the markdown."""
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------
# Running the scripts


def torchrun(nproc, script, *args):
    return [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", script, *args]


def show(cmd):
    """The command as a person would type it: `python`, and `torchrun` for the module."""
    cmd = list(cmd)
    if cmd[:3] == TORCHRUN:
        cmd = ["torchrun", *cmd[3:]]
    elif cmd[:1] == [PY]:
        cmd = ["python", *cmd[1:]]
    return shlex.join(cmd)


class Runner:
    """Runs commands one at a time from the repository root, each with a timeout, its
    output in a log file, and results cached by command: a section that needs a run
    another section already made (the same command) reads that one."""

    def __init__(self, work_dir):
        self.work_dir = work_dir
        self.runs = {}  # name -> record
        self.by_cmd = {}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        # Every launcher applies its own thread budget (torchrun: 1 per process; mp.spawn:
        # cores / processes; one process: all cores); a value from the shell would override all.
        self.removed_omp = self.env.pop("OMP_NUM_THREADS", None)

    def run(self, name, cmd, timeout, output_dir=False, env=None):
        """Run cmd (with `--output-dir DIR` appended when output_dir) and return its record:
        command, exit status, wall seconds, metrics (metrics.jsonl lines), json (JSON lines
        printed on stdout) and, on failure, the last lines of its output."""
        key = (*cmd, *sorted((env or {}).items()))
        if key in self.by_cmd:
            return self.by_cmd[key]
        run_dir = self.work_dir / name
        # A fresh directory: ddp_train.py would resume from an old run's checkpoint.
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        full = [*cmd, "--output-dir", str(run_dir.relative_to(ROOT))] if output_dir else list(cmd)
        log(f"[{time.strftime('%H:%M:%S')}] {name}: {show(full)}")
        t0 = time.perf_counter()
        with open(run_dir / "output.log", "w") as out:
            # A session of its own: a timeout or Ctrl-C stops exactly this command's processes.
            proc = subprocess.Popen(
                full,
                cwd=ROOT,
                env={**self.env, **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                status = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                stop(proc)
                status = f"timed out after {timeout} s"
            except KeyboardInterrupt:
                stop(proc)
                raise
        wall = time.perf_counter() - t0
        text = (run_dir / "output.log").read_text(errors="replace")
        metrics_file = run_dir / "metrics.jsonl"
        metrics = (
            [json.loads(ln) for ln in metrics_file.read_text().splitlines() if ln]
            if metrics_file.exists()
            else []
        )
        printed = []
        for line in text.splitlines():
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    printed.append(json.loads(line))
        shown = " ".join(f"{k}={v}" for k, v in (env or {}).items()) + " " * bool(env) + show(full)
        record = dict(
            name=name,
            command=shown,
            status=status,
            wall_seconds=wall,
            metrics=metrics,
            json=printed,
        )
        if status != 0 or not (metrics or printed):
            # The last lines of the output, made safe for a markdown table cell.
            tail = " / ".join(ln.strip() for ln in text.strip().splitlines()[-3:]) or "no output"
            if not isinstance(status, int):  # timed out: the tail is the stop's traceback
                tail = f"see {run_dir.relative_to(ROOT) / 'output.log'}"
            record["error"] = tail.replace("|", "\\|")[-400:]
        log(f"    -> {'ok' if status == 0 else 'FAILED: ' + str(status)} in {wall:.0f} s")
        self.runs[name] = self.by_cmd[key] = record
        return record


def stop(proc):
    """End a command's process group: SIGTERM first, which torchrun passes on to its workers
    (they run in sessions of their own), then SIGKILL if it is still there after a minute."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def ok(record):
    return "error" not in record


def failure(record):
    status = record["status"]
    why = f"exit {status}" if isinstance(status, int) else status
    return f"failed ({why}): {record['error']}"


# ----------------------------------------------------------------------------------------
# Reading metrics


def steady(metrics):
    """The epochs after the first (which pays one-time warm-up costs); all if only one."""
    return metrics[1:] or metrics


def samples_per_second(metrics):
    """Samples per second over the steady-state epochs (a time-weighted mean)."""
    rows = steady(metrics)
    seconds = sum(m["epoch_seconds"] for m in rows)
    return sum(m["samples_per_second"] * m["epoch_seconds"] for m in rows) / seconds


def ms_per_step(metrics):
    """Mean training milliseconds per optimizer step over the steady-state epochs."""
    rows = steady(metrics)
    steps_before = metrics[0]["step"] if len(metrics) > 1 else 0
    return 1000 * sum(m["epoch_seconds"] for m in rows) / (rows[-1]["step"] - steps_before)


def time_to(metrics, target):
    """(cumulative training seconds, 1-based epoch) at the first epoch end with test
    accuracy >= target, or None. Accuracy is measured once per epoch, so this is an
    upper bound at epoch granularity."""
    total = 0.0
    for m in metrics:
        total += m["epoch_seconds"]
        if m["test_acc"] >= target:
            return total, m["epoch"] + 1
    return None


def pct(x):
    return f"{100 * x:.1f}%"


def fmt_time_to(hit):
    return f"{hit[0]:.1f} s (epoch {hit[1]})" if hit else "not reached"


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def commands(*records):
    return ["", "Commands:", ""] + [f"- `{r['command']}`" for r in records]


# ----------------------------------------------------------------------------------------
# Data


def has_fashion_mnist(data_dir):
    """Whether data_dir holds the unzipped Fashion-MNIST files in torchvision's layout
    (DATA_DIR/FashionMNIST/raw/*-ubyte), which the scripts and the baseline recipe read.
    A relative data_dir is relative to the repository root, where the scripts run."""
    raw = ROOT / data_dir / "FashionMNIST" / "raw"
    return all((raw / f).is_file() for f in RAW_FILES)


# Where the files are missing: what to do, offline too (README.md, Data).
NO_FASHION_MNIST = (
    "no Fashion-MNIST files (*-ubyte) in {}/FashionMNIST/raw: add --download to a script once, "
    "or gunzip Debian's dataset-fashion-mnist there (README.md, Data)"
)


# ----------------------------------------------------------------------------------------
# Sections. Each returns markdown lines and data for results.json (section a also the
# accuracy curves for the plot).


def configs(args):
    """Flags and timeouts of the full run and of the --quick smoke pass."""
    if args.quick:
        return dict(
            train=["--epochs", "1", "--max-steps", str(args.quick_steps)],
            baseline=["--epochs", "1", "--max-steps", str(args.quick_steps)],
            bare=["--steps", "20"],
            overhead=["--rounds", "2", "--steps", "10"],
            pipeline=["--max-batches", str(args.quick_steps)],
            gpu=["--epochs", "1", "--max-steps", str(args.quick_steps)],
            gpu_bare=["--steps", "20"],
            comm=[
                ("cnn", ["--rounds", "1", "--steps", "2"]),
                ("resnet18", ["--batch-size", "4", "--rounds", "1", "--steps", "1"]),
            ],
            pipeline_mp=["--data", "synthetic", "--epochs", "2"],
            quantize=["--runs", "5"],
            timeout=300,
        )
    return dict(
        train=[],  # ddp_train.py's defaults: 5 epochs
        baseline=[],  # the recipe's 10 epochs
        bare=["--steps", "200"],
        overhead=["--rounds", "8", "--steps", "50"],
        pipeline=[],  # one epoch of one rank's shard
        gpu=["--epochs", str(args.gpu_epochs)],
        gpu_bare=["--steps", "200"],
        # The CNN's 29 k parameters make the all-reduce trivial; ResNet-18's 11 M show the bytes.
        comm=[
            ("cnn", ["--rounds", "5", "--steps", "20"]),
            ("resnet18", ["--batch-size", "16", "--rounds", "3", "--steps", "3"]),
        ],
        # 15 steps per epoch of the synthetic set (Fashion-MNIST's shape): speed only.
        pipeline_mp=["--data", "synthetic", "--epochs", "5"],
        quantize=["--qat-steps", "200", "--threads", "1", "--runs", "200"],
        timeout=1200,
    )


def cpu_flags(args):
    """Sections a-c measure the CPU with gloo: say so on a machine that also has CUDA."""
    flags = ["--data-dir", args.data_dir] if args.data_dir != "data" else []
    return flags + (["--device", "cpu"] if torch.cuda.is_available() else [])


def ddp_run(runner, args, cfg, nproc):
    cmd = torchrun(nproc, "ddp_train.py", *cpu_flags(args), *cfg["train"])
    return runner.run(f"ddp_train_{nproc}proc", cmd, cfg["timeout"], output_dir=True)


def section_time_to_accuracy(runner, args, cfg):
    lines = ["## a. Time to accuracy on Fashion-MNIST", ""]
    configs_ = [("ddp_train.py, 2 processes", ddp_run(runner, args, cfg, 2))]
    configs_.append(("ddp_train.py, 1 process", ddp_run(runner, args, cfg, 1)))
    if not has_fashion_mnist(args.data_dir):
        lines += ["Baseline not run: " + NO_FASHION_MNIST.format(args.data_dir) + ".", ""]
        baseline = None
    else:
        device = ["--device", "cpu"] if torch.cuda.is_available() else []
        flags = ["--data-dir", args.data_dir, *device, *cfg["baseline"]]
        cmd = torchrun(2, "benchmarks/baseline_recipe.py", *flags)
        baseline = runner.run("baseline_recipe_2proc", cmd, cfg["timeout"], output_dir=True)
        configs_.append(("baseline recipe, 2 processes", baseline))
    target = baseline["metrics"][-1]["test_acc"] if baseline and ok(baseline) else None
    base_hit = time_to(baseline["metrics"], target) if target is not None else None
    base_sps = samples_per_second(baseline["metrics"]) if target is not None else None

    rows, data = [], {}
    for label, r in configs_:
        if not ok(r):
            rows.append([label, failure(r)] + [""] * 7)
            data[label] = dict(command=r["command"], error=failure(r))
            continue
        m = r["metrics"]
        hit = time_to(m, target) if target is not None else None
        hits = {"baseline_final": hit, "0.90": time_to(m, 0.90), "0.91": time_to(m, 0.91)}
        train_s = sum(x["epoch_seconds"] for x in m)
        sps = samples_per_second(m)
        speedup = f"{base_hit[0] / hit[0]:.1f}x" if hit and base_hit else "n/a"
        rows.append(
            [
                label,
                pct(m[-1]["test_acc"]),
                f"{train_s:.1f}",
                f"{r['wall_seconds']:.0f}",
                f"{sps:.0f}" + (f" ({sps / base_sps:.1f}x)" if base_sps else ""),
                fmt_time_to(hit) if target is not None else "n/a",
                fmt_time_to(hits["0.90"]),
                fmt_time_to(hits["0.91"]),
                speedup,
            ]
        )
        data[label] = dict(
            command=r["command"],
            final_acc=m[-1]["test_acc"],
            training_seconds=train_s,
            run_wall_seconds=r["wall_seconds"],
            samples_per_second_steady=sps,
            time_to={k: (v[0] if v else None) for k, v in hits.items()},
            speedup_to_baseline_final=(base_hit[0] / hit[0]) if hit and base_hit else None,
            per_epoch=[
                dict(epoch=x["epoch"] + 1, test_acc=x["test_acc"], epoch_seconds=x["epoch_seconds"])
                for x in m
            ],
        )
    base_label = pct(target) if target is not None else "baseline final"
    lines += table(
        [
            "configuration",
            "final test acc",
            "training s",
            "run wall s",
            "samples/s (vs baseline)",
            f"to {base_label} (baseline final)",
            "to 90%",
            "to 91%",
            f"speed-up to {base_label}",
        ],
        rows,
    )
    lines += [
        "",
        "Training s: the sum of epoch_seconds (training only, no evaluation or start-up); run "
        "wall s: the whole "
        "command. Time to X: cumulative training seconds at the first epoch end whose test "
        "accuracy is at least X. "
        "Samples/s: steady state (epochs after the first). Speed-up: the baseline's time to its "
        "own final accuracy "
        "divided by this configuration's.",
        "",
        "Test accuracy per epoch (cumulative training seconds):",
        "",
    ]
    good = [(label, r["metrics"]) for label, r in configs_ if ok(r)]
    epochs = max((len(m) for _, m in good), default=0)
    rows = []
    for e in range(epochs):
        row = [str(e + 1)]
        for _, m in good:
            row.append(
                f"{pct(m[e]['test_acc'])} ({sum(x['epoch_seconds'] for x in m[: e + 1]):.1f} s)"
                if e < len(m)
                else ""
            )
        rows.append(row)
    lines += table(["epoch"] + [label for label, _ in good], rows)
    lines += commands(*(r for _, r in configs_))
    curves = {
        label: [
            (sum(x["epoch_seconds"] for x in m[: i + 1]), x["test_acc"]) for i, x in enumerate(m)
        ]
        for label, m in good
    }
    return lines, dict(baseline_final_acc=target, configurations=data), curves


def section_overhead(runner, args, cfg):
    lines = ["## b. Overhead: ddp_train.py against a bare DDP loop (2 processes)", ""]
    ddp = ddp_run(runner, args, cfg, 2)
    bare = runner.run(
        "bare_loop_2proc",
        torchrun(2, "benchmarks/bare_loop.py", *cpu_flags(args), *cfg["bare"]),
        600,
    )
    inter_cmd = torchrun(2, "benchmarks/overhead.py", *cpu_flags(args), *cfg["overhead"])
    inter = runner.run("overhead_interleaved_2proc", inter_cmd, 600)
    pipe_cmd = [
        PY,
        "benchmarks/input_pipeline.py",
        "--world-size",
        "2",
        *cpu_flags(args),
        *cfg["pipeline"],
    ]
    pipe = runner.run("input_pipeline", pipe_cmd, 600)
    data, rows, step_ms = {}, [], None
    if ok(inter):
        o = inter["json"][-1]
        rounds = len(o["ratio_per_round"])
        label = (
            f"ddp_train.py step vs bare loop, interleaved in one run (median of {rounds} rounds)"
        )
        value = f"{o['script_ms_per_step']:.1f} ms vs {o['bare_ms_per_step']:.1f} ms"
        rows.append([label, value, f"{o['ratio']:.2f}x"])
        data.update(overhead_ratio=o["ratio"], overhead_ratio_per_round=o["ratio_per_round"])
    else:
        rows.append(["interleaved comparison", failure(inter), ""])
    if ok(ddp):
        step_ms = ms_per_step(ddp["metrics"])
        which = (
            "mean of epochs 2 and later"
            if len(ddp["metrics"]) > 1
            else "epoch 1 only, warm-up included"
        )
        rows.append([f"ddp_train.py step ({which})", f"{step_ms:.1f} ms", ""])
        data["ddp_train_ms_per_step"] = step_ms
    else:
        rows.append(["ddp_train.py step", failure(ddp), ""])
    if ok(bare):
        b = bare["json"][-1]
        wall, median = b["ms_per_step_wall"], b["ms_per_step"]
        for label, ms in (
            ("mean wall time, batch gather included", wall),
            ("median of forward+backward+step", median),
        ):
            rows.append(
                [
                    f"bare loop step ({label})",
                    f"{ms:.1f} ms",
                    f"{step_ms / ms:.2f}x" if step_ms else "",
                ]
            )
        data.update(bare_ms_per_step_wall=wall, bare_ms_per_step_median=median)
        if step_ms:
            data["overhead_ratio_separate_runs"] = step_ms / wall
    else:
        rows.append(["bare loop step", failure(bare), ""])
    if ok(pipe):
        p = pipe["json"][-1]
        label = f"input pipeline alone, per batch ({p['batches']} batches of rank 0 of 2, "
        label += f"{p['threads']} thread)"
        share = f"{100 * p['ms_per_batch'] / step_ms:.1f}% of it" if step_ms else ""
        rows.append([label, f"{p['ms_per_batch']:.2f} ms", share])
        data["input_ms_per_batch"] = p["ms_per_batch"]
        if step_ms:
            data["input_share_of_step"] = p["ms_per_batch"] / step_ms
    else:
        rows.append(["input pipeline", failure(pipe), ""])
    lines += table(["quantity", "value", "ddp_train.py step relative to it"], rows)
    lines += [
        "",
        "The bare loop is the same model and optimizer on random batches of the same in-memory "
        "tensors, "
        "without DataLoader, sampler, schedule, logging or checks: the limit for ddp_train.py on "
        "this machine. "
        "The first row is ddp_train.py's overhead (the target: at most 1.10): "
        "benchmarks/overhead.py alternates rounds of the bare loop and of ddp_train.main() "
        "in the same two processes, which cancels the machine's drift. The rows below it "
        "compare separate runs minutes apart, where that drift (up to 30% here) swamps the "
        "difference. The input pipeline row iterates the training loader ddp_train.main() "
        "builds, without a model.",
    ]
    lines += commands(inter, ddp, bare, pipe)
    return lines, data


def section_launchers(runner, args, cfg):
    lines = ["## c. Launchers and strategies", ""]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ddp2, ddp1 = ddp_run(runner, args, cfg, 2), ddp_run(runner, args, cfg, 1)
    flags = [*cpu_flags(args), *cfg["train"]]
    spawn_cmd = [PY, "ddp_mp_spawn.py", "--nprocs", "2", *flags]
    spawn = runner.run("ddp_mp_spawn_2proc", spawn_cmd, cfg["timeout"], output_dir=True)
    dp = runner.run("dp_train_1proc", [PY, "dp_train.py", *flags], cfg["timeout"], output_dir=True)
    comparisons = [
        ("launcher: mp.spawn vs torchrun, 2 processes", spawn, ddp2, f"{max(1, cores // 2)} vs 1"),
        ("strategy: DataParallel vs DDP, 1 process", dp, ddp1, f"{cores} vs {cores}"),
        ("scaling: 2 processes vs 1 (torchrun)", ddp2, ddp1, f"1 each vs {cores}"),
    ]
    rows, data = [], {}
    for label, a, b, threads in comparisons:
        if not (ok(a) and ok(b)):
            bad = a if not ok(a) else b
            rows.append([label, failure(bad), "", "", "", threads])
            continue
        sa, sb = samples_per_second(a["metrics"]), samples_per_second(b["metrics"])
        ratio = sa / sb
        note = (
            f" ({100 * ratio / 2:.0f}% scaling efficiency)" if label.startswith("scaling") else ""
        )
        accs = f"{pct(a['metrics'][-1]['test_acc'])} / {pct(b['metrics'][-1]['test_acc'])}"
        rows.append([label, f"{sa:.0f}", f"{sb:.0f}", f"{ratio:.2f}x{note}", accs, threads])
        data[label] = dict(
            samples_per_second=[sa, sb],
            ratio=ratio,
            final_acc=[a["metrics"][-1]["test_acc"], b["metrics"][-1]["test_acc"]],
        )
    lines += table(
        [
            "comparison (A vs B)",
            "A samples/s",
            "B samples/s",
            "A / B",
            "final acc A / B",
            "threads per process A vs B",
        ],
        rows,
    )
    lines += [
        "",
        "Samples/s are steady state (epochs after the first), same flags for A and B. Threads: "
        "torchrun gives each "
        "of several workers OMP_NUM_THREADS=1; mp.spawn children get cores / processes from "
        "common.init_distributed_mode(); a single process uses every core.",
    ]
    lines += commands(spawn, ddp2, dp, ddp1)
    return lines, data


def gpu_off():
    """Sections a-d measure the CPU with gloo: say so on a machine that also has CUDA."""
    return ["--device", "cpu"] if torch.cuda.is_available() else []


def section_comm_hooks(runner, args, cfg):
    lines = ["## d1. DDP communication hooks (ddp_comm.py --comm-hook), 2 processes", ""]
    hooks = ("none", "fp16", "bf16", "powersgd")
    rows, data, records = [], {}, []
    for model, flags in cfg["comm"]:
        cmd = torchrun(2, "benchmarks/comm_hooks.py", "--model", model, *gpu_off(), *flags)
        r = runner.run(f"comm_hooks_{model}", cmd, cfg["timeout"])
        records.append(r)
        if not ok(r):
            rows.append([model, failure(r)] + [""] * 5)
            continue
        o = r["json"][-1]
        data[model] = o
        ms, sent = o["ms_per_step"], o["bytes_per_step"]
        for hook in hooks:
            # Compression costs compute and saves bytes; it pays where sending the saved bytes
            # takes longer than the compute it adds: on links slower than saved / extra.
            extra_s, saved = (ms[hook] - ms["none"]) / 1000, sent["none"] - sent[hook]
            if hook == "none":
                pays = ""
            elif extra_s <= 0:
                pays = "faster here already"
            else:
                pays = f"below {saved * 8 / extra_s / 1e9:.2f} Gbit/s"
            rows.append(
                [
                    f"{model} ({o['params'] / 1e6:.2f} M parameters, batch {o['batch_size']} per "
                    f"process)",
                    hook,
                    f"{ms[hook]:.1f}",
                    f"{o['time_ratio'][hook]:.2f}x",
                    f"{sent[hook] / 1e6:.3f}",
                    f"{o['bytes_ratio'][hook]:.3f}x",
                    pays,
                ]
            )
    lines += table(
        [
            "model",
            "--comm-hook",
            "ms per step",
            "time vs none",
            "MB all-reduced per step per rank",
            "bytes vs none",
            "pays off on links",
        ],
        rows,
    )
    lines += [
        "",
        "Each option trains its own DDP model in alternating rounds in the same two processes "
        "(medians over "
        "rounds), set up by ddp_comm.register_comm_hook(); PowerSGD at rank "
        f"{next(iter(data.values()))['powersgd_rank'] if data else '?'}, compressing from the "
        f"third step. "
        "Bytes: what each rank hands to all-reduce per step (counted at "
        "torch.distributed.all_reduce for the "
        "hooks; for none, every fp32 gradient). Here both processes share one machine, so the "
        "all-reduce "
        "costs almost nothing and compression only adds compute. "
        '"Pays off" is the link speed below which '
        "the bytes saved take longer to send than the compute added, assuming the all-reduce is "
        "not hidden "
        "behind backward (DDP overlaps them) and a 2-process ring, which moves each rank's bytes "
        "once.",
    ]
    lines += commands(*records)
    return lines, data


# (label, processes, schedule, micro-batches, threads of a single process)
# (label, processes, model_parallel.py flags, threads of the one process or None for all cores)
PIPELINE_CONFIGS = [
    ("single device (1 process, all cores)", 1, ["--devices", "cpu", "--microbatches", "1"], None),
    ("single device (1 process, 1 thread)", 1, ["--devices", "cpu", "--microbatches", "1"], 1),
    (
        "mode 1, naive: 1 process, 2 stages (cpu,cpu)",
        1,
        ["--devices", "cpu,cpu", "--microbatches", "1"],
        None,
    ),
    (
        "mode 2: 1 process, 2 stages, 8 micro-batches",
        1,
        ["--devices", "cpu,cpu", "--microbatches", "8"],
        None,
    ),
    (
        "mode 3, naive: 2 processes, 1 micro-batch",
        2,
        ["--pipeline-schedule", "gpipe", "--microbatches", "1"],
        None,
    ),
    (
        "mode 3, GPipe: 2 processes, 8 micro-batches",
        2,
        ["--pipeline-schedule", "gpipe", "--microbatches", "8"],
        None,
    ),
    (
        "mode 3, 1F1B: 2 processes, 8 micro-batches",
        2,
        ["--pipeline-schedule", "1f1b", "--microbatches", "8"],
        None,
    ),
]


def section_model_parallel(runner, args, cfg):
    lines = ["## d2. Model parallelism: model_parallel.py's three modes", ""]
    records, rows, data = [], [], {}
    base = None
    for i, (label, nproc, mode_flags, threads) in enumerate(PIPELINE_CONFIGS):
        flags = [*mode_flags, *gpu_off(), *cfg["pipeline_mp"]]
        cmd = (
            torchrun(nproc, "model_parallel.py", *flags)
            if nproc > 1
            else [PY, "model_parallel.py", *flags]
        )
        env = {"OMP_NUM_THREADS": str(threads)} if threads else None
        r = runner.run(f"model_parallel_{i}", cmd, cfg["timeout"], output_dir=True, env=env)
        records.append(r)
        stages = 2 if nproc > 1 or "cpu,cpu" in mode_flags else 1
        micro = int(mode_flags[mode_flags.index("--microbatches") + 1])
        bubble = f"{(stages - 1) / (micro + stages - 1):.0%}" if stages > 1 else "none"
        if not ok(r):
            rows.append([label, bubble, failure(r), "", "", ""])
            continue
        sps, ms = samples_per_second(r["metrics"]), ms_per_step(r["metrics"])
        if label == PIPELINE_CONFIGS[0][0]:
            base = sps  # the single device with all cores; if it failed, there is no ratio
        ratio = sps / base if base else None
        shown = f"{ratio:.2f}x" if ratio else "n/a"
        rows.append(
            [label, bubble, f"{sps:.0f}", f"{ms:.1f}", shown, pct(r["metrics"][-1]["test_acc"])]
        )
        data[label] = dict(
            samples_per_second=sps, ms_per_step=ms, ratio=ratio, command=r["command"]
        )
    lines += table(
        [
            "configuration",
            "bubble (S-1)/(M+S-1)",
            "samples/s",
            "ms per step",
            "vs single device",
            "final test acc",
        ],
        rows,
    )
    lines += [
        "",
        "Same model (model_parallel.py's GroupNorm CNN, cut into stages of equal FLOPs), global "
        "batch 128 and data "
        "for every row; samples/s and ms per step over the epochs after the first. Threads: the "
        "single process "
        "uses every core, or one (a per-core comparison); each torchrun worker one. Modes 1 and 2 "
        "put both "
        "stages on the one CPU: they show the mechanics and cost the copies, with no second "
        "device to gain from. "
        "With as many stages as "
        "cores the pipeline has no more compute than one process: at best it ties, and it pays "
        "for the "
        "activations sent between stages and for micro-batches too small to keep a core busy. "
        "Pipelining "
        "pays when each stage has a device of its own and the model does not fit on one.",
    ]
    lines += commands(*records)
    return lines, data


def section_quantize(runner, args, cfg):
    lines = ["## d3. Int8 quantization: quantize.py", ""]
    ddp = ddp_run(runner, args, cfg, 2)
    if not ok(ddp):
        return lines + [f"not run: the float model's training failed: {failure(ddp)}"], dict(
            error=failure(ddp)
        )
    ckpt = runner.work_dir / "ddp_train_2proc" / "checkpoint.pt"
    report = runner.work_dir / "quantize.json"
    report.unlink(missing_ok=True)
    flags = [
        "--checkpoint",
        str(ckpt.relative_to(ROOT)),
        "--json",
        str(report.relative_to(ROOT)),
        *cfg["quantize"],
    ]
    flags += ["--data-dir", args.data_dir] if args.data_dir != "data" else []
    r = runner.run("quantize", [PY, "quantize.py", *flags], cfg["timeout"])
    if r["status"] != 0 or not report.exists():
        return lines + [failure(r) if not ok(r) else "failed: no JSON report"] + commands(r), dict(
            error=r.get("error")
        )
    q = json.loads(report.read_text())
    rows = [
        [
            x["method"],
            f"{x['size_mb']:.3f} ({x['size_ratio']:.2f}x)",
            f"{x['latency_ms']:.3f} ({x['latency_speedup']:.2f}x)",
            f"{x['throughput']:.0f} ({x['throughput_speedup']:.2f}x)",
            pct(x["accuracy"]),
            f"{100 * x['accuracy_delta']:+.2f}",
            pct(x["agreement"]),
        ]
        for x in q["results"]
    ]
    lines += table(
        [
            "method",
            "size MB (vs fp32)",
            "batch-1 ms (speed-up)",
            f"batch-{q['batch_size']} images/s (speed-up)",
            "test acc",
            "vs fp32 (points)",
            "same prediction as fp32",
        ],
        rows,
    )
    lines += [
        "",
        f"The float model is section a's `ddp_train.py` run (2 processes, defaults). "
        f"{q['threads']} thread{'s' * (q['threads'] > 1)}, "
        f"engine {q['engine']}; static int8 calibrated on {q['calib_images']} training images; "
        f"accuracy on all "
        f"{q['test_images']} test images. The models take turns call by call in one process "
        f"(medians), so the "
        "speed-ups are side by side. Size: the serialized state_dict.",
    ]
    lines += commands(ddp, r)
    return lines, q


# Section e: ddp_train.py on one GPU. tests/test_benchmarks.py trains with these flags on CPU
# (synthetic data, no compile), so that they keep working on machines without a GPU to run them.
GPU_TARGET = 0.94
GPU_BATCH = "256"
GPU_RECIPE = [
    # Its files must be in --data-dir already: GPU machines may be offline (no --download).
    *("--data", "fashion-mnist"),
    *("--model", "resnet18", "--amp", "bf16", "--channels-last"),
    # Shifts of up to 4 pixels and left-right flips, on the GPU. ResNet-18's 11 M weights learn
    # the 60 k training images by heart within a few epochs; these keep every garment's label
    # (a shoe pointing the other way is still a shoe) and are the usual remedy.
    "--augment",
    *("--batch-size", GPU_BATCH),
]
# The speed limit on the same GPU (benchmarks/bare_loop.py): the same model, batch, bf16 and
# augmentation, with the data set on the GPU and nothing else in the loop.
GPU_BARE = ["--model", "resnet18", "--batch-size", GPU_BATCH, "--amp", "bf16", "--augment"]
# Each configuration's flags, for both ddp_train.py and the bare loop.
GPU_CONFIGS = [("eager", []), ("torch.compile", ["--compile"])]


def section_gpu(runner, args, cfg):
    lines = [
        f"## e. GPU: ResNet-18 to {GPU_TARGET:.0%} on Fashion-MNIST (bf16, channels_last), with "
        f"and without "
        "torch.compile",
        "",
    ]
    if not torch.cuda.is_available():
        return lines + ["not run: no CUDA device"], dict(status="not run: no CUDA device")
    if not has_fashion_mnist(args.data_dir):
        status = "not run: " + NO_FASHION_MNIST.format(args.data_dir)
        return lines + [status], dict(status=status)
    data = ["--data-dir", args.data_dir]
    trained, bare, records = {}, {}, []
    for label, extra in GPU_CONFIGS:
        name = "gpu_resnet18_" + label.replace("torch.", "")
        cmd = [PY, "ddp_train.py", *GPU_RECIPE, *data, "--device", "cuda", *extra, *cfg["gpu"]]
        trained[label] = runner.run(name, cmd, cfg["timeout"], output_dir=True)
        cmd = [
            PY,
            "benchmarks/bare_loop.py",
            *GPU_BARE,
            *data,
            "--device",
            "cuda",
            *extra,
            *cfg["gpu_bare"],
        ]
        bare[label] = runner.run(
            "gpu_bare_loop_" + label.replace("torch.", ""), cmd, cfg["timeout"]
        )
        records += [trained[label], bare[label]]

    rows, out = [], dict(device=torch.cuda.get_device_name(0), target=GPU_TARGET)
    for label, _ in GPU_CONFIGS:
        r, b = trained[label], bare[label]
        bare_ms = b["json"][-1]["ms_per_step_wall"] if ok(b) else None
        if ok(r):
            m = r["metrics"]
            hit, ms = time_to(m, GPU_TARGET), ms_per_step(m)
            rows.append(
                [
                    f"ddp_train.py, {label}",
                    f"{samples_per_second(m):.0f}",
                    f"{ms:.2f}",
                    f"{ms / bare_ms:.2f}x" if bare_ms else "n/a",
                    fmt_time_to(hit),
                    f"{pct(m[-1]['test_acc'])} after {len(m)} epochs",
                    f"{m[0]['epoch_seconds']:.1f}",
                    f"{r['wall_seconds']:.0f}",
                ]
            )
            out[label] = dict(
                command=r["command"],
                images_per_second=samples_per_second(m),
                ms_per_step=ms,
                ratio_to_bare_loop=ms / bare_ms if bare_ms else None,
                time_to_target=hit[0] if hit else None,
                final_acc=m[-1]["test_acc"],
                first_epoch_seconds=m[0]["epoch_seconds"],
                per_epoch=[
                    dict(
                        epoch=x["epoch"] + 1,
                        test_acc=x["test_acc"],
                        epoch_seconds=x["epoch_seconds"],
                    )
                    for x in m
                ],
            )
        else:
            rows.append([f"ddp_train.py, {label}", failure(r)] + [""] * 6)
            out[label] = dict(command=r["command"], error=failure(r))
        if ok(b):
            o = b["json"][-1]
            rows.append(
                [
                    f"bare loop, {label}",
                    f"{o['samples_per_second']:.0f}",
                    f"{o['ms_per_step_wall']:.2f} (GPU time {o['ms_per_step']:.2f})",
                    "1.00x",
                    "",
                    "",
                    "",
                    f"{b['wall_seconds']:.0f}",
                ]
            )
            out[f"bare loop, {label}"] = dict(command=b["command"], **o)
        else:
            rows.append([f"bare loop, {label}", failure(b)] + [""] * 6)
    lines += table(
        [
            "configuration",
            "images/s",
            "ms per step",
            "vs bare loop",
            f"to {pct(GPU_TARGET)} test acc (training s)",
            "final test acc",
            "first epoch s",
            "run wall s",
        ],
        rows,
    )
    lines += [
        "",
        f"One process on {out['device']}, batch {GPU_BATCH}, one-cycle SGD. Images/s and ms per "
        f"step:"
        " ddp_train.py's epochs after the first (which compiles, and warms cuDNN up), from "
        "metrics.jsonl; "
        "the bare loop's mean wall time per step over its timed steps (after 20 warm-up steps), "
        "with its median "
        "GPU time per step beside it. Time to the target: cumulative training seconds (evaluation "
        "excluded, the "
        "first epoch's compilation included) at the first epoch end whose test accuracy reaches "
        "it; test "
        "accuracy is measured once per epoch under bf16 autocast. The bare loop keeps the data "
        "set on the GPU "
        "and draws random batches from it: what is left between it and ddp_train.py is the "
        "DataLoader, the "
        "copy to the GPU, the schedule, the loss bookkeeping and the checks.",
    ]
    lines += commands(*records)
    return lines, out


# ----------------------------------------------------------------------------------------
# Report


def machine():
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                memory = f"{int(line.split()[1]) / 2**20:.0f} GiB"
    except OSError:
        pass
    try:
        import torchvision

        tv = torchvision.__version__
    except ImportError:
        tv = None
    git = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    # Changes to tracked files only: a data folder linked in, or run outputs, change no code.
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return dict(
        cores=cores,
        cpu=cpu,
        memory=memory,
        gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        torch=torch.__version__,
        torchvision=tv,
        python=platform.python_version(),
        os=f"{platform.system()} {platform.release()}",
        commit=(git + (" (with uncommitted changes)" if dirty else "")) or None,
    )


def plot(curves, path):
    """Test accuracy against cumulative training seconds; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in curves.items():
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, [100 * y for y in ys], marker="o", label=label)
    for level in (90, 91):
        ax.axhline(level, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("training seconds (sum of epoch_seconds)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Fashion-MNIST: test accuracy against training time")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke pass: a few steps of every run (numbers meaningless)",
    )
    p.add_argument(
        "--quick-steps", type=int, default=40, help="--quick: optimizer steps per training run"
    )
    p.add_argument("--sections", default="abcde", help="which sections to run, e.g. 'ab'")
    p.add_argument(
        "--data-dir", default="data", help="data root passed to the scripts (their default: data)"
    )
    p.add_argument(
        "--gpu-epochs", type=int, default=15, help="epochs of section e's ResNet-18 runs"
    )
    p.add_argument("--work-dir", default=str(BENCH / "runs"), help="logs and outputs of every run")
    p.add_argument(
        "--results-dir",
        default=None,
        help="where results.md/json and the plot go "
        "(default: benchmarks/; --sections e alone: benchmarks/gpu/)",
    )
    args = p.parse_args()
    if args.quick_steps < 1 or args.gpu_epochs < 1:
        p.error("--quick-steps and --gpu-epochs must be at least 1")
    work_dir = Path(args.work_dir).resolve()
    if not work_dir.is_relative_to(ROOT):
        p.error("--work-dir must be inside the repository (the scripts get paths relative to it)")
    # Section e alone (a GPU machine's run) must not replace the CPU sections' results.
    default_results = work_dir if args.quick else BENCH / "gpu" if args.sections == "e" else BENCH
    results_dir = Path(args.results_dir or default_results).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    results_dir.mkdir(parents=True, exist_ok=True)

    started = time.gmtime()
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if load_before is not None and load_before > 0.5:
        log(
            f"warning: load average {load_before:.2f}: other work is running and will distort the "
            f"figures"
        )
    t0 = time.perf_counter()
    info = machine()
    runner = Runner(work_dir)
    cfg = configs(args)
    body, data, curves = [], {}, {}
    if "a" in args.sections:
        lines, data["a_time_to_accuracy"], curves = section_time_to_accuracy(runner, args, cfg)
        body += lines + [""]
    if "b" in args.sections:
        lines, data["b_overhead"] = section_overhead(runner, args, cfg)
        body += lines + [""]
    if "c" in args.sections:
        lines, data["c_launchers"] = section_launchers(runner, args, cfg)
        body += lines + [""]
    if "d" in args.sections:
        lines, data["d1_comm_hooks"] = section_comm_hooks(runner, args, cfg)
        body += lines + [""]
        lines, data["d2_model_parallel"] = section_model_parallel(runner, args, cfg)
        body += lines + [""]
        lines, data["d3_quantize"] = section_quantize(runner, args, cfg)
        body += lines + [""]
    if "e" in args.sections:
        lines, data["e_gpu"] = section_gpu(runner, args, cfg)
        body += lines + [""]
    wall = time.perf_counter() - t0

    command = "python benchmarks/run_all.py" + (
        " " + shlex.join(sys.argv[1:]) if sys.argv[1:] else ""
    )
    header = [
        "# Benchmark results"
        + (" (QUICK SMOKE PASS: a few steps per run; not benchmark figures)" if args.quick else ""),
        "",
        f"- Machine: {info['cores']} CPU cores ({info['cpu']}), {info['memory']} memory"
        + (f", GPU {info['gpu']}" if info["gpu"] else ", no GPU"),
        f"- Software: PyTorch {info['torch']}, torchvision {info['torchvision']}, "
        f"Python {info['python']}, {info['os']}",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M', started)} UTC; commit {info['commit']}; "
        f"{wall / 60:.1f} minutes in all",
        f"- Command: `{command}` (runs one after another; compare figures within one run, as "
        f"ratios)",
    ]
    if load_before is not None:
        # Anything else running distorts every figure: the 1-minute load average shows it.
        header.append(
            f"- Load average (1 min) at the start: {load_before:.2f} (well above 0 means other "
            f"work was running)"
        )
    if runner.removed_omp is not None:
        header.append(
            f"- OMP_NUM_THREADS={runner.removed_omp} was set in the shell; removed for the runs"
        )
    markdown = "\n".join(header + [""] + body).rstrip() + "\n"
    print(markdown)

    # The figures other benchmarks put below run_all.py's stay: only its own part is replaced.
    old = results_dir / "results.md"
    rest = old.read_text().partition(OTHERS)[1:] if old.exists() else ("", "")
    (results_dir / "results.md").write_text(
        markdown + ("\n---\n\n" + "".join(rest) if rest[0] else "")
    )
    results = dict(
        machine=dict(info, load_average_at_start=load_before),
        command=command,
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", started),
        quick=args.quick,
        wall_seconds=wall,
    )
    results.update(sections=data, runs=runner.runs)
    (results_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    if curves and plot(curves, results_dir / "accuracy_vs_time.png"):
        log(f"wrote {results_dir / 'accuracy_vs_time.png'}")
    else:
        log(
            "no plot: matplotlib is not installed (pip install -r benchmarks/requirements.txt)"
            if curves
            else "no plot"
        )
    log(f"wrote {results_dir / 'results.md'} and results.json in {wall / 60:.1f} minutes")


if __name__ == "__main__":
    main()
