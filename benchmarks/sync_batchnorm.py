"""What synchronised BatchNorm costs: trainer.py on 2 CPU processes with and without it.

ResNet-18 and its projection head (21 BatchNorm layers), 8 px, global batch 128,
float32: the same command line with ``--sync-batchnorm`` and ``--no-sync-batchnorm``,
runs alternating, each reporting samples/s over its steps (``metrics.jsonl``); the
median per variant and their ratio. Also the layer alone: ``SyncBatchNormFunction``
forward+backward against ``F.batch_norm`` on 2 gloo ranks, on an activation of layer1's
shape; and the latency floor: two blocking exchanges per layer and step (statistics
forward, gradient sums backward; exactness allows no fewer), each at least one bare
all-gather, as a share of the unsynced step.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import standalone
from contrastive_accelerate.compat import BatchNormBase
from contrastive_accelerate.testing import run_on_ranks
from models import SimCLR

REPO = Path(__file__).resolve().parents[1]


def _launch(sync: bool, steps: int, batch_size: int, image_size: int, output_dir: str) -> float:
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "accelerate_configs" / "cpu_2_processes.yaml"),
        "--main_process_port",
        "0",
        str(REPO / "trainer.py"),
        *("--model", "resnet18", "--image-size", str(image_size), "--batch-size", str(batch_size)),
        *("--max-steps", str(steps), "--log-every", str(steps), "--knn-k", "0"),
        "--sync-batchnorm" if sync else "--no-sync-batchnorm",
        *("--output-dir", output_dir),
    ]
    environment = {**os.environ, "TQDM_DISABLE": "1", "HF_DATASETS_OFFLINE": "1"}
    subprocess.run(command, check=True, capture_output=True, env=environment, cwd=REPO)
    records = [json.loads(line) for line in open(Path(output_dir) / "metrics.jsonl")]
    return next(r["samples_per_s"] for r in reversed(records) if "samples_per_s" in r)


def trainer_overhead(
    steps: int = 30, batch_size: int = 128, image_size: int = 8, repeats: int = 2
) -> dict:
    samples_per_s: dict[str, list[float]] = {"synced": [], "unsynced": []}
    for _ in range(repeats):
        for name in samples_per_s:
            with tempfile.TemporaryDirectory() as output_dir:
                samples_per_s[name].append(
                    _launch(name == "synced", steps, batch_size, image_size, output_dir)
                )
    median = {name: statistics.median(values) for name, values in samples_per_s.items()}
    return {
        "steps": steps,
        "batch_size": batch_size,
        "image_size": image_size,
        "samples_per_s": samples_per_s,
        "overhead": median["unsynced"] / median["synced"] - 1,
    }


def layer_worker(rank: int, world_size: int, shape: tuple, repeats: int) -> dict:
    from models.sync_batchnorm import SyncBatchNormFunction

    torch.manual_seed(rank)
    x = torch.randn(*shape, requires_grad=True)
    weight = torch.ones(shape[1], requires_grad=True)
    bias = torch.zeros(shape[1], requires_grad=True)
    grad = torch.randn(*shape)

    def synced():
        SyncBatchNormFunction.apply(x, weight, bias, 1e-5, None)[0].backward(grad)

    def plain():
        F.batch_norm(x, None, None, weight, bias, True, 0.1, 1e-5).backward(grad)

    small, table = torch.zeros(2 * shape[1]), torch.zeros(2 * 2 * shape[1])

    def all_gather():  # the latency every SyncBatchNorm layer pays twice per step
        torch.distributed.all_gather_into_tensor(table, small)

    seconds: dict[str, list[float]] = {"synced": [], "plain": [], "all_gather": []}
    for index in range(repeats + 1):
        for name, step in (("synced", synced), ("plain", plain), ("all_gather", all_gather)):
            torch.distributed.barrier()
            started = time.perf_counter()
            step()
            if index:
                seconds[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in seconds.items()}


def layer_cost(shape=(64, 64, 8, 8), repeats: int = 20) -> dict:
    per_rank = run_on_ranks(layer_worker, 2, shape, repeats)
    seconds = {name: max(r[name] for r in per_rank) for name in per_rank[0]}
    return {"shape": list(shape), "seconds": seconds, "ratio": seconds["synced"] / seconds["plain"]}


def model_step_worker(rank: int, world_size: int, variant: str, steps: int) -> dict:
    """One DDP training step of ResNet-18 (8 px, 64 pairs per rank, NT-Xent), without the
    loader: ``unsynced``, ``synced``, or ``local``: synced with every exchange replaced by
    a local stand-in of the same shape, which leaves SyncBatchNorm's compute alone."""
    from torch.nn.parallel import DistributedDataParallel

    from losses import NTXentLoss
    from models import convert_sync_batchnorm
    from models import sync_batchnorm as module

    exchange_seconds: list[float] = []
    exchange = module.gather_statistics

    def timed_exchange(local, group):
        started = time.perf_counter()
        table = exchange(local, group)
        exchange_seconds.append(time.perf_counter() - started)
        return table

    def local_exchange(local, group):
        return local.expand(world_size, -1).clone()

    module.gather_statistics = local_exchange if variant == "local" else timed_exchange
    torch.manual_seed(0)
    model = SimCLR(backbone="resnet18", image_size=8)
    if variant != "unsynced":
        model = convert_sync_batchnorm(model)
    model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = NTXentLoss()
    images = torch.randn(128, 3, 8, 8)
    seconds = []
    for index in range(steps + 2):
        torch.distributed.barrier()
        if index == 2:  # warm-up over: time this step's exchanges and the later ones
            exchange_seconds.clear()
        started = time.perf_counter()
        embeddings = model(images)
        criterion(embeddings[:64], embeddings[64:]).backward()
        optimizer.step()
        optimizer.zero_grad()
        if index >= 2:
            seconds.append(time.perf_counter() - started)
    return {"seconds": statistics.median(seconds), "exchanges": exchange_seconds}


def model_step(steps: int = 15, repeats: int = 2) -> dict:
    """Where the synced step's extra time goes: compute (``local``) and exchanges."""
    seconds: dict[str, list[float]] = {"unsynced": [], "synced": [], "local": []}
    exchange_seconds: list[float] = []
    for _ in range(repeats):
        for variant in seconds:
            per_rank = run_on_ranks(model_step_worker, 2, variant, steps)
            seconds[variant].append(max(r["seconds"] for r in per_rank))
            exchange_seconds += per_rank[0]["exchanges"]
    median = {variant: statistics.median(values) for variant, values in seconds.items()}
    return {
        "seconds": median,
        "overhead": {v: median[v] / median["unsynced"] - 1 for v in ("synced", "local")},
        "exchange_ms": {
            "mean": statistics.mean(exchange_seconds) * 1e3,
            "median": statistics.median(exchange_seconds) * 1e3,
            "share_over_2ms": sum(t > 2e-3 for t in exchange_seconds) / len(exchange_seconds),
        },
    }


def exchanges_per_step() -> int:
    """Blocking SyncBatchNorm exchanges in one step of the benchmarked model."""
    model = SimCLR(backbone="resnet18", image_size=8)  # the trainer's NT-Xent head
    return 2 * sum(isinstance(m, BatchNormBase) for m in model.modules())


def latency_floor(trainer: dict, layer: dict) -> dict:
    """The overhead that the exchanges' bare latency alone would cost the unsynced step."""
    unsynced_samples_per_s = statistics.median(trainer["samples_per_s"]["unsynced"])
    unsynced_step_s = trainer["batch_size"] / unsynced_samples_per_s
    exchanges = exchanges_per_step()
    floor_s = exchanges * layer["seconds"]["all_gather"]
    return {"exchanges": exchanges, "seconds": floor_s, "overhead": floor_s / unsynced_step_s}


def run(quick: bool) -> dict:
    results = {
        "trainer": trainer_overhead(steps=10 if quick else 30, repeats=1 if quick else 3),
        # The same at 16 px: 4x the compute per step for the same 42 exchanges.
        "trainer_16px": trainer_overhead(
            steps=5 if quick else 10, image_size=16, repeats=1 if quick else 2
        ),
        "layer": layer_cost(repeats=5 if quick else 20),
        "model_step": model_step(steps=5 if quick else 15, repeats=1 if quick else 2),
    }
    results["floor"] = latency_floor(results["trainer"], results["layer"])
    return results


def table_lines(results: dict) -> list[str]:
    layer, floor, step = results["layer"], results["floor"], results["model_step"]
    lines = [
        "SyncBatchNorm on 2 CPU processes (ResNet-18, global batch 128, float32, runs "
        "alternating; samples/s of each run)",
        "",
        "| image size | steps | synced | unsynced | overhead of synchronising |",
        "|---|---|---|---|---|",
    ]
    for trainer in (results["trainer"], results["trainer_16px"]):
        runs = {
            name: ", ".join(f"{value:.0f}" for value in values)
            for name, values in trainer["samples_per_s"].items()
        }
        lines.append(
            f"| {trainer['image_size']} px | {trainer['steps']} | {runs['synced']} "
            f"| {runs['unsynced']} | {trainer['overhead']:+.1%} |"
        )
    return lines + [
        "",
        "The layer alone "
        f"({'x'.join(map(str, layer['shape']))} per rank, forward+backward): "
        f"{layer['seconds']['synced'] * 1e3:.2f} ms against F.batch_norm's "
        f"{layer['seconds']['plain'] * 1e3:.2f} ms (ratio {layer['ratio']:.2f}); one bare "
        f"all-gather of its statistics {layer['seconds']['all_gather'] * 1e3:.2f} ms.",
        "",
        f"Latency floor at {results['trainer']['image_size']} px: {floor['exchanges']} "
        f"exchanges per step x the bare all-gather = {floor['seconds'] * 1e3:.1f} ms, "
        f"{floor['overhead']:+.1%} of the unsynced step before any compute.",
        "",
        f"The step without the loader (DDP, NT-Xent): synced {step['overhead']['synced']:+.1%}, "
        f"of which compute {step['overhead']['local']:+.1%} (exchanges replaced by local "
        f"copies); an exchange inside the step took {step['exchange_ms']['mean']:.2f} ms on "
        "average on rank 0, waiting for the other rank included "
        f"(median {step['exchange_ms']['median']:.2f} ms), "
        f"{step['exchange_ms']['share_over_2ms']:.0%} of them over 2 ms.",
    ]


if __name__ == "__main__":
    standalone.main("sync_batchnorm", __doc__.split("\n")[0], run, table_lines)
