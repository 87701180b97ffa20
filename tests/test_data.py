"""Sharding and shuffling as each rank sees it, through ddp_train.build_loaders for every
rank of a world (DistributedSampler takes the rank explicitly: no process group needed)."""

import pytest
import torch
from conftest import SYNTHETIC, run_python

import common
import ddp_train


@pytest.fixture(scope="module")
def synthetic():
    train_set, test_set, _, _ = common.load_datasets("synthetic", "unused")
    return train_set, test_set


def rank_loaders(world, synthetic, batch_size=64):
    args = ddp_train.get_args([*SYNTHETIC, "--batch-size", str(batch_size)])
    infos = [common.DistInfo(world > 1, r, r, world, world, torch.device("cpu")) for r in range(world)]
    return [ddp_train.build_loaders(args, *synthetic, info) for info in infos]


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
    assert torch.cat(labels).bincount(minlength=10).tolist() == test_set.labels.bincount(minlength=10).tolist()


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
        ["ddp_train.py", *SYNTHETIC, "--augment", "--epochs", "1", "--max-steps", "3", "--no-channels-last"]
    )
    assert "epoch 0:" in proc.stdout
