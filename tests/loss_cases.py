"""The losses of ``losses`` as test cases: how to build each, its plain reference, what its
forward takes, and the broken variants (negative controls) that must miss the reference.
Shared by the distributed harness (test_losses) and the mixed-precision tests."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from contrastive_accelerate import collectives
from contrastive_accelerate.collectives import all_gather_rows, all_gather_sizes
from losses import (
    BarlowTwinsLoss,
    DCLLoss,
    DCLWLoss,
    GISTEmbedLoss,
    InfoNCELoss,
    KoLeoLoss,
    MultipleNegativesRankingLoss,
    NTXentLoss,
    SigLIPLoss,
    SupConLoss,
    VICRegLoss,
)

import references

FEATURES = 5
TEMPERATURE = 0.3
MNRL_SCALE = 20.0  # sentence-transformers' default


def no_grad_gather(x, group=None, sizes=None, **_):
    """Known-bad: no gradient to any rank, as with ``Accelerator.gather``."""
    return all_gather_rows(x, group, sizes)


class _LocalSliceGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.rank = sizes, dist.get_rank(group)
        return all_gather_rows(x, group, sizes)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.split(ctx.sizes)[ctx.rank], None, None


def local_slice_gather(x, group=None, sizes=None, **_):
    """Known-bad: the classic ``GatherLayer``, this rank's slice of its own gradient only."""
    sizes = sizes or all_gather_sizes(x, group)[0]
    return _LocalSliceGather.apply(x, sizes, group)


class _SliceThenAllReduceGather(_LocalSliceGather):
    @staticmethod
    def backward(ctx, grad_output):
        local = grad_output.split(ctx.sizes)[ctx.rank]
        padded = local.new_zeros((max(ctx.sizes), *local.shape[1:]))
        padded[: len(local)] = local
        dist.all_reduce(padded)
        return padded[: len(local)], None, None


def slice_then_all_reduce_gather(x, group=None, sizes=None, **_):
    """Known-bad: this rank's slice, then all-reduced (it sums other ranks' rows)."""
    sizes = sizes or all_gather_sizes(x, group)[0]
    return _SliceThenAllReduceGather.apply(x, sizes, group)


class _NoGradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        total = x.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


def no_grad_all_reduce(x, group=None):
    """Known-bad: an in-place ``dist.all_reduce``; each rank's input gets only its own
    loss's gradient (lightly issues #1920, #1977)."""
    return _NoGradAllReduce.apply(x)


class PerRankSoftmaxDCLW(DCLWLoss):
    """lightly's DCLW weights: softmax and N of this rank's batch only."""

    def _positive_weights(self, views):
        with torch.no_grad():
            similarity = (views.z0 * views.z1).sum(dim=1) / self.sigma
            weights = 2 - len(views.z0) * torch.softmax(similarity, dim=0)
        return weights, weights


class PerRankKoLeo(KoLeoLoss):
    """DINOv2's and lightly's KoLeo: each sample's neighbour among its own rank's rows."""

    def neighbours(self, z, every, offset):
        return offset + super().neighbours(z, z, 0)


class PerRankStandardisedBarlowTwins(BarlowTwinsLoss):
    """lightly's Barlow Twins standardisation: each rank's own mean and variance."""

    def _standardised(self, z, count, distributed):
        return F.batch_norm(z, None, None, training=True, eps=self.eps) if len(z) else z


@dataclass
class Case:
    """A loss, its reference on the whole batch, and what else its forward takes."""

    make: Callable[[], torch.nn.Module]
    reference: Callable[..., torch.Tensor]
    extra: str = ""  # "labels", "guides", "scale", "scale_bias", or "single": one input
    controls: dict[str, Callable[[], object]] = field(default_factory=dict)


GATHER_CONTROLS = {"no_grad_gather": lambda: Patched("gather", no_grad_gather)}
REDUCE_CONTROLS = {"no_grad_all_reduce": lambda: Patched("all_reduce", no_grad_all_reduce)}

CASES = {
    "ntxent": Case(
        lambda: NTXentLoss(TEMPERATURE),
        lambda a, b: references.ntxent(a, b, TEMPERATURE),
        controls={
            **GATHER_CONTROLS,
            "local_slice_gather": lambda: Patched("gather", local_slice_gather),
        },
    ),
    "ntxent_tiled": Case(
        lambda: NTXentLoss(TEMPERATURE, tile_rows=2),
        lambda a, b: references.ntxent(a, b, TEMPERATURE),
    ),
    "dcl": Case(
        lambda: DCLLoss(TEMPERATURE),
        lambda a, b: references.dcl(a, b, TEMPERATURE),
        controls=GATHER_CONTROLS,
    ),
    "dclw": Case(
        lambda: DCLWLoss(TEMPERATURE, sigma=0.5),
        lambda a, b: references.dclw(a, b, TEMPERATURE, 0.5),
        controls={"per_rank_softmax": lambda: PerRankSoftmaxDCLW(TEMPERATURE, sigma=0.5)},
    ),
    "supcon": Case(
        lambda: SupConLoss(TEMPERATURE),
        lambda a, b, labels: references.supcon(a, b, labels, TEMPERATURE),
        extra="labels",
        controls=GATHER_CONTROLS,
    ),
    "supcon_tiled_unlabelled": Case(
        lambda: SupConLoss(TEMPERATURE, tile_rows=3),
        lambda a, b: references.ntxent(a, b, TEMPERATURE),
    ),
    "infonce": Case(
        lambda: InfoNCELoss(), references.infonce, extra="scale", controls=GATHER_CONTROLS
    ),
    "infonce_tiled": Case(lambda: InfoNCELoss(tile_rows=2), references.infonce, extra="scale"),
    "siglip": Case(
        lambda: SigLIPLoss(), references.siglip, extra="scale_bias", controls=GATHER_CONTROLS
    ),
    "siglip_tiled": Case(lambda: SigLIPLoss(tile_columns=2), references.siglip, extra="scale_bias"),
    "mnrl": Case(
        lambda: MultipleNegativesRankingLoss(MNRL_SCALE),
        lambda a, b: references.mnrl(a, b, scale=MNRL_SCALE),
        controls=GATHER_CONTROLS,
    ),
    "mnrl_symmetric": Case(
        lambda: MultipleNegativesRankingLoss(MNRL_SCALE, symmetric=True, tile_rows=2),
        lambda a, b: references.mnrl(a, b, scale=MNRL_SCALE, symmetric=True),
        controls=GATHER_CONTROLS,
    ),
    # The guide: the inputs themselves, detached (a frozen copy of the trained model).
    "gist": Case(
        lambda: GISTEmbedLoss(temperature=0.5, margin=0.05),
        lambda a, b, guides: references.gist(a, b, guides, temperature=0.5, margin=0.05),
        extra="guides",
        controls=GATHER_CONTROLS,
    ),
    "koleo": Case(
        lambda: KoLeoLoss(),
        references.koleo,
        extra="single",
        controls={**GATHER_CONTROLS, "per_rank_neighbours": lambda: PerRankKoLeo()},
    ),
    "barlowtwins": Case(
        lambda: BarlowTwinsLoss(lambda_param=0.1),
        lambda a, b: references.barlow_twins(a, b, 0.1),
        controls={
            **REDUCE_CONTROLS,
            "per_rank_standardisation": lambda: PerRankStandardisedBarlowTwins(lambda_param=0.1),
        },
    ),
    "vicreg": Case(
        lambda: VICRegLoss(),
        lambda a, b: references.vicreg(a, b, 25.0, 25.0, 1.0, 1e-4),
        controls=REDUCE_CONTROLS,
    ),
}


class Patched:
    """Context: ``contrastive_accelerate.collectives.<name>``, which the losses call, replaced
    by a broken implementation."""

    def __init__(self, name: str, replacement) -> None:
        self.name, self.replacement = name, replacement

    def __enter__(self):
        self.original = getattr(collectives, self.name)
        setattr(collectives, self.name, self.replacement)

    def __exit__(self, *exc_info):
        setattr(collectives, self.name, self.original)


def global_batch(total: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    out0 = torch.randn(total, FEATURES, generator=generator, dtype=torch.float64)
    out1 = out0 + 0.7 * torch.randn(total, FEATURES, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 3, (total,), generator=generator)
    return {"out0": out0, "out1": out1, "labels": labels}


def owner_scales(sizes: list[int]) -> torch.Tensor:
    """Rank r's rows are multiplied by 1 + r / 4 before the loss (an asymmetric upstream)."""
    return torch.cat(
        [
            torch.full((size, 1), 1 + rank / 4, dtype=torch.float64)
            for rank, size in enumerate(sizes)
        ]
    )


def call(case: Case, loss_fn, out0, out1, labels, log_scale=None, bias=None) -> torch.Tensor:
    """``loss_fn`` on a batch, with what the case's forward takes besides the two inputs."""
    if case.extra == "single":
        return loss_fn(out0)
    if case.extra == "labels":
        return loss_fn(out0, out1, labels)
    if case.extra == "guides":
        return loss_fn(out0, out1, guides=(out0.detach(), out1.detach()))
    if case.extra in ("scale", "scale_bias"):
        log_scale = torch.tensor(math.log(1.5)) if log_scale is None else log_scale
        bias = torch.tensor(-1.5) if bias is None else bias
        if case.extra == "scale":
            return loss_fn(out0, out1, log_scale.exp())
        return loss_fn(out0, out1, log_scale.exp(), bias)
    return loss_fn(out0, out1)


def evaluate(case: Case, loss_fn, out0, out1, labels, scales):
    """The loss and the gradients of its inputs and of the learnable scale and bias."""
    out0, out1 = out0.clone().requires_grad_(), out1.clone().requires_grad_()
    log_scale = torch.tensor(math.log(1.5), dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(-1.5, dtype=torch.float64, requires_grad=True)
    loss = call(case, loss_fn, out0 * scales, out1 * scales, labels, log_scale, bias)
    loss.backward()
    grad0, grad1 = (x.grad if x.grad is not None else torch.zeros_like(x) for x in (out0, out1))
    scalar_grads = torch.stack(
        [g if g is not None else torch.zeros(()) for g in (log_scale.grad, bias.grad)]
    ).double()
    return loss.detach(), grad0, grad1, scalar_grads


def max_abs(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
