"""What dp_train.py (nn.DataParallel) and ddp_mp_spawn.py (mp.spawn) do beyond ddp_train.py's
loop: DataParallel only on CUDA, its replicas compute in the dtype and memory format asked
for, every GPU's RNG state is saved, a torchrun group is torn down, and a failing child is
reported once.
Their training itself is checked in test_scripts.py, test_copies.py and test_resume.py."""

import copy
import re
import textwrap
import threading

import pytest
import torch
import torch.nn as nn
from conftest import DIST_TIMEOUT, ROOT, SYNTHETIC, run_python, torchrun

import checkpoint
import dp_train
import models

MLP_STEPS = [*SYNTHETIC, "--model", "mlp", "--batch-size", "32"]


def test_dp_train_wraps_only_on_cuda(no_launcher):
    """DataParallel takes every visible GPU whatever the model's device: built with --device
    cpu on a machine with GPUs, it moved the model to cuda:0 (or, with two, refused it). So it
    is built on CUDA only; on the CPU every batch goes straight to the model. A spy tells
    whether it was built (tests/test_gpu.py runs --device cpu beside real GPUs)."""
    built = []

    class Spy(nn.DataParallel):
        def __init__(self, *args, **kwargs):
            built.append(args)
            super().__init__(*args, **kwargs)

    no_launcher.setattr(nn, "DataParallel", Spy)
    dp_train.main([*MLP_STEPS, "--max-steps", "3"])
    assert built == []


def test_dataparallel_replicas_compute_in_the_dtype_asked_for():
    """DataParallel's replica threads re-enter autocast with `enabled` alone, which means the
    device's default dtype (fp16 on CUDA, bf16 on CPU), not the one asked for. Mimicked here
    on CPU: a thread that enables autocast with the default dtype, as parallel_apply does,
    must still compute in fp16 when fp16 was asked for."""
    model = dp_train.Autocast(models.build_model("mlp", 1, 10), torch.float16)
    dtypes = []
    model.module[1].register_forward_hook(lambda module, inputs, out: dtypes.append(out.dtype))

    def replica():
        with torch.autocast("cpu", enabled=True):  # what parallel_apply's threads do
            model(torch.randn(4, 1, 28, 28))

    thread = threading.Thread(target=replica)
    thread.start()
    thread.join()
    assert dtypes == [torch.float16]


@pytest.mark.parametrize("channels_last", [True, False])
def test_dataparallel_replicas_compute_nhwc(channels_last):
    """What dp_train.py hands to DataParallel, run the way a second GPU's replica runs:
    replicate() gives it contiguous (NCHW) copies of the weights, and the batch may arrive
    NCHW. Its convolutions must still compute NHWC by default, NCHW with --no-channels-last."""
    nhwc = set()

    def record(module, inputs, out):
        nhwc.add(out.is_contiguous(memory_format=torch.channels_last))

    def nchw(t):  # a fresh copy in NCHW strides (.contiguous() keeps a 1-channel NHWC one)
        return torch.empty(t.shape, dtype=t.dtype).copy_(t)

    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = models.build_model("cnn", 1, 10).to(memory_format=fmt)
    replica = copy.deepcopy(dp_train.Autocast(model, None, fmt))
    for p in replica.parameters():
        p.data = nchw(p.data)  # as replicate()'s broadcast copies are
    for conv in (m for m in replica.modules() if isinstance(m, nn.Conv2d)):
        conv.register_forward_hook(record)
    with torch.no_grad():
        replica(nchw(torch.randn(4, 1, 28, 28)))
    assert nhwc == {channels_last}


def test_dp_train_checkpoint_keeps_every_gpus_rng_state(tmp_path, monkeypatch):
    """On CUDA each replica draws from its own GPU's generator: the checkpoint holds all of
    them (through torch.load's weights_only) and a resume sets all of them, as many as are
    visible. No GPU here: torch.cuda's RNG functions stand in for two GPUs."""
    gpus = [torch.arange(4, dtype=torch.uint8), torch.arange(4, 8, dtype=torch.uint8)]
    restored = {}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": gpus[0].clone())
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [g.clone() for g in gpus])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: None)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: restored.update(all=s))
    device = torch.device("cuda", 0)
    checkpoint.save_checkpoint({"rng": [dp_train.rng_states(device)]}, tmp_path / "ckpt.pt")
    [state] = checkpoint.read_torch_file(tmp_path / "ckpt.pt")["rng"]
    for visible in (2, 1):
        monkeypatch.setattr(torch.cuda, "device_count", lambda n=visible: n)
        dp_train.set_rng_states(state, device)
        assert [t.tolist() for t in restored["all"]] == [g.tolist() for g in gpus[:visible]]
    restored.clear()
    dp_train.set_rng_states(state, torch.device("cpu"))  # on CPU no CUDA call at all
    assert restored == {}


def test_dp_train_under_torchrun_destroys_its_process_group(tmp_path):
    """torchrun with one process: init_distributed_mode forms a group (as it does for DDP),
    which dp_train.py must destroy when it is done. gloo says nothing at exit about a group
    left up, so the script is run through a wrapper that looks before and after."""
    wrapper = tmp_path / "dp_train_and_look.py"
    wrapper.write_text(
        textwrap.dedent("""
        import sys
        import torch.distributed as dist
        sys.path.insert(0, ROOT)
        import dp_train
        formed, init = [], dp_train.init_distributed_mode

        def init_and_look(**kwargs):
            formed.append(init(**kwargs))
            return formed[-1]

        dp_train.init_distributed_mode = init_and_look
        dp_train.main(sys.argv[1:])
        print(f"group formed: {formed[0].distributed}, left up: {dist.is_initialized()}")
        """).replace("ROOT", repr(str(ROOT)))
    )
    proc = torchrun(1, [wrapper, *MLP_STEPS, "--max-steps", "2", *DIST_TIMEOUT])
    assert "group formed: True, left up: False" in proc.stdout
    assert "NOT been destroyed" not in proc.stderr


def test_mp_spawn_child_error_is_said_once(tmp_path):
    """A child that stops with an error prints its one line (each failing child its own);
    the parent adds nothing of its own and exits non-zero."""
    argv = ["ddp_mp_spawn.py", "--nprocs", "2", "--data", "mnist", "--data-dir", tmp_path]
    proc = run_python([*argv, "--device", "cpu", *DIST_TIMEOUT], check=False)
    errors = re.findall(r"^error: .*$", proc.stderr, re.M)
    assert proc.returncode == 1, proc.stderr
    assert 1 <= len(errors) <= 2, proc.stderr
    assert set(errors) == {errors[0]} and "mnist not found" in errors[0], proc.stderr
