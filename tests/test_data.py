"""Sharding and shuffling as each rank sees it: the loaders ddp_train.main() builds on every
rank of a world (conftest.built_loaders)."""

import pytest
import torch
from conftest import SYNTHETIC, built_loaders, run_python

import data
import ddp_train


@pytest.fixture(scope="module")
def synthetic():
    train_set, test_set, _, _ = data.load_datasets("synthetic", "unused")
    return train_set, test_set


def rank_loaders(world, synthetic, batch_size=64):
    argv = [*SYNTHETIC, "--batch-size", batch_size]
    return [built_loaders(argv, world, rank) for rank in range(world)]


def epoch_order(sampler, epoch):
    sampler.set_epoch(epoch)
    return list(sampler)


def test_synthetic_test_set_is_not_divisible_by_2_or_3(synthetic):
    # The exact-evaluation tests rely on it: with 499 samples every sharding is uneven.
    assert len(synthetic[1]) % 2 and len(synthetic[1]) % 3


@pytest.mark.parametrize("world", [2, 3])
def test_train_shards_are_disjoint_and_cover_the_set(world, synthetic):
    n = len(synthetic[0])
    for epoch in (0, 1):
        shards = [epoch_order(sampler, epoch) for sampler, _, _ in rank_loaders(world, synthetic)]
        seen = [i for shard in shards for i in shard]
        assert len({len(s) for s in shards}) == 1  # equal shares: every rank takes as many steps
        assert len(seen) == len(set(seen))  # disjoint
        assert len(seen) == n - n % world  # all but the remainder that drop_last trims


def test_epochs_are_shuffled_differently_and_reproducibly(synthetic):
    (sampler, _, _), _ = rank_loaders(2, synthetic)
    first, second = epoch_order(sampler, 0), epoch_order(sampler, 1)
    assert first != second and sorted(first) != first
    (again, _, _), _ = rank_loaders(2, synthetic)
    assert epoch_order(again, 1) == second  # same seed and epoch: same order (resume relies on it)
    assert epoch_order(again, 0) == first


def test_train_loader_yields_the_sampler_order(synthetic):
    train_set, _ = synthetic
    for sampler, loader, _ in rank_loaders(2, synthetic, batch_size=64):
        sampler.set_epoch(1)
        indices = torch.tensor(list(sampler))
        images = torch.cat([x for x, _ in loader])
        labels = torch.cat([y for _, y in loader])
        # drop_last: whole batches only
        assert len(labels) == len(indices) // 64 * 64
        assert torch.equal(images, train_set.images[indices[: len(labels)]])
        assert torch.equal(labels, train_set.labels[indices[: len(labels)]])


@pytest.mark.parametrize("world", [1, 2, 3])
def test_test_shards_count_every_sample_once(world, synthetic):
    _, test_set = synthetic
    labels = []
    indices = []
    for _, _, test_loader in rank_loaders(world, synthetic):
        indices += list(test_loader.dataset.indices)
        labels += [y for _, y in test_loader]
    assert sorted(indices) == list(range(len(test_set)))
    assert (
        torch.cat(labels).bincount(minlength=10).tolist()
        == test_set.labels.bincount(minlength=10).tolist()
    )


def test_random_crop_flip_takes_a_shifted_possibly_flipped_crop_of_each_image():
    # Every output image must equal, for some shift (dy, dx) in [0, 2*pad] and flip or not,
    # the crop of the zero-padded input; and across a batch both flips and several shifts occur.
    torch.manual_seed(0)
    images = torch.randn(64, 3, 8, 8)
    out = ddp_train.random_crop_flip(images, pad=2)
    assert out.shape == images.shape
    padded = torch.nn.functional.pad(images, (2, 2, 2, 2))
    seen = set()

    def crop(i, dy, dx, flip):
        c = padded[i, :, dy : dy + 8, dx : dx + 8]
        return c.flip(-1) if flip else c

    for i in range(len(images)):
        shifts = [(dy, dx, flip) for dy in range(5) for dx in range(5) for flip in (False, True)]
        matches = [s for s in shifts if torch.equal(out[i], crop(i, *s))]
        assert matches, f"image {i} is not a crop of its padded input"
        seen.add(matches[0])
    assert {flip for _, _, flip in seen} == {False, True}
    assert len({(dy, dx) for dy, dx, _ in seen}) > 5


def test_augmented_training_runs(tmp_path):
    proc = run_python(
        [
            "ddp_train.py",
            *SYNTHETIC,
            "--augment",
            "--epochs",
            "1",
            "--max-steps",
            "3",
            "--no-channels-last",
        ]
    )
    assert "epoch 0:" in proc.stdout


def _download_rank(rank, world, local_ranks, port, log):
    """One rank of a 3-process gloo group on 2 "nodes" (local ranks 0, 1 | 0) that loads
    Fashion-MNIST with --download; the download is replaced by a slow stand-in that logs when
    it starts and ends, so overlapping downloads show in the log."""
    import os
    import time

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    real_load = data._load

    def fake_load(name, data_dir, download, image_size):
        with open(log, "a") as f:
            f.write(f"{rank} {int(download)} start {time.time()}\n")
        time.sleep(0.5 if download else 0)
        with open(log, "a") as f:
            f.write(f"{rank} {int(download)} end {time.time()}\n")
        return real_load("synthetic", data_dir, False, image_size)

    data._load = fake_load
    try:
        data.load_datasets("fashion-mnist", "unused", download=True, local_rank=local_ranks[rank])
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_download_happens_once_per_node_while_the_others_wait(tmp_path):
    """torchvision downloads into the final file names: ranks downloading at once truncate
    each other's files. Global rank 0 downloads first, then the first process of the other
    node; rank 1 (the second process of node 0) only reads, after rank 0's download ended."""
    from conftest import free_port

    log = tmp_path / "log"
    torch.multiprocessing.spawn(_download_rank, args=(3, [0, 1, 0], free_port(), log), nprocs=3)
    events = {}
    for line in log.read_text().splitlines():
        rank, download, what, when = line.split()
        events[(int(rank), what)] = (int(download), float(when))
    assert {r for (r, _), (d, _) in events.items() if d} == {0, 2}  # the downloaders
    assert events[(0, "end")][1] <= events[(2, "start")][1]  # one after the other
    assert (
        events[(1, "start")] == (0, events[(1, "start")][1])
        and events[(0, "end")][1] <= events[(1, "start")][1]
    )


@pytest.mark.slow
def test_small_images_train_at_their_own_size(tmp_path):
    """An ImageFolder of 28x28 images: the crop defaults to 28, not 224 (64x the compute)."""
    from PIL import Image

    for split in ("train", "val"):
        for c in range(2):
            (tmp_path / split / f"c{c}").mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (28, 28), (80 * c, 10 * i, 0)).save(
                    tmp_path / split / f"c{c}" / f"{i}.png"
                )
    argv = [
        "--data",
        "imagefolder",
        "--data-dir",
        tmp_path,
        "--device",
        "cpu",
        "--max-steps",
        "1",
        "--batch-size",
        "4",
    ]
    proc = run_python(["ddp_train.py", *argv])
    assert "(28x28 images)" in proc.stdout
    proc = run_python(["ddp_train.py", *argv, "--image-size", "20"])
    assert "(20x20 images)" in proc.stdout


@pytest.mark.parametrize("kind", ["images", "text"])
def test_evaluation_padding_is_one_sample_that_counts_for_nothing(kind, monkeypatch):
    """data.pad_batches tops a rank's test batches up to the most any rank has (here, as if
    another rank had 3 more) with batches that go through the model like any other, at least
    one sample each (an empty one never returns from tensor parallelism's reshape where seq
    == dim: nd_parallel.py --dp 2 --tp 2 --dim 32 --seq-len 32 hung), and training.evaluate's
    loss and accuracy over them are those of the real batches alone."""
    import training

    if kind == "images":  # 50 images: 2 batches, the last one short
        images, labels = torch.randn(50, 1, 8, 8), torch.randint(0, 10, (50,))
        test_set = torch.utils.data.TensorDataset(images, labels)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    else:
        test_set = data.TextWindows(torch.arange(2000, dtype=torch.uint8) % 251, 16)
        model = torch.nn.Sequential(torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256))
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(test_set, 32)
    alone = training.evaluate(model, loader, torch.device("cpu"))
    monkeypatch.setattr(data, "get_world_size", lambda: 2)
    monkeypatch.setattr(data.dist, "all_reduce", lambda t, op: t.add_(3))  # another rank's MAX
    padded = list(data.pad_batches(loader, test_set[0], torch.device("cpu")))
    assert len(padded) == len(loader) + 3 and all(len(x) >= 1 for x, _ in padded)
    assert training.evaluate(model, padded, torch.device("cpu")) == alone
