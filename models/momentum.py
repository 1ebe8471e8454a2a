"""Momentum teachers and queues of past keys (MoCo, BYOL), identical on every rank.

- ``EMATeacher``: an exponential moving average of the student's weights, kept in
  float32 (or float64) whatever the mixed precision, because in bf16 an update of
  ``(1 - m) * (student - teacher)`` at m = 0.996 is below half an ulp of the teacher's
  weights and rounds away: the teacher stops moving.
- ``cosine_momentum``: BYOL's schedule, a function of the step, so resume needs no state.
- ``PredictorModel``: the student of MoCo v3 and BYOL, SimCLR's with a predictor.
- ``KeyQueue``: a FIFO of the global batch's keys in global sample order (MoCo v2's
  queue), so its contents are the same on 1 and N processes, and a checkpoint of it
  resumes on any number of processes.

Every rank holds the same student after each optimizer step (DDP), so every rank
computes the same teacher and queue without a broadcast.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from models.image import ImageModel, projection_head, tower_projection_head
from models.towers import image_tower


def cosine_momentum(step: int, total_steps: int, base: float) -> float:
    """BYOL's momentum at ``step`` (Grill et al., 2020): ``1 - (1 - base) * (cos(pi k/K) + 1)/2``,
    from ``base`` at step 0 to 1 at the last step."""
    progress = min(step / max(total_steps, 1), 1.0)
    return 1.0 - (1.0 - base) * (math.cos(math.pi * progress) + 1.0) / 2.0


class EMATeacher(nn.Module):
    """A momentum copy of ``student`` without its ``without`` submodules (the predictor):
    ``teacher <- m * teacher + (1 - m) * student`` for every parameter, in ``dtype``.

    ``dtype`` None keeps float64 students in float64 and everything else in float32.
    Buffers (BatchNorm running statistics) are the teacher's own: it updates them in its
    forward, in training mode, as MoCo's and BYOL's momentum encoders do. The teacher
    takes no gradient.

    Example::

        teacher = EMATeacher(student, without=("predictor",))
        with torch.no_grad():
            keys = teacher(images)
        teacher.update(student, cosine_momentum(step, total_steps, 0.99))  # after optimizer.step()
    """

    def __init__(
        self, student: nn.Module, without: tuple[str, ...] = (), dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        network = copy.deepcopy(student)
        for name in without:
            setattr(network, name, None)
        student_dtype = next(student.parameters()).dtype
        if dtype is None:
            dtype = torch.float64 if student_dtype == torch.float64 else torch.float32
        self.network = network.to(dtype).requires_grad_(False)
        self.dtype = dtype

    def forward(self, *args, **kwargs):
        return self.network(*args, **kwargs)

    @torch.no_grad()
    def update(self, student: nn.Module, momentum: float) -> None:
        """One EMA step towards ``student``, whose parameter names include the teacher's."""
        source = dict(student.named_parameters())
        names = [name for name, _ in self.network.named_parameters()]
        teacher = [parameter for _, parameter in self.network.named_parameters()]
        # lightly's and MoCo's form, m * t + (1 - m) * s, in the teacher's dtype.
        torch._foreach_mul_(teacher, momentum)
        torch._foreach_add_(
            teacher, [source[name].detach().to(self.dtype) for name in names], alpha=1 - momentum
        )


class KeyQueue:
    """The last ``size`` keys of the global batch, oldest first, in global sample order.

    ``push`` takes the whole global batch's keys (already gathered, the same on every
    rank): a partial last batch is enqueued whole, and a batch larger than the queue
    leaves its newest ``size`` keys. ``keys()`` are the rows filled so far, so an empty
    queue adds no negatives (MoCo starts from random keys instead). The fill level is a
    host integer: reading the queue never waits for the device.
    """

    def __init__(self, size: int, dim: int, dtype: torch.dtype, device=None) -> None:
        if size < 1:
            raise ValueError(f"KeyQueue: size must be >= 1, got {size}")
        self.buffer = torch.zeros(size, dim, dtype=dtype, device=device)
        self.filled = 0  # rows in use; the newest row is buffer[filled - 1] once full rotates

    @property
    def size(self) -> int:
        return self.buffer.shape[0]

    def keys(self) -> torch.Tensor:
        return self.buffer[: self.filled]

    @torch.no_grad()
    def push(self, keys: torch.Tensor) -> None:
        keys = keys.detach().to(self.buffer.dtype)[-self.size :]
        new = len(keys)
        if new == 0:
            return
        kept = min(self.filled, self.size - new)
        # Oldest first: keep the newest `kept` rows, append the new ones after them.
        self.buffer[:kept] = self.buffer[self.filled - kept : self.filled].clone()
        self.buffer[kept : kept + new] = keys
        self.filled = kept + new

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"queue": self.keys().clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        keys = state["queue"]
        if keys.dim() != 2 or keys.shape[1] != self.buffer.shape[1]:
            raise ValueError(
                f"the checkpoint's queue has shape {tuple(keys.shape)}; this run's keys have "
                f"{self.buffer.shape[1]} features"
            )
        self.filled = 0
        self.push(keys.to(self.buffer.device))


class PredictorModel(ImageModel):
    """MoCo v3's and BYOL's student: SimCLR's encoder and projection head, then a
    predictor, an MLP of the head's shape (BatchNorm for the ResNets) from
    ``projection_dim`` to itself (Grill et al., 2020; Chen et al., 2021). ``forward``
    returns predictions; a teacher made without the predictor
    (``EMATeacher(model, without=("predictor",))``) returns projections.

    Example::

        student = PredictorModel(backbone="resnet18", image_size=32)
        teacher = EMATeacher(student, without=("predictor",))
    """

    def __init__(
        self,
        backbone: str = "resnet18",
        image_size: int = 32,
        in_channels: int = 3,
        projection_hidden_dim: int = 512,
        projection_dim: int = 128,
        projection_layers: int = 2,
        prediction_hidden_dim: int = 512,
        dropout: float = 0.0,
        drop_path: float = 0.0,
        encoder: nn.Module | None = None,
    ) -> None:
        super().__init__()
        # BatchNorm in the predictor where the head has it; drawn before the tower, as in
        # earlier versions (see models.image).
        self.predictor = projection_head(
            projection_dim, prediction_hidden_dim, projection_dim, 2,
            batch_norm=encoder is None and image_tower(backbone).batch_norm, after_linear=False,
        )  # fmt: skip
        tower, width = self.add_tower(
            backbone, image_size, in_channels, dropout, drop_path, encoder=encoder
        )
        self.projection_head = tower_projection_head(
            tower, width, projection_hidden_dim, projection_dim, projection_layers
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        projections = self.projection_head(self.encoder(images))
        return projections if self.predictor is None else self.predictor(projections)
