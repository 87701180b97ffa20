"""quantize.py and finetune.py take a model in either file form the training scripts write:
a checkpoint.pt whose "model" is the state_dict (ddp_train.py and its copies, finetune.py),
or model.pt, the whole model's plain state_dict (fsdp_train.py, tensor_parallel.py). Each
loads the weights themselves (the fp32 accuracy is the trained model's, the tensors are the
file's), and a file of another network stops with one line."""

import json

import pytest
import torch
from conftest import SYNTHETIC, read_metrics, run_python
from torch.utils.data import DataLoader

import checkpoint
import data
import finetune
import models
import quantize
import training

pytestmark = [  # torch.ao.quantization's notices (quantize.py silences them in its own runs)
    pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning"),
    pytest.mark.filterwarnings("ignore:Please use quant_min and quant_max:UserWarning"),
    pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning"),
]
QUICK = ["--data", "synthetic", "--runs", "1"]


def fails(main, argv):
    with pytest.raises(SystemExit) as excinfo:
        main(list(map(str, argv)))
    message = excinfo.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message
    return message


def test_quantize_takes_a_plain_state_dict(tmp_path):
    """An MLP's weights as model.pt holds them: fp32's accuracy is that model's own."""
    torch.manual_seed(1)
    model = models.build_model("mlp", 1, 10)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    _, test_set, _, _ = data.load_datasets("synthetic", "unused")
    loader = DataLoader(test_set, batch_size=100, collate_fn=data.collate)
    _, accuracy = training.evaluate(model, loader, torch.device("cpu"))
    report = tmp_path / "q.json"
    argv = [*QUICK, "--checkpoint", tmp_path / "model.pt", "--model", "mlp", "--json", report]
    quantize.main(list(map(str, argv)))
    fp32 = json.loads(report.read_text())["results"][0]
    assert fp32["method"] == "fp32" and fp32["accuracy"] == pytest.approx(accuracy, abs=1e-9)


@pytest.mark.parametrize(
    "content, words",
    [
        (lambda: models.build_model("mlp", 1, 10).state_dict(), "does not fit this model"),
        (lambda: {"weight": torch.zeros(2), "note": "text"}, "neither a checkpoint"),
        (lambda: [torch.zeros(2)], "neither a checkpoint"),
    ],
)
def test_quantize_refuses_what_does_not_fit(tmp_path, content, words):
    """model.pt of an MLP with the default --model cnn (it records no --model), and files
    that hold no state_dict: one line, nothing written."""
    torch.save(content(), tmp_path / "model.pt")
    out = tmp_path / "out"
    argv = [*QUICK, "--checkpoint", tmp_path / "model.pt", "--output-dir", out]
    assert words in fails(quantize.main, [*argv, "--json", out / "q.json"])
    assert not out.exists()


def test_finetune_takes_a_resnet_state_dict(tmp_path):
    """models.py's ResNet-18 (as fsdp_train.py --model resnet18 saves it): every tensor but the
    1-channel 3x3 stem and the head loads, with the file's values."""
    torch.manual_seed(1)
    state = models.build_model("resnet18", 1, 10).state_dict()
    torch.save(state, tmp_path / "model.pt")
    args = finetune.get_args(["--weights-file", str(tmp_path / "model.pt")])
    model, new = finetune.build_pretrained_resnet(args, num_classes=5)
    assert new == {"conv1.weight", "fc.weight", "fc.bias"}
    loaded = model.state_dict()
    for key in set(state) - new:
        assert torch.equal(loaded[key], state[key]), key


@pytest.mark.parametrize("name", ["vit", "mlp", "cnn"])
def test_finetune_refuses_another_network(tmp_path, name):
    torch.save(models.build_model(name, 1, 10).state_dict(), tmp_path / "model.pt")
    args = finetune.get_args(["--weights-file", str(tmp_path / "model.pt")])
    with pytest.raises(SystemExit) as excinfo:
        finetune.build_pretrained_resnet(args, num_classes=5)
    assert "does not fit --model resnet18" in excinfo.value.code


# ----------------------------------------------------------------------------------------
# The files real training runs write

fsdp_runs = pytest.mark.skipif(torch.__version__ < "2.7", reason="fsdp_train.py needs 2.7")


@pytest.mark.slow
@fsdp_runs
def test_quantize_reads_fsdp_train_model_pt(tmp_path):
    """fsdp_train.py's model.pt of an MLP, quantized: fp32's accuracy on the whole test set
    is the training run's last test accuracy."""
    train = ["fsdp_train.py", *SYNTHETIC, "--model", "mlp", "--epochs", "1", "--max-steps", "4"]
    run_python([*train, "--output-dir", tmp_path / "fsdp"])
    trained = read_metrics(tmp_path / "fsdp")[-1]["test_acc"]
    report = tmp_path / "q" / "q.json"  # a folder quantize.py makes
    argv = [*QUICK, "--checkpoint", tmp_path / "fsdp" / "model.pt", "--model", "mlp"]
    run_python(["quantize.py", *argv, "--json", report])
    fp32 = json.loads(report.read_text())["results"][0]
    assert fp32["accuracy"] == pytest.approx(trained, abs=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, name",
    [pytest.param("fsdp_train.py", "model.pt", marks=fsdp_runs), ("ddp_train.py", "checkpoint.pt")],
)
def test_finetune_reads_a_trained_resnet18(tmp_path, script, name):
    """A ResNet-18 trained by fsdp_train.py (model.pt) or ddp_train.py (checkpoint.pt) starts
    a fine-tuning run: all of it loads but the stem and the head."""
    train = [script, *SYNTHETIC, "--model", "resnet18", "--epochs", "1", "--max-steps", "1"]
    run_python([*train, "--batch-size", "16", "--output-dir", tmp_path / "base"], timeout=300)
    weights = tmp_path / "base" / name
    argv = ["finetune.py", *SYNTHETIC, "--weights-file", weights, "--image-size", "32"]
    proc = run_python([*argv, "--epochs", "1", "--max-steps", "1", "--batch-size", "16"])
    assert f"{weights}: loaded 119 of 122 tensors" in proc.stdout


# ----------------------------------------------------------------------------------------
# How the sharded scripts make and fill them without the whole model in one process


def test_the_streamed_model_pt_is_what_torch_save_writes(tmp_path):
    """checkpoint.export_whole lays the file out, then writes each tensor's bytes in place
    (here one process: each tensor its own whole): plain torch.load reads every dtype and
    shape back (bf16, an int buffer, a 0-d one, a non-contiguous view), under every name."""
    model = torch.nn.Linear(3, 5).to(torch.bfloat16)
    model.register_buffer("steps", torch.tensor(7))
    model.register_buffer("table", torch.arange(12).view(3, 4).t())  # not contiguous
    paths = [tmp_path / "model.pt", tmp_path / "copy.pt"]
    assert checkpoint.export_whole(model, paths) == paths[0]
    for path in paths:
        loaded = torch.load(path, weights_only=True)
        assert list(loaded) == list(model.state_dict())
        for key, value in model.state_dict().items():
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.pt", "model.pt"]  # no tmp left


def test_export_to_a_missing_directory_is_one_line_and_writes_nothing(tmp_path):
    with pytest.raises(SystemExit) as excinfo:
        checkpoint.export_whole(torch.nn.Linear(2, 2), [tmp_path / "no" / "model.pt"])
    assert (
        excinfo.value.code.startswith("error: could not write") and not (tmp_path / "no").exists()
    )


@pytest.mark.parametrize("build", [lambda: models.GPT(256, 16, 32, 3, 2), lambda: models.ViT()])
def test_each_tensor_is_drawn_alone_from_its_name_and_the_seed(build):
    """What a sharded script fills (models.initial_tensor on a meta-device model, one tensor at
    a time) is what the model built after seed_everything holds: one process's weights. A
    tensor's values depend on (seed, name) alone: the other tensors are not drawn."""
    models.seed_everything(5)
    built = build().state_dict()
    with torch.device("meta"):
        shapes = build()
    for name in reversed(list(built)):  # any order: each from its own generator
        assert torch.equal(models.initial_tensor(shapes, name, 5), built[name]), name
    twins = [built[f"blocks.{i}.attn.v.weight"] for i in (0, 1)]  # one shape and spread
    assert not torch.equal(*twins)  # each from its own name's generator
    drawn = models.initial_weights(build, 5)
    assert torch.equal(drawn("blocks.1.attn.q.weight"), built["blocks.1.attn.q.weight"])
    other = models.initial_tensor(shapes, "blocks.1.attn.q.weight", 6)
    assert not torch.equal(other, built["blocks.1.attn.q.weight"])  # another seed, new values
    models.seed_everything(5)  # the same blocks in a deeper model: the same q and k
    deeper = models.GPT(256, 16, 32, 4, 2).state_dict()
    if "embed.weight" in built:
        assert torch.equal(deeper["blocks.1.attn.k.weight"], built["blocks.1.attn.k.weight"])
