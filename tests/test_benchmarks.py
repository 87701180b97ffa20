"""The benchmark's GPU section (run_all.py, section e) runs only where CUDA is present, which
the machines that run these tests lack. Its flags still train here: the same recipe on CPU,
with synthetic data, a small batch, two steps and no torch.compile (tested on its own in
test_scripts.py and tests/test_gpu.py), and the bare loop it is compared with runs a few steps
with its flags, so that a renamed flag or a broken combination shows before a GPU run.
The overhead and input-pipeline benchmarks run ddp_train.main() itself: a few steps of each
show when main() changes under them."""

import importlib.util
import json
import math

import pytest
import torch
from conftest import ROOT, SYNTHETIC, read_metrics, run_python, tp_shapes

import models

spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks" / "run_all.py")
run_all = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_all)


def replace(flags, name, value):
    """flags with `name`'s value replaced (or the flag removed when value is None)."""
    out, i = [], 0
    while i < len(flags):
        takes_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        if flags[i] == name:
            if value is not None:
                out += [name, value]
            i += 2 if takes_value else 1
            continue
        out.append(flags[i])
        i += 1
    return out


# ddp_train.py with its test set cut to the first 24 samples: evaluating all 499 was 85% of
# the run (ResNet-18 in bf16: slow convolutions on a CPU without bf16 units); 24 go through
# the same evaluation.
SHORT_TEST = """
import sys, torch
sys.path.insert(0, {root!r})
import ddp_train
real = ddp_train.load_datasets
def load_datasets(*args, **kwargs):
    train_set, test_set, *rest = real(*args, **kwargs)
    return train_set, torch.utils.data.Subset(test_set, range(24)), *rest
ddp_train.load_datasets = load_datasets
ddp_train.main(sys.argv[1:])
"""


@pytest.mark.slow
def test_gpu_recipe_trains_on_cpu(tmp_path):
    flags = run_all.GPU_RECIPE
    assert {"--model", "--amp", "--augment", "--channels-last", "--batch-size"} <= set(flags)
    assert ["--compile"] in [extra for _, extra in run_all.GPU_CONFIGS]
    for name, value in (("--data", None), ("--batch-size", "8")):
        flags = replace(flags, name, value)
    short = ["-c", SHORT_TEST.format(root=str(ROOT))]
    run_python([*short, *flags, *SYNTHETIC, "--max-steps", "2", "--output-dir", tmp_path])
    [record] = read_metrics(tmp_path)
    assert record["step"] == 2 and math.isfinite(record["test_loss"])


def test_gpu_bare_loop_flags_run_on_cpu():
    # The small CNN instead of ResNet-18 (which the test above trains): the bare loop's 22
    # steps stay quick.
    flags = replace(replace(run_all.GPU_BARE, "--model", "cnn"), "--batch-size", "8")
    proc = run_python(["benchmarks/bare_loop.py", *flags, *SYNTHETIC, "--steps", "2"])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["amp"] == "bf16" and result["augment"] and result["ms_per_step_wall"] > 0


def test_transfer_benchmark_refuses_impossible_flags_before_its_base_run():
    # The base run takes minutes; flags that would only fail in the runs after it stop at once.
    for flags in (["--epochs", "0"], ["--per-class", "4", "--batch-size", "25"]):
        proc = run_python(["benchmarks/transfer.py", *flags], check=False, timeout=30)
        assert proc.returncode == 2 and "transfer.py: error:" in proc.stderr, proc.stderr
        assert "$ finetune.py" not in proc.stdout  # nothing was started


def last_json(proc):
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_overhead_benchmark_times_ddp_train_main():
    # overhead.py runs ddp_train.main() itself between rounds of its bare loop: a change to
    # main() that it relies on (its forward, its launcher, --max-steps) shows here.
    flags = ["--data", "synthetic", "--device", "cpu", "--rounds", "1", "--steps", "2"]
    result = last_json(run_python(["benchmarks/overhead.py", *flags]))
    assert result["bare_ms_per_step"] > 0 and result["script_ms_per_step"] > 0
    assert len(result["ratio_per_round"]) == 1 and result["world_size"] == 1


def test_input_pipeline_benchmark_iterates_ddp_train_loader():
    # input_pipeline.py takes the training loader ddp_train.main() builds: 2000 synthetic
    # samples, rank 0 of 2, batch 64 make 15 full batches.
    flags = [*SYNTHETIC, "--world-size", "2", "--batch-size", "64"]
    result = last_json(run_python(["benchmarks/input_pipeline.py", *flags]))
    assert result["batches"] == 15 and result["batch_size"] == 64 and result["ms_per_batch"] > 0


@pytest.mark.slow
def test_sharding_benchmark_counts_what_each_rank_holds():
    proc = run_python(
        ["benchmarks/sharding.py", "--worlds", "2", "--models", "mlp", "--steps", "1"]
    )
    rows = {}
    for line in proc.stdout.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[2]] = [float(c) for c in cells[3:7]]  # weights, in forward, grads, optimizer
    ddp, zero, fsdp, keep = (rows[w] for w in ("ddp", "ddp+zero", "fsdp", "fsdp no reshard"))
    close = lambda mb: pytest.approx(mb, abs=0.002)  # noqa: E731 - printed to 0.001 MB
    assert ddp[0] == ddp[1] == ddp[2] > 0 and ddp[3] == close(2 * ddp[0])  # Adam's 2 moments
    # ZeRO hands out whole tensors: rank 0 holds the state of the MLP's first weight alone.
    assert zero[:3] == ddp[:3] and ddp[0] < zero[3] < ddp[3]
    assert fsdp[:3] == [close(ddp[0] / 2)] * 3 and fsdp[3] == close(ddp[0])
    assert keep[0] == fsdp[0] and keep[1] == ddp[0]  # every block gathered until backward


@pytest.mark.slow
def test_sharding_benchmark_counts_what_tensor_parallel_ranks_hold():
    argv = ["benchmarks/sharding.py", "--worlds", "2", "--models", "vit", "--steps", "1"]
    proc = run_python(argv)
    rows = {}
    for line in proc.stdout.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[2]] = [float(c) for c in cells[3:8]]  # ... optimizer, activations
    ddp, tp, sp = rows["ddp"], rows["tp"], rows["tp+sp"]
    # TP 2 halves the 9 split tensors of each block and keeps the rest whole.
    vit = models.ViT(1, 10, 28)
    columns = ("attn.q.", "attn.k.", "attn.v.", "mlp.fc1.")
    rows_split = ("attn.proj.weight", "mlp.fc2.weight")
    split = sum(
        p.numel()
        for n, p in vit.named_parameters()
        if n.startswith("blocks.") and (any(c in n for c in columns) or n.endswith(rows_split))
    )
    mb = (sum(p.numel() for p in vit.parameters()) - split / 2) * 4 / 2**20
    close = lambda x: pytest.approx(x, abs=0.002)  # noqa: E731 - printed to 0.001 MB
    assert tp[:3] == sp[:3] == [close(mb)] * 3 and tp[3] == close(2 * mb) and mb < ddp[0]
    # A TP rank saves less for backward than one process on the whole batch (DDP's ranks hold
    # half of it); sequence parallelism, keeping half of the tokens between the pairs, less.
    assert 0 < sp[4] < tp[4] < 2 * ddp[4]


@pytest.mark.slow
def test_nd_costs_counts_what_rank_0_holds_and_sends(tmp_path):
    """benchmarks/nd_costs.py, 4 processes, a GPT of 2 blocks, pp 2 x dp 2 and cp 2 x tp 2:
    rank 0's weights are what the cuts leave it (stage 0's tensors, q, k, v and fc1 cut by rows
    and proj's and fc2's weights by columns over tp, FSDP's first chunk of rows over dp x cp),
    as many gradients, AdamW's two moments and a step count per tensor; the bytes counted at
    c10d's operators per dimension are the formulas' from the shapes, nothing else sent."""
    rows = tmp_path / "rows.json"
    argv = ["--world", "4", "--layouts", "2,2,1,1", "1,1,2,2", "--depth", "2", "--dim", "32"]
    argv += ["--seq-len", "32", "--no-warmup", "--json", rows]
    run_python(["benchmarks/nd_costs.py", *argv], timeout=400)
    for row in json.loads(rows.read_text()):
        pp, dp, cp, tp = row["layout"].values()
        with torch.device("meta"):
            gpt = models.keep_stage(models.GPT(256, 32, 32, 2, 4), 0, 2 // pp)
        numel = 0
        for shape in tp_shapes(gpt, tp).values():
            first = -(-shape[0] // (dp * cp))  # torch.chunk's first piece
            numel += first * math.prod(shape[1:])
        tensors = len(list(gpt.parameters()))
        assert row["weights"] == row["grads"] == 4 * numel, row["layout"]
        assert row["optimizer"] == 2 * row["weights"] + 4 * tensors  # AdamW's step: fp32
        assert row["activations"] > 0 and row["peak"] > 0
        degrees = dict(pp=pp, dp_shard_cp=dp * cp, cp=cp, tp=tp)
        for dim, sent in row["sent"].items():
            assert sent == pytest.approx(row["formula"][dim]), (row["layout"], dim)
            assert (sent > 0) == (degrees[dim] > 1), (row["layout"], dim)
        assert row["sent_elsewhere"] == {}
