"""Where training images come from: a hub dataset, a local folder or file, or the offline digits.

``load_image_dataset`` returns the training split and the evaluation split with their
image and label columns, the images undecoded (``contrastive_accelerate.data.decoding``
decodes them, so that a broken file can be named).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from contrastive_accelerate.config import option
from contrastive_accelerate.data.formats import TABLE_BUILDERS
from contrastive_accelerate.hub import unreachable_reason
from contrastive_accelerate.untrusted import preview, read_json

IMAGE_COLUMNS = ("image", "img", "pixel_values")
LABEL_COLUMNS = ("label", "labels", "fine_label")
EVAL_SPLITS = ("test", "validation", "valid", "val")
#: Single data files that ``--dataset`` accepts, by suffix, and the ``datasets`` builder for each.


@dataclass
class TableOptions:
    """What only a table reads (a stream or a mixture has no epochs and no held-out
    rows): a section of ``TrainConfig`` (``contrastive_accelerate.options``)."""

    eval_split: str = option(
        "auto", "evaluation split: auto (test, validation, valid or val) or a name", resume="free"
    )
    eval_holdout: float = option(
        0.2, "share of the training split held out if no evaluation split; 0: none",
        at_least=0.0, below=1.0,
    )  # fmt: skip
    drop_last: bool = option(False, "drop each epoch's short last batch")


class DataError(ValueError):
    """A dataset problem the user must fix: reported as one line, not a traceback."""


@dataclass
class ImageData:
    """What ``load_image_dataset`` found: the splits, their columns, and where evaluation
    images come from (``evaluation_source``: one line the trainer prints at start-up)."""

    train: Any
    evaluation: Any | None
    image_column: str
    label_column: str | None
    evaluation_source: str


def load_image_dataset(
    name: str | None = None,
    *,
    config_name: str | None = None,
    split: str = "train",
    image_column: str | None = None,
    label_column: str | None = None,
    eval_split: str = "auto",
    eval_holdout: float = 0.2,
    evaluate: bool = True,
) -> ImageData:
    """Load the training split and, if ``evaluate``, an evaluation split, as HF datasets.

    ``name`` is a hub dataset, a local dataset directory or image folder (through
    ``datasets.load_dataset``, with ``config_name``), a directory written by
    ``save_to_disk`` (a ``Dataset`` or ``DatasetDict``), or one ``.parquet``, ``.csv``
    or ``.json(l)`` file. ``None`` is the offline default: scikit-learn's 8x8 digits,
    real images that ship with the package.

    Evaluation uses ``eval_split`` ("auto": the first of test / validation / valid /
    val that exists); a labelled dataset without one gives up ``eval_holdout`` of its
    training split (0 keeps every image for training and turns evaluation off). The
    image column is returned undecoded: ``read_image`` decodes it, so that a broken
    file can be named.
    """
    splits = load_splits(name, config_name)
    shown = name or "digits"
    if split not in splits:
        raise DataError(f"dataset {shown!r} has no split {split!r} (splits: {', '.join(splits)})")
    train = splits[split]
    columns = train.column_names
    if image_column is None:
        image_column = next((c for c in IMAGE_COLUMNS if c in columns), None)
    if image_column not in columns:
        wanted = repr(image_column) if image_column else " or ".join(map(repr, IMAGE_COLUMNS))
        raise DataError(
            f"dataset {shown!r} has no image column {wanted} "
            f"(columns: {', '.join(columns)}); pass --image-column"
        )
    if label_column is None:
        label_column = next((c for c in LABEL_COLUMNS if c in columns), None)
    elif label_column not in columns:
        raise DataError(
            f"dataset {shown!r} has no label column {label_column!r} "
            f"(columns: {', '.join(columns)})"
        )

    evaluation, source = None, "kNN evaluation: off"
    if evaluate and label_column is None:
        source = "kNN evaluation: off (the dataset has no label column; pass --label-column)"
    elif evaluate:
        train, evaluation, held_out = evaluation_split(
            splits, split, train, eval_split, eval_holdout, shown, "images"
        )
        source = f"kNN evaluation: {held_out}"
        if evaluation is not None and label_column not in evaluation.column_names:
            raise DataError(f"evaluation split has no label column {label_column!r}")
    train = _undecoded(train, image_column, name)
    if evaluation is not None:
        evaluation = _undecoded(evaluation, image_column, name)
    return ImageData(train, evaluation, image_column, label_column, source)


def evaluation_split(
    splits: dict, split: str, train, eval_split: str, eval_holdout: float, shown: str, rows: str
):
    """``(train, evaluation, description)``: ``eval_split`` ("auto": the first of test /
    validation / valid / val that exists), else ``eval_holdout`` of ``train`` held out
    (seed 0, not --seed: the same rows whatever the run's seed), else no evaluation."""
    candidates = EVAL_SPLITS if eval_split == "auto" else (eval_split,)
    found = next((s for s in candidates if s in splits and s != split), None)
    if eval_split != "auto" and found is None:
        raise DataError(
            f"dataset {shown!r} has no evaluation split {eval_split!r} "
            f"(splits: {', '.join(splits)})"
        )
    if found is not None:
        evaluation = splits[found]
        return train, evaluation, f"split {found!r} ({len(evaluation)} {rows})"
    if eval_holdout > 0 and len(train) >= 2:
        held = train.train_test_split(test_size=eval_holdout, seed=0)
        train, evaluation = held["train"], held["test"]
        return (
            train,
            evaluation,
            (
                f"{len(evaluation)} {rows} held out of split {split!r} "
                f"(--eval-holdout {eval_holdout:g}); training on the other {len(train)}"
            ),
        )
    return train, None, f"off (no evaluation split and --eval-holdout {eval_holdout:g})"


def load_splits(name: str | None, config_name: str | None):
    """``{split: Dataset}`` from any source ``load_image_dataset`` accepts."""
    import datasets

    if name is None:
        return {"train": _digits_dataset()}
    # A hub name is "name" or "owner/name"; more than that, or ./, / or ~, is a path.
    looks_like_path = name.count("/") > 1 or name.startswith((".", os.sep, "~"))
    if looks_like_path and not os.path.exists(name):
        raise DataError(f"dataset path {name!r} does not exist")
    if not os.path.exists(name) and (reason := unreachable_reason(name, "datasets")):
        raise DataError(f"cannot load dataset {name!r}: {reason}")
    suffix = os.path.splitext(name)[1].lower()
    try:
        if os.path.isdir(name) and (
            os.path.exists(os.path.join(name, "dataset_dict.json"))
            or os.path.exists(os.path.join(name, "state.json"))
        ):
            if config_name:
                raise DataError("--dataset-config does not apply to a save_to_disk directory")
            check_saved_dataset(name)
            dataset = datasets.load_from_disk(name)
        elif os.path.isfile(name):
            if suffix not in TABLE_BUILDERS:
                raise DataError(
                    f"dataset file {name!r}: expected one of {', '.join(TABLE_BUILDERS)}"
                )
            if config_name:
                raise DataError("--dataset-config does not apply to a single data file")
            if not _holds_text(name):  # datasets' own error is a bare StopIteration
                raise DataError(f"dataset file {name!r} is empty")
            dataset = datasets.load_dataset(TABLE_BUILDERS[suffix], data_files={"train": name})
        else:
            dataset = datasets.load_dataset(name, name=config_name)
    except DataError:
        raise
    except Exception as error:  # datasets raises many types; the user needs one line
        raise DataError(f"cannot load dataset {name!r}: {first_line(error)}") from None
    if isinstance(dataset, datasets.Dataset):
        return {"train": dataset}
    return dict(dataset)


def check_saved_dataset(folder: str) -> None:
    """Refuse a ``save_to_disk`` folder whose JSON names a file or a split outside it,
    before ``datasets`` opens anything: its ``state.json`` lists the Arrow files by name
    and ``dataset_dict.json`` the split folders, and ``datasets`` joins them to the folder
    as they are (a crafted ``../../etc/passwd`` was opened)."""
    dict_file = os.path.join(folder, "dataset_dict.json")
    if not os.path.exists(dict_file):
        _check_saved_split(folder)
        return
    splits = _read_saved_json(dict_file).get("splits")
    if not isinstance(splits, list) or not all(isinstance(split, str) for split in splits):
        raise DataError(f"{dict_file}: malformed (no list of split names)")
    for split in splits:
        if not _inside(folder, split):
            raise DataError(f"{dict_file}: split {preview(split)} is outside {folder!r}")
        _check_saved_split(os.path.join(folder, split))


def _check_saved_split(folder: str) -> None:
    state_file = os.path.join(folder, "state.json")
    files = _read_saved_json(state_file).get("_data_files")
    if not isinstance(files, list) or not all(isinstance(entry, dict) for entry in files):
        raise DataError(f"{state_file}: malformed (no list of data files)")
    for entry in files:
        filename = entry.get("filename")
        if not isinstance(filename, str) or not _inside(folder, filename):
            raise DataError(f"{state_file}: data file {preview(filename)} is outside {folder!r}")


def _read_saved_json(path: str) -> dict:
    try:
        value = read_json(path)
    except (OSError, ValueError) as error:
        raise DataError(f"cannot read {path}: {first_line(error)}") from None
    if not isinstance(value, dict):
        raise DataError(f"{path}: malformed (not a JSON object)")
    return value


def _holds_text(path: str) -> bool:
    """Whether the file holds anything but white space (read up to its first such byte)."""
    with open(path, "rb") as file:
        while chunk := file.read(1 << 16):
            if chunk.strip():
                return True
    return False


def _inside(folder: str, name: str) -> bool:
    """Whether ``folder/name`` is a path inside ``folder``, symbolic links resolved."""
    root = os.path.realpath(folder)
    return os.path.realpath(os.path.join(folder, name)).startswith(root + os.sep)


def _undecoded(dataset, image_column: str, name: str | None):
    """The image column as ``{"bytes", "path"}`` records (file paths become records too).

    Relative paths in a single data file are taken relative to that file's folder.
    """
    import datasets

    feature = dataset.features[image_column]
    if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
        if name and os.path.isfile(name):
            folder = os.path.dirname(os.path.abspath(name))
            dataset = dataset.map(
                lambda path: {image_column: os.path.join(folder, path)},
                input_columns=image_column,
            )
        return dataset.cast_column(image_column, datasets.Image(decode=False))
    if isinstance(feature, datasets.Image) and feature.decode:
        return dataset.cast_column(image_column, datasets.Image(decode=False))
    return dataset


def _digits_dataset():
    import datasets
    from sklearn.datasets import load_digits

    digits = load_digits()
    # 0..16 grey levels -> 0..255 uint8 images
    images = (digits.images * (255 / 16)).round().astype(np.uint8)
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=[str(d) for d in range(10)])}
    )
    return datasets.Dataset.from_dict(
        {"image": list(images), "label": digits.target.tolist()}, features=features
    )


def first_line(error: Exception) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


def label_ids(dataset, label_column: str) -> torch.Tensor:
    """Every sample's label as an integer class id (string labels are numbered in sorted order)."""
    labels = dataset[label_column]
    if all(isinstance(label, int) and not isinstance(label, bool) for label in labels):
        return torch.tensor(labels, dtype=torch.long)
    classes = {label: i for i, label in enumerate(sorted(set(map(str, labels))))}
    return torch.tensor([classes[str(label)] for label in labels], dtype=torch.long)


def is_table(name: str) -> bool:
    """A data file or a ``save_to_disk`` directory: rows with a length."""
    marks = ("dataset_dict.json", "state.json")
    return os.path.isfile(name) or any(os.path.exists(os.path.join(name, m)) for m in marks)


def is_image(value) -> bool:
    """An image as a row holds one: a PIL image or a ``{"bytes", "path"}`` record (a
    webdataset tar's image member, a parquet of image bytes)."""
    from PIL import Image

    return isinstance(value, Image.Image) or (
        isinstance(value, dict) and isinstance(value.get("bytes"), bytes)
    )
