"""Check your own code: one process's result on N processes, for losses and training scripts.

A loss is *exact on W processes* when, with the global batch split over W ranks (evenly,
unevenly, one rank empty), the mean of the per-rank values is the single-process loss
and DDP's gradient average is the single-process gradient: every input row's gradient
divided by W on the rank that holds it, and every parameter's gradient averaged over
ranks. ``assert_loss_invariant`` checks exactly that on real gloo processes::

    from functools import partial
    from contrastive_accelerate.testing import assert_loss_invariant

    def make_inputs():
        g = torch.Generator().manual_seed(0)
        return torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g)

    def test_my_loss_is_exact():
        assert_loss_invariant(partial(MyLoss, temperature=0.1), make_inputs)

``make_loss`` and ``make_inputs`` must be importable (module-level functions or
``functools.partial`` of them): they are called in every worker. Tensors whose first
dimension is the global batch size (that of the first tensor) are split by rows with
the embeddings (labels, further views, hard negatives); everything else goes whole to
every rank. ``assert_training_invariant`` runs a training script under ``accelerate
launch`` on 1 and N CPU processes and diffs the final checkpoints; the console script
``invariance-check`` does the same without pytest.

What the checks cannot see: randomness (dropout, augmentation: feed none, or key it by
sample), state kept across steps (queues, centers, EMA teachers: one call is one step),
and anything the check does not feed (a model's BatchNorm when you check a loss alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from contrastive_accelerate.compat import TorchDispatchMode
from contrastive_accelerate.invariance_check import (
    assert_training_invariant,
    final_checkpoint,
    launch_command,
)
from contrastive_accelerate.workers import (
    COLLECTIVE_TIMEOUT_S,
    MAX_POOLED_WORKERS,
    free_port,
    run_in_group,
    run_in_workers,
    run_on_ranks,
)


@dataclass
class SplitFigures:
    """The check of one split: the worst difference of each compared tensor."""

    sizes: list[int]
    errors: dict[str, float]  # "value", "input 0", "parameter temperature", ...
    own_loss_only: bool = False  # every rank's rows received only its own loss's gradient
    times_w: dict[str, float] = field(default_factory=dict)  # the input errors after x W
    raised: str | None = None  # what a rank raised, when the loss did not run to its end

    @property
    def worst(self) -> tuple[str, float]:
        if self.raised is not None:
            return "the loss raised", math.inf
        return max(self.errors.items(), key=lambda item: item[1])


@dataclass
class InvarianceReport:
    """What ``assert_loss_invariant`` measured: every split it ran, and its tolerance."""

    atol: float
    splits: list[SplitFigures] = field(default_factory=list)

    @property
    def worst(self) -> float:
        return max((split.worst[1] for split in self.splits), default=0.0)


def default_splits(total: int, world_size: int) -> list[list[int]]:
    """Even, uneven and with an empty last rank: how ``total`` rows meet ``world_size`` ranks."""
    even = [len(part) for part in torch.arange(total).tensor_split(world_size)]
    uneven = list(even)
    if uneven[-1] > 0:
        uneven[0], uneven[-1] = uneven[0] + 1, uneven[-1] - 1
    empty = [len(part) for part in torch.arange(total).tensor_split(world_size - 1)] + [0]
    return [even, uneven, empty]


def assert_loss_invariant(
    make_loss: Callable[[], Callable[..., torch.Tensor]],
    make_inputs: Callable[[], Sequence[Any]],
    world_sizes: Sequence[int] = (2, 3),
    splits: dict[int, list[list[int]]] | None = None,
    dtype: torch.dtype = torch.float64,
    atol: float = 1e-10,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
) -> InvarianceReport:
    """Assert that ``make_loss()(*make_inputs())`` is exact on every world size and split.

    Compares, against one process on the whole batch (in this process): the mean of the
    per-rank values, every floating input's gradient (divided by W, as DDP's average
    sees it) and every parameter's gradient of the loss module (a learnable
    temperature), after an asymmetric upstream (rank r's rows are scaled by 1 + r/4,
    so that gradients sent to the wrong rank cannot cancel). ``splits``: per world
    size, the per-rank row counts (default: ``default_splits``). ``dtype``: floating
    inputs are cast to it; float64 leaves only summation order between the runs, so
    ``atol`` 1e-10 is generous. A collective that waits longer than ``timeout_s`` fails
    the check instead of hanging it.

    Raises ``AssertionError`` naming the worst tensor, its difference and the split,
    with a diagnosis where the pattern is known; returns the figures otherwise.
    """
    inputs = make_inputs()
    total = _global_rows(inputs)
    report = InvarianceReport(atol)
    for world_size in world_sizes:
        for sizes in (splits or {}).get(world_size) or default_splits(total, world_size):
            if sum(sizes) != total or len(sizes) != world_size:
                raise ValueError(f"split {sizes} does not give {total} rows to {world_size} ranks")
            reference = _evaluate(make_loss, make_inputs, dtype, sizes, None)
            try:
                per_rank = run_in_group(
                    _check_on_rank,
                    world_size,
                    (make_loss, make_inputs, dtype, sizes),
                    timeout_s=timeout_s + 30,
                    collective_timeout_s=timeout_s,
                )
            except TimeoutError as error:
                raise AssertionError(
                    f"rows {sizes}: the loss did not finish within {timeout_s:g} s on "
                    f"{world_size} processes ({error}): a collective is waiting for a rank "
                    "that never joins it"
                ) from None
            except RuntimeError as error:  # a rank raised (stuck workers were replaced)
                report.splits.append(SplitFigures(list(sizes), {}, raised=_last_line(error)))
                continue
            report.splits.append(_compare(reference, per_rank, sizes))
    failing = [split for split in report.splits if not split.worst[1] <= atol]
    if failing:
        raise AssertionError(_failure_message(report, failing))
    return report


def _last_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(error).__name__


def _global_rows(inputs: Sequence[Any]) -> int:
    tensors = [value for value in _values(inputs) if isinstance(value, torch.Tensor)]
    if not tensors or tensors[0].dim() == 0:
        raise ValueError("make_inputs must return the global batch: a tensor of rows first")
    return tensors[0].shape[0]


def _values(inputs) -> list[Any]:
    return list(inputs.values()) if isinstance(inputs, dict) else list(inputs)


def _evaluate(make_loss, make_inputs, dtype, sizes: list[int], rank: int | None) -> dict:
    """The loss on one rank's rows (``rank``) or on all of them (None), and its gradients."""
    torch.manual_seed(0)  # the same loss parameters everywhere
    loss_fn = make_loss()
    inputs = make_inputs()
    names = list(inputs) if isinstance(inputs, dict) else list(range(len(inputs)))
    values = _values(inputs)
    total = _global_rows(inputs)
    rows = slice(0, total) if rank is None else slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    owner_scale = torch.cat(
        [torch.full((size,), 1 + owner / 4, dtype=dtype) for owner, size in enumerate(sizes)]
    )
    leaves, local = {}, []
    for name, value in zip(names, values, strict=True):
        is_rows = isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == total
        if is_rows and value.is_floating_point():
            leaf = value.to(dtype)[rows].clone().requires_grad_()
            leaves[name] = leaf
            scale = owner_scale[rows].view(-1, *([1] * (value.dim() - 1)))
            value = leaf * scale
        elif is_rows:
            value = value[rows]
        local.append(value)
    if isinstance(loss_fn, torch.nn.Module):
        loss_fn = loss_fn.to(dtype)
    call = dict(zip(names, local, strict=True)) if isinstance(inputs, dict) else None
    loss = loss_fn(**call) if call is not None else loss_fn(*local)
    parameters = dict(loss_fn.named_parameters()) if isinstance(loss_fn, torch.nn.Module) else {}
    targets = [*leaves.values(), *parameters.values()]
    grads = torch.autograd.grad(loss, targets, allow_unused=True) if loss.requires_grad else []
    grads = list(grads) or [None] * len(targets)
    grads = [
        torch.zeros_like(t) if g is None else g.detach()
        for t, g in zip(targets, grads, strict=True)
    ]
    input_grads, parameter_grads = grads[: len(leaves)], grads[len(leaves) :]
    return {
        "value": loss.detach().to(torch.float64),
        "inputs": {f"input {n}": g for n, g in zip(leaves, input_grads, strict=True)},
        "parameters": {
            f"parameter {n}": g for n, g in zip(parameters, parameter_grads, strict=True)
        },
    }


def _check_on_rank(rank: int, world_size: int, make_loss, make_inputs, dtype, sizes) -> dict:
    """One rank's share of the check: what DDP would see, and whether this rank's rows got
    only its own loss's gradient (the loss of every rank scaled by 1 + rank: for an exact
    loss the rows' gradient mixes the scales; for an own-loss-only one it is c_r times it)."""
    import torch.distributed as dist

    result = _evaluate(make_loss, make_inputs, dtype, sizes, rank)
    value = result["value"].clone()
    dist.all_reduce(value)
    parameters = {}
    for name, grad in result["parameters"].items():
        grad = grad.clone()
        dist.all_reduce(grad)  # what DDP does with a parameter's gradient, then / W
        parameters[name] = (grad / world_size).tolist()

    def scaled_make_loss():
        loss_fn = make_loss()
        return lambda *a, **k: (1 + rank) * loss_fn(*a, **k)

    scaled = _evaluate(scaled_make_loss, make_inputs, dtype, sizes, rank)
    own = all(
        torch.allclose(scaled["inputs"][name], (1 + rank) * grad, rtol=1e-9, atol=1e-12)
        for name, grad in result["inputs"].items()
    )
    own_everywhere = torch.tensor([int(own)])
    dist.all_reduce(own_everywhere, op=dist.ReduceOp.MIN)
    return {
        "value": (value / world_size).item(),
        "inputs": {name: (grad / world_size).tolist() for name, grad in result["inputs"].items()},
        "parameters": parameters,
        "own_loss_only": bool(own_everywhere.item()),
    }


def _compare(reference: dict, per_rank: list[dict], sizes: list[int]) -> SplitFigures:
    errors = {"value": abs(per_rank[0]["value"] - reference["value"].item())}
    for name, grad in reference["inputs"].items():
        distributed = torch.cat([torch.tensor(rank["inputs"][name], dtype=grad.dtype).view(
            -1, *grad.shape[1:]) for rank in per_rank])  # fmt: skip
        errors[name] = _max_abs(distributed, grad)
        errors[f"{name} (x W)"] = _max_abs(distributed * len(sizes), grad)
    for name, grad in reference["parameters"].items():
        distributed = torch.tensor(per_rank[0]["parameters"][name], dtype=grad.dtype)
        errors[name] = _max_abs(distributed.view_as(grad), grad)
    figures = {name: error for name, error in errors.items() if not name.endswith("(x W)")}
    times_w = {name: error for name, error in errors.items() if name.endswith("(x W)")}
    return SplitFigures(list(sizes), figures, per_rank[0]["own_loss_only"], times_w)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _failure_message(report: InvarianceReport, failing: list[SplitFigures]) -> str:
    worst_split = max(failing, key=lambda split: split.worst[1])
    name, error = worst_split.worst
    processes = f"not exact on {len(worst_split.sizes)} processes"
    if worst_split.raised is not None:
        lines = [f"{processes}: with per-rank rows {worst_split.sizes} a rank raised: "
                 f"{worst_split.raised}"]  # fmt: skip
    else:
        lines = [f"{processes}: {name} differs by {error:.3e} (atol {report.atol:g}) with "
                 f"per-rank rows {worst_split.sizes}"]  # fmt: skip
    diagnosis = diagnose(report)
    if diagnosis:
        lines.append(f"diagnosis: {diagnosis}")
    for split in report.splits:
        worst = (
            f"raised: {split.raised}"
            if split.raised
            else f"worst {split.worst[0]} " + (f"{split.worst[1]:.3e}")
        )
        lines.append(f"  rows {split.sizes}: {worst}")
    return "\n".join(lines)


def diagnose(report: InvarianceReport) -> str | None:
    """The known patterns behind a failed check, if they are known ones."""
    bad = [split for split in report.splits if not split.worst[1] <= report.atol]
    raised = [split for split in bad if split.raised is not None]
    numeric = [split for split in bad if split.raised is None]
    found = []
    if raised and all(len(set(split.sizes)) > 1 for split in raised):
        found.append(
            "it raises when the ranks hold different numbers of rows: a collective that needs "
            "equal sizes (dist.all_gather, torch.distributed.nn.all_gather)"
        )
    elif raised:
        found.append("it raises on a rank (see the rows below)")
    if numeric:
        found.append(_numeric_diagnosis(report, numeric))
    found = [text for text in found if text]
    return "; and ".join(found) or None


def _numeric_diagnosis(report: InvarianceReport, bad: list[SplitFigures]) -> str | None:
    ran = [split for split in report.splits if split.raised is None]
    even = [split for split in ran if len(set(split.sizes)) == 1]
    if even and all(split.worst[1] <= report.atol for split in even):
        return (
            "correct on even splits, wrong on uneven ones: offsets computed as rank * n "
            "(positives at arange(n) + rank * n, or a mean per rank) assume equal batches"
        )
    inputs_only = all(split.errors["value"] <= report.atol for split in bad)
    times_w = all(
        all(error <= max(report.atol, 1e-9) for error in split.times_w.values()) for split in bad
    )
    if inputs_only and times_w:
        return (
            "every gradient is the true one times 1/W: an all-reduce (or gather) without "
            "gradient, so each rank's rows receive only their own rank's copy of the loss"
        )
    # Observable only where two ranks hold rows: one rank alone has no one else's loss.
    mixed = [split for split in bad if sum(map(bool, split.sizes)) >= 2]
    if inputs_only and mixed and all(split.own_loss_only for split in bad):
        return (
            "each rank's rows receive only the gradient of that rank's own loss: a gather "
            "whose backward returns the local slice (the classic GatherLayer) or drops the "
            "gradient (Accelerator.gather, dist.all_gather)"
        )
    if not inputs_only:
        return (
            "the loss value itself differs from one process's: it is computed from per-rank "
            "statistics or negatives (a per-rank softmax, mean or standardisation), not from "
            "the global batch"
        )
    return None


class HostSyncs:
    """Counts, inside a ``with`` block, the operations that make the host wait for the
    device on CUDA, also when everything runs on the CPU (where none of them waits)::

        with HostSyncs() as syncs:
            loss = criterion(z0, z1)
            loss.backward()
        assert syncs.seen == []

    Seen: reading a value (``item()``, ``bool()``, ``float()``: ``_local_scalar_dense``),
    building a tensor from host data (``torch.tensor``: a copy to the device),
    data-dependent shapes (``nonzero``, ``masked_select``, ``unique``, ``bincount``,
    indexing with a boolean mask) and ``tolist()``, ``numpy()``, ``cpu()`` of a tensor.
    ``seen`` lists them in order. Operators are seen through a ``TorchDispatchMode`` on
    this thread, so work in other threads (the loader's workers, autograd's device
    threads) is not counted.
    """

    _READS = (
        "aten._local_scalar_dense",
        "aten.nonzero",
        "aten.masked_select",
        "aten._unique",
        "aten.unique",
        "aten.bincount",
        "aten.lift_fresh",
    )
    _INDEXING = ("aten.index.Tensor", "aten.index_put")
    _HOST_COPIES = ("tolist", "numpy", "cpu")

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._mode = _SyncMode(self.seen)
        self._patched: dict[str, Any] = {}

    def __enter__(self) -> HostSyncs:
        for name in self._HOST_COPIES:
            original = getattr(torch.Tensor, name)
            self._patched[name] = original
            setattr(torch.Tensor, name, _counted(original, f"Tensor.{name}", self.seen))
        self._mode.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self._mode.__exit__(*exc_info)
        for name, original in self._patched.items():
            setattr(torch.Tensor, name, original)
        self._patched.clear()


def _counted(method, name: str, seen: list[str]):
    def wrapper(self, *args, **kwargs):
        seen.append(name)
        return method(self, *args, **kwargs)

    return wrapper


class _SyncMode(TorchDispatchMode):
    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(HostSyncs._READS) or (
            name.startswith(HostSyncs._INDEXING) and _has_boolean_index(args)
        ):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def _has_boolean_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in indices or ()
    )


__all__ = [
    "COLLECTIVE_TIMEOUT_S",
    "MAX_POOLED_WORKERS",
    "free_port",
    "InvarianceReport",
    "SplitFigures",
    "assert_loss_invariant",
    "assert_training_invariant",
    "default_splits",
    "diagnose",
    "final_checkpoint",
    "launch_command",
    "run_in_workers",
    "run_on_ranks",
]
