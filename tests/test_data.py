"""The data pipeline's world-size invariance, piece by piece (no processes needed)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from contrastive_accelerate.data import (
    DataError,
    GlobalBatchSampler,
    TwoViews,
    batches_per_epoch,
    load_image_dataset,
)

from launch import make_image_folder


@pytest.mark.parametrize("dataset_size", [20, 23, 24, 25])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_rank_shares_concatenate_to_the_single_process_batch(dataset_size, world_size):
    single = list(GlobalBatchSampler(dataset_size, 8, epoch=3, seed=7))
    shares = [
        list(GlobalBatchSampler(dataset_size, 8, epoch=3, seed=7, rank=r, world_size=world_size))
        for r in range(world_size)
    ]
    assert all(len(share) == len(single) for share in shares)
    for step, batch in enumerate(single):
        assert [item for share in shares for item in share[step]] == batch


def test_every_sample_once_per_epoch_and_no_padding():
    for world_size in (1, 3):
        seen = [
            index
            for rank in range(world_size)
            for batch in GlobalBatchSampler(22, 6, 0, 0, rank, world_size)
            for _, index in batch
        ]
        assert sorted(seen) == list(range(22))  # 22 = 6 + 6 + 6 + 4: nothing repeated


def test_short_last_batch_of_one_sample_is_dropped():
    # A single pair has no negatives; 19 = 6 + 6 + 6 + 1.
    assert batches_per_epoch(19, 6, drop_last=False) == 3
    assert batches_per_epoch(20, 6, drop_last=False) == 4
    assert batches_per_epoch(20, 6, drop_last=True) == 3


def test_resume_skips_exactly_the_trained_batches():
    full = list(GlobalBatchSampler(30, 4, epoch=1, seed=0, rank=1, world_size=2))
    resumed = list(GlobalBatchSampler(30, 4, epoch=1, seed=0, rank=1, world_size=2, start_batch=3))
    assert resumed == full[3:]


def test_shuffle_depends_on_seed_and_epoch():
    order = [
        list(GlobalBatchSampler(50, 50, epoch, seed))
        for epoch, seed in [(0, 0), (0, 0), (1, 0), (0, 1)]
    ]
    assert order[0] == order[1] and order[0] != order[2] and order[0] != order[3]


@pytest.fixture(scope="module")
def digits():
    train, evaluation, image_column, label_column = load_image_dataset(None)
    return train, evaluation, image_column, label_column


def test_views_depend_only_on_seed_epoch_and_index(digits):
    train, _, image_column, _ = digits
    views = TwoViews(train, image_column, 16, seed=5)
    first = views[(2, 7)]
    views[(0, 1)]  # other items in between must not matter
    torch.manual_seed(123)  # nor the process's RNG
    again = views[(2, 7)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], first[1])  # two different views
    assert not torch.equal(views[(3, 7)][0], first[0])  # a new epoch, new crops


def test_views_independent_of_dataloader_workers(digits):
    train, _, image_column, _ = digits
    views = TwoViews(train.select(range(12)), image_column, 16, seed=0)
    sampler = GlobalBatchSampler(12, 4, epoch=0, seed=0)

    def batches(workers):
        loader = DataLoader(
            views, batch_sampler=sampler, collate_fn=views.collate, num_workers=workers
        )
        return [torch.cat(batch) for batch in loader]

    assert all(torch.equal(a, b) for a, b in zip(batches(0), batches(2), strict=True))


def test_process_rng_untouched_by_augmentation(digits):
    train, _, image_column, _ = digits
    views = TwoViews(train, image_column, 16, seed=0)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    views[(0, 0)]
    assert torch.equal(torch.rand(3), expected)


def test_empty_share_collates_to_empty_tensors(digits):
    train, _, image_column, _ = digits
    views = TwoViews(train, image_column, 16, seed=0)
    view0, view1 = views.collate([])
    assert view0.shape == (0, 3, 16, 16) and view1.shape == (0, 3, 16, 16)


def test_default_digits_split(digits):
    train, evaluation, image_column, label_column = digits
    assert (len(train), len(evaluation)) == (1437, 360)
    assert (image_column, label_column) == ("image", "label")


def test_imagefolder_through_load_dataset(tmp_path):
    make_image_folder(tmp_path, count=12)
    train, evaluation, image_column, label_column = load_image_dataset(str(tmp_path))
    assert len(train) + len(evaluation) == 12  # labelled: 20% held out for kNN
    assert (image_column, label_column) == ("image", "label")


def test_unknown_path_and_missing_column(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_image_dataset(str(tmp_path / "nowhere"))
    make_image_folder(tmp_path, count=4)
    with pytest.raises(DataError, match="no image column 'pixels'"):
        load_image_dataset(str(tmp_path), image_column="pixels")
