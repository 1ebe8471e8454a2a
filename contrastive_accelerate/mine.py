"""Hard negatives mined over any number of processes: sentence-transformers'
``mine_hard_negatives`` (its options, filters and output), sharded and exact.

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --main_process_port 0 \\
        -m contrastive_accelerate.mine --model path/to/sentence-transformer \\
        --dataset pairs.jsonl --output mined.jsonl --output-format n-tuple \\
        --num-negatives 3 --relative-margin 0.05
    python trainer.py --method pairs --text-model path/to/sentence-transformer \\
        --dataset mined.jsonl --columns anchor,positive,negative_1,negative_2,negative_3

What is mined (sentence-transformers 5's semantics): the queries are the dataset's
distinct anchors, each with its distinct positives; the corpus is ``--corpus``'s texts
then the positives, without duplicates. Texts are embedded with the model's prompts and
compared by cosine similarity. A query's candidates are its ``range_max +
max_positives`` most similar corpus texts; its own positives, the candidates within the
margins of its hardest positive and those outside ``--min-score``/``--max-score`` are
dropped; of the rest, ranks ``range_min`` to ``range_max`` form the window its
``--num-negatives`` come from (the first ones, or a sample keyed by ``--seed`` and the
query). A triplet row is dropped where a negative is missing, an n-tuple row unless all
are there.

How it is sharded: the texts are embedded in batches of ``--batch-size`` in order of
decreasing length, as sentence-transformers' ``encode`` batches them, batch b on rank b
mod N, so each text is embedded in the same batch on any number of processes. Each rank
keeps its batches of the corpus; the queries go to every rank. Each rank scores the
queries against its share in blocks of ``--chunk-size`` queries by ``--chunk-size``
corpus texts (no larger score matrix), keeping each query's best; the ranks' best are
gathered and merged by score, ties to the lower corpus row. So the output does not
depend on the number of processes. Rank 0 writes it, whole or not at all.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from contrastive_accelerate.collectives import all_gather_rows, rank_and_world_size
from contrastive_accelerate.config import option, parse_args, validate
from contrastive_accelerate.durable_files import error_reason, fsync_directory, fsync_file
from contrastive_accelerate.launch import make_accelerator, one_line_errors
from contrastive_accelerate.methods.base import DTYPES
from contrastive_accelerate.retrieval import embed_texts

#: What the mined file is written as, by its extension.
OUTPUT_FORMATS = (".jsonl", ".parquet")


class MineError(ValueError):
    """A mining input or option the user must fix: one line on every rank."""


@dataclass
class MineOptions:
    """The options of ``python -m contrastive_accelerate.mine``: sentence-transformers'
    arguments of ``mine_hard_negatives``, as flags."""

    model: str | None = option(None, "sentence-transformers or transformers folder to embed with")
    dataset: str | None = option(None, "the (anchor, positive) table: a file, folder or hub name")
    output: str | None = option(None, "the mined table to write: a new .jsonl or .parquet file")
    anchor_column: str | None = option(None, "the anchors' column; none: the first")
    positive_column: str | None = option(None, "the positives' column; none: the second")
    corpus: str | None = option(None, "a table of more candidate texts (its --corpus-column)")
    corpus_column: str = option("text", "--corpus: its column of texts")
    range_min: int = option(0, "skip each query's this many most similar candidates", at_least=0)
    range_max: int | None = option(
        None, "look at this many candidates; none: derived as sentence-transformers does",
        at_least=1,
    )  # fmt: skip
    max_score: float | None = option(None, "drop candidates scoring above this")
    min_score: float | None = option(None, "drop candidates scoring below this")
    absolute_margin: float | None = option(
        None, "drop candidates within this of the hardest positive's score"
    )
    relative_margin: float | None = option(
        None, "drop candidates above hardest positive score - |that score| x this"
    )
    num_negatives: int = option(3, "negatives per anchor and positive", at_least=1)
    sampling_strategy: str = option(
        "top", "the window's best, or a sample of it", choices=("top", "random")
    )
    output_format: str = option(
        "triplet", "a row per negative, or one with all", choices=("triplet", "n-tuple")
    )
    output_scores: bool = option(False, "add a scores column: positive's, then negatives'")
    query_prompt: str | None = option(None, "the anchors' prefix; none: the model's query prompt")
    corpus_prompt: str | None = option(None, "the corpus' prefix; none: its document prompt")
    max_length: int | None = option(
        None, "tokens per text; none: the model's max_seq_length", at_least=1
    )
    batch_size: int = option(32, "texts per embedding batch", at_least=1)
    chunk_size: int = option(16384, "queries and corpus texts per score block", at_least=1)
    dtype: str = option("float32", "the model's dtype", choices=DTYPES)
    seed: int = option(0, "--sampling-strategy random: the samples' seed")
    collective_timeout: float = option(600.0, "seconds before a stalled peer is an error",
                                       above=0)  # fmt: skip

    def __post_init__(self) -> None:
        validate(self)


def main(argv: Sequence[str] | None = None) -> None:
    with one_line_errors():
        options = parse_args(MineOptions, argv, __doc__.split("\n")[0])
        check(options)
        output = os.path.abspath(options.output)
        accelerator = make_accelerator(os.path.dirname(output), "none", options.collective_timeout)
        with torch.no_grad():
            rows, summary = mine(options, accelerator.device)
        if accelerator.is_main_process:
            write_table(rows, output)
            print(f"{summary}; wrote {output}", flush=True)
        accelerator.wait_for_everyone()


def check(options: MineOptions) -> None:
    """The options alone, before anything loads: what sentence-transformers checks, and
    an output that is new and writable."""
    for name in ("model", "dataset", "output"):
        if getattr(options, name) is None:
            raise MineError(f"--{name} is required")
    if os.path.splitext(options.output)[1] not in OUTPUT_FORMATS:
        raise MineError(f"--output {options.output!r}: end it in {' or '.join(OUTPUT_FORMATS)}")
    if os.path.exists(options.output):
        raise MineError(f"--output {options.output!r} exists: remove it or name another file")
    parent = os.path.dirname(os.path.abspath(options.output))
    if not os.path.isdir(parent):
        raise MineError(f"--output {options.output!r}: its folder does not exist")
    if options.range_max is not None:
        window_checks(options, options.range_max)


def window_checks(options: MineOptions, range_max: int) -> None:
    if options.range_min >= range_max:
        raise MineError(f"--range-min {options.range_min} must be below --range-max {range_max}")
    if options.num_negatives > range_max - options.range_min:
        raise MineError(
            f"--num-negatives {options.num_negatives}: only {range_max - options.range_min} "
            f"candidates lie between --range-min {options.range_min} and --range-max {range_max}"
        )


@dataclass
class Pairs:
    """The dataset as mining reads it: distinct queries, each with its distinct positives
    (corpus rows, in order of first appearance), and the corpus."""

    anchor_column: str
    positive_column: str
    queries: list[str]
    positives: list[list[int]]
    corpus: list[str]


def read_pairs(options: MineOptions) -> Pairs:
    from contrastive_accelerate.data.sources import load_splits

    table = load_splits(options.dataset, None)["train"]
    columns = table.column_names
    if len(columns) < 2 and not (options.anchor_column and options.positive_column):
        raise MineError(f"--dataset {options.dataset!r}: an anchor and a positive column needed")
    anchor = options.anchor_column or columns[0]
    positive = options.positive_column or columns[1]
    if len(table) == 0:
        raise MineError(f"--dataset {options.dataset!r} has no rows")
    anchors = texts_of(table, anchor, "--dataset")
    positives = texts_of(table, positive, "--dataset")
    corpus = []
    if options.corpus is not None:
        extra = load_splits(options.corpus, None)["train"]
        corpus = texts_of(extra, options.corpus_column, "--corpus")
    corpus = list(dict.fromkeys(corpus + positives))
    row = {text: i for i, text in enumerate(corpus)}
    queries = list(dict.fromkeys(anchors))
    of_query: dict[str, dict[int, None]] = {query: {} for query in queries}
    for query, text in zip(anchors, positives, strict=True):
        of_query[query][row[text]] = None
    return Pairs(anchor, positive, queries, [list(of_query[q]) for q in queries], corpus)


def texts_of(table, column: str, what: str) -> list[str]:
    if column not in table.column_names:
        raise MineError(f"{what}: no column {column!r} (it has {', '.join(table.column_names)})")
    texts = list(table[column])
    bad = next((i for i, text in enumerate(texts) if not isinstance(text, str)), None)
    if bad is not None:
        raise MineError(f"{what}: row {bad} of {column!r} is not a text")
    return texts


def mine(options: MineOptions, device: torch.device) -> tuple[list[dict], str]:
    """The mined rows (the same on every rank) and a one-line summary."""
    from contrastive_accelerate.methods.pairs import check_text_model_limits
    from models.sentence_folder import load_sentence_tower

    pairs = read_pairs(options)
    max_positives = max(len(rows) for rows in pairs.positives)
    range_max = options.range_max or derived_range_max(options, max_positives)
    window_checks(options, range_max)
    tower, tokenizer, folder = load_sentence_tower(options.model, DTYPES[options.dtype], "--model")
    positions = getattr(tower.encoder.config, "max_position_embeddings", None)
    max_length = options.max_length or (folder.max_seq_length if folder else None)
    max_length = max_length or min(filter(None, (positions, tokenizer.model_max_length)))
    check_text_model_limits(tower.encoder, tokenizer, max_length, "--model", options.model)
    tower.to(device)  # after the check's probe, which runs on the CPU
    query_prompt, corpus_prompt = prompts_of(options, folder.prompts if folder else {})

    def embed(texts: list[str]) -> torch.Tensor:
        return embed_texts(tower, tokenizer, texts, max_length, device)

    queries = everywhere(*embedded_share([query_prompt + q for q in pairs.queries], embed,
                                         options.batch_size), len(pairs.queries))  # fmt: skip
    corpus, rows = embedded_share([corpus_prompt + t for t in pairs.corpus], embed,
                                  options.batch_size)  # fmt: skip
    scores, indices = nearest_candidates(queries, corpus, rows, range_max + max_positives,
                                         options.chunk_size)  # fmt: skip
    positive_scores = positives_scored(queries, corpus, rows, pairs.positives)
    return negatives(options, pairs, scores, indices, positive_scores, range_max)


def prompts_of(options: MineOptions, prompts: dict[str, str]) -> tuple[str, str]:
    """The queries' and the corpus' prefixes: the flags', else the model's own, as
    sentence-transformers' ``encode_query`` and ``encode_document`` pick them."""
    query = options.query_prompt
    if query is None:
        query = prompts.get("query", "")
    corpus = options.corpus_prompt
    if corpus is None:
        names = [name for name in ("document", "passage", "corpus") if name in prompts]
        corpus = prompts[names[0]] if names else ""
    return query, corpus


def derived_range_max(options: MineOptions, max_positives: int) -> int:
    """sentence-transformers' default: room for the positives, and ten times the
    negatives where a filter may drop candidates."""
    filtered = any(value is not None for value in (options.absolute_margin,
                   options.relative_margin, options.max_score))  # fmt: skip
    return options.range_min + options.num_negatives * (10 if filtered else 1) + max_positives


def embedded_share(texts: list[str], embed, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of ``texts`` embedded and L2-normalised, in ascending row order,
    with those rows. The rows are batched longest first (stable), batch b on rank b mod
    N: a text meets the same batch on any number of processes."""
    rank, world_size = rank_and_world_size()
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    own = batches[rank::world_size]
    parts = [torch.nn.functional.normalize(embed([texts[i] for i in batch]), dim=1)
             for batch in own]  # fmt: skip
    embeddings = torch.cat(parts) if parts else embed([])  # no batch here: (0, width)
    rows = torch.tensor([i for batch in own for i in batch], dtype=torch.int64)
    ascending = rows.argsort()
    return embeddings[ascending], rows[ascending].to(embeddings.device)


def everywhere(share: torch.Tensor, rows: torch.Tensor, count: int) -> torch.Tensor:
    """Every rank's ``embedded_share`` (``share``, its ``rows``) of ``count`` rows, whole
    and in row order, on every rank."""
    if rank_and_world_size()[1] == 1:
        return share
    whole = share.new_empty((count, share.shape[1]))
    whole[all_gather_rows(rows)] = all_gather_rows(share)
    return whole


def nearest_candidates(
    queries: torch.Tensor, corpus: torch.Tensor, rows: torch.Tensor, k: int, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's ``k`` highest cosine scores over every rank's share of the corpus
    (``corpus``: this rank's unit rows, ``rows`` their corpus rows, ascending), and their
    rows, best first, ties to the lower row: ``top_candidates`` in blocks of
    ``chunk_size`` queries, merged over the ranks. Call it on every rank."""
    best = [merged(*top_candidates(queries[i : i + chunk_size], corpus, rows, k, chunk_size), k)
            for i in range(0, len(queries), chunk_size)]  # fmt: skip
    if not best:
        return queries.new_empty((0, k)), rows.new_empty((0, k))
    return torch.cat([scores for scores, _ in best]), torch.cat([found for _, found in best])


def top_candidates(
    queries: torch.Tensor, corpus: torch.Tensor, rows: torch.Tensor, k: int, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's ``k`` highest scores against ``corpus`` (unit rows, in ascending order
    of their corpus ``rows``) and those rows, best first, ties to the lower row; missing
    places score -inf with row -1. Scored ``chunk_size`` corpus rows at a time: no
    matrix larger than ``len(queries)`` by ``chunk_size + k``."""
    best = queries.new_full((len(queries), k), -math.inf)
    best_rows = rows.new_full((len(queries), k), -1)
    for start in range(0, len(corpus), chunk_size):
        block = queries @ corpus[start : start + chunk_size].T
        block_rows = rows[start : start + chunk_size].expand(len(queries), -1)
        # Stable: the kept best (lower rows, earlier blocks) stay before equal new scores.
        order = torch.cat([best, block], dim=1).sort(dim=1, descending=True, stable=True)
        best = order.values[:, :k]
        best_rows = torch.cat([best_rows, block_rows], dim=1).gather(1, order.indices[:, :k])
    return best, best_rows


def merged(scores: torch.Tensor, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's ``top_candidates`` of the same queries as one: the ``k`` best of all,
    by score, ties to the lower row (missing places, -inf and row -1, last)."""
    if rank_and_world_size()[1] == 1:
        return scores, rows
    gathered = [all_gather_rows(t).reshape(-1, *t.shape).transpose(0, 1).flatten(1)
                for t in (scores, rows)]  # fmt: skip
    scores, rows = gathered
    by_row = torch.where(rows < 0, torch.iinfo(torch.int64).max, rows).sort(dim=1, stable=True)
    scores, rows = scores.gather(1, by_row.indices), rows.gather(1, by_row.indices)
    order = scores.sort(dim=1, descending=True, stable=True).indices[:, :k]
    return scores.gather(1, order), rows.gather(1, order)


def positives_scored(
    queries: torch.Tensor, corpus: torch.Tensor, rows: torch.Tensor, positives: list[list[int]]
) -> torch.Tensor:
    """Each (query, positive) pair's score, in the pairs' order: each rank scores the
    positives it holds, and a sum (of one score and zeros) gives them to every rank."""
    query = torch.tensor([q for q, own in enumerate(positives) for _ in own], dtype=torch.int64)
    row = torch.tensor([r for own in positives for r in own], dtype=torch.int64)
    place = torch.searchsorted(rows.cpu(), row).clamp(max=max(len(rows) - 1, 0))
    held = (rows.cpu()[place] == row) if len(rows) else torch.zeros(len(row), dtype=torch.bool)
    scores = queries.new_zeros(len(row))
    scores[held] = (queries[query[held]] * corpus[place[held]]).sum(dim=1)
    if rank_and_world_size()[1] > 1:
        dist.all_reduce(scores)
    return scores


def negatives(
    options: MineOptions,
    pairs: Pairs,
    scores: torch.Tensor,
    indices: torch.Tensor,
    positive_scores: torch.Tensor,
    range_max: int,
) -> tuple[list[dict], str]:
    """sentence-transformers' selection from each query's candidates, and its rows."""
    counts = [len(own) for own in pairs.positives]
    scores = scores.clone()
    for q, own in enumerate(pairs.positives):  # a query's own positives are no negatives
        scores[q, torch.isin(indices[q], torch.tensor(own, device=indices.device))] = -math.inf
    # The margins count from each query's hardest positive (its lowest score).
    hardest = torch.stack([part.min() for part in positive_scores.split(counts)])
    skipped = {}
    drops = {
        "absolute_margin": lambda m: scores + m > hardest[:, None],
        "relative_margin": lambda m: scores > (hardest - hardest.abs() * m)[:, None],
        "max_score": lambda m: scores > m,
        "min_score": lambda m: scores < m,
    }
    for name, dropped in drops.items():
        if (value := getattr(options, name)) is not None:
            mask = dropped(value) & (scores > -math.inf)
            skipped[name] = int(mask.sum())
            scores[mask] = -math.inf
    order = scores.sort(dim=1, descending=True, stable=True).indices[:, :range_max]
    scores, indices = scores.gather(1, order), indices.gather(1, order)
    scores, indices = scores[:, options.range_min :], indices[:, options.range_min :]
    n = options.num_negatives
    if options.sampling_strategy == "top":
        scores, indices = scores[:, :n], indices[:, :n]
    else:
        finite = (scores > -math.inf).sum(dim=1).clamp(min=n).tolist()
        picks = torch.tensor([sorted(random.Random(options.seed * 2**32 + q).sample(range(m), n))
                              for q, m in enumerate(finite)], dtype=torch.int64)  # fmt: skip
        picks = picks.reshape(len(finite), n).to(scores.device)
        scores, indices = scores.gather(1, picks), indices.gather(1, picks)
    rows = table_rows(options, pairs, scores, indices, positive_scores)
    return rows, summary(pairs, scores, skipped)


def table_rows(options, pairs: Pairs, scores, indices, positive_scores) -> list[dict]:
    anchor, positive = pairs.anchor_column, pairs.positive_column
    rows, pair = [], 0
    for q, own in enumerate(pairs.positives):
        found = [(pairs.corpus[i], s) for i, s in zip(indices[q].tolist(), scores[q].tolist(),
                                                      strict=True) if s > -math.inf]  # fmt: skip
        for p in own:
            base = {anchor: pairs.queries[q], positive: pairs.corpus[p]}
            score = positive_scores[pair].item()
            pair += 1
            if options.output_format == "triplet":
                rows += [{**base, "negative": text, **({"scores": [score, s]}
                          if options.output_scores else {})} for text, s in found]  # fmt: skip
            elif len(found) == options.num_negatives:
                row = {**base, **{f"negative_{j}": t for j, (t, _) in enumerate(found, start=1)}}
                if options.output_scores:
                    row["scores"] = [score, *(s for _, s in found)]
                rows.append(row)
    return rows


def summary(pairs: Pairs, scores: torch.Tensor, skipped: dict[str, int]) -> str:
    found = int((scores > -math.inf).sum())
    wanted = scores.numel()
    dropped = "".join(f", {count} dropped by --{name.replace('_', '-')}"
                      for name, count in skipped.items())  # fmt: skip
    return (f"mined {found} of {wanted} negatives for {len(pairs.queries)} queries over a "
            f"corpus of {len(pairs.corpus)}{dropped}")  # fmt: skip


def write_table(rows: list[dict], path: str) -> None:
    """``rows`` as JSON lines or parquet, in a temporary file renamed into place."""
    partial = f"{path}.partial"
    try:
        _write(rows, partial, parquet=path.endswith(".parquet"))
        fsync_file(partial)
        os.replace(partial, path)
        fsync_directory(os.path.dirname(path))
    except OSError as error:
        raise MineError(f"--output {path!r}: cannot write it ({error_reason(error)})") from None
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def _write(rows: list[dict], path: str, parquet: bool) -> None:
    if parquet:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        with open(path, "w") as file:
            file.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


if __name__ == "__main__":
    main(sys.argv[1:])
