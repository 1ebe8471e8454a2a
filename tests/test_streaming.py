"""Streamed shards (``--streaming``, ``contrastive_accelerate.data.streams``): the same
global batches on 1, 2 and 3 processes and any number of loader workers, an exact and
elastic resume without a saved position, and bad rows named by shard and member.

Shards are written by the tests: jsonl and parquet text pairs with a hard-negative
column, and webdataset tar files of the digits with captions, of uneven sizes, so that
streams end their passes at different steps and processes get uneven shares.
"""

from __future__ import annotations

import io
import itertools
import json
import shutil
import tarfile
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from contrastive_accelerate.data import ShardStreams, StreamBatches
from contrastive_accelerate.data.loader import as_built
from contrastive_accelerate.data.streams import find_shards

from launch import (
    TrainerRuns,
    final_files_difference,
    make_captioned_digits,
    make_digit_parquet,
    make_digit_tar_shards,
    make_text_pair_shards,
    one_line_errors,
    resumed_differences,
    train_pooled,
)

pytest.importorskip("transformers")
EXACT = 1e-9  # float64: only the summation order differs between the world sizes
#: 5 shards, 5 streams: a global batch of 6 takes 2, 1, 1, 1, 1 rows of them, and 3
#: processes own streams (0, 1), (2, 3), (4): shares of 3, 2 and 1 rows. Stream 0's 7
#: rows end a pass every 3.5 steps.
TEXT_SHARDS = [7, 11, 5, 9, 4]
TEXT = ["--columns", "anchor,positive,negative_1", "--dtype", "float64", "--batch-size", "6",
        "--lr", "1e-3", "--max-length", "8", "--log-every", "1", "--max-steps", "8",
        "--shuffle-buffer", "4"]  # fmt: skip
#: 4 tar shards, 4 streams of 3 rows per batch of 12; 3 processes: 6, 3 and 3 rows.
TAR_SHARDS = [10, 7, 12, 5]
IMAGE_TEXT = ["--columns", "png,txt", "--text-model", "scratch", "--model", "mlp", "--dtype",
              "float64", "--image-size", "8", "--batch-size", "12", "--lr", "1e-3",
              "--max-length", "6", "--log-every", "1", "--max-steps", "6",
              "--shuffle-buffer", "3"]  # fmt: skip


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("shards")
    return {
        "jsonl": str(make_text_pair_shards(root / "jsonl", TEXT_SHARDS)),
        "parquet": str(make_text_pair_shards(root / "parquet", TEXT_SHARDS, "parquet")),
        "tar": str(make_digit_tar_shards(root / "tar", TAR_SHARDS)),
        # A dataset repository's layout, which load_dataset(..., streaming=True) reads.
        "hub": str(make_text_pair_shards(root / "hub" / "data", TEXT_SHARDS).parent),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shards, tiny_bert):
    return {
        "jsonl": TrainerRuns(tmp_path_factory, "--streaming", "--dataset", shards["jsonl"],
                             "--text-model", tiny_bert, *TEXT),
        "parquet": TrainerRuns(tmp_path_factory, "--streaming", "--dataset",
                               str(Path(shards["parquet"]) / "*.parquet"), "--text-model",
                               tiny_bert, *TEXT),
        "tar": TrainerRuns(tmp_path_factory, "--streaming", "--dataset", shards["tar"],
                           *IMAGE_TEXT),
    }  # fmt: skip


# The design, without a model: what each rank's loader yields.


class Rows(NamedTuple):
    """A toy method's batch: each row's sample id and where it came from."""

    ids: list[tuple[int, int, str]]
    unreadable: list


def loader_batches(
    source: ShardStreams, rank: int, world_size: int, steps: int, *, first_step: int = 0,
    per_rank: bool = False,
) -> list[list[tuple[int, int, str]]]:  # fmt: skip
    """Rank ``rank``'s rows of steps ``first_step, ...``, through a DataLoader without
    workers (in this process, they would leave multiprocessing's resource tracker
    behind; the trainer runs below have workers)."""
    stream = StreamBatches(
        source, lambda row, epoch, index: (epoch, index, row["__source__"]),
        lambda items: Rows(items, []), lambda row: None, batch_size=6, seed=3, rank=rank,
        world_size=world_size, per_rank=per_rank,
    )  # fmt: skip
    stream.set_epoch(0, first_step)
    loader = torch.utils.data.DataLoader(stream, batch_size=None, collate_fn=as_built)
    batches = []
    for batch in loader:
        batches.append(batch.ids)
        if len(batches) == steps:
            break
    return batches


def global_batches(source: ShardStreams, world_size: int, steps: int, **options):
    """Every step's global batch: the ranks' shares in rank order."""
    shares = [loader_batches(source, rank, world_size, steps, **options)
              for rank in range(world_size)]  # fmt: skip
    return [sum((share[step] for share in shares), []) for step in range(steps)]


def test_the_global_batches_are_the_same_on_any_number_of_processes(shards):
    """12 steps of 5 streams (every stream passes its shards several times): the ranks'
    shares in rank order are the single process's batch, and each rank's rows come from
    its own streams' shards alone."""
    source = find_shards(shards["jsonl"], None, 4)
    reference = global_batches(source, 1, 12)
    assert len({row[:2] for batch in reference for row in batch}) == 12 * 6  # distinct ids
    for world_size in (2, 3, 4, 5):
        assert global_batches(source, world_size, 12) == reference, world_size
    owned = torch.arange(source.streams).tensor_split(3)
    for rank in range(3):
        files = {source.shards[v] for v in owned[rank].tolist()}
        rows = [row for batch in loader_batches(source, rank, 3, 12) for row in batch]
        assert {row[2].split(",")[0] for row in rows} <= files


def test_control_per_rank_shards_and_shuffling_change_the_global_batches(shards):
    """webdataset's split_by_node with per-rank seeds: each process's batches come from
    its own shards, and 2 processes see other global batches than 1."""
    source = find_shards(shards["jsonl"], None, 4)
    reference = global_batches(source, 1, 12)
    per_rank = global_batches(source, 2, 12, per_rank=True)
    differing = sum(a != b for a, b in zip(reference, per_rank, strict=True))
    print(f"per-rank shards: {differing} of 12 global batches differ from 1 process's")
    assert differing > 6


def test_a_loader_started_at_step_t_continues_the_straight_one(shards):
    """The position of every stream is a function of the step: a loader started at step 5
    (on another number of processes) yields the straight run's steps 5 on.
    The control: started without its position (from row 0), it repeats steps 0 on."""
    source = find_shards(shards["jsonl"], None, 4)
    straight = global_batches(source, 1, 12)
    assert global_batches(source, 3, 7, first_step=5) == straight[5:]
    restarted = global_batches(source, 3, 7)
    assert restarted != straight[5:] and restarted == straight[:7]


def test_a_tar_of_json_members_streams_the_same_rows_as_jsonl(shards, tmp_path):
    """Text pairs as webdataset json members: each object's fields are columns, and the
    rows, keyed alike, are the jsonl shards' rows in the same order."""
    root = tmp_path / "tar"
    root.mkdir()
    for path in sorted(Path(shards["jsonl"]).iterdir()):
        with tarfile.open(root / f"{path.stem}.tar", "w") as archive:
            for number, line in enumerate(path.read_text().splitlines()):
                member = tarfile.TarInfo(f"{number:06d}.json")
                member.size = len(line.encode())
                archive.addfile(member, io.BytesIO(line.encode()))
    columns = ("anchor", "positive", "negative_1")

    def rows(source):
        return [[tuple(row[c] for c in columns) for row in stream] for stream in
                (itertools.islice((r for _, _, r in source.rows(v, 3)), 40)
                 for v in range(source.streams))]  # fmt: skip

    assert rows(find_shards(str(root), None, 4)) == rows(find_shards(shards["jsonl"], None, 4))


def test_streams_default_to_the_shards_up_to_8_and_are_refused_beyond_them(shards, tmp_path):
    assert find_shards(shards["jsonl"], None, 1).streams == 5
    with pytest.raises(ValueError, match=r"--streams 6 exceeds the 5 shards"):
        find_shards(shards["jsonl"], 6, 1)
    with pytest.raises(ValueError, match=r"no shards found"):
        find_shards(str(tmp_path / "*.tar"), None, 1)


# Training: float64, 1 vs 2 vs 3 processes.


@pytest.mark.parametrize(
    "data, processes, workers",
    [("jsonl", 2, 2), ("jsonl", 3, 0), ("parquet", 3, 2), ("tar", 2, 0), ("tar", 3, 2)],
)
def test_one_process_and_n_processes_train_the_same_model_from_streams(
    runs, data, processes, workers
):
    reference = runs[data](1, "--num-workers", "0")
    error = final_files_difference(reference, runs[data](processes, "--num-workers", str(workers)))
    print(f"streamed {data}, 1 process vs {processes} with {workers} workers: {error:.1e}")
    assert error <= EXACT


def test_a_hub_dataset_streams_as_its_files_do(runs, shards, tiny_bert, tmp_path):
    """The jsonl shards as a dataset repository (``data/``), which is
    ``load_dataset(..., streaming=True)``: its shards are the files, so 2 processes train
    what 1 process trains from the files themselves."""
    hub = tmp_path / "hub"
    train_pooled(2, "--streaming", "--dataset", shards["hub"], "--text-model", tiny_bert, *TEXT,
                 "--num-workers", "0", "--output-dir", str(hub))  # fmt: skip
    error = final_files_difference(runs["jsonl"](1, "--num-workers", "0"), hub)
    print(f"streamed through load_dataset(streaming=True), 2 processes vs the files: {error:.1e}")
    assert error <= EXACT


def test_control_per_rank_shards_train_another_model(runs):
    error = final_files_difference(
        runs["jsonl"](1, "--num-workers", "0"),
        runs["jsonl"](2, "--num-workers", "0", "--stream-split", "per-rank"),
    )
    print(f"control --stream-split per-rank, 1 vs 2 processes: {error:.1e}")
    assert error > 1e3 * EXACT


def test_a_resume_mid_stream_ends_where_the_straight_run_does(runs, tmp_path):
    """Resumed at step 4 of 8 on 1 process (2 workers): 0.0 from the straight run; a
    2-process run's checkpoint resumed on 3 processes: within float64 summation order."""
    same, error = resumed_differences(runs["jsonl"], 4, tmp_path, workers=(2, 0))
    print(f"streamed resume at step 4 of 8: 1 -> 1 process {same:.1e}, 2 -> 3 processes "
          f"{error:.1e} (from the 1-process straight run)")  # fmt: skip
    assert same == 0.0
    assert error <= EXACT


def test_a_shard_edited_in_place_at_the_same_size_refuses_the_resume(tmp_path):
    """A stream's fingerprint held the shards' names and sizes: a shard whose text was
    changed in place at the same size resumed without notice. Its modification time is
    part of it now. The control: before the edit, a copy of the run resumes."""
    shards = make_text_pair_shards(tmp_path / "shards", [7, 5, 9])
    flags = ["--streaming", "--dataset", str(shards), "--text-model", "scratch", *TEXT,
             "--save-every", "2", "--num-workers", "0"]  # fmt: skip
    train_pooled(1, *flags, "--max-steps", "2", "--output-dir", str(tmp_path / "run"))
    shutil.copytree(tmp_path / "run", tmp_path / "control")
    train_pooled(1, *flags, "--max-steps", "4", "--resume-from", "latest", "--output-dir",
                 str(tmp_path / "control"))  # fmt: skip
    shard = shards / "part-00001.jsonl"
    text = shard.read_text()
    edited = text.replace("a", "b", 1)
    assert edited != text and len(edited) == len(text)
    shard.write_text(edited)
    result = train_pooled(1, *flags, "--max-steps", "4", "--resume-from", "latest",
                          "--output-dir", str(tmp_path / "run"), check=False)  # fmt: skip
    one_line_errors(result, "this run differs from the checkpoint's in --dataset's shard times", 1)
    assert "--dataset's shards " not in result.stderr  # the names and sizes are the same


def test_the_streamed_run_logs_its_losses_and_refuses_what_it_cannot_honour(runs, shards, tmp_path):
    records = [json.loads(line) for line in (runs["tar"](1, "--num-workers", "0") /
                                             "metrics.jsonl").open()]  # fmt: skip
    losses = [record["loss"] for record in records if "loss" in record]
    assert len(losses) == 6 and all(loss > 0 for loss in losses)
    result = train_pooled(2, "--streaming", "--dataset", shards["jsonl"], "--streams", "1",
                          "--text-model", "scratch", *TEXT, "--output-dir", str(tmp_path),
                          check=False)  # fmt: skip
    one_line_errors(result, "--streams 1 is fewer than the 2 processes", 2)


# Bad rows: a one-line error naming the shard and member on every rank, or skipped.


#: JSON nested deeper than any parser's stack: a RecursionError, were it not caught.
DEEP_JSON = "[" * 200_000 + "]" * 200_000


def write_bad_shards(root: Path, case: str) -> Path:
    """Text-pair or digit shards with one bad row in shard 1."""
    if case in ("malformed-json", "deep-json-line"):
        make_text_pair_shards(root, [6, 6, 6])
        path = root / "part-00001.jsonl"
        lines = path.read_text().splitlines()
        lines[2] = lines[2][: len(lines[2]) // 2] if case == "malformed-json" else DEEP_JSON
        path.write_text("\n".join(lines) + "\n")
        return root
    make_digit_tar_shards(root, [6, 6, 6])
    path = root / "shard-00001.tar"
    if case == "deep-json-member":  # sample 000008 gains a json member nested 200,000 deep
        with tarfile.open(path) as archive:
            members = [(member, archive.extractfile(member).read()) for member in archive]
        with tarfile.open(path, "w") as archive:
            for member, data in members:
                archive.addfile(member, io.BytesIO(data))
                if member.name == "000008.txt":
                    deep = tarfile.TarInfo("000008.json")
                    deep.size = len(DEEP_JSON)
                    archive.addfile(deep, io.BytesIO(DEEP_JSON.encode()))
        return root
    if case == "truncated-tar":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2 + 100])
        return root
    if case == "garbage-tar":  # no tar at all: named as such, not "after None"
        path.write_bytes(bytes(range(256)) * 40)
        return root
    with tarfile.open(path, "a") as archive:  # an image whose caption is missing, or the reverse
        member = tarfile.TarInfo("999999.txt" if case == "caption-without-image" else "999999.png")
        data = b"a caption" if case == "caption-without-image" else b"\x89PNG not really"
        member.size = len(data)
        archive.addfile(member, io.BytesIO(data))
    return root


BAD_ROWS = {
    "malformed-json": ("part-00001.jsonl, line 3: malformed JSON", TEXT[:2]),
    "deep-json-line": (
        "part-00001.jsonl, line 3: malformed JSON (nested too deeply to read)",
        TEXT[:2],
    ),
    "deep-json-member": (
        "shard-00001.tar: member '000008.json' cannot be read (nested too deeply to read)",
        IMAGE_TEXT[:2],
    ),
    "truncated-tar": ("shard-00001.tar: truncated or malformed tar after", IMAGE_TEXT[:2]),
    "garbage-tar": (
        "shard-00001.tar: not a tar archive, or cut before its first member",
        IMAGE_TEXT[:2],
    ),
    "member-without-pair": ("shard-00001.tar, 999999: no column 'txt'", IMAGE_TEXT[:2]),
    "caption-without-image": ("shard-00001.tar, 999999: no column 'png'", ["--method", "simclr"]),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
@pytest.mark.parametrize("processes", [1, 2])
def test_a_bad_row_is_one_line_on_every_rank_or_skipped_and_said(case, processes, tmp_path):
    expected, columns = BAD_ROWS[case]
    root = write_bad_shards(tmp_path / "shards", case)
    flags = ["--streaming", "--dataset", str(root), *columns, "--batch-size", "6",
             "--max-steps", "4", "--num-workers", "0", "--log-every", "1"]  # fmt: skip
    if columns[0] == "--columns":
        flags += ["--text-model", "scratch", "--max-length", "6"]
    if columns[0] != "--columns" or columns == IMAGE_TEXT[:2]:  # an image tower: the mlp
        flags += ["--model", "mlp", "--image-size", "8"]
    result = train_pooled(processes, *flags, "--output-dir", str(tmp_path / "run"), check=False)
    print(one_line_errors(result, expected, processes)[0])
    skipped = train_pooled(processes, *flags, "--skip-bad-rows", "--output-dir",
                           str(tmp_path / "skipped"))  # fmt: skip
    warnings = [line for line in skipped.stdout.splitlines() if "(--skip-bad-rows)" in line]
    assert warnings and all(expected in line for line in warnings)
    records = [json.loads(line) for line in (tmp_path / "skipped" / "metrics.jsonl").open()]
    counted = [record["skipped_samples"] for record in records if "skipped_samples" in record]
    assert counted[-1] == len(warnings)  # said by the rank that drew it, counted on all
    print(f"{case}, {processes} process(es): {len(warnings)} row(s) skipped, said and counted")


def test_tar_members_are_named_and_decoded_as_webdataset_does(tmp_path):
    """webdataset's rules on shards its own TarWriter wrote: a sample's key ends at the
    first dot of the member's name, the column is the rest (lower-cased), and the last
    extension decides the type. ``seg.png`` is an image, ``b.txt`` and the ``y.txt`` of
    a key ``x.y`` are texts (they were raw bytes here, so such a column could not train).
    Every column of every sample is compared with ``WebDataset(...).decode("pil")``."""
    import numpy as np
    import webdataset
    from PIL import Image

    from contrastive_accelerate.data.streams import read_shard

    def png(seed: int) -> bytes:
        pixels = np.random.default_rng(seed).integers(0, 256, (6, 6, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="png")
        return buffer.getvalue()

    path = str(tmp_path / "shard-00000.tar")
    with webdataset.TarWriter(path) as writer:
        writer.write({"__key__": "a", "jpg": png(0), "seg.png": png(1), "txt": "a digit",
                      "b.txt": "a second caption", "meta.json": {"k": [1, 2]}, "cls": 3,
                      "mask.cls2": 7})  # fmt: skip
        writer.write({"__key__": "x.y", "txt": "the key has a dot", "PNG": png(2)})
        writer.write({"__key__": "sub/c", "Caption.TXT": "upper case", "inx": 4})
    ours = list(read_shard(path, "tar"))
    theirs = list(webdataset.WebDataset(path, shardshuffle=False).decode("pil"))
    assert len(ours) == len(theirs) == 3
    for row, sample in zip(ours, theirs, strict=True):
        columns = {key: value for key, value in sample.items() if not key.startswith("__")}
        assert set(columns) <= set(row), (sorted(columns), sorted(row))
        for column, value in columns.items():
            if isinstance(value, Image.Image):  # ours stays bytes until the sample is used
                decoded = Image.open(io.BytesIO(row[column]["bytes"])).convert("RGB")
                assert np.array_equal(np.asarray(decoded), np.asarray(value)), column
            else:
                assert row[column] == value, column
    assert {"seg.png", "b.txt", "mask.cls2"} <= set(ours[0]) and "y.txt" in ours[1]
    # The control: undecoded, as these columns were here, they differ from webdataset's.
    raw = next(iter(webdataset.WebDataset(path, shardshuffle=False)))
    assert raw["b.txt"] != theirs[0]["b.txt"] and raw["mask.cls2"] != theirs[0]["mask.cls2"]


def test_a_stream_evaluates_on_eval_dataset_alike_on_any_number_of_processes(
    image_folder, tmp_path
):
    """SimCLR on tar shards of digits, evaluated on a labelled table (``--eval-dataset``):
    the kNN and probe figures are the same on 1 and 2 processes; without it a stream
    has no evaluation (the control: the figures come from the option)."""
    shards = make_digit_tar_shards(tmp_path / "tar", TAR_SHARDS)
    flags = ["--method", "simclr", "--streaming", "--dataset", str(shards), "--shuffle-buffer",
             "4", "--model", "mlp", "--image-size", "8", "--dtype", "float64", "--batch-size",
             "6", "--max-steps", "3", "--num-workers", "0", "--knn-k", "3"]  # fmt: skip

    def figures(processes: int, *extra: str) -> dict[str, float]:
        out = tmp_path / f"run-{processes}-{len(extra)}"
        train_pooled(processes, *flags, *extra, "--output-dir", str(out))
        records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
        return {key: value for record in records for key, value in record.items()
                if "top1" in key}  # fmt: skip

    evaluated = [figures(processes, "--eval-dataset", image_folder) for processes in (1, 2)]
    print(f"--eval-dataset on a stream, 1 and 2 processes: {evaluated}")
    assert {"knn_top1", "linear_probe_top1", "raw_pixels_knn_top1"} <= set(evaluated[0])
    assert evaluated[0] == evaluated[1]
    assert figures(1) == {}


def test_image_text_on_a_stream_retrieves_and_classifies_eval_dataset_alike(tmp_path):
    """Image-text on tar shards of captioned digits (``png``, ``txt``), evaluated on a
    table of other digits with the same columns (``--eval-dataset``): retrieval both
    ways, zero-shot and kNN read its evaluation split, and give the same figures on 1 and
    2 processes; without it (the control) a stream has no figures."""
    shards = make_digit_tar_shards(tmp_path / "tar", TAR_SHARDS)
    held = make_captioned_digits(tmp_path / "held", 40, start=100)
    flags = ["--streaming", "--dataset", str(shards), "--columns", "png,txt", "--shuffle-buffer",
             "4", "--model", "mlp", "--text-model", "scratch", "--image-size", "8",
             "--max-length", "8", "--dtype", "float64", "--batch-size", "6", "--max-steps", "3",
             "--num-workers", "0", "--knn-k", "3", "--no-linear-probe"]  # fmt: skip

    def figures(processes: int, *extra: str) -> dict[str, float]:
        out = tmp_path / f"run-{processes}-{len(extra)}"
        train_pooled(processes, *flags, *extra, "--output-dir", str(out))
        records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
        return {key: value for record in records for key, value in record.items()
                if "top1" in key or "recall" in key}  # fmt: skip

    evaluated = [figures(processes, "--eval-dataset", str(held), "--zero-shot-template",
                         "the digit {}") for processes in (1, 2)]  # fmt: skip
    print(f"image-text on a stream, --eval-dataset, 1 and 2 processes: {evaluated}")
    assert {"knn_top1", "zero_shot_top1", "image_to_text_recall@1",
            "text_to_image_recall@1"} <= set(evaluated[0])  # fmt: skip
    assert evaluated[0] == evaluated[1]
    assert figures(1) == {}


def test_an_image_method_streams_parquet_shards_of_image_bytes_alike(tmp_path):
    """SimCLR on a folder of parquet shards whose image column holds PNG bytes (as
    ``datasets`` writes images): 1 and 2 processes train the same model."""
    root = tmp_path / "parquet"
    for number, start in enumerate((0, 9, 20)):
        make_digit_parquet(root / f"part-{number:05d}.parquet", 7 + number, start=start)
    flags = ["--method", "simclr", "--streaming", "--dataset", str(root), "--shuffle-buffer",
             "4", "--model", "mlp", "--dropout", "0.1", "--image-size", "8", "--dtype",
             "float64", "--batch-size", "6", "--max-steps", "4", "--num-workers", "0",
             "--knn-k", "0"]  # fmt: skip
    runs = [tmp_path / f"run-{processes}" for processes in (1, 2)]
    for processes, out in zip((1, 2), runs, strict=True):
        train_pooled(processes, *flags, "--output-dir", str(out))
    error = final_files_difference(*runs)
    print(f"simclr on parquet shards of image bytes, 1 vs 2 processes: {error:.1e}")
    assert error <= EXACT
