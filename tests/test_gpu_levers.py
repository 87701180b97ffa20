"""The GPU's speed levers, checked on the CPU: benchmarks/gpu/mfu.py's FLOP count and dry run,
and --sdpa-backend (a GPU's attention kernel; on the CPU nothing changes)."""

import importlib.util
import json

import pytest
import torch
from conftest import ROOT, run_python

import models
from profiling import step_flops

spec = importlib.util.spec_from_file_location("gpu_mfu", ROOT / "benchmarks/gpu/mfu.py")
mfu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mfu)


@pytest.mark.parametrize("shape", [mfu.TINY, mfu.GPT2_SMALL], ids=["tiny", "gpt2-small"])
def test_the_counted_flops_per_token_are_nanogpts(shape):
    """profiling.step_flops, which every script's MFU divides, counts 6 N + 12 L H Q T per
    token (N: the weights of the matrix products), and at GPT-2-small size within 0.5% of
    nanoGPT's 6 N with N all weights but the embedding and positions (it adds the biases and
    norms)."""
    depth, dim, heads, seq_len = (shape[k] for k in ("depth", "dim", "heads", "seq_len"))
    with torch.device("meta"):
        gpt = models.GPT(256, seq_len, dim, depth, heads)
        counted = step_flops(gpt, torch.zeros(3, seq_len, dtype=torch.long)) / (3 * seq_len)
    matrices = sum(m.weight.numel() for m in gpt.modules() if isinstance(m, torch.nn.Linear))
    attention = 12 * depth * heads * (dim // heads) * seq_len
    assert counted == mfu.flops_per_token(depth, dim, heads, seq_len) == 6 * matrices + attention
    weights = sum(p.numel() for n, p in gpt.named_parameters() if n not in ("embed.weight", "pos"))
    assert counted == pytest.approx(6 * weights + attention, rel=0.005 if dim >= 768 else 0.05)


def test_the_dry_run_measures_each_change_and_says_what_did_not_run(tmp_path):
    """mfu.py --cpu: the tiny GPT, every row; a kernel the CPU lacks is a row that says so, not
    a stop; compilation skipped; the best of the changes measured last."""
    run_python(["benchmarks/gpu/mfu.py", "--cpu", "--json", tmp_path / "m.json"], timeout=120)
    rows = {r["name"]: r for r in json.loads((tmp_path / "m.json").read_text())["rows"]}
    assert list(rows) == [*mfu.CHANGES, "best"]
    for name in ("baseline", "fused-adamw", "sdpa-flash", "bf16-params", "batch-32", "batch-64"):
        assert rows[name]["status"] == "ok" and rows[name]["tokens_per_second"] > 0, rows[name]
    assert rows["fused-adamw"]["fused"] and rows["bf16-params"]["params"] == "bf16"
    assert [rows[n]["batch"] for n in ("baseline", "batch-32", "batch-64")] == [2, 4, 8]
    assert rows["sdpa-cudnn"]["status"].startswith("failed: RuntimeError")
    assert rows["compile-model"]["status"].startswith("skipped")
    per_token = mfu.flops_per_token(**mfu.TINY)
    assert rows["baseline"]["flops_per_token"] == per_token
    assert rows["best"]["status"] in ("ok", "none: no change beat the baseline")
    # the same weights and tokens in every row of a batch: the same first loss, near ln 256
    same_batch = [r for r in rows.values() if r["status"] == "ok" and r["batch"] == 2]
    assert len(same_batch) >= 4 and rows["baseline"]["first_loss"] == pytest.approx(5.545, abs=0.05)
    for row in same_batch:
        assert row["first_loss"] == pytest.approx(rows["baseline"]["first_loss"], abs=1e-3), row


def test_an_out_of_memory_row_is_a_row_and_the_best_takes_each_winner(monkeypatch):
    def measure(config, *args):
        if config["batch"] > 32:
            raise torch.OutOfMemoryError("CUDA out of memory")
        speed = dict(fused=2.0 if config["fused"] else 1.0, batch=config["batch"] / 16)
        return dict(tokens_per_second=speed["fused"] * speed["batch"])

    monkeypatch.setattr(mfu, "measure", measure)
    rows = [
        mfu.run_row(mfu.configure(n, 16), mfu.TINY, torch.device("cpu"), 1, 0, None)
        for n in ("baseline", "fused-adamw", "sdpa-flash", "batch-32", "batch-64")
    ]
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "ok", "out of memory"]
    best = mfu.best_config(rows, 16)
    assert (best["fused"], best["batch"], best["sdpa"], best["compile"]) == (
        True,
        32,
        "default",
        "none",
    )


def test_sdpa_backend_orders_the_kernels_and_leaves_the_cpu_alone():
    """auto: cuDNN's kernel first on Hopper (9.x) with cuDNN, PyTorch's choice elsewhere; a
    named kernel alone. On the CPU the setting changes nothing: the same output bit for bit."""
    cudnn_first = ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
    assert models.sdpa_order("auto", (9, 0), True) == cudnn_first
    assert models.sdpa_order("auto", (9, 0), False) is None
    assert models.sdpa_order("auto", (8, 0), True) is None
    assert models.sdpa_order("flash", (8, 0), True) == ["FLASH_ATTENTION"]
    assert models.sdpa_order("default", (9, 0), True) is None
    torch.manual_seed(0)
    gpt, x = models.GPT(256, 16, 32, 2, 2), torch.randint(0, 256, (2, 16))
    try:
        expected = gpt(x)
        for name in ("cudnn", "efficient", "auto"):  # kernels the CPU does not have
            models.Attention.kernels = name
            assert torch.equal(gpt(x), expected), name
    finally:
        models.Attention.kernels = "default"


def test_sdpa_backend_is_a_flag_of_every_sharded_script_and_refuses_a_bad_name():
    import fsdp_train

    try:
        args = fsdp_train.get_args(["--data", "text", "--model", "gpt", "--sdpa-backend", "cudnn"])
        assert args.sdpa_backend == "cudnn" and models.Attention.kernels == "cudnn"
        assert fsdp_train.get_args([]).sdpa_backend == "auto" == models.Attention.kernels
    finally:
        models.Attention.kernels = "default"
    proc = run_python(["fsdp_train.py", "--sdpa-backend", "fastest"], check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and "--sdpa-backend" in lines[0], proc.stderr


def test_mirror_averaged_is_the_mean_over_each_image_and_its_mirror():
    torch.manual_seed(0)
    model = models.build_model("cnn", 1, 10).eval()
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        both = models.MirrorAveraged(model)(x)
        assert torch.allclose(both, (model(x) + model(x.flip(-1))) / 2)
        symmetric = x + x.flip(-1)  # its own mirror: the same answer as the model's alone
        assert torch.allclose(models.MirrorAveraged(model)(symmetric), model(symmetric), atol=1e-6)


@pytest.mark.slow
def test_tta_is_what_ddp_train_evaluates(tmp_path):
    """ddp_train.py --augment --tta: the test accuracy it records and the one --eval-only --tta
    prints are those of the mirror-averaged model; without --tta, the model's own (the default,
    unchanged)."""
    import data

    flags = ["ddp_train.py", "--data", "synthetic", "--device", "cpu", "--model", "cnn"]
    flags += ["--batch-size", "32", "--epochs", "1", "--max-steps", "12"]
    run_python([*flags, "--augment", "--tta", "--output-dir", tmp_path], timeout=300)
    recorded = json.loads((tmp_path / "metrics.jsonl").read_text())["test_acc"]
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    model = models.build_model("cnn", 1, 10)
    model.load_state_dict(ckpt["model"])
    _, test_set, _, _ = data.load_datasets("synthetic", "data")
    accuracy = {}
    for name, judged in (("plain", model), ("tta", models.MirrorAveraged(model))):
        with torch.no_grad():
            judged.eval()
            right = judged(test_set.images).argmax(1) == test_set.labels
            accuracy[name] = right.double().mean().item()
    assert accuracy["plain"] != accuracy["tta"]  # else the test could not tell them apart
    assert recorded == pytest.approx(accuracy["tta"], abs=1e-9)
    resume = [*flags, "--eval-only", "--resume", tmp_path / "checkpoint.pt"]
    for extra, name in (([], "plain"), (["--tta"], "tta")):
        printed = run_python([*resume, *extra]).stdout
        assert f"test_acc {accuracy[name]:.4f}" in printed, (name, printed)
