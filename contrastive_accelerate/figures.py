"""The run's final figures and what they mean: each next to its raw-pixel baseline on
the same held-out images, as the last lines of a run print them.

    results = baselines_and_probe(encoder, knn, k=20, linear_probe=True)
    print(final_summary({**metrics, **results}, 20, "runs/simclr/final", knn))
"""

from __future__ import annotations

from torch import nn

from contrastive_accelerate.knn import KnnData, RawPixels, knn_top1
from contrastive_accelerate.linear_probe import linear_probe_top1
from contrastive_accelerate.sharding import reshard_after_evaluation


def baselines_and_probe(encoder: nn.Module, knn: KnnData, k: int, linear_probe: bool) -> dict:
    """kNN top-1 on raw pixels of the same held-out images, and with ``linear_probe`` the
    linear probe's top-1 of ``encoder``'s features and of raw pixels; under --fsdp every
    rank runs the same forwards, and the encoder is resharded after."""
    encoder.eval()
    results = {"raw_pixels_knn_top1": knn_top1(RawPixels(), knn, k=k)}
    if linear_probe:
        results["linear_probe_top1"] = linear_probe_top1(encoder, knn)
        results["raw_pixels_linear_probe_top1"] = linear_probe_top1(RawPixels(), knn)
    encoder.train()
    reshard_after_evaluation(encoder)
    return results


def final_summary(metrics: dict[str, float], k: int, final: str, knn: KnnData | None) -> str:
    """The final figures, each next to its raw-pixel baseline on the same held-out images."""
    lines = [f"final model: {final}"]
    if "loss" in metrics:
        lines.append(f"final loss: {metrics['loss']:.4f}")
    if knn is not None:
        held_out = f"{len(knn.query_labels)} held-out images"
        line = f"kNN top-1 (k={k}, {held_out}): raw pixels {metrics['raw_pixels_knn_top1']:.1%},"
        if "knn_top1_init" in metrics:
            line += f" random init {metrics['knn_top1_init']:.1%} ->"
        lines.append(f"{line} trained {metrics['knn_top1']:.1%}")
    if "linear_probe_top1" in metrics:
        raw, trained = metrics["raw_pixels_linear_probe_top1"], metrics["linear_probe_top1"]
        probe = f"linear probe top-1 ({held_out}): raw pixels {raw:.1%}"
        lines.append(f"{probe}, trained {trained:.1%}")
    if "zero_shot_top1" in metrics:
        lines.append(f"zero-shot top-1 ({held_out}): {metrics['zero_shot_top1']:.1%}")
    retrieval = {key: value for key, value in metrics.items() if "@" in key}
    if retrieval:
        figures = ", ".join(f"{key} {value:.3f}" for key, value in retrieval.items())
        lines.append(f"retrieval on the held-out pairs: {figures}")
    return "\n".join(lines)
