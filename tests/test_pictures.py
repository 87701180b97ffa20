"""benchmarks/pictures.py draws from real traces and real measurements, and refuses in one line
a trace without what a picture draws: no empty pictures."""

import importlib.util
import json

import pytest
import torch
from conftest import MLP_ARGS, ROOT, SYNTHETIC, run_python, torchrun_workers

spec = importlib.util.spec_from_file_location("pictures", ROOT / "benchmarks" / "pictures.py")
pictures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pictures)

PICTURES = "benchmarks/pictures.py"
STEPS = ["--max-steps", "6", "--batch-size", "16"]


def refused(argv):
    """pictures.py with argv fails with one error line: that line."""
    proc = run_python([PICTURES, *argv], check=False, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), proc
    return lines[0]


@pytest.fixture(scope="module")
def ddp_trace(tmp_path_factory):
    """--profile traces of ddp_train.py, 2 processes, the MLP."""
    trace = tmp_path_factory.mktemp("ddp_trace")
    torchrun_workers(2, ["ddp_train.py", *MLP_ARGS, *STEPS, "--profile", trace])
    return trace


@pytest.mark.slow
def test_timeline_of_a_ddp_step_and_no_picture_without_collectives(ddp_trace, tmp_path):
    ranks = pictures.one_step(ddp_trace)
    assert [rank for rank, _, _ in ranks] == [0, 1]
    for _, trace, window in ranks:
        drawn = pictures.phases(trace, window)  # forward, backward and the optimizer step
        assert all(drawn[phase] for phase in ("forward", "backward", "optimizer"))
        kinds = {pictures.collective_kind(name) for _, _, name, _ in trace["collectives"]}
        assert "all-reduce" in kinds  # DDP's gradient buckets
    run_python([PICTURES, "--only", "timelines", "--traces", f"DDP={ddp_trace}", "--out", tmp_path])
    assert (tmp_path / "timelines.png").stat().st_size > 10_000
    # One process sends nothing: there is no communication to draw against its compute.
    alone = tmp_path / "alone"
    run_python(["dp_train.py", *MLP_ARGS, *STEPS, "--profile", alone])
    error = refused(["--only", "timelines", "--traces", f"one={alone}", "--out", tmp_path])
    assert error.startswith(f"error: {alone}/rank0.json: no collective events")


OLD_TORCH = tuple(map(int, torch.__version__.split(".")[:2])) < (2, 10)


@pytest.mark.slow
@pytest.mark.skipif(OLD_TORCH, reason="model_parallel.py's one stage per process: 2.10+")
def test_pipeline_picture_from_model_parallel_stages_and_none_from_a_ddp_trace(ddp_trace, tmp_path):
    """Two stages of 1F1B, 4 micro-batches: each stage's trace names the forward and the
    backward of every micro-batch of the step; a DDP trace has none of them."""
    trace = tmp_path / "1f1b"
    argv = ["model_parallel.py", *SYNTHETIC, "--max-steps", "6", "--batch-size", "16"]
    torchrun_workers(2, [*argv, "--microbatches", "4", "--profile", trace])
    ranks = pictures.pipeline_chunks(trace)
    assert [rank for rank, _ in ranks] == [0, 1]
    for rank, chunks in ranks:
        assert {stage for *_, stage in chunks} == {rank}  # 1f1b: stage r on rank r
        assert sorted((kind, mb) for _, _, kind, mb, _ in chunks) == sorted(
            (kind, mb) for kind in ("backward", "forward") for mb in range(4)
        )
    # --profile also counts each stage's activations held for backward (the GPT's schedules
    # are held to their micro-batch counts in test_model_parallel.py): 1F1B's stage 0 holds
    # 2 micro-batches' of the 4, the last 1.
    held = pictures.stage_activations(trace)
    assert sorted(held) == [0, 1] and held[1]["peak"] == held[1]["micro_batch"] > 0, held
    assert held[0]["peak"] == 2 * held[0]["micro_batch"] > 0, held
    proc = run_python(
        [PICTURES, "--only", "pipeline", "--traces", f"1F1B={trace}", "--out", tmp_path]
    )
    assert (tmp_path / "pipeline.png").stat().st_size > 10_000
    assert f"activations KiB {held[0]['peak'] / 1024:.0f} " in proc.stdout
    error = refused(["--only", "pipeline", "--traces", f"DDP={ddp_trace}", "--out", tmp_path])
    assert "no 'stageN forward mbM' ranges" in error


@pytest.mark.slow
def test_memory_picture_from_sharding_measurements(tmp_path):
    """sharding.py --json (DDP and expert parallelism's MoE, 2 processes) into memory.png; its
    rows carry the counted bytes and a measured peak; a file without them is refused."""
    rows = tmp_path / "rows.json"
    argv = ["--worlds", "2", "--models", "vit", "--steps", "1", "--wrappers", "ddp", "ep"]
    run_python(["benchmarks/sharding.py", *argv, "--json", rows], timeout=300)
    ddp, ep = json.loads(rows.read_text())
    assert [ddp["wrapper"], ep["wrapper"]] == ["ddp", "ep"]
    assert ddp["peak"] > ddp["params"] + ddp["grads"] and ep["peak"] > ep["params"] > 0
    run_python([PICTURES, "--only", "memory", "--memory-json", rows, "--out", tmp_path])
    assert (tmp_path / "memory.png").stat().st_size > 10_000
    del ddp["peak"]
    rows.write_text(json.dumps([ddp]))
    error = refused(["--only", "memory", "--memory-json", rows, "--out", tmp_path])
    assert error == f"error: {rows}: a row without peak: not sharding.py --json's"
