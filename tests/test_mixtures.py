"""Mixtures (several ``--dataset``, ``contrastive_accelerate.data.mixture``): every global
batch from one source on every rank, sources in proportion to their weights, the same
model on 1, 2 and 3 processes, and an exact resume that knows which source is next.

The sources are text pairs of different columns and sizes: 17 rows with a hard
negative, 11 without, and jsonl shards (7, 5, 9 rows) read as a stream.
"""

from __future__ import annotations

import json
from typing import NamedTuple

import pytest
import torch

from contrastive_accelerate.data.loader import as_built
from contrastive_accelerate.data.mixture import Mixture, MixtureBatches
from contrastive_accelerate.data.pairs import load_mixture
from contrastive_accelerate.data.sources import DataError
from contrastive_accelerate.data.streams import find_shards

from launch import (
    TrainerRuns,
    final_files_difference,
    make_sentence_pairs,
    make_text_pair_shards,
    one_line_errors,
    resumed_differences,
    train_pooled,
)

pytest.importorskip("transformers")
EXACT = 1e-9  # float64: only the summation order differs between the world sizes
COMMON = ["--columns", "anchor,positive,negative_1", "--columns", "anchor,positive", "--dtype",
          "float64", "--batch-size", "6", "--lr", "1e-3", "--max-length", "8", "--log-every",
          "1", "--max-steps", "10"]  # fmt: skip


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sources")
    return {
        "negatives": str(make_sentence_pairs(root / "negatives.jsonl", 17, negatives=1, seed=5)),
        "plain": str(make_sentence_pairs(root / "plain.jsonl", 11, negatives=0, seed=6)),
        "shards": str(make_text_pair_shards(root / "shards", [7, 5, 9])),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sources, tiny_bert):
    tables = ["--dataset", sources["negatives"], "--dataset", sources["plain"]]
    streamed = ["--streaming", "--dataset", sources["shards"], "--dataset", sources["plain"],
                "--mixture-weights", "2,1", "--shuffle-buffer", "4"]  # fmt: skip
    return {
        "tables": TrainerRuns(tmp_path_factory, *tables, "--text-model", tiny_bert, *COMMON),
        "stream+table": TrainerRuns(tmp_path_factory, *streamed, "--text-model", tiny_bert,
                                    *COMMON),
    }  # fmt: skip


# The schedule, without a model: what each rank's loader yields.


class Rows(NamedTuple):
    ids: list[tuple[str, int, int]]
    unreadable: list


class TableRows(torch.utils.data.Dataset):
    """A toy method's dataset over a table: each item its source, epoch and row."""

    def __init__(self, name: str, rows: int) -> None:
        self.name, self.rows = name, rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, item: tuple[int, int]) -> tuple[str, int, int]:
        return (self.name, *item)

    def collate(self, items: list) -> Rows:
        return Rows(items, [])


class StreamRows(TableRows):
    """The same over a stream (``dataset``: its ``ShardStreams``)."""

    def __init__(self, name: str, source) -> None:
        self.name, self.dataset = name, source

    def item(self, row: dict, epoch: int, index: int) -> tuple[str, int, int]:
        return (self.name, epoch, index)

    def problem(self, row: dict) -> None:
        return None


def toy_mixture(shards: str) -> Mixture:
    stream = StreamRows("stream", find_shards(shards, 3, 4))
    return Mixture([TableRows("big", 17), TableRows("small", 11), stream],
                   ["big", "small", "stream"], [3.0, 1.0, 2.0])  # fmt: skip


def global_batches(mixture: Mixture, world_size: int, steps: int, first: int = 0, **options):
    """Every rank's share of steps ``first ..`` (lists in rank order) per step."""
    shares = []
    for rank in range(world_size):
        batches = MixtureBatches(mixture, 6, seed=1, rank=rank, world_size=world_size, **options)
        batches.set_epoch(0, first)
        loader = torch.utils.data.DataLoader(batches, batch_size=None, collate_fn=as_built)
        shares.append([batch.ids for batch, _ in zip(loader, range(steps), strict=False)])
    return [[share[step] for share in shares] for step in range(steps)]


def test_every_global_batch_comes_from_one_source_the_same_on_any_number_of_processes(sources):
    """60 steps of two tables and a stream, weights 3:1:2: on 3 ranks every step's rows come
    from one source (read from what each rank's loader yields), and the ranks' shares in
    order are 1 rank's batch; a loader started at step 37 on 2 ranks continues it."""
    mixture = toy_mixture(sources["shards"])
    reference = [shares[0] for shares in global_batches(mixture, 1, 60)]
    per_rank = global_batches(mixture, 3, 60)
    assert all(len({row[0] for share in shares for row in share}) == 1 for shares in per_rank)
    assert [sum(shares, []) for shares in per_rank] == reference
    resumed = global_batches(mixture, 2, 23, first=37)
    assert [sum(shares, []) for shares in resumed] == reference[37:]
    drawn = {name: sum(batch[0][0] == name for batch in reference) for name in mixture.names}
    print(f"60 steps of a 3:1:2 mixture: {drawn}, each global batch from one source")
    assert all(drawn.values())


def test_the_sources_follow_their_weights(sources):
    """Over 6000 steps each source's share of the steps is its weight's within 0.02
    (binomial standard deviations: at most 0.0065, so 3 of them)."""
    mixture, steps = toy_mixture(sources["shards"]), 6000
    counts = mixture.steps_per_source(steps, seed=1)
    shares = [count / steps for count in counts]
    expected = [weight / sum(mixture.weights) for weight in mixture.weights]
    print(f"shares of 6000 steps: {[f'{s:.3f}' for s in shares]}, weights {expected}")
    assert all(abs(share - want) <= 0.02 for share, want in zip(shares, expected, strict=True))
    round_robin = Mixture(mixture.datasets, mixture.names, None)
    assert round_robin.steps_per_source(6000, seed=1) == [2000, 2000, 2000]


def test_control_a_source_drawn_per_rank_mixes_sources_in_a_global_batch(sources):
    per_rank = global_batches(toy_mixture(sources["shards"]), 3, 60, per_rank_choice=True)
    mixed = sum(len({row[0] for share in shares for row in share}) > 1 for shares in per_rank)
    print(f"sources drawn per rank: {mixed} of 60 global batches mix sources")
    assert mixed > 10


# Training: float64, 1 vs 2 vs 3 processes.


@pytest.mark.parametrize(
    "mixture, processes, workers",
    [("tables", 2, 0), ("tables", 3, 2), ("stream+table", 2, 2), ("stream+table", 3, 0)],
)
def test_one_process_and_n_processes_train_the_same_model_from_a_mixture(
    runs, mixture, processes, workers
):
    reference = runs[mixture](1, "--num-workers", "0")
    error = final_files_difference(
        reference, runs[mixture](processes, "--num-workers", str(workers))
    )
    print(f"mixture of {mixture}, 1 process vs {processes} with {workers} workers: {error:.1e}")
    assert error <= EXACT


def test_the_log_counts_the_steps_of_each_source(runs, sources):
    records = [json.loads(line) for line in (runs["tables"](1, "--num-workers", "0") /
                                             "metrics.jsonl").open()]  # fmt: skip
    last = next(record for record in reversed(records) if "loss" in record)
    counts = {key: value for key, value in last.items() if key.startswith("steps/")}
    # Proportional to the rows (17 and 11), drawn from (seed 0, step): recomputed here.
    mixture = Mixture([TableRows("negatives", 17), TableRows("plain", 11)],
                      ["negatives.jsonl", "plain.jsonl"], [17.0, 11.0])  # fmt: skip
    expected = dict(zip(("steps/negatives.jsonl", "steps/plain.jsonl"),
                        mixture.steps_per_source(10, seed=0), strict=True))  # fmt: skip
    print(f"metrics.jsonl at step 10: {counts}")
    assert counts == expected and all(counts.values())


def test_a_mixture_resumes_where_the_straight_run_goes_on(runs, tmp_path):
    """At step 5 of 10 on 1 process: 0.0 from the straight run; a 2-process checkpoint
    resumed on 3 processes (2 workers), within float64 summation order of it."""
    same, error = resumed_differences(runs["stream+table"], 5, tmp_path, workers=(0, 2))
    print(f"mixture resumed at step 5 of 10: 1 -> 1 process {same:.1e}, 2 -> 3 processes "
          f"{error:.1e}")  # fmt: skip
    assert same == 0.0
    assert error <= EXACT


def test_a_streamed_source_without_weights_is_one_line(sources, tiny_bert, tmp_path):
    result = train_pooled(1, "--streaming", "--dataset", sources["shards"], "--dataset",
                          sources["plain"], "--text-model", tiny_bert, *COMMON, "--output-dir",
                          str(tmp_path / "run"), check=False)  # fmt: skip
    one_line_errors(result, "a mixture with a streamed source needs --mixture-weights", 1)
    assert not (tmp_path / "run" / "final").exists()


def test_weights_that_overflow_are_refused_on_every_rank_before_a_step(sources, tmp_path):
    """Two finite weights whose sum is infinite passed the check and failed at step 1 in a
    loader worker, with its traceback in the error line: now every rank refuses them."""
    result = train_pooled(2, "--dataset", sources["plain"], "--dataset", sources["plain"],
                          "--mixture-weights", "1e308,1e308", "--text-model", "scratch",
                          *COMMON, "--output-dir", str(tmp_path / "run"), check=False)  # fmt: skip
    one_line_errors(result, "--mixture-weights 1e308,1e308: 2 positive finite numbers", 2)


@pytest.mark.parametrize("contents", ["", "\n\n"])
def test_an_empty_source_is_named_on_every_rank(sources, tmp_path, contents):
    """An empty data file among the sources was ``cannot load dataset ...: StopIteration``
    (``datasets``' own error, with no message)."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text(contents)
    result = train_pooled(2, "--dataset", sources["negatives"], "--dataset", str(empty),
                          "--text-model", "scratch", *COMMON, "--output-dir",
                          str(tmp_path / "run"), check=False)  # fmt: skip
    one_line_errors(result, f"dataset file {str(empty)!r} is empty", 2)


def test_a_mixture_of_text_pairs_and_image_text_is_refused(sentence_pairs, captioned_images):
    """Every source of a mixture is of one kind: the loss and the towers are one."""
    with pytest.raises(DataError, match="a mixture is all text pairs or all image-text: "
                                        f"--dataset '{captioned_images}' has images"):  # fmt: skip
        load_mixture(
            (sentence_pairs, captioned_images), [("anchor", "positive"), ("image", "caption")],
            streaming=False, streams=None, shuffle_buffer=4, mixture="round-robin",
            weights=None, temperature=1.0,
        )  # fmt: skip
