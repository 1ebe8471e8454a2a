"""The other gathered losses against the peers that have them: time and extra peak memory.

One process, float32, forward+backward. Each loss and its peer (lightly or
open_clip) alternate within one process for time (median of ``repeats``); memory is
measured in a fresh subprocess as for NT-Xent (``benchmarks.loss``: VmHWM minus the
RSS once the inputs exist). Barlow Twins and VICReg use their papers' embedding width
(d = 2048), the others d = 128.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from benchmarks.fresh_process import in_fresh_process, memory_status_bytes

WIDTH = {"barlowtwins": 2048, "vicreg": 2048}


def make(name: str, implementation: str):
    """(loss module, what its forward takes besides the two inputs)."""
    import losses

    if implementation == "ours":
        return {
            "dcl": (losses.DCLLoss(0.1), ""),
            "dclw": (losses.DCLWLoss(0.1, sigma=0.5), ""),
            "infonce": (losses.InfoNCELoss(), "scale"),
            "siglip": (losses.SigLIPLoss(), "scale_bias"),
            "barlowtwins": (losses.BarlowTwinsLoss(), ""),
            "vicreg": (losses.VICRegLoss(), ""),
        }[name]
    if name in ("infonce", "siglip"):
        import open_clip.loss

        if name == "infonce":
            return open_clip.loss.ClipLoss(), "scale"
        return open_clip.loss.SigLipLoss(), "scale_bias"
    import lightly.loss

    return {
        "dcl": lambda: (lightly.loss.DCLLoss(0.1), ""),
        "dclw": lambda: (lightly.loss.DCLWLoss(0.1, sigma=0.5), ""),
        "barlowtwins": lambda: (lightly.loss.BarlowTwinsLoss(), ""),
        "vicreg": lambda: (lightly.loss.VICRegLoss(), ""),
    }[name]()


def peer_of(name: str) -> str:
    return "open_clip" if name in ("infonce", "siglip") else "lightly"


def _inputs(name: str, pairs: int):
    generator = torch.Generator().manual_seed(0)
    dim = WIDTH.get(name, 128)
    out0 = torch.randn(pairs, dim, generator=generator)
    out1 = out0 + 0.3 * torch.randn(pairs, dim, generator=generator)
    if name in ("infonce", "siglip"):  # CLIP towers hand over normalised features
        out0, out1 = out0 / out0.norm(dim=1, keepdim=True), out1 / out1.norm(dim=1, keepdim=True)
    return out0.requires_grad_(), out1.requires_grad_()


def _forward_backward(loss_fn, extra: str, out0, out1) -> float:
    out0.grad = out1.grad = None
    if extra == "scale":
        loss = loss_fn(out0, out1, torch.tensor(1 / 0.07))
    elif extra == "scale_bias":
        loss = loss_fn(out0, out1, torch.tensor(10.0), torch.tensor(-10.0))
    else:
        loss = loss_fn(out0, out1)
    loss.backward()
    return loss.item()


def time_against_peer(name: str, pairs: int, repeats: int = 5) -> dict:
    out0, out1 = _inputs(name, pairs)
    made = {impl: make(name, impl) for impl in ("ours", "peer")}
    values = {impl: _forward_backward(*made[impl], out0, out1) for impl in made}  # warm-up
    seconds: dict[str, list[float]] = {impl: [] for impl in made}
    for repeat in range(repeats):
        order = list(made) if repeat % 2 else list(reversed(made))  # no position bias
        for impl in order:
            started = time.perf_counter()
            _forward_backward(*made[impl], out0, out1)
            seconds[impl].append(time.perf_counter() - started)
    return {
        "seconds": {impl: statistics.median(values_) for impl, values_ in seconds.items()},
        "value_diff": abs(values["ours"] - values["peer"]),
        "relative_value_diff": abs(values["ours"] - values["peer"]) / max(1.0, abs(values["peer"])),
    }


def _measure_here(name: str, implementation: str, pairs: int) -> dict:
    loss_fn, extra = make(name, implementation)
    out0, out1 = _inputs(name, pairs)
    baseline = memory_status_bytes("VmRSS")
    _forward_backward(loss_fn, extra, out0, out1)
    return {"extra_peak_bytes": max(0, memory_status_bytes("VmHWM") - baseline)}


def peak_memory(name: str, implementation: str, pairs: int, timeout: int = 900) -> dict:
    return in_fresh_process(
        "benchmarks.loss_family", "_measure_here", name, implementation, pairs, timeout=timeout
    )


def run(pairs: int, repeats: int) -> list[dict]:
    rows = []
    for name in ("dcl", "dclw", "infonce", "siglip", "barlowtwins", "vicreg"):
        timing = time_against_peer(name, pairs, repeats)
        memory = {impl: peak_memory(name, impl, pairs) for impl in ("ours", "peer")}
        rows.append(
            {"loss": name, "peer": peer_of(name), "pairs": pairs, "dim": WIDTH.get(name, 128),
             **timing, "memory": memory}
        )  # fmt: skip
        print(f"{name} vs {peer_of(name)}: done", flush=True)
    return rows


def table_lines(rows: list[dict]) -> list[str]:
    mib = 2**20
    lines = [
        f"The loss family against its peers, forward+backward, fp32, 1 process, "
        f"N = {rows[0]['pairs']} pairs (median time; extra peak memory)",
        "",
        "| loss | d | peer | ours | peer's | time ratio | memory ratio | value diff (relative) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        seconds, memory = row["seconds"], row["memory"]
        ours_bytes = memory["ours"].get("extra_peak_bytes", math.nan)
        peer_bytes = memory["peer"].get("extra_peak_bytes", math.nan)
        lines.append(
            f"| {row['loss']} | {row['dim']} | {row['peer']} | "
            f"{seconds['ours']:.3f} s; {ours_bytes / mib:.0f} MiB | "
            f"{seconds['peer']:.3f} s; {peer_bytes / mib:.0f} MiB | "
            f"{seconds['ours'] / seconds['peer']:.2f} | "
            f"{ours_bytes / peer_bytes if peer_bytes else math.nan:.2f} | "
            f"{row['relative_value_diff']:.1e} |"
        )
    return lines
