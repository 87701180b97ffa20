"""quantize.py: the int8 models are smaller, nearly as accurate as fp32, reload from disk,
and bad input stops with one line and writes nothing.

One real run of ddp_train.py makes the float checkpoint and one real run of quantize.py
quantizes it (with QAT); most tests read that run's JSON, table and saved model."""

import json
import random

import pytest
import torch
from conftest import CNN_ARGS, run_python
from torch.utils.data import DataLoader

import data
import models
import quantize

# torch.ao.quantization's deprecation notices (quantize.py silences them for its own runs;
# pytest resets warning filters per test).
pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning"),
    pytest.mark.filterwarnings("ignore:Please use quant_min and quant_max:UserWarning"),
    pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning"),
]
QUICK = ["--data", "synthetic", "--runs", "3"]  # 3 timed calls: the timing is not under test here
METHODS = ["fp32", "dynamic int8", "static int8", "QAT int8"]


@pytest.fixture(scope="session")
def quantized(tmp_path_factory):
    """A CNN trained by ddp_train.py (one process, 3 epochs of the synthetic set), then
    quantize.py on its checkpoint. Returns (train dir, quantize dir, JSON report, stdout)."""
    train_dir = tmp_path_factory.mktemp("float")
    run_python(["ddp_train.py", *CNN_ARGS, "--output-dir", train_dir])
    out = tmp_path_factory.mktemp("int8")
    ckpt = train_dir / "checkpoint.pt"
    # QAT at 0.05 moves a few predictions: a non-zero accuracy difference, whose sign is tested
    argv = [*QUICK, "--checkpoint", ckpt, "--qat-steps", "10", "--qat-lr", "0.05"]
    argv += ["--json", out / "q.json"]
    argv += ["--output-dir", out]
    proc = run_python(["quantize.py", *argv])
    return train_dir, out, json.loads((out / "q.json").read_text()), proc


def rows(report):
    return {r["method"]: r for r in report["results"]}


@pytest.mark.slow
def test_json_has_every_method_against_fp32(quantized):
    _, _, report, _ = quantized
    assert [r["method"] for r in report["results"]] == METHODS
    assert report["model"] == "cnn" and report["test_images"] == 499  # the whole synthetic test set
    fp32 = rows(report)["fp32"]
    assert fp32["size_ratio"] == fp32["latency_speedup"] == fp32["throughput_speedup"] == 1.0
    assert fp32["accuracy_delta"] == 0.0 and fp32["agreement"] == 1.0
    for r in report["results"]:
        assert r["size_mb"] > 0 and r["latency_ms"] > 0 and r["throughput"] > 0
        assert r["size_ratio"] == pytest.approx(r["size_mb"] / fp32["size_mb"])
        assert r["accuracy_delta"] == pytest.approx(r["accuracy"] - fp32["accuracy"])
    assert rows(report)["QAT int8"]["accuracy_delta"] != 0  # else a flipped sign would pass


@pytest.mark.slow
def test_table_on_stdout(quantized):
    *_, proc = quantized
    lines = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert len(lines) == 2 + len(METHODS)  # header, separator, one row per method
    assert [line.split("|")[1].strip() for line in lines[2:]] == METHODS
    assert "Warning" not in proc.stderr  # torch.ao's deprecation notices are silenced


@pytest.mark.slow
def test_static_int8_is_smaller(quantized):
    r = rows(quantized[2])
    # int8 weights: a quarter of the bytes, plus scales and graph constants.
    assert r["static int8"]["size_ratio"] < 0.4
    assert r["QAT int8"]["size_ratio"] < 0.4
    # Dynamic int8 converts Linear layers only: the CNN's convolutions stay fp32.
    assert r["static int8"]["size_ratio"] < r["dynamic int8"]["size_ratio"] < 1.0


@pytest.mark.slow
def test_int8_accuracy_close_to_fp32(quantized):
    r = rows(quantized[2])
    assert r["fp32"]["accuracy"] > 0.8  # a trained model, or the comparison means nothing
    for method in METHODS[1:]:
        assert abs(r[method]["accuracy_delta"]) < 0.03, method
        assert r[method]["agreement"] > 0.95, method


@pytest.mark.slow
def test_fp32_row_is_the_checkpoints_accuracy(quantized):
    # The same weights, test set and batch size as ddp_train.py's last evaluation.
    train_dir, _, report, _ = quantized
    last = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert rows(report)["fp32"]["accuracy"] == pytest.approx(last["test_acc"], abs=1.5 / 499)


@pytest.mark.slow
def test_saved_int8_model_reloads(quantized):
    _, out, report, _ = quantized
    model = quantize.load_int8(out / "model_int8.pt")
    _, test_set, _, _ = data.load_datasets("synthetic", "data")
    loader = DataLoader(test_set, batch_size=256, collate_fn=data.collate)
    accuracy = (quantize.predictions(model, loader) == test_set.labels).double().mean().item()
    assert accuracy == rows(report)["static int8"]["accuracy"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_static_int8_for_every_model(name):
    torch.manual_seed(0)
    model = models.build_model(name, 1, 10).eval()
    images = torch.randn(4, 1, 28, 28)
    qmodel = quantize.static_int8(model, [images], "x86")
    kinds = {type(m).__module__ for m in qmodel.modules()}
    swapped_in = any(k.startswith("torch.ao.nn.quantized") for k in kinds)  # int8 modules
    assert swapped_in, kinds
    with torch.no_grad():
        expected, actual = model(images), qmodel(images)
    assert torch.nn.functional.cosine_similarity(actual.flatten(), expected.flatten(), dim=0) > 0.98


@pytest.mark.slow
def test_without_checkpoint_trains_first(tmp_path):
    # In this process (no second torch import): the MLP, where dynamic int8 converts nearly all.
    json_path = tmp_path / "q.json"
    argv = [*QUICK, "--model", "mlp", "--epochs", "2", "--runs", "1", "--json", str(json_path)]
    quantize.main(argv)
    r = rows(json.loads(json_path.read_text()))
    assert r["fp32"]["accuracy"] > 0.8
    assert r["dynamic int8"]["size_ratio"] < 0.4 and r["static int8"]["size_ratio"] < 0.4


# ----------------------------------------------------------------------------------------
# Bad input: one line starting "error:", exit status 1, nothing written

JUNK = random.Random(0).randbytes(4096)


def fails(argv):
    with pytest.raises(SystemExit) as excinfo:
        quantize.main(list(map(str, argv)))
    message = excinfo.value.code
    assert isinstance(message, str) and message.startswith("error: "), message
    assert "\n" not in message, message
    return message


def checkpoint(path, model="cnn", **extra):
    torch.save(dict(model=models.build_model(model, 1, 10).state_dict(), **extra), path)
    return path


@pytest.mark.parametrize(
    "make, flags, words",
    [
        (lambda p: None, [], "does not exist"),
        (lambda p: p.write_bytes(JUNK), [], "cannot read checkpoint"),
        # No record of its model: the weights differ; then with ddp_train.py's record.
        (lambda p: checkpoint(p, "mlp"), [], "does not fit"),
        (lambda p: checkpoint(p, "mlp", args=dict(model="mlp")), [], "--model mlp"),
        (lambda p: checkpoint(p), ["--calib-batches", "0"], "--calib-batches"),
        (lambda p: checkpoint(p), ["--calib-batches", "-2"], "--calib-batches"),
        (lambda p: checkpoint(p), ["--runs", "0"], "--runs"),
        (lambda p: checkpoint(p), ["--threads", "0"], "--threads"),
        (lambda p: checkpoint(p), ["--qat-steps", "-1"], "--qat-steps"),
        (lambda p: checkpoint(p), ["--qat-lr", "0"], "--qat-lr"),
        (lambda p: checkpoint(p), ["--batch-size", "0"], "--batch-size"),
        (lambda p: checkpoint(p), ["--model", "vit"], "--model"),
        (lambda p: checkpoint(p), ["--data", "imagefolder"], "--data"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_input(tmp_path, make, flags, words):
    ckpt = tmp_path / "float.pt"
    make(ckpt)
    out, json_path = tmp_path / "out", tmp_path / "q.json"
    argv = [*QUICK, "--checkpoint", ckpt, *flags, "--json", json_path, "--output-dir", out]
    message = fails(argv)
    assert words in message
    assert not out.exists() and not json_path.exists()


@pytest.mark.slow
def test_json_and_output_dir_into_missing_folders(tmp_path):
    """The docstring's `--json runs/q/results.json --output-dir runs/q` on a fresh clone: both
    folders are made, as the training scripts make theirs."""
    report, out = tmp_path / "runs" / "q" / "results.json", tmp_path / "runs" / "int8"
    quantize.main(
        list(
            map(
                str,
                [
                    *QUICK,
                    "--model",
                    "mlp",
                    "--epochs",
                    "1",
                    "--runs",
                    "1",
                    "--json",
                    report,
                    "--output-dir",
                    out,
                ],
            )
        )
    )
    assert json.loads(report.read_text())["model"] == "mlp"
    assert (out / "model_int8.pt").is_file()


def test_one_line_error_from_a_real_process(tmp_path):
    (tmp_path / "bad.pt").write_bytes(JUNK)
    argv = [*QUICK, "--checkpoint", tmp_path / "bad.pt", "--output-dir", tmp_path / "out"]
    proc = run_python(["quantize.py", *argv], check=False)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: ")
    assert not (tmp_path / "out").exists()


def test_refuses_several_processes(monkeypatch, tmp_path):
    # Under torchrun every process would time, print and write the same files.
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "one process" in fails([*QUICK, "--output-dir", tmp_path / "out"])
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_speedups_are_the_measured_ratios(quantized):
    """The speed columns are computed from the measured times, against fp32 (the figures
    themselves are benchmarks' business: timing varies on a shared machine)."""
    r = rows(quantized[2])
    for m in METHODS:
        assert r[m]["latency_speedup"] == pytest.approx(
            r["fp32"]["latency_ms"] / r[m]["latency_ms"]
        )
        speedup = r[m]["throughput"] / r["fp32"]["throughput"]
        assert r[m]["throughput_speedup"] == pytest.approx(speedup)


@pytest.mark.slow
def test_timer_measures_each_model_by_itself():
    """Models that sleep 20 ms and 100 ms per call: the timer finds each one's own time, not
    its neighbour's, at every shape (sleeps dwarf the machine's noise)."""
    import time

    import quantize

    class Sleeper(torch.nn.Module):
        def __init__(self, seconds):
            super().__init__()
            self.seconds = seconds

        def forward(self, x):
            time.sleep(self.seconds * (1 + x.shape[0] // 4))
            return x

    models = {"fast": Sleeper(0.02), "slow": Sleeper(0.1)}
    found = quantize.time_models(models, [(1, 1, 4, 4), (4, 1, 4, 4)], runs=5)
    for shape, factor in ((0, 1), (1, 2)):
        assert found[("fast", shape)] == pytest.approx(0.02 * factor, rel=0.5)
        assert found[("slow", shape)] == pytest.approx(0.1 * factor, rel=0.5)
