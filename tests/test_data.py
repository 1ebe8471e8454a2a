"""The data pipeline's world-size invariance, piece by piece (no processes needed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from contrastive_accelerate.data import (
    AUGMENTATIONS,
    DataError,
    GlobalBatchSampler,
    MultiCrop,
    TwoViews,
    UnreadableImage,
    batches_per_epoch,
    load_image_dataset,
    read_image,
    simclr_augmentation,
)
from contrastive_accelerate.data.augmentation import ColorJitter

from launch import add_unusual_images, make_image_folder, small_labelled_dataset


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
    data = load_image_dataset(None)
    return data.train, data.evaluation, data.image_column, data.label_column


def test_views_depend_only_on_seed_epoch_and_index(digits):
    train, _, image_column, _ = digits
    views = TwoViews(train, image_column, 16, seed=5)
    first = views[(2, 7)][:2]
    views[(0, 1)]  # other items in between must not matter
    torch.manual_seed(123)  # nor the process's RNG
    again = views[(2, 7)][:2]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], first[1])  # two different views
    assert not torch.equal(views[(3, 7)][0], first[0])  # a new epoch, new crops


def test_horizontal_flip_can_be_left_out(digits):
    def flips(transform) -> bool:
        return any(isinstance(step, v2.RandomHorizontalFlip) for step in transform.transforms)

    assert flips(simclr_augmentation(8))
    assert not flips(simclr_augmentation(8, horizontal_flip=False))
    train, _, image_column, _ = digits
    views = TwoViews(train, image_column, 8, seed=0, horizontal_flip=False)
    assert not flips(views.augment)
    crops = MultiCrop(train, image_column, 8, seed=0, global_crops=2, local_crops=1,
                      local_crop_size=4, horizontal_flip=False)  # fmt: skip
    assert not flips(crops.global_augment) and not flips(crops.local_augment)


def test_the_colour_jitter_is_torchvisions_but_for_a_grey_images_hue(digits):
    """Ours leaves a grey image's hue alone (rotating it is the identity, and costly): its
    outputs equal torchvision's ``ColorJitter``'s bit for bit, the same seed, on 100 digits
    (grey) and on 50 colour images. Control: without the hue, the colour images change
    (skipping it there would lose it); the digits do not."""
    train, _, image_column, _ = digits
    generator = torch.Generator().manual_seed(0)
    colour = [torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8, generator=generator)
              for _ in range(50)]  # fmt: skip
    grey = [read_image(train[index][image_column], index) for index in range(100)]
    assert all(torch.equal(image[:1].expand(3, -1, -1), image) for image in grey)
    jitters = {name: jitter(0.4, 0.4, 0.4, hue) for name, jitter, hue in (
        ("ours", ColorJitter, 0.1), ("torchvision", v2.ColorJitter, 0.1),
        ("no hue", v2.ColorJitter, None),
    )}  # fmt: skip

    def outputs(name: str, images: list[torch.Tensor]) -> list[torch.Tensor]:
        jittered = []
        for number, image in enumerate(images):
            torch.manual_seed(number)  # each image's draws, the hue's last (none: not drawn)
            jittered.append(jitters[name](image))
        return jittered

    for images in (grey, colour):
        assert all(map(torch.equal, outputs("ours", images), outputs("torchvision", images)))
    assert all(map(torch.equal, outputs("no hue", grey), outputs("ours", grey)))
    moved = sum(
        not torch.equal(a, b)
        for a, b in zip(outputs("no hue", colour), outputs("ours", colour), strict=True)
    )
    assert moved > 25


@pytest.mark.parametrize("augmentation", AUGMENTATIONS)
def test_each_augmentation_is_drawn_from_the_sample_alone_and_reaches_every_view(
    digits, augmentation
):
    """``--augmentation``'s rows: two views and multi-crop's crops of sample i depend on
    (seed, epoch, i) alone, flips are left out when asked, and the row chosen is the one
    that draws them (the other row draws other views)."""
    train, _, image_column, _ = digits
    views = TwoViews(train, image_column, 8, seed=5, horizontal_flip=False,
                     augmentation=augmentation)  # fmt: skip
    first = views[(2, 7)][:2]
    views[(0, 1)]
    torch.manual_seed(123)
    assert all(torch.equal(a, b) for a, b in zip(first, views[(2, 7)][:2], strict=True))
    assert not torch.equal(first[0], first[1])
    other = next(name for name in AUGMENTATIONS if name != augmentation)
    others = TwoViews(train, image_column, 8, seed=5, horizontal_flip=False, augmentation=other)
    assert not torch.equal(others[(2, 7)][0], first[0])
    crops = MultiCrop(train, image_column, 8, seed=5, global_crops=2, local_crops=1,
                      local_crop_size=4, horizontal_flip=False,
                      augmentation=augmentation)  # fmt: skip
    for transform in (views.augment, crops.global_augment, crops.local_augment):
        kinds = {type(step) for step in transform.transforms}
        assert v2.RandomHorizontalFlip not in kinds
        assert (v2.RandomAffine in kinds) == (augmentation == "affine")


def test_views_independent_of_dataloader_workers(digits):
    train, _, image_column, _ = digits
    views = TwoViews(train.select(range(12)), image_column, 16, seed=0)
    sampler = GlobalBatchSampler(12, 4, epoch=0, seed=0)

    def batches(workers):
        loader = DataLoader(
            views, batch_sampler=sampler, collate_fn=views.collate, num_workers=workers
        )
        return [torch.cat([batch.view0, batch.view1]) for batch in loader]

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
    view0, view1, indices, unreadable = views.collate([])
    assert view0.shape == (0, 3, 16, 16) and view1.shape == (0, 3, 16, 16)
    assert indices.shape == (0,) and not unreadable


def test_default_digits_split(digits):
    train, evaluation, image_column, label_column = digits
    assert (len(train), len(evaluation)) == (1437, 360)
    assert (image_column, label_column) == ("image", "label")


def test_imagefolder_through_load_dataset(tmp_path):
    make_image_folder(tmp_path, count=12)
    data = load_image_dataset(str(tmp_path))
    assert len(data.train) + len(data.evaluation) == 12  # labelled: 20% held out for kNN
    assert (data.image_column, data.label_column) == ("image", "label")


def test_unknown_path_and_missing_column(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_image_dataset(str(tmp_path / "nowhere"))
    make_image_folder(tmp_path, count=4)
    with pytest.raises(DataError, match="no image column 'pixels'"):
        load_image_dataset(str(tmp_path), image_column="pixels")


def test_default_holdout_is_stated_and_skipped_without_evaluation():
    held = load_image_dataset(None)
    assert "360 images held out of split 'train' (--eval-holdout 0.2)" in held.evaluation_source
    no_evaluation = load_image_dataset(None, evaluate=False)
    assert (len(no_evaluation.train), no_evaluation.evaluation) == (1797, None)
    assert no_evaluation.evaluation_source == "kNN evaluation: off"
    no_holdout = load_image_dataset(None, eval_holdout=0.0)
    assert (len(no_holdout.train), no_holdout.evaluation) == (1797, None)
    assert "--eval-holdout 0" in no_holdout.evaluation_source


def _write_sources(root: Path) -> dict[str, tuple[str, dict]]:
    """The same 12 labelled images in every kind of source ``--dataset`` accepts."""
    import datasets
    from PIL import Image

    dataset = small_labelled_dataset(12)
    sources = {}
    dataset.save_to_disk(str(root / "saved_dataset"))
    sources["save_to_disk Dataset"] = (str(root / "saved_dataset"), {})
    splits = dataset.train_test_split(test_size=4, seed=0)
    datasets.DatasetDict(splits).save_to_disk(str(root / "saved_dict"))
    sources["save_to_disk DatasetDict"] = (str(root / "saved_dict"), {})
    dataset.to_parquet(str(root / "images.parquet"))
    sources["parquet file"] = (str(root / "images.parquet"), {})

    # CSV and JSON Lines hold file paths, relative to the data file's folder.
    (root / "files").mkdir()
    rows = []
    for index, record in enumerate(dataset.cast_column("image", datasets.Image(decode=True))):
        Image.fromarray(np.asarray(record["image"])).save(root / "files" / f"{index}.png")
        rows.append((f"files/{index}.png", record["label"]))
    (root / "images.csv").write_text(
        "image,label\n" + "".join(f"{path},{label}\n" for path, label in rows)
    )
    sources["csv file"] = (str(root / "images.csv"), {})
    (root / "images.jsonl").write_text(
        "".join(json.dumps({"image": path, "label": label}) + "\n" for path, label in rows)
    )
    sources["json lines file"] = (str(root / "images.jsonl"), {})

    # A local dataset with two configurations declared in its README, as on the hub.
    for name, size in (("small", 4), ("large", 8)):
        (root / "configured" / name).mkdir(parents=True)
        dataset.select(range(size)).to_parquet(str(root / "configured" / name / "train.parquet"))
    (root / "configured" / "README.md").write_text(
        "---\nconfigs:\n"
        "- config_name: small\n  data_files:\n  - split: train\n    path: small/*.parquet\n"
        "- config_name: large\n  data_files:\n  - split: train\n    path: large/*.parquet\n"
        "---\n"
    )
    sources["config 'large' of a local dataset"] = (
        str(root / "configured"),
        {"config_name": "large"},
    )
    return sources


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return _write_sources(tmp_path_factory.mktemp("sources"))


@pytest.mark.parametrize(
    ("kind", "train_size", "evaluation_size"),
    [
        ("save_to_disk Dataset", 9, 3),  # 20% of 12 held out, rounded up by datasets
        ("save_to_disk DatasetDict", 8, 4),  # its own test split: nothing held out
        ("parquet file", 9, 3),
        ("csv file", 9, 3),
        ("json lines file", 9, 3),
        ("config 'large' of a local dataset", 6, 2),
    ],
)
def test_every_kind_of_source_loads_and_decodes(sources, kind, train_size, evaluation_size):
    path, options = sources[kind]
    data = load_image_dataset(path, **options)
    assert (len(data.train), len(data.evaluation)) == (train_size, evaluation_size)
    assert (data.image_column, data.label_column) == ("image", "label")
    image = read_image(data.train[0]["image"], 0)
    assert image.shape == (3, 12, 12) and image.dtype == torch.uint8


def test_split_and_evaluation_split_are_chosen_by_name(sources):
    path, _ = sources["save_to_disk DatasetDict"]
    swapped = load_image_dataset(path, split="test", eval_split="train")
    assert (len(swapped.train), len(swapped.evaluation)) == (4, 8)
    with pytest.raises(DataError, match="no split 'validation'"):
        load_image_dataset(path, split="validation")
    with pytest.raises(DataError, match="no evaluation split 'val'"):
        load_image_dataset(path, eval_split="val")
    notes = Path(path).parent / "notes.txt"
    notes.write_text("not a dataset")
    with pytest.raises(DataError, match="expected one of .parquet"):
        load_image_dataset(str(notes))


def test_unreadable_and_unusual_images(tmp_path):
    make_image_folder(tmp_path, count=4)
    truncated, rgba = add_unusual_images(tmp_path)
    data = load_image_dataset(str(tmp_path), evaluate=False)
    paths = [record["image"]["path"] for record in data.train]
    rgba_index, truncated_index = paths.index(str(rgba)), paths.index(str(truncated))

    assert read_image(data.train[rgba_index]["image"], rgba_index).shape == (3, 12, 12)
    with pytest.raises(UnreadableImage, match=f"image {truncated_index} .*truncated.png"):
        read_image(data.train[truncated_index]["image"], truncated_index)

    views = TwoViews(data.train, "image", 8, seed=0)
    batch = views.collate([views[(0, i)] for i in range(len(data.train))])
    assert len(batch.view0) == len(data.train) - 1
    assert [str(error) for error in batch.unreadable] == [
        str(views[(0, truncated_index)])
    ] and "truncated.png" in str(batch.unreadable[0])


@pytest.mark.parametrize(
    "make",
    [
        lambda: Image.new("RGBA", (5, 4), (10, 20, 30, 40)),
        lambda: Image.new("LA", (5, 4), (100, 50)),
        lambda: Image.new("P", (5, 4), 7),
        lambda: Image.new("1", (5, 4), 1),
        lambda: Image.new("CMYK", (5, 4), (0, 0, 0, 0)),
        lambda: Image.fromarray(np.full((4, 5), 65535, np.uint16)),
        lambda: np.full((4, 5), 200, np.uint8),
        lambda: np.full((4, 5, 4), 0.5, np.float32),
    ],
    ids=["RGBA", "LA", "P", "1-bit", "CMYK", "16-bit", "HW array", "HWC float array"],
)
def test_any_image_mode_becomes_three_channels(make):
    image = read_image(make(), 0)
    assert image.shape == (3, 4, 5) and image.dtype == torch.uint8


def _duplicated_texts(count: int = 30, distinct: int = 30) -> list[tuple[int, ...]]:
    """Each sample's two text ids, drawn from few distinct texts: duplicates abound."""
    generator = torch.Generator().manual_seed(4)
    return [
        tuple(torch.randint(distinct, (2,), generator=generator).tolist()) for _ in range(count)
    ]


def _duplicates_in(batches, keys) -> int:
    total = 0
    for batch in batches:
        texts = [text for index in batch.tolist() for text in set(keys[index])]
        total += len(texts) - len(set(texts))
    return total


@pytest.mark.parametrize("epoch", [0, 1])
def test_unique_texts_keeps_texts_apart_and_every_rank_agrees(epoch):
    """With ``duplicate_keys`` no global batch holds a text twice while others are left
    (the control, the plain sampler, does); every sample still comes once per epoch, the
    batch sizes are the plain sampler's, and the ranks' shares concatenate to the
    single-process batch on 1, 2 and 3 ranks."""
    keys = _duplicated_texts()
    plain = GlobalBatchSampler(len(keys), 6, epoch, seed=0)
    sampler = GlobalBatchSampler(len(keys), 6, epoch, seed=0, duplicate_keys=keys)
    batches, plain_batches = sampler.global_batches(), plain.global_batches()
    print(f"duplicate texts in the epoch's batches: {_duplicates_in(batches, keys)}, "
          f"plain sampler {_duplicates_in(plain_batches, keys)}")  # fmt: skip
    assert _duplicates_in(plain_batches, keys) > 0
    assert _duplicates_in(batches[:2], keys) == 0  # the first batches have the choice
    assert _duplicates_in(batches, keys) < _duplicates_in(plain_batches, keys)
    assert [len(b) for b in batches] == [len(b) for b in plain_batches]
    assert sorted(torch.cat(batches).tolist()) == list(range(len(keys)))
    for world_size in (2, 3):
        shares = [
            list(GlobalBatchSampler(len(keys), 6, epoch, seed=0, rank=rank,
                                    world_size=world_size, duplicate_keys=keys))
            for rank in range(world_size)
        ]  # fmt: skip
        for step, batch in enumerate(batches):
            joined = [index for share in shares for _, index in share[step]]
            assert joined == batch.tolist()


def test_a_hub_name_that_cannot_be_fetched_is_refused_at_once(tmp_path, monkeypatch):
    """Without a network, loading a hub name retries for about a minute: a name that is
    neither local nor cached is refused at once when HF_HUB_OFFLINE is set or the hub's
    host does not answer; the controls, a local folder and a cached name, pass."""
    import huggingface_hub.constants

    from contrastive_accelerate.data.sources import load_splits
    from contrastive_accelerate.hub import unreachable_reason

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="'someone/pairs': it is not a local path nor in the"):
        load_splits("someone/pairs", None)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")  # a name that never resolves
    reason = unreachable_reason("someone/model", "models")
    assert reason and "the hub (https://hub.invalid) cannot be reached" in reason
    assert unreachable_reason(str(tmp_path), "models") is None
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    (tmp_path / "models--someone--model").mkdir()
    assert unreachable_reason("someone/model", "models") is None


def test_an_error_quotes_a_short_preview_of_a_value_never_the_value():
    """A 2 MB member named as a text column was an error line of 5.7 million characters:
    the message quotes its type, its length and its first characters."""
    from contrastive_accelerate.data.pairs import row_problem
    from contrastive_accelerate.untrusted import PREVIEW_CHARS, preview

    png = b"\x89PNG\r\n\x1a\n" + bytes(2_000_000)
    row = {"__source__": "shard-00001.tar, 000008", "txt": png}
    problem = row_problem(row, ["txt"])
    print(problem)
    assert problem.startswith(
        "shard-00001.tar, 000008: column 'txt' holds bytes, 2,000,008 long: b'\\x89PNG"
    )
    assert len(problem) < 200
    assert preview("a caption") == "'a caption'"  # short values whole
    assert len(preview(list(range(10**6)))) < PREVIEW_CHARS + 40


@pytest.mark.parametrize("crafted", ["data file", "split", "symlinked data file", "too deep"])
def test_a_save_to_disk_folder_naming_files_outside_it_is_refused_before_opening(tmp_path, crafted):
    """``datasets`` joins the names in ``state.json`` and ``dataset_dict.json`` to the
    folder as they are: a crafted name opened a file outside it. Each is refused in one
    line naming the file; the untouched folders load (the control)."""
    import datasets

    outside = tmp_path / "outside.arrow"
    outside.write_bytes(b"secret")
    dataset = small_labelled_dataset(4)
    dataset.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": dataset}).save_to_disk(str(tmp_path / "saved_dict"))
    for folder in ("saved", "saved_dict"):
        assert len(load_image_dataset(str(tmp_path / folder), evaluate=False).train) == 4
    state = tmp_path / "saved" / "state.json"
    target = tmp_path / "saved"
    if crafted == "data file":
        value = json.loads(state.read_text())
        value["_data_files"] = [{"filename": "../outside.arrow"}]
        state.write_text(json.dumps(value))
        expected = f"{state}: data file '../outside.arrow' is outside"
    elif crafted == "split":
        dict_file = tmp_path / "saved_dict" / "dataset_dict.json"
        dict_file.write_text(json.dumps({"splits": ["../saved_elsewhere"]}))
        target, expected = tmp_path / "saved_dict", "split '../saved_elsewhere' is outside"
    elif crafted == "symlinked data file":
        arrow = json.loads(state.read_text())["_data_files"][0]["filename"]
        (target / arrow).unlink()
        (target / arrow).symlink_to(outside)
        expected = f"data file {arrow!r} is outside"
    else:
        state.write_text("[" * 100_000)
        expected = f"cannot read {state}: nested too deeply to read"
    with pytest.raises(DataError) as refused:
        load_image_dataset(str(target), evaluate=False)
    assert expected in str(refused.value) and "\n" not in str(refused.value)
