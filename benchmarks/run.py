"""Run every benchmark, print a table and write JSON.

    pip install -e ".[bench]" && python -m benchmarks.run            # ~20 min on 2 cores
    python -m benchmarks.run --quick                                  # small sizes, ~2 min
    python -m benchmarks.run --publish            # the published figures: benchmarks/results.json

Writes ``benchmarks/results/run.json`` (ignored by git) unless ``--output`` names a file.

Speed and memory live here, never in the tests: CI must not fail because a
machine is noisy. Ratios come from implementations interleaved in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from benchmarks import gather, grad_cache, knn, loss_family, standalone, sync_batchnorm
from benchmarks.loss import peak_memory, time_losses
from benchmarks.throughput import augmentation_cost, loader_throughput, trainer_throughput

MiB = 2**20


def _machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as file:
            cpu = next(line.split(":", 1)[1].strip() for line in file if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
    }


def run(quick: bool) -> dict:
    results: dict = {"machine": _machine()}
    pairs_list = [512, 1024] if quick else [1024, 2048, 4096]
    has_lightly = _has_lightly()
    names = ["ours", "ours_tiled"] + (["lightly"] if has_lightly else [])
    results["loss"] = []
    for pairs in pairs_list:
        timing = time_losses(names, pairs, repeats=3 if quick else 5)
        memory = {name: peak_memory(name, pairs) for name in names}
        results["loss"].append({"pairs": pairs, "time": timing, "memory": memory})
        print(f"loss N={pairs}: done", flush=True)
    results["tiled_large"] = [
        {"global_rows": 2 * pairs, "memory": peak_memory("ours", pairs)}
        for pairs in ([4096] if quick else [16384, 32768])
    ]
    print("tiled large: done", flush=True)
    if has_lightly and _has_open_clip():
        results["loss_family"] = loss_family.run(
            pairs=512 if quick else 4096, repeats=3 if quick else 5
        )
    results["gather"] = gather.run(quick)
    print("gather: done", flush=True)
    results["trainer"] = trainer_throughput(steps=8 if quick else 20, repeats=1 if quick else 3)
    results["augmentation"] = augmentation_cost(items=100 if quick else 1000)
    results["loader"] = loader_throughput(epochs=2 if quick else 3, repeats=1 if quick else 2)
    results["grad_cache"] = grad_cache.run(quick)
    results["sync_batchnorm"] = sync_batchnorm.run(quick)
    results["knn"] = knn.run(quick)
    return results


def _has_lightly() -> bool:
    try:
        import lightly.loss  # noqa: F401
    except ImportError:
        print("lightly is not installed (pip install -e '.[bench]'): no reference loss")
        return False
    return True


def _has_open_clip() -> bool:
    try:
        import open_clip.loss  # noqa: F401
    except ImportError:
        print("open_clip is not installed (pip install -e '.[bench]'): no loss-family table")
        return False
    return True


def table(results: dict) -> str:
    lines = [
        f"Machine: {results['machine']['cpu']}, {results['machine']['cores']} cores, "
        f"torch {results['machine']['torch']}, {results['machine']['date']}",
        "",
    ]
    lines += [
        "NT-Xent forward+backward, d=128, fp32, 1 process (median time; extra peak memory)",
        "",
        "| N pairs | ours | ours tiled (1024 rows) | lightly | ours / lightly time "
        "| ours / lightly memory | max value diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["loss"]:
        time_, memory = row["time"], row["memory"]

        def cell(name, time_=time_, memory=memory):
            if name not in time_:
                return "n/a"
            return (
                f"{time_[name]['seconds']:.3f} s; "
                f"{memory[name].get('extra_peak_bytes', 0) / MiB:.0f} MiB"
            )

        if "lightly" in time_:
            time_ratio = f"{time_['ours']['seconds'] / time_['lightly']['seconds']:.2f}"
            ours_bytes = memory["ours"].get("extra_peak_bytes")
            lightly_bytes = memory["lightly"].get("extra_peak_bytes")
            memory_ratio = (
                f"{ours_bytes / lightly_bytes:.2f}" if ours_bytes and lightly_bytes else "n/a"
            )
            value_diff = f"{abs(time_['ours']['loss'] - time_['lightly']['loss']):.1e}"
        else:
            time_ratio = memory_ratio = value_diff = "n/a"
        lines.append(
            f"| {row['pairs']} | {cell('ours')} | {cell('ours_tiled')} | "
            f"{cell('lightly')} | {time_ratio} | {memory_ratio} | {value_diff} |"
        )
    lines += [
        "",
        "Automatically tiled NT-Xent at large global batches (one forward+backward)",
        "",
        "| 2N rows | extra peak memory | time |",
        "|---|---|---|",
    ]
    for row in results["tiled_large"]:
        memory = row["memory"]
        if "error" in memory:
            lines.append(f"| {row['global_rows']} | failed: {memory['error']} | |")
        else:
            lines.append(
                f"| {row['global_rows']} | {memory['extra_peak_bytes'] / MiB:.0f} MiB "
                f"| {memory['seconds']:.1f} s |"
            )
    if "loss_family" in results:
        lines += ["", *loss_family.table_lines(results["loss_family"])]
    lines += ["", *gather.table_lines(results["gather"])]
    trainer, augmentation = results["trainer"], results["augmentation"]
    lines += [
        "",
        f"Trainer throughput (ResNet-18, {trainer['image_size']} px, global batch "
        f"{trainer['batch_size']}, {trainer['steps']} steps, 1 process): "
        f"trainer.py {trainer['samples_per_s']['trainer']:.1f} samples/s, hand-written "
        f"Accelerate loop {trainer['samples_per_s']['hand_written']:.1f} samples/s, "
        f"ratio {trainer['ratio']:.3f}",
        "",
        f"Two-view augmentation at {augmentation['image_size']} px: per-sample seeded "
        f"{augmentation['seconds_per_item']['per_sample_seed'] * 1e3:.3f} ms/item, global "
        f"RNG {augmentation['seconds_per_item']['global_rng'] * 1e3:.3f} ms/item, "
        f"ratio {augmentation['ratio']:.3f}; the seeding alone "
        f"{augmentation['seeding_seconds_per_item'] * 1e6:.1f} us/item",
    ]
    if "loader" in results:
        loader = results["loader"]
        rates = loader["pairs_per_s"]
        lines += [
            "",
            f"Training loader, digits at {loader['image_size']} px, global batch "
            f"{loader['batch_size']}, {loader['epochs']} epochs, 1 process: no workers "
            f"{rates['no_workers']:.0f} pairs/s, 2 workers restarted every epoch "
            f"{rates['2_workers']:.0f} pairs/s, 2 persistent workers "
            f"{rates['2_persistent']:.0f} pairs/s",
        ]
    if "grad_cache" in results:
        lines += ["", *grad_cache.table_lines(results["grad_cache"])]
    if "sync_batchnorm" in results:
        lines += ["", *sync_batchnorm.table_lines(results["sync_batchnorm"])]
    if "knn" in results:
        lines += ["", *knn.table_lines(results["knn"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    standalone.add_output_arguments(parser, "run")
    args = parser.parse_args(argv)
    path = standalone.results_path(parser, args, "run")
    results = run(args.quick)
    with open(path, "w") as file:
        json.dump(results, file, indent=2)
    print(table(results))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
