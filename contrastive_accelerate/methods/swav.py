"""SwAV (Caron et al., 2020): online clustering of multi-crop views onto learnt
prototypes, each global crop's codes (a Sinkhorn-Knopp over the global batch and a
queue) predicted from every other crop."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from contrastive_accelerate.collectives import is_distributed
from contrastive_accelerate.config import field_names, option
from contrastive_accelerate.data import MultiCropBatch
from contrastive_accelerate.data.sources import ImageData
from contrastive_accelerate.methods.base import (
    EVERY_SOURCE,
    IMAGE_METHOD_TOWERS,
    SIMCLR_HEAD,
    Family,
    Method,
    MethodRow,
    PastKeys,
    Say,
    head_shape,
    image_data,
    image_model,
)
from contrastive_accelerate.methods.momentum import QUEUE_OPTIONS, QueueOptions
from contrastive_accelerate.methods.multicrop import (
    MULTICROP_OPTIONS,
    MultiCropOptions,
    check_crops,
    crop_defaults,
    crop_outputs,
    embed_multicrop,
    multicrop_dataset,
)
from losses.swav import SwAVLoss
from models.swav import SwAVModel


@dataclass
class SwAVOptions:
    """What only SwAV reads, a section of ``TrainConfig``
    (``contrastive_accelerate.options``); its queue is ``--queue-size``'s."""

    prototypes: int | None = option(None, "swav: prototypes; none: 3000 (digits: 30)", at_least=2)
    sinkhorn_epsilon: float = option(0.05, "swav: Sinkhorn-Knopp's temperature", above=0.0)
    sinkhorn_iterations: int = option(3, "swav: Sinkhorn-Knopp's iterations", at_least=1)
    freeze_prototypes_steps: int | None = option(
        None, "swav: steps the prototypes stay frozen; none: 313 (SwAV's; digits: 20)",
        resume="apply", at_least=0,
    )  # fmt: skip


class SwAVMethod(Method):
    """SwAV: ``SwAVModel`` (a tower, SimCLR's head, normalised projections ``z`` and their
    scores against the prototypes) on multi-crop views, ``SwAVLoss`` over the global
    batch.

    The codes of each global crop come from ``losses.sinkhorn_knopp`` over the global
    batch and, once it is full, the queue: the last ``--queue-size`` samples' ``z`` of
    each global crop in global sample order (``models.momentum.KeyQueue``, as MoCo's),
    scored with this step's prototypes, the same on every rank and split among the
    ranks for the Sinkhorn-Knopp so that each row counts once. SwAV's code keeps
    ``queue_length / W`` rows per rank instead, which ``--queue-keys per-rank`` comes
    close to (each rank its own keys): a control. The prototypes' rows are normalised
    after each optimizer step, and their gradient dropped for the first
    ``--freeze-prototypes-steps`` steps, as SwAV's ``freeze_prototypes_niters``.
    """

    def __init__(
        self,
        config,
        data: ImageData,
        world_size: int,
        say: Say,
        *,
        total_steps: int,
        device: torch.device | str = "cpu",
    ):
        self.seed, self.global_crops = config.seed, config.global_crops
        self.freeze_prototypes_steps = config.freeze_prototypes_steps
        self.dataset = multicrop_dataset(config, data)
        self.model = image_model(
            config, world_size, say, SwAVModel, **head_shape(SIMCLR_HEAD),
            prototypes=config.prototypes,
            other_size=config.local_crop_size if config.local_crops else None,
        )  # fmt: skip
        self.inputs = self.model.inputs
        self.dim = SIMCLR_HEAD[2]
        self.criterion = SwAVLoss(
            config.temperature, config.sinkhorn_iterations, config.sinkhorn_epsilon,
            sinkhorn_gather_distributed=config.gather,
        )  # fmt: skip
        dtype = next(self.model.parameters()).dtype
        self.past_keys = PastKeys(config, self.dim * config.global_crops, dtype, device)

    def embed(self, model: nn.Module, chunk: MultiCropBatch, step: int) -> torch.Tensor:
        return embed_multicrop(model, chunk, self.seed, step)

    def loss(
        self,
        outputs: list[torch.Tensor],
        batch: MultiCropBatch,
        sizes: Sequence[int] | None,
        step: int,
    ) -> torch.Tensor:
        crops = [crop.split([self.dim, crop.shape[1] - self.dim], dim=1)
                 for crop in crop_outputs(outputs, batch)]  # fmt: skip
        scores = [score for _, score in crops]
        queued, queue_sizes = self.queue_scores()
        self.past_keys.hold(
            torch.cat([z.detach() for z, _ in crops[: self.global_crops]], dim=1), sizes
        )
        return self.criterion(
            scores[: self.global_crops], scores[self.global_crops :], queued,
            sizes=sizes, queue_sizes=queue_sizes,
        )  # fmt: skip

    def queue_scores(self) -> tuple[list[torch.Tensor] | None, list[int] | None]:
        """This rank's share of the full queue's scores against this step's prototypes,
        one tensor per global crop, and every rank's number of queue rows; None before
        the queue is full (SwAV's ``use_the_queue``)."""
        queue = self.past_keys.queue
        if queue is None or queue.filled < queue.size:
            return None, None
        keys = queue.keys()
        if self.past_keys.global_keys and is_distributed():
            shares = keys.tensor_split(dist.get_world_size())
            keys, sizes = shares[dist.get_rank()], [len(share) for share in shares]
        else:  # one process, or each rank its own keys (the control)
            world_size = dist.get_world_size() if is_distributed() else 1
            sizes = [len(keys)] * world_size
        with torch.no_grad():
            weight = self.model.prototypes.weight.detach()
            if hasattr(weight, "full_tensor"):  # sharded (FSDP2): every rank gathers it
                weight = weight.full_tensor()
            return [view @ weight.T for view in keys.chunk(self.global_crops, dim=1)], sizes

    def before_optimizer_step(self, epoch: int, step: int) -> None:
        """SwAV's ``freeze_prototypes_niters``: no gradient, so no update, weight decay or
        momentum, for the prototypes of the first steps."""
        if step < self.freeze_prototypes_steps:
            self.model.prototypes.weight.grad = None

    def after_step(self, step: int) -> None:
        """The prototypes back to unit rows, and this step's global crops into the queue."""
        self.model.normalize_prototypes()
        self.past_keys.push()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.past_keys.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.past_keys.load_state_dict(state)


def defaults(config) -> dict[str, Any]:
    """SwAV's temperature (0.1), 3000 prototypes and 313 frozen steps; on the digits
    their own recipe (docs/methods.md): 30 prototypes, 20 frozen steps and no local
    crops."""
    digits = config.digits
    return {
        "temperature": 0.1,
        "prototypes": 30 if digits else 3000,
        "freeze_prototypes_steps": 20 if digits else 313,
        **crop_defaults(config),
    }


#: What only SwAV reads.
SWAV_OPTIONS = field_names(SwAVOptions)

SWAV = MethodRow(
    SwAVMethod,
    image_data,
    options=(*MULTICROP_OPTIONS, *QUEUE_OPTIONS, *SWAV_OPTIONS, "temperature"),
    sections=(MultiCropOptions, QueueOptions, SwAVOptions),
    defaults=defaults,
    check=check_crops,
    families=(Family("--method swav", EVERY_SOURCE, IMAGE_METHOD_TOWERS),),
)
