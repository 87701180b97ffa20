"""The shared modules' smaller promises: the output-directory probe that no other process
can delete, the note for mixed precision that runs slowly, the message of a failed download,
and the sharded scripts' data loaders."""

import argparse
import threading
import urllib.error
import urllib.request

import pytest
import torch

import checkpoint
import common
import data
import ddp_comm
import ddp_mp_spawn
import ddp_train
import dp_train
import training


def test_output_dir_probes_do_not_collide(tmp_path):
    """Ranks on several nodes (or in containers) can share a process id; checking one shared
    folder at once, a probe named after it was deleted by another rank between its write and
    its unlink ("not writable"). Threads of one process share a process id, too."""
    errors, start = [], threading.Barrier(8)

    def check():
        start.wait()
        for _ in range(100):
            try:
                checkpoint.check_output_dir(tmp_path)
            except SystemExit as e:
                errors.append(e.code)

    threads = [threading.Thread(target=check) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert list(tmp_path.iterdir()) == []  # every probe removed


@pytest.mark.parametrize(
    "amp, device, capability, note",
    [
        ("bf16", "cuda", (7, 0), "--amp bf16 on Tesla V100 (compute capability 7.0) is emulated"),
        ("bf16", "cuda", (8, 0), None),  # Ampere and later: bf16 in hardware
        ("fp16", "cuda", (7, 0), None),
        ("fp16", "cpu", None, "--amp fp16 on CPU is slow"),
        ("bf16", "cpu", None, None),
    ],
)
def test_amp_note(monkeypatch, capsys, amp, device, capability, note):
    """One line for mixed precision that runs but slowly; none where it runs at full speed.
    The GPU is pretended (a V100 before Ampere, an A100); tests/test_gpu.py asks the real one."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    training.amp_note(amp, torch.device(device))
    out = capsys.readouterr().out
    assert (note in out and out.count("\n") == 1) if note else out == ""


def spawn_train(argv):  # ddp_mp_spawn.py's training function, in this process
    return ddp_mp_spawn.train(ddp_mp_spawn.get_args(argv), common.init_distributed_mode())


@pytest.mark.parametrize("main", [dp_train.main, ddp_train.main, ddp_comm.main, spawn_train])
def test_scripts_print_the_amp_note(no_launcher, capsys, main):
    """The data-parallel scripts say it (here: fp16 on the CPU), once, before their data (a
    batch too large for it then stops them)."""
    argv = ["--data", "synthetic", "--device", "cpu", "--batch-size", "5000", "--amp", "fp16"]
    with pytest.raises(SystemExit):
        main(argv)
    assert capsys.readouterr().out.count("note: --amp fp16 on CPU is slow") == 1


def test_failed_download_says_so(monkeypatch, tmp_path):
    """Offline, --download fails: the message says the download failed and what to do, and
    does not ask for the --download that was passed. The network is taken away where
    torchvision opens its URLs."""

    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(SystemExit) as excinfo:
        data.load_datasets("mnist", str(tmp_path / "d"), download=True)
    message = excinfo.value.code
    assert message.startswith("error: downloading mnist into ") and "failed" in message, message
    assert "pass --download" not in message and "drop --download" in message
    assert "\n" not in message


def test_shard_loaders_cut_the_data_for_each_data_parallel_group():
    """data.shard_loaders, the sharded scripts' data: each of 3 groups its own third of an
    epoch, reshuffled by set_epoch; the test set once over the groups (499: uneven thirds);
    a batch larger than a shard refused in one line."""
    train_set, test_set, _, _ = data.load_datasets("synthetic", None)
    args = argparse.Namespace(batch_size=50, seed=0)
    cpu = torch.device("cpu")
    loaders = [data.shard_loaders(train_set, test_set, args, 3, i, cpu) for i in range(3)]

    def epoch(e):
        for sampler, _, _ in loaders:
            sampler.set_epoch(e)
        return [torch.cat([labels for _, labels in train]) for _, train, _ in loaders]

    first, second = epoch(0), epoch(1)
    assert [len(t) for t in first] == [650] * 3  # 666 a shard, 13 whole batches of 50
    assert not torch.equal(first[0], second[0])  # epoch 1 is not epoch 0's order
    indices = [list(sampler) for sampler, _, _ in loaders]
    assert len(set(sum(indices, []))) == 3 * 666  # disjoint shards
    tests = [list(test.dataset.indices) for _, _, test in loaders]
    assert [len(t) for t in tests] == [167, 166, 166]
    assert sorted(sum(tests, [])) == list(range(len(test_set)))  # each sample once, no padding
    assert sum(len(labels) for _, _, test in loaders for _, labels in test) == len(test_set)
    too_big = argparse.Namespace(batch_size=400, seed=0, accum_steps=2)
    with pytest.raises(SystemExit, match="--batch-size 400 x --accum-steps 2 is larger than one"):
        data.shard_loaders(train_set, test_set, too_big, 3, 0, cpu)
