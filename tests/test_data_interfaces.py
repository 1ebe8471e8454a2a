"""Every method's dataset and batch, on every kind of source its families read, and every
sampler keep the written interfaces of ``contrastive_accelerate.data.interfaces``; every
file format is read as its row of ``data.formats`` says.

The cases are found from the tables: each family of each row of ``METHODS`` with each
source of its own (``Family.sources``), so a new method, family or source is checked here
by being in the table (a family without a configuration below fails the first test).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from contrastive_accelerate.data import DataError, GlobalBatchSampler, load_image_dataset
from contrastive_accelerate.data.formats import FORMATS, TABLE_BUILDERS
from contrastive_accelerate.data.interfaces import Batch, BatchPlan, StreamDataset, TableDataset
from contrastive_accelerate.data.mixture import Mixture, MixtureBatches
from contrastive_accelerate.data.streams import ShardStreams, find_shards, stream_batches
from contrastive_accelerate.methods import METHODS
from trainer import TrainConfig

from launch import (
    make_digit_tar_shards,
    make_sentence_pairs,
    make_teacher,
    make_text_pair_shards,
    quick_tower,
)

pytest.importorskip("transformers")
IMAGES = {"model": "mlp", "image_size": 8, "knn_k": 0}
FAMILIES = {(method, family.name): family for method, row in METHODS.items()
            for family in row.families}  # fmt: skip
CASES = [(method, name, source) for (method, name), family in FAMILIES.items()
         for source in family.sources]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory, image_folder, sentence_pairs, captioned_images, tiny_bert):
    root = tmp_path_factory.mktemp("interfaces")
    return {
        "images": image_folder, "pairs": sentence_pairs, "captioned": captioned_images,
        "bert": tiny_bert, "more pairs": str(make_sentence_pairs(root / "more.jsonl", 11)),
        "text shards": str(make_text_pair_shards(root / "text", [7, 5])),
        "image shards": str(make_digit_tar_shards(root / "tar", [7, 5])),
        "teacher": str(root / "teacher"),
    } if make_teacher(root / "teacher") else {}  # fmt: skip


def options(method: str, family: str, source: str, data: dict[str, str]) -> dict:
    """A configuration of ``family`` on ``source``: a family missing here fails."""
    streamed = {"streaming": True, "max_steps": 2, "shuffle_buffer": 2}
    if family == "--method pairs (text pairs)":
        tables = (data["pairs"], data["more pairs"])
        dataset = {"table": data["pairs"], "stream": data["text shards"], "mixture": tables}
        extra = streamed if source == "stream" else {"max_steps": 2} if source == "mixture" else {}
        return {"columns": "anchor,positive,negative_1", "text_model": data["bert"],
                "max_length": 8, "knn_k": 0, "dataset": dataset[source], **extra}  # fmt: skip
    if family == "--method pairs (image-text)":
        if source == "mixture":  # a table and a stream, each its own columns
            return {"columns": ("image,caption", "png,txt"), "text_model": "scratch",
                    "dataset": (data["captioned"], data["image shards"]),
                    "mixture_weights": "1,1", **IMAGES, **streamed}  # fmt: skip
        if source == "stream":
            return {"columns": "png,txt", "dataset": data["image shards"], "text_model": "scratch",
                    **IMAGES, **streamed}  # fmt: skip
        return {"columns": "image,caption", "dataset": data["captioned"],
                "text_model": "scratch", **IMAGES}  # fmt: skip
    assert family == f"--method {method}", f"no configuration for {family}"
    dataset = {"table": {"dataset": data["images"]},
               "stream": {"dataset": data["image shards"], **streamed},
               "mixture": {"dataset": (data["images"],) * 2, "max_steps": 2}}  # fmt: skip
    teacher = {"distill_teacher": data["teacher"]} if method == "distill" else {}
    return {"method": method, **dataset[source], **IMAGES, "model": quick_tower(method), **teacher}


def test_every_family_has_a_configuration(data):
    for method, family, source in CASES:
        options(method, family, source, data)


@pytest.mark.parametrize("case", CASES, ids=" ".join)
def test_a_methods_dataset_and_batches_keep_the_interfaces(data, case):
    method, family, source = case
    torch.manual_seed(0)
    config = TrainConfig(**options(method, family, source, data)).resolved()
    loaded = METHODS[method].load(config)
    METHODS[method].check_data(config, loaded)
    built = METHODS[method].build(config, loaded, 1, print, total_steps=2)
    datasets = built.dataset.datasets if isinstance(built.dataset, Mixture) else [built.dataset]
    assert (source == "mixture") == isinstance(built.dataset, Mixture)
    for dataset in datasets:
        if isinstance(dataset.dataset, ShardStreams):  # a stream, or a mixture's
            assert isinstance(dataset, StreamDataset)
            plan = stream_batches(dataset, 4, 0)
            batch = next(iter(torch.utils.data.DataLoader(plan, batch_size=None,
                                                          collate_fn=lambda b: b)))  # fmt: skip
        else:
            assert isinstance(dataset, TableDataset)
            plan = GlobalBatchSampler(len(dataset), 4, 0, 0, 0, 1)
            batch = dataset.collate([dataset[(0, index)] for index in range(4)])
        assert isinstance(plan, BatchPlan) and plan.share_sizes(0) == [4]
        assert isinstance(batch, Batch) and batch.unreadable == []
        chunks = batch.split(2)
        assert all(isinstance(chunk, type(batch)) for chunk in chunks)
        assert torch.equal(torch.cat([chunk.indices for chunk in chunks]), batch.indices)
    if source == "mixture":
        assert isinstance(MixtureBatches(built.dataset, 4, 0, 0, 1), BatchPlan)


def test_every_file_format_is_read_as_its_row_says(tmp_path):
    """Each row of ``data.formats.FORMATS``: a file of it is a table where the row has a
    builder and refused as one where not; shards of it stream where the row has a reader
    and are refused where not."""
    rows = Dataset.from_dict({"anchor": ["a b", "c d", "e f"], "positive": ["b a", "d c", "f e"]})
    writers = {".parquet": rows.to_parquet, ".jsonl": rows.to_json, ".csv": rows.to_csv,
               ".json": lambda path: Path(path).write_text(json.dumps(rows.to_list()))}  # fmt: skip
    assert set(writers) | {".tar"} == set(FORMATS)
    for extension, row in FORMATS.items():
        folder = tmp_path / extension[1:]
        if extension == ".tar":
            path = next(make_digit_tar_shards(folder, [3]).iterdir())
        else:
            folder.mkdir()
            path = folder / f"pairs{extension}"
            writers[extension](str(path))
        if row.table is not None:
            assert len(load_image_dataset(str(path), image_column="anchor").train) == 3
        else:
            with pytest.raises(DataError, match=f"expected one of {', '.join(TABLE_BUILDERS)}"):
                load_image_dataset(str(path))
        shards = str(folder / f"*{extension}")
        if row.stream is not None:
            assert find_shards(shards, None, 1).first_rows(1)
        else:
            with pytest.raises(DataError, match="shards are one format of"):
                find_shards(shards, None, 1)
