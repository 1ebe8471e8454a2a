"""Text pairs with a pretrained tower: full fine-tuning against LoRA and LoRA with
gradient checkpointing, and our LoRA step against sentence-transformers' own PEFT path.

Two towers built in code (nothing downloaded), each with a word-level tokenizer of the
Python documentation pairs: the tests' tiny BERT (2 layers, width 16) and a
BERT-base-sized one (12 layers, width 768, 12 heads). One process, global batch 16 of
(anchor, positive) pairs of at most 32 tokens, AdamW. For each: the median step time
over interleaved rounds, one step's extra peak memory in a fresh process (``VmHWM`` -
``VmRSS`` before it, so the weights loaded before are not counted), and the trainable
parameters. The peer is ``SentenceTransformerTrainer`` with MNRL on the same tower with
``model.add_adapter(LoraConfig(...))``, one optimizer step at a time; where
transformers' PEFT integration refuses the installed peft (transformers 5 asks for
0.22), peft's ``inject_adapter_in_model``, which ``add_adapter`` calls, adds the same
adapters.

    python -m benchmarks.adapters            # ~6 min on 2 cores
    python -m benchmarks.adapters --quick    # smoke: the tiny tower, 2 rounds
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from functools import partial

import torch

from benchmarks.fresh_process import in_fresh_process, memory_status_bytes
from benchmarks.standalone import write_docs
from contrastive_accelerate.data.python_docs import python_docs_pairs
from contrastive_accelerate.grad_cache import cached_backward
from contrastive_accelerate.methods import METHODS
from trainer import TrainConfig

BATCH, MAX_LENGTH, RANK = 16, 32, 16
SIZES = {
    "tiny": {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
             "intermediate_size": 32},
    "base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "intermediate_size": 3072},
}  # fmt: skip
VARIANTS = {
    "full fine-tuning": {},
    "LoRA": {"lora_rank": RANK, "lora_alpha": 2.0 * RANK},
    "LoRA + checkpointing": {"lora_rank": RANK, "lora_alpha": 2.0 * RANK,
                             "gradient_checkpointing": True},
}  # fmt: skip


@functools.cache
def _tower(size: str) -> tuple[str, str]:
    """A BERT of ``SIZES[size]`` (random weights, seed 0) and a word-level tokenizer of the
    pairs' words, saved where ``--text-model`` loads them; and the pairs as a jsonl file."""
    from transformers import BertConfig, BertModel

    from models.text import scratch_text_encoder

    rows = python_docs_pairs()
    root = tempfile.mkdtemp()
    data = f"{root}/pairs.jsonl"
    with open(data, "w") as file:
        file.writelines(json.dumps({"anchor": r["anchor"], "positive": r["positive"]}) + "\n"
                        for r in rows)  # fmt: skip
    _, tokenizer = scratch_text_encoder([r[c] for r in rows for c in ("anchor", "positive")],
                                        MAX_LENGTH, torch.float32)  # fmt: skip
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), max_position_embeddings=512, **SIZES[size])
    BertModel(config, add_pooling_layer=False).save_pretrained(f"{root}/bert")
    tokenizer.save_pretrained(f"{root}/bert")
    return f"{root}/bert", data


def _ours(size: str, variant: str):
    """Our step (embed, MNRL through ``cached_backward``, AdamW) and the trainable count."""
    model, data = _tower(size)
    config = TrainConfig(dataset=data, columns="anchor,positive", text_model=model,
                         batch_size=BATCH, max_length=MAX_LENGTH, knn_k=0, eval_holdout=0.0,
                         **VARIANTS[variant]).resolved()  # fmt: skip
    torch.manual_seed(0)
    method = METHODS["pairs"].build(config, METHODS["pairs"].load(config), 1, lambda _: None)
    trained = [p for p in method.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4)
    batch = method.dataset.collate([method.dataset[(0, index)] for index in range(BATCH)])

    def step() -> None:
        cached_backward(
            method.model,
            batch.split(1),
            partial(method.loss, batch=batch, sizes=[BATCH], step=0),
            forward=partial(method.embed, method.model, step=0),
        )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, sum(p.numel() for p in trained)


def _sentence_transformers(size: str):
    """One step at a time of ``SentenceTransformerTrainer`` (MNRL, AdamW, no clipping) on
    the same tower with sentence-transformers' PEFT path: ``model.add_adapter``."""
    import threading

    from datasets import Dataset
    from peft import LoraConfig, inject_adapter_in_model
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import TrainerCallback

    model_path, data = _tower(size)
    hidden = SIZES[size]["hidden_size"]
    model = SentenceTransformer(modules=[Transformer(model_path, max_seq_length=MAX_LENGTH),
                                         Pooling(hidden, "mean")], device="cpu")  # fmt: skip
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=["query", "value"])
    try:
        model.add_adapter(config)
    except ValueError:  # transformers 5's PEFT integration asks for peft >= 0.22
        inject_adapter_in_model(config, model[0].auto_model)  # what add_adapter calls
    rows = [json.loads(line) for line in open(data)]
    go, done, seconds, ready = threading.Semaphore(0), threading.Semaphore(0), [], threading.Event()

    class OneStepAtATime(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            ready.set()
            go.acquire()
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds.append(time.perf_counter() - self.started)
            done.release()

    arguments = SentenceTransformerTrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=BATCH, max_steps=10**6,
        learning_rate=1e-4, lr_scheduler_type="constant", max_grad_norm=0.0,
        dataloader_drop_last=True, logging_strategy="no", save_strategy="no",
        report_to="none", disable_tqdm=True, use_cpu=True, seed=0,
    )  # fmt: skip
    trainer = SentenceTransformerTrainer(
        model=model, args=arguments, train_dataset=Dataset.from_list(rows),
        loss=MultipleNegativesRankingLoss(model, scale=20.0), callbacks=[OneStepAtATime()],
    )  # fmt: skip
    threading.Thread(target=trainer.train, daemon=True).start()
    ready.wait()

    def step() -> float:
        go.release()
        done.acquire()
        return seconds[-1]

    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return step, trained


def _step(name: str):
    size, who = name.split(":")
    return _sentence_transformers(size) if who == "sentence-transformers" else _ours(size, who)


def measure_memory(name: str) -> dict:
    """One step's extra peak memory in this (fresh) process, and the trainable count."""
    torch.set_num_threads(1)
    step, trained = _step(name)
    baseline = memory_status_bytes("VmRSS")
    step()
    return {"extra_peak_bytes": max(0, memory_status_bytes("VmHWM") - baseline),
            "trainable": trained}  # fmt: skip


def step_times(names: list[str], rounds: int) -> dict[str, float]:
    """Median seconds per step of each of ``names``, interleaved round by round."""
    steps = {name: _step(name)[0] for name in names}
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for step in steps.values():
        step()  # warm-up
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            own_time = step()
            seconds[name].append(own_time or time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny tower, 2 rounds")
    parser.add_argument(
        "--publish", action="store_true", help="refresh the published table in docs/pretrained.md"
    )
    args = parser.parse_args()
    if args.publish and args.quick:
        parser.error("--publish refreshes the published figures: a full run, not --quick")
    sizes = ["tiny"] if args.quick else list(SIZES)
    lines = ["| tower | training | trainable parameters | step (ms) | extra peak memory (MiB) |",
             "|---|---|---|---|---|"]  # fmt: skip
    ratios = ["| tower | ours, LoRA (ms) | SentenceTransformerTrainer + add_adapter (ms) | "
              "ratio |", "|---|---|---|---|"]  # fmt: skip
    for size in sizes:
        names = [f"{size}:{variant}" for variant in VARIANTS] + [f"{size}:sentence-transformers"]
        times = step_times(names, 2 if args.quick else 5)
        memory = {name: in_fresh_process("benchmarks.adapters", "measure_memory", name,
                                         timeout=1200) for name in names}  # fmt: skip
        for name in names:
            who = name.split(":")[1]
            shown = "LoRA, sentence-transformers" if who == "sentence-transformers" else who
            extra = memory[name].get("extra_peak_bytes", float("nan")) / 2**20
            lines.append(f"| {size} | {shown} | {memory[name].get('trainable', 0):,} | "
                         f"{times[name] * 1e3:.0f} | {extra:.0f} |")  # fmt: skip
        ours, theirs = times[f"{size}:LoRA"], times[f"{size}:sentence-transformers"]
        ratios.append(f"| {size} | {ours * 1e3:.0f} | {theirs * 1e3:.0f} | {ours / theirs:.2f} |")
    table = [*lines, "", *ratios]
    print("\n".join(table))
    if args.publish:
        write_docs("adapters", table, "pretrained.md")


if __name__ == "__main__":
    main()
