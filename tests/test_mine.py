"""Hard-negative mining (``python -m contrastive_accelerate.mine``): sentence-transformers'
``mine_hard_negatives``, over any number of processes.

- Parity: on a test-made sentence-transformers folder (mean pooling, a Dense layer,
  Normalize, a "query: " prompt), a corpus beside the positives and an anchor with two
  positives, our triplets and n-tuples are sentence-transformers', text for text, with
  its scores (float64; the embeddings differ only by batch padding's rounding). The
  control: without the model's query prompt, other negatives.
- 1 and 3 processes write the same file, byte for byte (random sampling, the margins,
  score blocks smaller than a rank's share, an uneven last embedding batch). The
  control: a rank's own candidates, unmerged, are not the whole corpus's.
- Memory: on a corpus 50 times the chunk size, no tensor of the search exceeds chunk x
  (chunk + k) elements, where one block makes the whole query x corpus matrix.
- The mined file trains (``--columns anchor,positive,negative_1,negative_2``); bad input
  is one line.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

from contrastive_accelerate.mine import nearest_candidates

from launch import make_sentence_pairs, make_sentence_transformer, one_line_errors, train_pooled

pytest.importorskip("sentence_transformers")
MINE = "contrastive_accelerate.mine"
#: float64 scores computed by both from the same weights; only the padding of the
#: embedding batches (their lengths) and the summation order differ.
SCORES = 1e-12
FILTERS = ["--range-min", "1", "--relative-margin", "0.05", "--max-score", "0.95",
           "--num-negatives", "2", "--dtype", "float64"]  # fmt: skip


@pytest.fixture(scope="module")
def mined(tmp_path_factory):
    """The folder, the pairs (40 rows and a second positive for the first anchor) and a
    corpus of 30 more texts."""
    root = tmp_path_factory.mktemp("mine")
    folder = make_sentence_transformer(root, pooling="mean", activation="identity")
    rows = [json.loads(line) for line in open(make_sentence_pairs(root / "p.jsonl", 40, 0, 3))]
    rows.append({"anchor": rows[0]["anchor"], "positive": rows[5]["positive"]})
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    extra = [json.loads(line)["anchor"] for line in open(make_sentence_pairs(root / "c", 30))]
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in extra))
    return {"folder": str(folder), "pairs": str(pairs), "corpus": str(corpus), "rows": rows,
            "extra": extra, "root": root}  # fmt: skip


def run_mine(mined, output, processes: int = 1, *flags: str, check: bool = True):
    return train_pooled(
        processes, "--model", mined["folder"], "--dataset", mined["pairs"], "--corpus",
        mined["corpus"], "--output", str(output), *flags, command=MINE, check=check,
    )  # fmt: skip


def read_rows(path) -> list[dict]:
    import datasets

    if str(path).endswith(".parquet"):
        return datasets.Dataset.from_parquet(str(path)).to_list()
    return [json.loads(line) for line in open(path)]


@pytest.mark.parametrize("output_format", ["triplet", "n-tuple"])
def test_the_negatives_are_sentence_transformers_own(mined, output_format, tmp_path):
    import datasets
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util import mine_hard_negatives

    model = SentenceTransformer(mined["folder"], device="cpu").double()
    theirs = mine_hard_negatives(
        datasets.Dataset.from_list(mined["rows"]), model, corpus=mined["extra"], range_min=1,
        relative_margin=0.05, max_score=0.95, num_negatives=2, output_format=output_format,
        output_scores=True, verbose=False,
    ).to_list()  # fmt: skip
    flags = [*FILTERS, "--output-format", output_format, "--output-scores"]
    run_mine(mined, tmp_path / "ours.parquet", 1, *flags)
    run_mine(mined, tmp_path / "unprompted.jsonl", 1, *flags, "--query-prompt", "")
    ours, unprompted = (
        read_rows(tmp_path / "ours.parquet"),
        read_rows(tmp_path / "unprompted.jsonl"),
    )

    def texts(rows):
        return [{key: value for key, value in row.items() if key != "scores"} for row in rows]

    difference = max(abs(a - b) for mine, peer in zip(ours, theirs, strict=True)
                     for a, b in zip(mine["scores"], peer["scores"], strict=True))  # fmt: skip
    print(f"{output_format}: {len(ours)} rows, as theirs ({len(theirs)}); scores {difference:.1e}")
    assert texts(ours) == texts(theirs) and len(ours) >= 5 and difference <= SCORES
    assert texts(unprompted) != texts(theirs)  # the control: the texts embedded otherwise


@pytest.mark.parametrize("batch_size", [4, 32], ids=["batches-of-4", "an-idle-rank"])
def test_one_and_three_processes_write_the_same_file(mined, tmp_path, batch_size):
    """Embedding batches of 4, or of 32: then the 40 queries are 2 batches, and the third
    rank embeds none."""
    flags = [*FILTERS, "--sampling-strategy", "random", "--seed", "5", "--output-format",
             "n-tuple", "--batch-size", str(batch_size), "--chunk-size", "6"]  # fmt: skip
    outputs = [tmp_path / f"on{processes}.jsonl" for processes in (1, 3)]
    for processes, output in zip((1, 3), outputs, strict=True):
        result = run_mine(mined, output, processes, *flags)
    one, three = (output.read_bytes() for output in outputs)
    print(f"batches of {batch_size}, 1 vs 3 processes: {len(one.splitlines())} rows, "
          f"equal {one == three}")  # fmt: skip
    print(result.stdout.strip().splitlines()[-1])
    assert one == three and len(one.splitlines()) >= 5


def random_unit_rows(count: int, width: int = 8, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(count, width, generator=generator,
                                                     dtype=torch.float64), dim=1)  # fmt: skip


class LargestTensor(TorchFunctionMode):
    """The most elements of any tensor a torch function returns inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for value in result if isinstance(result, tuple) else (result,):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return result


def test_the_search_holds_no_score_matrix_larger_than_a_block(capsys):
    chunk, k = 8, 4
    queries, corpus = random_unit_rows(3 * chunk), random_unit_rows(50 * chunk, seed=1)
    rows = torch.arange(len(corpus))
    found, largest = {}, {}
    for name, size in (("chunked", chunk), ("one block", len(corpus))):
        with LargestTensor() as recorder:
            found[name] = nearest_candidates(queries, corpus, rows, k, size)
        largest[name] = recorder.largest
    dense = (queries @ corpus.T).sort(dim=1, descending=True, stable=True)
    share = nearest_candidates(queries, corpus[::3], rows[::3], k, chunk)  # one rank's, unmerged
    print(
        f"largest tensor: chunked {largest['chunked']} elements (bound {chunk * (chunk + k)}),"
        f" one block {largest['one block']} (queries x corpus {len(queries) * len(corpus)})"
    )
    assert largest["chunked"] <= chunk * (chunk + k) < len(queries) * len(corpus)
    assert largest["one block"] >= len(queries) * len(corpus)  # the control: it would see it
    for scores, indices in found.values():
        assert torch.equal(indices, dense.indices[:, :k])
        assert (scores - dense.values[:, :k]).abs().max() <= SCORES
    assert not torch.equal(share[1], found["chunked"][1])  # the control: no merge, no match


def test_fewer_corpus_texts_than_candidates_leave_the_places_empty():
    scores, rows = nearest_candidates(
        random_unit_rows(2), random_unit_rows(3), torch.arange(3), 5, 2
    )
    assert rows[:, 3:].eq(-1).all() and scores[:, 3:].eq(-math.inf).all()
    assert sorted(rows[0, :3].tolist()) == [0, 1, 2]


def test_the_mined_file_trains(mined, tmp_path):
    output = tmp_path / "mined.jsonl"
    run_mine(mined, output, 1, *FILTERS, "--output-format", "n-tuple")
    train_pooled(1, "--dataset", str(output), "--text-model", mined["folder"], "--columns",
                 "anchor,positive,negative_1,negative_2", "--batch-size", "4", "--max-steps", "2",
                 "--num-workers", "0", "--output-dir", str(tmp_path / "run"))  # fmt: skip
    assert (tmp_path / "run" / "final" / "sentence_transformer").is_dir()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-negatives", "4", "--range-max", "3"], "--num-negatives 4: only 3 candidates"),
        (["--anchor-column", "query"], "--dataset: no column 'query'"),
        (["--corpus-column", "body"], "--corpus: no column 'body'"),
        (["--output-format", "labeled-pair"], "--output-format"),
        (["--max-length", "65"], "--max-length 65: --model"),
    ],
)
def test_bad_input_is_one_line_on_every_rank(mined, tmp_path, flags, message):
    result = run_mine(mined, tmp_path / "out.jsonl", 2, *flags, check=False)
    one_line_errors(result, message, 2)
    assert not (tmp_path / "out.jsonl").exists()


def test_an_existing_output_is_refused(mined, tmp_path):
    (tmp_path / "out.jsonl").write_text("kept\n")
    result = run_mine(mined, tmp_path / "out.jsonl", 1, check=False)
    one_line_errors(result, "exists: remove it", 1)
    assert (tmp_path / "out.jsonl").read_text() == "kept\n"
