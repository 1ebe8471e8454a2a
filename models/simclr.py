"""SimCLR: an encoder and a projection head (and BYOL's and MoCo v3's predictor), saved
HF-style (safetensors + config.json)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from huggingface_hub import PyTorchModelHubMixin
from torch import nn

from models.dino import DINOHead
from models.towers import IMAGE_TOWERS, SMALL_IMAGE_MAX_SIZE

BACKBONES = tuple(IMAGE_TOWERS)


class SimCLR(nn.Module, PyTorchModelHubMixin):
    """Encoder + projection head (Chen et al., 2020, "A Simple Framework for Contrastive Learning").

    ``backbone`` is a torchvision ResNet (randomly initialised: nothing downloads)
    with the projection head Linear-BN-ReLU-Linear (``projection_layers`` 3 gives
    Barlow Twins' and VICReg's Linear-BN-ReLU-Linear-BN-ReLU-Linear); a torchvision
    ``VisionTransformer`` (``"vit_tiny"``, ``"vit_small"``: LayerNorm, no batch
    statistics, the class token as feature, patches of 16 pixels above 64 px and
    ``image_size / 8`` below) with a BatchNorm-free head; or ``"mlp"``: a small
    BatchNorm-free encoder and head for fast exactness checks. ``dropout`` applies to
    the ViT's and the mlp's ``nn.Dropout`` layers (attention dropout stays 0: see
    ``models.dropout``; the ResNets have no dropout layers, and ``TrainConfig`` refuses
    ``--dropout`` and ``--drop-path`` for them). ``logit_scale``
    and ``logit_bias`` add learnable parameters initialised to these values for the
    CLIP-style losses (InfoNCE, SigLIP): ``log_logit_scale``, the log of the scale, as
    CLIP learns it (pass ``log_logit_scale.exp()`` to the loss), and ``logit_bias``. For
    images of at most ``small_image_max_size`` pixels the ResNet stem is the CIFAR one
    (3x3 stride-1 conv, no max-pool), as in the SimCLR paper's CIFAR-10 runs.
    ``prediction_hidden_dim`` adds BYOL's and MoCo v3's predictor after the head, an MLP
    of the head's shape (BatchNorm for the ResNets) from ``projection_dim`` to itself:
    ``forward`` then returns predictions, and a momentum teacher made without it
    (``models.momentum.EMATeacher(model, without=("predictor",))``) returns projections.
    ``drop_path`` adds stochastic depth to the ViT's blocks, DINO's linear rates from 0
    to ``drop_path`` at the last block (keyed by sample after ``convert_sample_dropout``).
    ``dino_out_dim`` replaces the projection head with DINO's (``models.dino.DINOHead``,
    ``projection_hidden_dim`` wide, into ``projection_dim``, then ``dino_out_dim`` logits;
    BatchNorm in its MLP for the ResNets, as in every head of theirs).

    Example::

        model = SimCLR(backbone="resnet18", image_size=32)
        projections = model(images)              # (batch, projection_dim), for the loss
        features = model.embed(images)           # (batch, feature_dim), for evaluation
    """

    def __init__(
        self,
        backbone: str = "resnet18",
        image_size: int = 32,
        in_channels: int = 3,
        projection_hidden_dim: int = 512,
        projection_dim: int = 128,
        projection_layers: int = 2,
        small_image_max_size: int = 64,
        logit_scale: float | None = None,
        logit_bias: float | None = None,
        dropout: float = 0.0,
        prediction_hidden_dim: int | None = None,
        dino_out_dim: int | None = None,
        drop_path: float = 0.0,
    ) -> None:
        super().__init__()
        if backbone not in BACKBONES:
            raise ValueError(f"unknown backbone {backbone!r}; choose one of {', '.join(BACKBONES)}")
        if small_image_max_size != SMALL_IMAGE_MAX_SIZE:  # kept for saved config.json files
            raise ValueError(f"small_image_max_size is {SMALL_IMAGE_MAX_SIZE}")
        if projection_layers < 2:
            raise ValueError(f"projection_layers must be >= 2, got {projection_layers}")
        # CLIP-style temperature as a learnable log-scale (and SigLIP's bias): parameters of
        # the model, so DDP synchronises them and checkpoints carry them.
        self.log_logit_scale = (
            nn.Parameter(torch.tensor(math.log(logit_scale))) if logit_scale is not None else None
        )
        self.logit_bias = (
            nn.Parameter(torch.tensor(float(logit_bias))) if logit_bias is not None else None
        )
        # BatchNorm in the predictor where the head has it (BYOL, MoCo v3's ResNets).
        self.predictor = (
            _head(
                projection_dim,
                prediction_hidden_dim,
                projection_dim,
                2,
                batch_norm=IMAGE_TOWERS[backbone].batch_norm,
                after_linear=False,
            )
            if prediction_hidden_dim is not None
            else None
        )
        tower = IMAGE_TOWERS[backbone]
        self.encoder, width = tower.build(image_size, in_channels, dropout, drop_path)
        if tower.patch_size is None and drop_path:
            raise ValueError(f"drop_path applies to towers of patches, not {backbone}")
        self.projection_head = _head(
            width,
            projection_hidden_dim,
            projection_dim,
            projection_layers,
            batch_norm=tower.batch_norm,
            after_linear=tower.linear_output,
        )
        if dino_out_dim is not None:  # DINO's head replaces the projection head
            self.projection_head = DINOHead(
                width, dino_out_dim, projection_hidden_dim, projection_dim,
                batch_norm=tower.batch_norm,
            )  # fmt: skip

    def save_exports(
        self,
        directory: str,
        whole: Callable[[nn.Module], AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        """What ``final/`` holds besides the streamed ``model.safetensors``: for this
        one-tower model, the model itself (``save_pretrained``: its weights and
        ``config.json``), inside ``whole(self)`` (``models.text.TextPairModel``'s)."""
        with whole(self):
            self.save_pretrained(directory)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Encoder features: what downstream tasks and the kNN evaluation use."""
        return self.encoder(images)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        projections = self.projection_head(self.encoder(images))
        return projections if self.predictor is None else self.predictor(projections)


def _head(
    in_dim: int, hidden: int, out: int, layers: int, batch_norm: bool, after_linear: bool = True
) -> nn.Sequential:
    """``layers`` linear layers, each hidden one followed by BatchNorm (ResNets) and ReLU:
    SimCLR's head with 2 layers, Barlow Twins' and VICReg's projector with 3."""
    modules: list[nn.Module] = []
    if not batch_norm and after_linear:
        modules.append(nn.ReLU())  # the mlp encoder ends in a linear layer
    dims = [in_dim] + [hidden] * (layers - 1)
    for fan_in, fan_out in zip(dims[:-1], dims[1:], strict=True):
        modules.append(nn.Linear(fan_in, fan_out, bias=not batch_norm))
        if batch_norm:
            modules.append(nn.BatchNorm1d(fan_out))
        modules.append(nn.ReLU())
    modules.append(nn.Linear(dims[-1], out))
    return nn.Sequential(*modules)
