"""Every ``--loss``, of every method: one row of ``LOSSES`` each.

A row says how the criterion is made from the run's options (``make``), how a method
calls it on its embeddings (``call``), the options it reads (set with another loss,
they are refused), its own defaults, and, for the two-view methods, the projection head
it wants and whether it needs labels. Which losses a method takes is its families'
business (``Family.losses``, the first the default): SimCLR's eight, text pairs' MNRL
and GISTEmbed, image-text's InfoNCE and SigLIP, which SimCLR also takes on two views.

Every call has one shape, ``call(criterion, model, embeddings, labels, sizes)``:
``embeddings`` the method's columns in order (SimCLR's two views; image-text's images,
then captions; text pairs' anchors, positives, then the negatives), ``model`` the
trained module (a CLIP-style loss reads its learnable scale and bias), ``labels`` the
batch's class ids where the row needs them, ``sizes`` every rank's rows (``losses.inputs``).

Adding a loss, a checklist: the ``nn.Module`` in ``losses/`` (with its export), one row
here, its options as fields of ``LossOptions`` below (a section of ``TrainConfig``), its
name in the families that take it; its tests grow from the table (``tests/test_methods.py``
finds its float64 case in ``tests/loss_cases.py``, a control and a launch case).

Example::

    row = LOSSES["dclw"]
    criterion = row.make(config)                # DCLWLoss(temperature, sigma=...)
    loss = row.call(criterion, model, [z0, z1], None, sizes)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from contrastive_accelerate.config import option
from contrastive_accelerate.methods.base import SIMCLR_HEAD
from losses import (
    BarlowTwinsLoss,
    DCLLoss,
    DCLWLoss,
    GISTEmbedLoss,
    InfoNCELoss,
    MultipleNegativesRankingLoss,
    NTXentLoss,
    SigLIPLoss,
    SupConLoss,
    VICRegLoss,
)
from losses.gist import MARGIN_STRATEGIES


@dataclass
class LossOptions:
    """What the losses read, each its own (``LossRow.options``), and their tiles.
    Declared once here, each a ``--flag`` and a config-file key of ``TrainConfig``
    (``contrastive_accelerate.options``), which holds this section."""

    temperature: float | None = option(
        None, "ntxent, dcl, dclw, supcon, moco, dino: temperature; none 0.5, moco 0.2, dino 0.1",
        resume="apply", above=0.0,
    )  # fmt: skip
    dclw_sigma: float = option(0.5, "dclw: scale of the vMF weights", resume="apply", above=0.0)
    supcon_rescale: bool = option(False, "supcon: loss times the temperature", resume="apply")
    logit_scale_init: float | None = option(
        None, "infonce, siglip: initial learnable scale; none: 1/0.07 and 10", above=0.0
    )
    logit_bias_init: float = option(-10.0, "siglip: initial learnable bias")
    barlow_lambda: float = option(
        5e-3, "barlowtwins: weight of the off-diagonal terms", resume="apply", at_least=0.0
    )
    vicreg_lambda: float = option(
        25.0, "vicreg: weight of the invariance term", resume="apply", at_least=0.0
    )
    vicreg_mu: float = option(
        25.0, "vicreg: weight of the variance term", resume="apply", at_least=0.0
    )
    vicreg_nu: float = option(
        1.0, "vicreg: weight of the covariance term", resume="apply", at_least=0.0
    )
    mnrl_scale: float = option(
        20.0, "mnrl: similarity scale (1 / temperature)", resume="apply", above=0.0
    )
    mnrl_symmetric: bool = option(
        False, "mnrl: also each positive against every anchor", resume="apply"
    )
    mnrl_false_negatives: str = option(
        "keep", "mnrl: identity: no text is a negative of its own copy", resume="apply",
        choices=("keep", "identity"),
    )  # fmt: skip
    gist_guide: str | None = option(
        None, "gist: the frozen guide, a sentence-transformers or transformers folder"
    )
    gist_temperature: float = option(
        0.01, "gist: temperature of the cosine similarities", resume="apply", above=0.0
    )
    gist_margin: float = option(0.0, "gist: how far the guide's margin reaches", resume="apply")
    gist_margin_strategy: str = option(
        "absolute", "gist: the margin absolute or relative to the positive's", resume="apply",
        choices=MARGIN_STRATEGIES,
    )  # fmt: skip
    gist_contrast_anchors: bool = option(
        True, "gist: anchors are each other's negatives too", resume="apply"
    )
    gist_contrast_positives: bool = option(
        True, "gist: positives are each other's negatives too", resume="apply"
    )
    loss_tile_rows: int | None = option(
        None, "loss rows computed at a time; none: dense up to 1 GiB", resume="free", at_least=1
    )


#: The papers' 3-layer 8192-wide projectors, scaled down for small data.
REDUNDANCY_HEAD = (3, 1024, 1024)
#: The CLIP-style losses' initial learnable scale: CLIP's 1 / 0.07, SigLIP's 10.
INITIAL_LOGIT_SCALE = {"infonce": 1 / 0.07, "siglip": 10.0}
# Barlow Twins and VICReg: their papers' LARS at 0.2 (measured on the digits, 4 epochs:
# kNN 92.2%, where SGD at lr 1e-4..3e-3 fell to 42-83%).
PAPERS_LARS = {"optimizer": "lars"}


@dataclass(frozen=True)
class LossRow:
    """One ``--loss``: everything the options and the methods know of it."""

    #: The criterion, from the run's options.
    make: Callable[[Any], nn.Module]
    #: ``call(criterion, model, embeddings, labels, sizes)``: this rank's share of the loss.
    call: Callable[..., torch.Tensor]
    #: The options it reads (besides --loss-tile-rows and the --no-gather control).
    options: tuple[str, ...] = ()
    #: Its own defaults for options left at None, where they differ from the shared ones.
    defaults: dict[str, Any] = field(default_factory=dict)
    #: The projection head a two-view method puts under it: layers, hidden, output width.
    head: tuple[int, int, int] = SIMCLR_HEAD
    #: Whether it needs the dataset's labels.
    labels: bool = False


def in_order(criterion, model, embeddings, labels, sizes):
    """``criterion(*embeddings)``: the two views, or the columns, in order."""
    return criterion(*embeddings, sizes=sizes)


def with_labels(criterion, model, embeddings, labels, sizes):
    """``criterion(z0, z1, labels)``: supervised contrastive."""
    return criterion(*embeddings, labels, sizes=sizes)


def ranked(criterion, model, embeddings, identities, sizes):
    """``criterion(*columns, identities=...)``: the columns, and their texts' identities
    where false negatives are masked (``--mnrl-false-negatives identity``), else None."""
    return criterion(*embeddings, sizes=sizes, identities=identities)


def guided(criterion, model, embeddings, guides, sizes):
    """``criterion(*columns, guides=...)``: GISTEmbed's columns and its guide's embeddings."""
    return criterion(*embeddings, guides=guides, sizes=sizes)


def clip_style(criterion, model, embeddings, labels, sizes):
    """Normalised features and the model's learnable scale (and SigLIP's bias), as in
    open_clip: ``criterion(x, y, log_logit_scale.exp()[, logit_bias])``."""
    x, y = (F.normalize(embedding, dim=1) for embedding in embeddings)
    scale = model.log_logit_scale.exp()
    if isinstance(criterion, SigLIPLoss):
        return criterion(x, y, scale, model.logit_bias, sizes=sizes)
    return criterion(x, y, scale, sizes=sizes)


def shared(config) -> dict[str, Any]:
    """The keywords every loss takes from the options: the --no-gather control."""
    return {"gather_distributed": config.gather}


def tiled(config) -> dict[str, Any]:
    """``shared``, and the rows a tiled loss computes at a time."""
    return {**shared(config), "tile_rows": config.loss_tile_rows}


LOSSES: dict[str, LossRow] = {
    "ntxent": LossRow(lambda c: NTXentLoss(c.temperature, **tiled(c)), in_order, ("temperature",)),
    "dcl": LossRow(lambda c: DCLLoss(c.temperature, **tiled(c)), in_order, ("temperature",)),
    "dclw": LossRow(
        lambda c: DCLWLoss(c.temperature, sigma=c.dclw_sigma, **tiled(c)),
        in_order,
        ("temperature", "dclw_sigma"),
    ),
    "supcon": LossRow(
        lambda c: SupConLoss(c.temperature, rescale=c.supcon_rescale, **tiled(c)),
        with_labels,
        ("temperature", "supcon_rescale"),
        labels=True,
    ),
    "infonce": LossRow(
        lambda c: InfoNCELoss(**tiled(c)),
        clip_style,
        ("logit_scale_init",),
        defaults={"logit_scale_init": INITIAL_LOGIT_SCALE["infonce"]},
    ),
    "siglip": LossRow(
        lambda c: SigLIPLoss(tile_columns=c.loss_tile_rows, **shared(c)),
        clip_style,
        ("logit_scale_init", "logit_bias_init"),
        defaults={"logit_scale_init": INITIAL_LOGIT_SCALE["siglip"]},
    ),
    "barlowtwins": LossRow(
        lambda c: BarlowTwinsLoss(c.barlow_lambda, **shared(c)),
        in_order,
        ("barlow_lambda",),
        defaults=PAPERS_LARS,
        head=REDUNDANCY_HEAD,
    ),
    "vicreg": LossRow(
        lambda c: VICRegLoss(c.vicreg_lambda, c.vicreg_mu, c.vicreg_nu, **shared(c)),
        in_order,
        ("vicreg_lambda", "vicreg_mu", "vicreg_nu"),
        defaults=PAPERS_LARS,
        head=REDUNDANCY_HEAD,
    ),
    "mnrl": LossRow(
        lambda c: MultipleNegativesRankingLoss(
            c.mnrl_scale, symmetric=c.mnrl_symmetric, **tiled(c)
        ),
        ranked,  # anchors, positives, then each negative column
        ("mnrl_scale", "mnrl_symmetric", "mnrl_false_negatives"),
    ),
    "gist": LossRow(
        lambda c: GISTEmbedLoss(
            c.gist_temperature,
            c.gist_margin_strategy,
            c.gist_margin,
            c.gist_contrast_anchors,
            c.gist_contrast_positives,
            **tiled(c),
        ),  # fmt: skip
        guided,  # the columns as mnrl's, and the guide's embeddings of them
        (
            "gist_guide",
            "gist_temperature",
            "gist_margin",
            "gist_margin_strategy",
            "gist_contrast_anchors",
            "gist_contrast_positives",
        ),
    ),  # fmt: skip
}

#: The options of the losses: each reads its own (``LossRow.options``).
LOSS_OPTIONS = tuple(dict.fromkeys(name for row in LOSSES.values() for name in row.options))


def options_of(losses: Sequence[str]) -> tuple[str, ...]:
    """The options that the rows of ``losses`` read, each once."""
    return tuple(dict.fromkeys(name for loss in losses for name in LOSSES[loss].options))
