"""kNN evaluation's peak memory and time against the evaluation set's size, 1 process.

Synthetic 32 px images (a ``datasets.Dataset`` of PIL images), the mlp encoder (fast:
the images, not the encoder, are what grow), a bank of the same size as the queries
(capped at ``knn.BANK_SIZE``). ``whole`` is
how the evaluation used to run: every image decoded into one tensor, then embedded;
``streamed`` is ``knn_top1``: a batch at a time, only the features kept. Each runs in
a fresh process; extra peak is ``VmHWM`` minus the RSS once the data and model exist.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from benchmarks import standalone
from benchmarks.fresh_process import in_fresh_process, memory_status_bytes

IMAGE_SIZE = 32


def _setup(images: int):
    import datasets
    import numpy as np
    from PIL import Image

    from contrastive_accelerate.knn import knn_data
    from models import SimCLR

    generator = np.random.default_rng(0)
    pixels = generator.integers(0, 256, (images, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    dataset = datasets.Dataset.from_dict(
        {"image": [Image.fromarray(p) for p in pixels], "label": [i % 10 for i in range(images)]}
    )
    torch.manual_seed(0)
    model = SimCLR("mlp", image_size=IMAGE_SIZE).eval()
    return model, knn_data(dataset, dataset, "image", "label", IMAGE_SIZE, False)


@torch.no_grad()
def _whole(model, knn) -> float:
    from contrastive_accelerate.data import evaluation_images

    def features(dataset):
        images, _ = evaluation_images(dataset, knn.image_column, knn.image_size)
        assert images is not None
        return F.normalize(torch.cat([model.embed(c) for c in images.split(256)]), dim=1)

    bank, queries = features(knn.bank), features(knn.queries)
    similarity, neighbours = (queries @ bank.T).topk(20, dim=1)
    votes = torch.zeros(len(queries), 10)
    votes.scatter_add_(1, knn.bank_labels[neighbours], (similarity / 0.07).exp())
    return (votes.argmax(1) == knn.query_labels).double().mean().item()


def _measure_here(images: int, method: str) -> dict:
    from contrastive_accelerate.knn import knn_top1

    model, knn = _setup(images)
    baseline = memory_status_bytes("VmRSS")
    started = time.perf_counter()
    accuracy = _whole(model, knn) if method == "whole" else knn_top1(model, knn)
    seconds = time.perf_counter() - started
    peak = memory_status_bytes("VmHWM")
    return {"extra_peak_bytes": max(0, peak - baseline), "seconds": seconds, "accuracy": accuracy}


def measure(images: int, method: str) -> dict:
    return in_fresh_process("benchmarks.knn", "_measure_here", images, method)


def run(quick: bool) -> dict:
    sizes = [500, 1000] if quick else [1000, 5000, 20000]
    return {
        "image_size": IMAGE_SIZE,
        "rows": [
            {"images": n, "whole": measure(n, "whole"), "streamed": measure(n, "streamed")}
            for n in sizes
        ],
    }


def table_lines(results: dict) -> list[str]:
    mib = 2**20
    lines = [
        f"kNN evaluation, 1 process, mlp encoder, {results['image_size']} px synthetic "
        "images, bank = queries (extra peak memory; time; accuracy)",
        "",
        "| eval images | whole (decoded into one tensor) | streamed (knn_top1) |",
        "|---|---|---|",
    ]
    for row in results["rows"]:

        def cell(entry):
            if "error" in entry:
                return f"failed: {entry['error']}"
            return (
                f"{entry['extra_peak_bytes'] / mib:.0f} MiB; {entry['seconds']:.1f} s; "
                f"{entry['accuracy']:.4f}"
            )

        lines.append(f"| {row['images']} | {cell(row['whole'])} | {cell(row['streamed'])} |")
    return lines


if __name__ == "__main__":
    standalone.main("knn", __doc__.split("\n")[0], run, table_lines)
