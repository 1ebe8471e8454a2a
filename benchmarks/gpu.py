"""What only an accelerator can tell: one command, one GPU, a few minutes.

    python -m benchmarks.gpu                         # one CUDA GPU, ~5-8 min
    python -m benchmarks.gpu --device cpu --quick    # smoke test (CI)

Writes ``benchmarks/results/gpu.json`` (ignored by git; ``--output`` another file) and
prints a table for docs/benchmarks.md:
- NT-Xent forward+backward against lightly at N = 4096, 16384 and 65536 pairs (ours
  tiles automatically): median time and ``torch.cuda.max_memory_allocated`` beyond the
  inputs (lightly's dense 2N x 2N logits do not fit at 65536: reported as failed).
- trainer.py's samples/s (ResNet-18, 32 px, float32 and ``--mixed_precision bf16``)
  against a hand-written Accelerate loop with torch's own BatchNorm, each in a fresh
  process.
- ``SyncBatchNormFunction`` forward+backward against ``F.batch_norm`` (one rank).
- trainer.py compiled (Accelerate's ``dynamo_backend="inductor"``) against eager,
  samples/s after its first steps (where it compiles).
- host-device synchronisations per training step, counted with
  ``torch.cuda.set_sync_debug_mode("warn")`` over the trainer's steps.
- ``--fsdp``'s sharding on NCCL (a world of one process: one GPU): a BERT-large-sized and a
  ViT-L-sized tower built in code, samples/s and peak memory, whole and sharded.
- trainer.py fine-tuning a CLIP ViT-B/32-sized ``CLIPModel`` built in code (random
  weights, 224 px, the digits with captions): samples/s and peak memory, whole and
  with LoRA (rank 16 on the query and value projections of both towers).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.fresh_process import in_fresh_process


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: kernels, allocator, cuBLAS handles
    seconds = []
    for _ in range(repeats):
        _synchronize(device)
        started = time.perf_counter()
        fn()
        _synchronize(device)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def loss_table(device: torch.device, sizes: list[int], repeats: int) -> list[dict]:
    from benchmarks.loss import make_loss

    rows = []
    for pairs in sizes:
        row: dict = {"pairs": pairs}
        for name in ("ours", "lightly"):
            try:
                loss = make_loss(name)
            except ImportError:
                row[name] = {"error": "not installed"}
                continue
            generator = torch.Generator(device="cpu").manual_seed(0)
            out0 = torch.randn(pairs, 128, generator=generator).to(device).requires_grad_()
            out1 = torch.randn(pairs, 128, generator=generator).to(device).requires_grad_()

            def step(loss=loss, out0=out0, out1=out1):
                loss(out0, out1).backward()

            try:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
                seconds = _timed(step, device, repeats)
                peak = (
                    torch.cuda.max_memory_allocated(device) - base
                    if device.type == "cuda"
                    else None
                )
                row[name] = {"seconds": seconds, "extra_peak_bytes": peak}
            except torch.OutOfMemoryError:
                row[name] = {"error": "out of memory"}
            del out0, out1
        rows.append(row)
        print(f"loss N={pairs}: done", flush=True)
    return rows


def _trainer_here(
    device: str, precision: str, kind: str, steps: int, batch_size: int, model: str
) -> float:
    """Samples/s of trainer.py (eager, or compiled: ``kind`` "trainer_<dynamo backend>") or of
    the hand-written loop, in this (fresh) process. A compiled run's rate leaves out its
    first steps, where it compiles."""
    import tempfile
    from pathlib import Path

    from accelerate import Accelerator

    from benchmarks.compiled import WARMUP, step_seconds
    from benchmarks.throughput import hand_written_loop
    from trainer import TrainConfig, train

    backend = kind.removeprefix("trainer_") if kind.startswith("trainer_") else "no"
    accelerator = Accelerator(
        cpu=device == "cpu", mixed_precision=precision, dynamo_backend=backend
    )
    with tempfile.TemporaryDirectory() as output_dir:
        config = TrainConfig(
            lr=0.03,
            max_steps=steps,
            batch_size=batch_size,
            model=model,
            image_size=32,
            knn_k=0,
            log_every=1 if backend != "no" else steps,
            output_dir=output_dir,
        )
        if kind == "hand_written":
            return hand_written_loop(config, accelerator)
        metrics = train(config, accelerator).metrics
        if backend == "no":
            return metrics["samples_per_s"]
        return batch_size / step_seconds(Path(output_dir), batch_size, min(WARMUP, steps // 2))


def _trainer_kinds_here(
    device: str, precision: str, kinds: list[str], steps: int, batch_size: int, model: str
) -> dict[str, float]:
    """``_trainer_here`` for each of ``kinds`` in this process, Accelerate's process state
    reset between them (the smoke test's shortcut: its rates are not measurements)."""
    from contrastive_accelerate.compat import reset_accelerate_state

    rates = {}
    for kind in kinds:
        rates[kind] = _trainer_here(device, precision, kind, steps, batch_size, model)
        reset_accelerate_state()
    return rates


def trainer_table(
    device: str,
    steps: int,
    batch_size: int,
    repeats: int,
    compiler: str,
    smoke: bool = False,
    model: str = "resnet18",
) -> list[dict]:
    """trainer.py against the hand-written loop, and compiled by ``compiler`` (a dynamo
    backend: inductor on a GPU; eager, dynamo alone, in the CPU smoke test, which
    compiles in float32 only, and trains the mlp: a CPU without native bf16 takes
    minutes for 4 bf16 steps of ResNet-18)."""
    rows = []
    for precision in ("no", "bf16"):
        samples_per_s: dict[str, list[float]] = {"trainer": [], "hand_written": []}
        if not (smoke and precision == "bf16"):
            samples_per_s[f"trainer_{compiler}"] = []
        for _ in range(repeats):
            # A fresh process each: AcceleratorState is one per process. The smoke test
            # runs them all in this process, resetting that state between them.
            if smoke:
                values = _trainer_kinds_here(device, precision, list(samples_per_s), steps,
                                             batch_size, model)  # fmt: skip
            else:
                values = {
                    kind: in_fresh_process(
                        "benchmarks.gpu", "_trainer_here", device, precision, kind, steps,
                        batch_size, model,
                    )
                    for kind in samples_per_s
                }  # fmt: skip
            if "error" in values:
                raise RuntimeError(f"{precision}: {values['error']}")
            for kind, value in values.items():
                if isinstance(value, dict):
                    raise RuntimeError(f"{kind} ({precision}): {value['error']}")
                samples_per_s[kind].append(value)
        median = {kind: statistics.median(values) for kind, values in samples_per_s.items()}
        rows.append(
            {
                "precision": precision,
                "samples_per_s": median,
                "ratio": median["trainer"] / median["hand_written"],
                "compiled": compiler if f"trainer_{compiler}" in median else None,
                "compiled_ratio": median.get(f"trainer_{compiler}", math.nan) / median["trainer"],
            }
        )
        print(f"trainer {precision}: done", flush=True)
    return rows


def sync_batchnorm_cost(device: torch.device, shape: tuple, repeats: int) -> dict:
    """``SyncBatchNormFunction`` on a one-rank group (its collectives included) against
    ``F.batch_norm`` in training mode."""
    import torch.distributed as dist

    from contrastive_accelerate.testing import free_port
    from models.sync_batchnorm import SyncBatchNormFunction

    started_group = not dist.is_initialized()
    if started_group:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
        )
    try:
        x = torch.randn(*shape, device=device, requires_grad=True)
        weight = torch.ones(shape[1], device=device, requires_grad=True)
        bias = torch.zeros(shape[1], device=device, requires_grad=True)
        grad = torch.randn(*shape, device=device)

        def synced():
            SyncBatchNormFunction.apply(x, weight, bias, 1e-5, None)[0].backward(grad)

        def plain():
            F.batch_norm(x, None, None, weight, bias, True, 0.1, 1e-5).backward(grad)

        seconds = {
            name: _timed(fn, device, repeats) for name, fn in (("synced", synced), ("plain", plain))
        }
    finally:
        if started_group:
            dist.destroy_process_group()
    return {"shape": list(shape), "seconds": seconds, "ratio": seconds["synced"] / seconds["plain"]}


def syncs_per_step(device: torch.device, steps: int, batch_size: int) -> float | None:
    """Host-device synchronisations per trainer.py step (CUDA only): the warnings of
    ``set_sync_debug_mode("warn")`` while training, minus those of a run one step shorter
    (start-up, the final save and logging), so the figure is the steady state's."""
    if device.type != "cuda":
        return None
    import tempfile

    from trainer import TrainConfig, train

    counts = []
    for run_steps in (steps - 1, steps):
        with tempfile.TemporaryDirectory() as output_dir:
            config = TrainConfig(
                max_steps=run_steps,
                batch_size=batch_size,
                image_size=32,
                knn_k=0,
                log_every=10**6,
                output_dir=output_dir,
            )
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    train(config)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            counts.append(sum("synchroniz" in str(w.message) for w in caught))
    return float(counts[1] - counts[0])


#: CLIP ViT-B/32's sizes (Radford et al., 2021), and the smoke test's.
CLIP_SIZES = {
    "full": ({"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
              "num_attention_heads": 12, "image_size": 224, "patch_size": 32},
             {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 12,
              "num_attention_heads": 8, "max_position_embeddings": 77}, 512),
    "quick": ({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
               "num_attention_heads": 2, "image_size": 32, "patch_size": 16},
              {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
               "num_attention_heads": 2, "max_position_embeddings": 77}, 32),
}  # fmt: skip


def _clip_model(size: str) -> str:
    """A ``CLIPModel`` of ``CLIP_SIZES[size]`` with a word-level tokenizer of the digits'
    captions and a CLIP image processor, saved where ``--clip-model`` loads them."""
    import tempfile

    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    from contrastive_accelerate.data.pairs import load_pair_dataset
    from models.text import scratch_text_encoder

    captions = load_pair_dataset(None, ("image", "caption")).train["caption"]
    _, tokenizer = scratch_text_encoder([c for row in captions for c in row], 77, torch.float32)
    vision, text, width = CLIP_SIZES[size]
    special = {"bos_token_id": tokenizer.cls_token_id, "eos_token_id": tokenizer.sep_token_id,
               "pad_token_id": tokenizer.pad_token_id, "vocab_size": len(tokenizer)}  # fmt: skip
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(text_config={**text, **special}, vision_config=vision,
                                 projection_dim=width))  # fmt: skip
    directory = tempfile.mkdtemp()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    side = vision["image_size"]
    processor = CLIPImageProcessor(size={"shortest_edge": side},
                                   crop_size={"height": side, "width": side})  # fmt: skip
    processor.save_pretrained(directory)
    return directory


def _clip_here(device: str, precision: str, lora: bool, steps: int, batch_size: int,
               size: str) -> dict:  # fmt: skip
    """trainer.py fine-tuning ``_clip_model(size)``, whole or with LoRA, in this (fresh)
    process: samples/s and the device's peak memory."""
    import tempfile

    from accelerate import Accelerator

    from trainer import TrainConfig, train

    accelerator = Accelerator(cpu=device == "cpu", mixed_precision=precision)
    if accelerator.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(accelerator.device)
    adapters = {"lora_rank": 16, "lora_alpha": 32.0} if lora else {}
    with tempfile.TemporaryDirectory() as output_dir:
        config = TrainConfig(columns="image,caption", clip_model=_clip_model(size),
                             max_steps=steps, batch_size=batch_size, max_length=16, knn_k=0,
                             log_every=steps, output_dir=output_dir, **adapters)  # fmt: skip
        rate = train(config, accelerator).metrics["samples_per_s"]
    peak = torch.cuda.max_memory_allocated() if accelerator.device.type == "cuda" else None
    return {"samples_per_s": rate, "peak_bytes": peak}


def _clip_kinds_here(device: str, precision: str, steps: int, batch_size: int,
                     size: str) -> list[dict]:  # fmt: skip
    """``_clip_here`` whole and with LoRA in this process, Accelerate's state reset
    between them (the smoke test's shortcut: its rates are not measurements)."""
    from contrastive_accelerate.compat import reset_accelerate_state

    results = []
    for lora in (False, True):
        results.append(_clip_here(device, precision, lora, steps, batch_size, size))
        reset_accelerate_state()
    return results


def clip_table(device: str, quick: bool) -> list[dict]:
    """``_clip_here`` whole and with LoRA, each in a fresh process, in bf16 on a GPU (the
    smoke test: both in this process)."""
    precision = "no" if quick else "bf16"
    if quick:
        results = _clip_kinds_here(device, precision, 3, 8, "quick")
    else:
        results = [in_fresh_process("benchmarks.gpu", "_clip_here", device, precision, lora, 30,
                                    256, "full") for lora in (False, True)]  # fmt: skip
    if "error" in results:
        raise RuntimeError(f"CLIP: {results['error']}")
    rows = []
    for lora, result in zip((False, True), results, strict=True):
        if "error" in result:
            raise RuntimeError(f"CLIP {'LoRA' if lora else 'whole'}: {result['error']}")
        rows.append({"training": "LoRA r16" if lora else "whole", "precision": precision,
                     **result})  # fmt: skip
    print("clip: done", flush=True)
    return rows


def fsdp_table(device: str, quick: bool) -> list[dict]:
    """A BERT-large-sized and a ViT-L-sized tower, whole and under ``--fsdp``'s
    ``shard_model`` in a world of one process on NCCL (``benchmarks.fsdp.gpu_here``), each
    in a fresh process: samples/s and peak memory (the smoke test: tiny ones, in this
    process)."""
    if quick:
        from benchmarks.fsdp import gpu_rows_here

        return gpu_rows_here(device, ["tiny-bert", "tiny-vit"], 2, 4)
    rows = []
    for tower in ("bert-large", "vit-l"):
        for sharded in (False, True):
            result = in_fresh_process("benchmarks.fsdp", "gpu_here", device, tower, sharded,
                                      10, 64, timeout=1200)  # fmt: skip
            if "error" in result:
                raise RuntimeError(f"FSDP {tower}: {result['error']}")
            rows.append({"tower": tower, "fsdp": sharded, **result})
    print("fsdp: done", flush=True)
    return rows


def run(device_name: str, quick: bool) -> dict:
    device = torch.device(device_name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device; use --device cpu --quick for a smoke test")
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "loss": loss_table(device, [256] if quick else [4096, 16384, 65536], 2 if quick else 10),
        "trainer": trainer_table(
            device_name,
            steps=4 if quick else 30,
            batch_size=16 if quick else 256,
            repeats=1,
            compiler="eager" if quick else "inductor",
            smoke=quick,
            model="mlp" if quick else "resnet18",
        ),
        "sync_batchnorm": sync_batchnorm_cost(
            device, (8, 16, 8, 8) if quick else (256, 64, 32, 32), 2 if quick else 20
        ),
        "syncs_per_step": syncs_per_step(device, steps=5, batch_size=64),
        "clip": clip_table(device_name, quick),
        "fsdp": fsdp_table(device_name, quick),
    }


def table_lines(results: dict) -> list[str]:
    mib = 2**20

    def loss_cell(entry: dict) -> str:
        if "error" in entry:
            return entry["error"]
        memory = entry["extra_peak_bytes"]
        return f"{entry['seconds'] * 1e3:.1f} ms" + (
            f"; {memory / mib:.0f} MiB" if memory is not None else ""
        )

    lines = [
        f"Device: {results['device']}, torch {results['torch']}, {results['date']}",
        "",
        "| N pairs | NT-Xent ours | lightly |",
        "|---|---|---|",
    ]
    lines += [
        f"| {row['pairs']} | {loss_cell(row['ours'])} | {loss_cell(row['lightly'])} |"
        for row in results["loss"]
    ]
    lines += [
        "",
        "| precision | trainer.py | hand-written loop | ratio | trainer.py compiled "
        "| compiled / eager |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["trainer"]:
        rates = row["samples_per_s"]
        compiled = "not run" if row["compiled"] is None else (
            f"{rates['trainer_' + row['compiled']]:.0f} samples/s ({row['compiled']})"
        )  # fmt: skip
        lines.append(
            f"| {row['precision']} | {rates['trainer']:.0f} samples/s "
            f"| {rates['hand_written']:.0f} samples/s | {row['ratio']:.3f} "
            f"| {compiled} | {row['compiled_ratio']:.3f} |"
        )
    bn = results["sync_batchnorm"]
    lines += [
        "",
        f"SyncBatchNormFunction {'x'.join(map(str, bn['shape']))}: "
        f"{bn['seconds']['synced'] * 1e3:.2f} ms against F.batch_norm's "
        f"{bn['seconds']['plain'] * 1e3:.2f} ms (ratio {bn['ratio']:.2f}); host-device "
        f"synchronisations per training step: {results['syncs_per_step']}",
        "",
        "| CLIP ViT-B/32-sized, --clip-model | precision | samples/s | peak memory |",
        "|---|---|---|---|",
    ]
    for row in results["clip"]:
        peak = "n/a" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 2**30:.1f} GiB"
        lines.append(f"| {row['training']} | {row['precision']} | "
                     f"{row['samples_per_s']:.0f} | {peak} |")  # fmt: skip
    lines += ["", "| tower, 1 process on NCCL | training | samples/s | peak memory |",
              "|---|---|---|---|"]  # fmt: skip
    for row in results["fsdp"]:
        peak = "n/a" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 2**30:.1f} GiB"
        training = "--fsdp (shard_model)" if row["fsdp"] else "whole"
        lines.append(f"| {row['tower']} | {training} | {row['samples_per_s']:.0f} | {peak} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument("--output", default="benchmarks/results/gpu.json")
    args = parser.parse_args()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    results = run(args.device, args.quick)
    with open(args.output, "w") as file:
        json.dump(results, file, indent=2)
    print("\n".join(table_lines(results)))
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
