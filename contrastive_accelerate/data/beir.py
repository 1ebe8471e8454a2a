"""A retrieval benchmark in BEIR's format: ``corpus.jsonl`` (``_id``, ``title``,
``text``), ``queries.jsonl`` (``_id``, ``text``) and ``qrels/<split>.tsv`` (a header,
then ``query-id``, ``corpus-id``, ``score`` per line), read as JSON and text only."""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass

from contrastive_accelerate.data import DataError
from contrastive_accelerate.untrusted import parse_json


@dataclass
class Beir:
    """The queries that have a relevant document, the corpus in ascending id order (the
    peer's tie-break), and each query's relevant corpus rows."""

    queries: list[str]
    corpus: list[str]
    relevant: list[set[int]]


def load_beir(directory: str, split: str = "test") -> Beir:
    """``directory``'s corpus, queries and ``qrels/<split>.tsv`` (relevance > 0 counts);
    a missing file, a row without its fields or a judgement naming no row is one line."""

    def rows(name: str) -> dict[str, dict]:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise DataError(f"--eval-beir {directory!r}: no {name}")
        found = {}
        with open(path, encoding="utf-8") as file:
            for number, line in enumerate(file, start=1):
                if not line.strip():
                    continue
                try:
                    row = parse_json(line)
                    found[str(row["_id"])] = row
                except (ValueError, KeyError, TypeError):
                    raise DataError(f"{path}:{number}: not a JSON object with an _id") from None
        return found

    corpus, queries = rows("corpus.jsonl"), rows("queries.jsonl")
    qrels = os.path.join(directory, "qrels", f"{split}.tsv")
    if not os.path.isfile(qrels):
        raise DataError(f"--eval-beir {directory!r}: no qrels/{split}.tsv")
    corpus_ids = sorted(corpus)
    row_of = {corpus_id: row for row, corpus_id in enumerate(corpus_ids)}
    judged: dict[str, set[int]] = {}
    with open(qrels, encoding="utf-8", newline="") as file:
        for number, fields in enumerate(csv.reader(file, delimiter="\t"), start=1):
            if number == 1 and fields[:1] == ["query-id"]:
                continue
            try:
                query_id, corpus_id, score = fields[0], fields[1], float(fields[2])
            except (IndexError, ValueError):
                raise DataError(f"{qrels}:{number}: query-id, corpus-id, score expected") from None
            if query_id not in queries or corpus_id not in row_of:
                raise DataError(f"{qrels}:{number}: {query_id!r} or {corpus_id!r} is in no file")
            if score > 0:
                judged.setdefault(query_id, set()).add(row_of[corpus_id])
    ids = sorted(judged)
    if not ids:
        raise DataError(f"{qrels}: no query has a relevant document")

    def text(row: dict) -> str:
        return f"{row.get('title') or ''} {row.get('text') or ''}".strip()

    return Beir([str(queries[i].get("text") or "") for i in ids],
                [text(corpus[i]) for i in corpus_ids], [judged[i] for i in ids])  # fmt: skip
