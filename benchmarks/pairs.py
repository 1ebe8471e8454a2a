"""Pairs against the peers' loops on the same towers: step time and extra peak memory.

- image-text: ``ImageTextMethod``'s step (its embed and InfoNCE through ``cached_backward``,
  AdamW) against a hand-written open_clip loop on the same image and text towers
  (``ClipLoss(local_loss=True, gather_with_grad=True)``, one forward per tower);
- text-text: ``TextPairsMethod``'s step against sentence-transformers on the same tower
  (a ``SentenceTransformer`` of its Transformer and Pooling modules): its
  ``SentenceTransformerTrainer`` with ``MultipleNegativesRankingLoss``, one optimizer step
  at a time, and that loss's step alone (``compute_loss`` on ``tokenize``d columns, AdamW).

One process, the mlp image tower (and ResNet-18) on the digits with captions and the
scratch BERT, Python's documentation pairs for text, global batch 64. Steps are
interleaved round by round in one process (median over rounds); extra peak memory is
one step's in a fresh process each (``VmHWM`` - ``VmRSS`` before it), ours at K = 1, 2
and 4 chunks.

    python -m benchmarks.pairs            # ~3 min on 2 cores
    python -m benchmarks.pairs --quick    # smoke: 3 rounds
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from functools import partial

import torch
import torch.nn.functional as F

from benchmarks.fresh_process import in_fresh_process, memory_status_bytes
from contrastive_accelerate.data.python_docs import python_docs_pairs
from contrastive_accelerate.grad_cache import cached_backward
from contrastive_accelerate.methods import METHODS
from trainer import TrainConfig

BATCH = 64


def _method(kind: str, chunks: int = 1, dropout_masks: str = "per-sample"):
    """The method, its optimizer and one batch of ``BATCH`` rows (``dropout_masks``
    "per-process": torch's ``nn.Dropout``, as the peers' loops have). ``kind``
    "image-text" has the mlp image tower, "image-text-resnet18" ResNet-18."""
    if kind.startswith("image-text"):
        model = "resnet18" if kind.endswith("resnet18") else "mlp"
        options = {"columns": "image,caption", "model": model, "knn_k": 0}
    else:
        path = tempfile.mkdtemp() + "/python_docs.jsonl"
        with open(path, "w") as file:
            import json

            file.writelines(json.dumps(row) + "\n" for row in python_docs_pairs())
        options = {"dataset": path, "columns": "anchor,positive", "knn_k": 0, "max_length": 64}
    config = TrainConfig(text_model="scratch", batch_size=BATCH, accumulation_chunks=chunks,
                         dropout_masks=dropout_masks, **options).resolved()  # fmt: skip
    torch.manual_seed(0)
    data = METHODS["pairs"].load(config)
    method = METHODS["pairs"].build(config, data, 1, lambda _: None)
    optimizer = torch.optim.AdamW(method.model.parameters(), lr=1e-3)
    batch = method.dataset.collate([method.dataset[(0, index)] for index in range(BATCH)])
    return method, optimizer, batch


def _ours(method, optimizer, batch, chunks: int = 1) -> None:
    cached_backward(
        method.model,
        batch.split(chunks),
        partial(method.loss, batch=batch, sizes=[len(batch.indices)], step=0),  # as the trainer
        forward=partial(method.embed, method.model, step=0),
    )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    method.after_step(0)


def _open_clip(kind: str):
    """A step of the hand-written open_clip loop on copies of our towers."""
    from open_clip.loss import ClipLoss

    method, _, batch = _method(kind, dropout_masks="per-process")
    image, text = copy.deepcopy(method.model.image), copy.deepcopy(method.model.text)
    log_scale = torch.nn.Parameter(method.model.log_logit_scale.detach().clone())
    parameters = [*image.parameters(), *text.parameters(), log_scale]
    optimizer = torch.optim.AdamW(parameters, lr=1e-3)
    criterion = ClipLoss(local_loss=True, gather_with_grad=True)
    ((ids, mask),) = batch.columns

    def step() -> None:
        features = F.normalize(image(batch.images), dim=1), F.normalize(text(ids, mask), dim=1)
        criterion(*features, log_scale.exp()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            log_scale.clamp_(max=4.6052)

    return step


def _sentence_transformer(method) -> object:
    """Our text tower, saved and loaded as sentence-transformers' Transformer and Pooling."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    directory = tempfile.mkdtemp()
    method.model.towers[0].encoder.save_pretrained(directory)
    method.model.tokenizers[0].save_pretrained(directory)
    return SentenceTransformer(
        modules=[Transformer(directory, max_seq_length=64),
                 Pooling(method.model.towers[0].encoder.config.hidden_size, "mean")],
        device="cpu",
    ).train()  # fmt: skip


def _sentence_transformers_loss():
    """A step of sentence-transformers' MNRL on our tower: ``compute_loss`` on ``tokenize``d
    columns and AdamW, without the HF Trainer around it."""
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    method, _, _ = _method("text-text")
    model = _sentence_transformer(method)
    rows = python_docs_pairs()[:BATCH]
    features = [model.tokenize([row[c] for row in rows]) for c in ("anchor", "positive")]
    criterion = MultipleNegativesRankingLoss(model, scale=20.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        criterion(features, None).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _sentence_transformers_trainer():
    """One optimizer step at a time of ``SentenceTransformerTrainer`` with MNRL on our tower
    (AdamW at a constant 1e-3, no gradient clipping: ours clips none). Its ``train()``
    runs in a thread that waits at each ``on_step_begin``; a step returns the trainer's
    own time from ``on_step_begin`` to ``on_step_end``, which leaves out its batch
    fetching and tokenization, done before, as ours leaves out its data loading."""
    import threading

    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from transformers import TrainerCallback

    method, _, _ = _method("text-text")
    model = _sentence_transformer(method)
    rows = [{"anchor": row["anchor"], "positive": row["positive"]} for row in python_docs_pairs()]
    go, done, seconds = threading.Semaphore(0), threading.Semaphore(0), []

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
        learning_rate=1e-3, lr_scheduler_type="constant", max_grad_norm=0.0,
        dataloader_drop_last=True, logging_strategy="no", save_strategy="no",
        report_to="none", disable_tqdm=True, use_cpu=True, seed=0,
    )  # fmt: skip
    trainer = SentenceTransformerTrainer(
        model=model,
        args=arguments,
        train_dataset=Dataset.from_list(rows),
        loss=MultipleNegativesRankingLoss(model, scale=20.0),
        callbacks=[OneStepAtATime()],
    )
    ready = threading.Event()
    threading.Thread(target=trainer.train, daemon=True).start()
    ready.wait()  # set up, its first batch fetched

    def step() -> float:
        go.release()
        done.acquire()
        return seconds[-1]

    return step


def _step_function(name: str):
    kind, who, chunks = name.split(":")
    if who == "ours":
        method, optimizer, batch = _method(kind, int(chunks))
        return partial(_ours, method, optimizer, batch, int(chunks))
    if kind.startswith("image-text"):
        return _open_clip(kind)
    return _sentence_transformers_trainer() if who == "trainer" else _sentence_transformers_loss()


PAIRS = {
    "image-text": ("image-text:ours:1", "image-text:open_clip:1"),
    "image-text-resnet18": ("image-text-resnet18:ours:1", "image-text-resnet18:open_clip:1"),
    "text-text": ("text-text:ours:1", "text-text:trainer:1"),
    "text-text, against the loss step": ("text-text:ours:1", "text-text:loss-step:1"),
}
PEERS = {
    "open_clip": "a hand-written open_clip loop",
    "trainer": "SentenceTransformerTrainer",
    "loss-step": "sentence-transformers' MNRL step without the HF Trainer",
}


def step_times(rounds: int) -> dict[str, float]:
    """Median seconds per step of each entry of ``PAIRS``, interleaved round by round."""
    steps = {name: _step_function(name) for pair in PAIRS.values() for name in pair}
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        step()  # warm-up
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            own_time = step()  # a step that times itself returns its seconds
            seconds[name].append(own_time or time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in seconds.items()}


def measure_memory(name: str) -> dict:
    """One step's extra peak memory, in this (fresh) process."""
    torch.set_num_threads(1)
    step = _step_function(name)
    baseline = memory_status_bytes("VmRSS")
    step()
    return {"extra_peak_bytes": max(0, memory_status_bytes("VmHWM") - baseline)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds, one memory run each")
    args = parser.parse_args()
    times = step_times(3 if args.quick else 15)
    kinds = list(dict.fromkeys(ours.split(":")[0] for ours, _ in PAIRS.values()))
    memory_names = [*dict.fromkeys(n for pair in PAIRS.values() for n in pair),
                    *(f"{kind}:ours:{k}" for kind in kinds for k in (2, 4))]  # fmt: skip
    memory = {name: in_fresh_process("benchmarks.pairs", "measure_memory", name, timeout=600)
              for name in memory_names}  # fmt: skip
    print("| pairs | ours (ms) | peer | peer (ms) | time ratio | extra peak, ours / peer (MiB) |")
    print("|---|---|---|---|---|---|")
    for kind, (ours, peer) in PAIRS.items():
        mib = [memory[n].get("extra_peak_bytes", float("nan")) / 2**20 for n in (ours, peer)]
        print(f"| {kind} | {times[ours] * 1e3:.1f} | {PEERS[peer.split(':')[1]]} | "
              f"{times[peer] * 1e3:.1f} | {times[ours] / times[peer]:.2f} | "
              f"{mib[0]:.1f} / {mib[1]:.1f} |")  # fmt: skip
    print("\n| pairs | extra peak at K = 1 / 2 / 4 chunks (MiB) |\n|---|---|")
    for kind in kinds:
        values = [memory[f"{kind}:ours:{k}"].get("extra_peak_bytes", float("nan")) / 2**20
                  for k in (1, 2, 4)]  # fmt: skip
        print(f"| {kind} | {' / '.join(f'{v:.1f}' for v in values)} |")


if __name__ == "__main__":
    main()
