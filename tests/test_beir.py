"""Retrieval evaluation on a benchmark in BEIR's format (``--eval-beir``): a test-made
folder of 12 queries, 20 documents and graded judgements, text pairs on the tiny BERT.

- The figures (nDCG@10, MRR@10, recall@1/5/10), every ``--eval-every`` steps and at the
  end, are the same on 1 and 3 processes: each rank embeds its share of the queries and
  of the corpus.
- They equal sentence-transformers' ``InformationRetrievalEvaluator`` on the run's own
  export (``final/sentence_transformer``), float64.
- The control: without ``--eval-beir`` there are none. A broken folder is one line.
"""

from __future__ import annotations

import json

import pytest

from contrastive_accelerate.data.beir import load_beir

from launch import TrainerRuns, make_beir, train_pooled

pytest.importorskip("sentence_transformers")
COMMON = ["--dtype", "float64", "--batch-size", "6", "--lr", "1e-3", "--max-length", "16",
          "--max-steps", "4", "--num-workers", "0", "--columns", "anchor,positive"]  # fmt: skip


@pytest.fixture(scope="module")
def beir(tmp_path_factory) -> str:
    return str(make_beir(tmp_path_factory.mktemp("beir"), queries=12, distractors=8))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sentence_pairs, tiny_bert):
    return TrainerRuns(tmp_path_factory, *COMMON, "--dataset", sentence_pairs,
                       "--text-model", tiny_bert)  # fmt: skip


def figures(run) -> dict[int, dict[str, float]]:
    """The run's BEIR figures, by the step at which they were measured."""
    by_step: dict[int, dict[str, float]] = {}
    for record in map(json.loads, (run / "metrics.jsonl").open()):
        found = {key: value for key, value in record.items() if key.startswith("beir_")}
        if found:
            by_step.setdefault(record["step"], {}).update(found)
    return by_step


def test_the_figures_every_eval_every_are_the_same_on_1_and_3_processes(runs, beir):
    one, three = (figures(runs(processes, "--eval-beir", beir, "--eval-every", "2"))
                  for processes in (1, 3))  # fmt: skip
    print(f"--eval-beir --eval-every 2, 1 process: {one}; 3: {three}")
    assert sorted(one) == sorted(three) == [2, 4]  # during the run, and at its end
    assert set(one[4]) == {"beir_ndcg@10", "beir_mrr@10", "beir_recall@1", "beir_recall@5",
                           "beir_recall@10"}  # fmt: skip
    for step in one:  # sums over queries, in another order
        assert one[step] == pytest.approx(three[step], abs=1e-12)
    assert figures(runs(1)) == {}


def test_the_figures_are_sentence_transformers_information_retrieval_evaluators(runs, beir):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import (
        InformationRetrievalEvaluator,
    )

    run = runs(1, "--eval-beir", beir)
    data = load_beir(beir)
    model = SentenceTransformer(str(run / "final" / "sentence_transformer"), device="cpu")
    evaluator = InformationRetrievalEvaluator(
        {f"q{i}": text for i, text in enumerate(data.queries)},
        {f"c{i:04d}": text for i, text in enumerate(data.corpus)},  # ids sorted as ours
        {f"q{i}": {f"c{row:04d}" for row in rows} for i, rows in enumerate(data.relevant)},
        mrr_at_k=[10], ndcg_at_k=[10], accuracy_at_k=[1], precision_recall_at_k=[1, 5, 10],
        map_at_k=[10], name="beir",
    )  # fmt: skip
    theirs = evaluator(model)
    ours = figures(run)[4]
    pairs = {f"beir_{name}": theirs[f"beir_cosine_{name}"]
             for name in ("ndcg@10", "mrr@10", "recall@1", "recall@5", "recall@10")}  # fmt: skip
    print(f"ours {ours}; InformationRetrievalEvaluator {pairs}")
    assert ours == pytest.approx(pairs, abs=1e-6)  # its export embeds in float32


def test_a_broken_folder_is_one_line(sentence_pairs, tiny_bert, beir, tmp_path):
    import shutil

    broken = tmp_path / "beir"
    shutil.copytree(beir, broken)
    with open(broken / "qrels" / "test.tsv", "a") as file:
        file.write("q001\tnowhere\t1\n")
    result = train_pooled(1, *COMMON, "--dataset", sentence_pairs, "--text-model", tiny_bert,
                          "--eval-beir", str(broken), "--output-dir", str(tmp_path / "run"),
                          check=False)  # fmt: skip
    last = (result.stdout + result.stderr).strip().splitlines()[-1]
    assert result.returncode != 0 and "'nowhere' is in no file" in last, last
