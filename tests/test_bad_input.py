"""Bad input ends with one line that starts with "error:", exit status 1, and nothing
written to the output directory. A few cases run as real processes (what a user sees on
the terminal); the rest call main() here, where SystemExit carries the same message."""

import argparse
import importlib
import random

import pytest
import torch
from conftest import SYNTHETIC, run_python

import ddp_comm
import ddp_mp_spawn
import ddp_train
import dp_train
import models

CHEAP = [*SYNTHETIC, "--epochs", "1", "--max-steps", "1"]
JUNK = random.Random(0).randbytes(4096)  # a corrupt file, the same in every run


def assert_untouched(out_dir, before=()):
    """The output directory holds what it held before the run (nothing, or `before`)."""
    assert not out_dir.exists() or sorted(p.name for p in out_dir.iterdir()) == sorted(before)


def error_line(excinfo):
    message = excinfo.value.code
    assert isinstance(message, str), message  # a string code: Python prints it and exits 1
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def fails(main, argv):
    with pytest.raises(SystemExit) as excinfo:
        main(argv)
    return error_line(excinfo)


def real_checkpoint(path, model="cnn"):
    torch.save(dict(model=models.build_model(model, 1, 10).state_dict(), epoch=1), path)
    return path


# ----------------------------------------------------------------------------------------
# As real processes


@pytest.mark.parametrize("case", ["missing-data", "flag-value", "corrupt-checkpoint"])
def test_one_line_error_from_a_real_process(tmp_path, case):
    out = tmp_path / "out"
    argv = {
        "missing-data": ["--data", "mnist", "--data-dir", tmp_path / "empty"],
        "flag-value": ["--batch-size", "0"],
        "corrupt-checkpoint": [*CHEAP, "--resume", tmp_path / "bad.pt"],
    }[case]
    (tmp_path / "bad.pt").write_bytes(JUNK)
    proc = run_python(["ddp_train.py", *argv, "--output-dir", out], timeout=120, check=False)
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    # torch may warn before; the message is the last line and there is no traceback.
    assert lines and lines[-1].startswith("error: "), proc.stderr
    assert sum(line.startswith("error:") for line in lines) == 1 and "Traceback" not in proc.stderr
    assert proc.stdout == ""
    assert_untouched(out)


# ----------------------------------------------------------------------------------------
# In this process


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--batch-size", "0"], "--batch-size"),
        (["--epochs", "-1"], "--epochs"),
        (["--accum-steps", "0"], "--accum-steps"),
        (["--lr", "0"], "--lr"),
        (["--warmup", "1.5"], "--warmup"),
        (["--max-steps", "-1"], "--max-steps"),
        (["--eval-only"], "--resume"),
        (["--model", "transformer"], "--model"),
        (["--data", "imagenet"], "--data"),
        (["--epochs", "two"], "--epochs"),
        (["--no-such-flag"], "--no-such-flag"),
        (["--comm-hook", "int8"], "--comm-hook"),
        (["--powersgd-rank", "0"], "--powersgd-rank"),
        (["--powersgd-start", "-1"], "--powersgd-start"),
    ],
)
def test_impossible_flags(no_launcher, tmp_path, flags, words):
    assert words in fails(ddp_train.main, [*flags, "--output-dir", str(tmp_path / "out")])
    assert_untouched(tmp_path / "out")


@pytest.mark.parametrize("data", ["mnist", "fashion-mnist", "cifar10", "imagefolder"])
def test_missing_data(no_launcher, tmp_path, data):
    message = fails(
        ddp_train.main,
        [
            "--data",
            data,
            "--data-dir",
            str(tmp_path / "nothing"),
            "--output-dir",
            str(tmp_path / "out"),
        ],
    )
    assert str(tmp_path / "nothing") in message
    if data != "imagefolder":
        assert "--download" in message  # the way out is named
    assert_untouched(tmp_path / "out")


def unsafe_checkpoint(path):
    # A pickled object other than tensors and containers: weights_only=True must refuse it.
    torch.save(dict(model={}, args=argparse.Namespace(lr=1)), path)


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda p: p.write_bytes(JUNK), "cannot read checkpoint"),
        (
            lambda p: p.write_bytes(real_checkpoint(p).read_bytes()[:20000]),
            "cannot read checkpoint",
        ),
        (lambda p: p.write_bytes(b""), "cannot read checkpoint"),
        (lambda p: torch.save([1, 2, 3], p), "not a checkpoint"),
        (unsafe_checkpoint, "refused"),
        (lambda p: real_checkpoint(p, model="mlp"), "does not fit"),
        (lambda p: None, "does not exist"),
    ],
    ids=[
        "random-bytes",
        "truncated",
        "empty",
        "not-a-dict",
        "unsafe-pickle",
        "other-model",
        "missing",
    ],
)
def test_bad_checkpoint(no_launcher, tmp_path, make, words):
    ckpt = tmp_path / "in.pt"
    make(ckpt)
    for extra in ([], ["--eval-only"]):
        message = fails(
            ddp_train.main,
            [*CHEAP, *extra, "--resume", str(ckpt), "--output-dir", str(tmp_path / "out")],
        )
        assert words in message and str(ckpt) in message
        assert_untouched(tmp_path / "out")


def test_corrupt_checkpoint_in_output_dir_is_not_overwritten(no_launcher, tmp_path):
    # Automatic resume finds OUTPUT_DIR/checkpoint.pt: a damaged one stops the run and stays
    # as it was (the user may want to look at it), rather than being trained over.
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(JUNK)
    assert str(out / "checkpoint.pt") in fails(ddp_train.main, [*CHEAP, "--output-dir", str(out)])
    assert_untouched(out, before=["checkpoint.pt"])
    assert (out / "checkpoint.pt").read_bytes() == JUNK


def test_sync_bn_on_cpu(no_launcher, tmp_path):
    assert "--sync-bn" in fails(ddp_train.main, [*CHEAP, "--sync-bn", "--device", "cpu"])


def test_cuda_without_gpu(no_launcher, tmp_path):
    no_launcher.setattr(torch.cuda, "is_available", lambda: False)
    assert "CUDA" in fails(
        ddp_train.main, [*CHEAP, "--device", "cuda", "--output-dir", str(tmp_path / "out")]
    )
    assert_untouched(tmp_path / "out")


def test_mp_spawn_bad_nprocs(no_launcher):
    assert "--nprocs" in fails(ddp_mp_spawn.main, ["--nprocs", "0", *CHEAP])


def test_mp_spawn_refuses_to_run_under_another_launcher(no_launcher, monkeypatch):
    # Under `torchrun --nproc_per_node=2`, each worker would spawn its own group on torchrun's port.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "plain python" in fails(ddp_mp_spawn.main, ["--nprocs", "2", *CHEAP])


def test_mp_spawn_checks_training_flags_before_spawning(no_launcher):
    assert "--batch-size" in fails(ddp_mp_spawn.main, ["--nprocs", "2", "--batch-size", "0"])


def test_dp_train_refuses_several_processes(no_launcher, tmp_path):
    no_launcher.setenv("RANK", "0")
    no_launcher.setenv("WORLD_SIZE", "2")  # as torchrun --nproc_per_node=2 would start it
    assert "one process" in fails(dp_train.main, [*CHEAP, "--output-dir", str(tmp_path / "out")])
    assert_untouched(tmp_path / "out")


def test_batch_larger_than_a_shard(no_launcher, tmp_path):
    assert "--batch-size" in fails(ddp_train.main, [*SYNTHETIC, "--batch-size", "4096"])


# ----------------------------------------------------------------------------------------
# Resuming with other flags


def test_resume_with_other_epochs_is_refused_in_one_line(no_launcher, tmp_path):
    """The schedule is a function of --epochs: OneCycleLR's restored state would stop with
    "Tried to step N times", and a cosine schedule would jump back up. Refused, checkpoint kept."""
    out = tmp_path / "out"
    ddp_train.main([*SYNTHETIC, "--epochs", "1", "--max-steps", "2", "--output-dir", str(out)])
    before = (out / "checkpoint.pt").read_bytes()
    for script in (ddp_train, dp_train):
        assert "--epochs 1" in fails(
            script.main, [*SYNTHETIC, "--epochs", "2", "--output-dir", str(out)]
        )
    assert (out / "checkpoint.pt").read_bytes() == before


def test_resume_may_switch_to_fp16(no_launcher, tmp_path):
    """A checkpoint saved without fp16 has an empty GradScaler state; a resume with --amp fp16
    starts a fresh scaler instead of crashing in scaler.load_state_dict."""
    out = str(tmp_path / "out")
    ddp_train.main(
        [*SYNTHETIC, "--model", "mlp", "--epochs", "2", "--max-steps", "2", "--output-dir", out]
    )
    ddp_train.main(
        [
            *SYNTHETIC,
            "--model",
            "mlp",
            "--epochs",
            "2",
            "--max-steps",
            "4",
            "--amp",
            "fp16",
            "--output-dir",
            out,
        ]
    )
    ckpt = torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == 4 and ckpt["scaler"]["scale"] > 0


def test_powersgd_with_fp16_is_refused(no_launcher):
    assert "--amp fp16" in fails(
        ddp_comm.main, [*CHEAP, "--comm-hook", "powersgd", "--amp", "fp16"]
    )


@pytest.mark.slow
def test_a_check_on_rank_0_stops_every_rank_with_its_cause(tmp_path):
    """Only rank 0 checks the output directory; the other rank must stop at once with the same
    cause, not later with "another process died"."""
    from conftest import clean_env, free_port, run_ranks

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    port = str(free_port())
    envs = [
        clean_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        for r in range(2)
    ]
    argv = ["ddp_train.py", *SYNTHETIC, "--dist-timeout", "60", "--output-dir", blocker / "out"]
    for rank in run_ranks(argv, envs, timeout=60, check=False):
        assert rank.returncode == 1
        last = rank.stderr.strip().splitlines()[-1]
        assert last.startswith("error: output directory") and "not writable" in last, rank.stderr


@pytest.mark.parametrize(
    "script", ["fsdp_train", "tensor_parallel", "context_parallel", "expert_parallel"]
)
def test_sharded_scripts_refuse_what_requirements_refuse(no_launcher, tmp_path, script):
    """PyTorch 2.7 and 2.8 run the sharded scripts, but two processes of fsdp_train.py no
    longer take one process's steps there (README): refused in one line, as requirements.txt
    refuses them, before anything is written; 2.10 (after 2.9 by number, not by text) runs."""
    module = __import__(script)
    out = tmp_path / "out"
    cheap = [*CHEAP, "--model", "vit"] if script == "context_parallel" else CHEAP
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "__version__", "2.8.0")
        line = fails(module.main, [*cheap, "--output-dir", str(out)])
    assert line == f"error: {script}.py needs PyTorch 2.9 or newer (this is 2.8.0)"
    assert_untouched(out)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "__version__", "2.10.0")  # on to the next check: no checkpoint
        line = fails(module.main, [*cheap, "--eval-only", "--resume", str(out)])
    assert "does not exist" in line


# ----------------------------------------------------------------------------------------
# --help

SCRIPTS = ["dp_train", "ddp_train", "ddp_mp_spawn", "ddp_comm", "fsdp_train", "tensor_parallel"]
SCRIPTS += ["context_parallel", "expert_parallel", "model_parallel", "nd_parallel", "finetune"]
SCRIPTS += ["quantize"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_shows_every_default_and_a_whole_sentence(no_launcher, monkeypatch, capsys, script):
    """--help (common.ArgumentParser): each flag with a default says it, and the description
    is the docstring's first sentence whole, not its first line cut mid-sentence."""
    module = importlib.import_module(script)
    parsers = []
    real_help = argparse.ArgumentParser.format_help
    monkeypatch.setattr(
        argparse.ArgumentParser, "format_help", lambda p: parsers.append(p) or real_help(p)
    )
    with pytest.raises(SystemExit) as excinfo:
        module.get_args(["--help"])
    assert excinfo.value.code == 0
    [parser], text = parsers, capsys.readouterr().out
    described = " ".join(parser.description.split())
    assert described.endswith(".") and described in " ".join(module.__doc__.split()), described
    for action in parser._actions:
        if action.default not in (None, False, argparse.SUPPRESS):
            shown = parser._get_formatter()._expand_help(action)
            assert "default" in shown, (action.option_strings, shown)
            assert str(action.default) in shown or "default " in shown, (action.dest, shown)
    assert "(default: " in text
