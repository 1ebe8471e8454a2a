"""SimCLR: an encoder and a projection head (and BYOL's and MoCo v3's predictor), saved
HF-style (safetensors + config.json)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F
import torchvision
from huggingface_hub import PyTorchModelHubMixin
from torch import nn
from torchvision.ops import StochasticDepth

from models.dino import DINOHead

BACKBONES = ("resnet18", "resnet34", "resnet50", "vit_tiny", "vit_small", "mlp")
#: Vision Transformers (Dosovitskiy et al., 2021) in DeiT's sizes (Touvron et al., 2021):
#: layers, heads, width, MLP width.
VIT_SIZES = {"vit_tiny": (12, 3, 192, 768), "vit_small": (12, 6, 384, 1536)}


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
                batch_norm=backbone not in ("mlp", *VIT_SIZES),
                after_linear=False,
            )
            if prediction_hidden_dim is not None
            else None
        )
        if backbone == "mlp":
            hidden = 256
            self.encoder = nn.Sequential(
                nn.Flatten(),
                nn.Linear(in_channels * image_size * image_size, hidden),
                nn.ReLU(),
                *([nn.Dropout(dropout)] if dropout else []),
                nn.Linear(hidden, hidden),
            )
            self.projection_head = _head(
                hidden, projection_hidden_dim, projection_dim, projection_layers, batch_norm=False
            )
            self._dino_head(hidden, dino_out_dim, projection_hidden_dim, projection_dim)
            return
        if backbone in VIT_SIZES:
            self.encoder = _vision_transformer(backbone, image_size, dropout, drop_path)
            self.projection_head = _head(
                self.encoder.hidden_dim,
                projection_hidden_dim,
                projection_dim,
                projection_layers,
                batch_norm=False,
                after_linear=False,
            )
            self._dino_head(
                self.encoder.hidden_dim, dino_out_dim, projection_hidden_dim, projection_dim
            )
            return
        resnet = torchvision.models.get_model(backbone, weights=None)
        if image_size <= small_image_max_size:  # CIFAR stem: keep the few pixels there are
            resnet.conv1 = nn.Conv2d(
                in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False
            )
            resnet.maxpool = nn.Identity()
        elif in_channels != 3:
            resnet.conv1 = nn.Conv2d(
                in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False
            )
        feature_dim = resnet.fc.in_features
        resnet.fc = nn.Identity()
        self.encoder = resnet
        self.projection_head = _head(
            feature_dim, projection_hidden_dim, projection_dim, projection_layers, batch_norm=True
        )
        self._dino_head(
            feature_dim, dino_out_dim, projection_hidden_dim, projection_dim, batch_norm=True
        )

    def _dino_head(
        self, in_dim: int, out_dim: int | None, hidden: int, bottleneck: int, batch_norm=False
    ) -> None:
        if out_dim is not None:  # DINO's head replaces the projection head
            self.projection_head = DINOHead(
                in_dim, out_dim, hidden, bottleneck, batch_norm=batch_norm
            )

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


def vit_patch_size(image_size: int) -> int:
    """The ViTs' patch size at ``image_size``: 16 pixels above 64 px, else ``image_size / 8``."""
    return 16 if image_size > 64 else max(1, image_size // 8)


def _vision_transformer(name: str, image_size: int, dropout: float, drop_path: float) -> nn.Module:
    layers, heads, width, mlp_width = VIT_SIZES[name]
    patch_size = vit_patch_size(image_size)
    if image_size % patch_size:
        raise ValueError(
            f"{name} at image size {image_size} needs it divisible by its patch size {patch_size}"
        )
    vit = MultiResolutionViT(
        image_size=image_size,
        patch_size=patch_size,
        num_layers=layers,
        num_heads=heads,
        hidden_dim=width,
        mlp_dim=mlp_width,
        dropout=dropout,
        attention_dropout=0.0,  # drawn inside nn.MultiheadAttention: not per-sample
    )
    vit.heads = nn.Identity()  # the class token's features
    if drop_path:  # DINO's rates: linear from 0 at the first block to drop_path at the last
        blocks = vit.encoder.layers
        for index, name in enumerate(list(blocks._modules)):
            rate = drop_path * index / max(len(blocks) - 1, 1)
            blocks._modules[name] = _StochasticDepthBlock(blocks._modules[name], rate)
    return vit


class MultiResolutionViT(torchvision.models.VisionTransformer):
    """torchvision's ``VisionTransformer`` for square inputs of any size that the patch
    size divides, as DINO's ViT takes its local crops: at another size than
    ``image_size`` the patch position embeddings are resized to the patch grid by
    DINO's bicubic ``interpolate_pos_encoding`` (the class token's is kept). At
    ``image_size`` it is torchvision's forward, with the same state names.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, height, width = x.shape
        if height != width or height % self.patch_size:
            raise ValueError(
                f"the ViT takes square inputs divisible by {self.patch_size} px, got "
                f"{height}x{width}"
            )
        patches = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(n, -1, -1), patches], dim=1)
        x = x + self.position_embedding(height // self.patch_size)
        encoder = self.encoder
        return self.heads(encoder.ln(encoder.layers(encoder.dropout(x)))[:, 0])

    def position_embedding(self, grid: int) -> torch.Tensor:
        """``(1, 1 + grid**2, hidden)``: the class token's embedding, then the patches'
        resized from the trained grid to ``grid x grid``. DINO adds 0.1 to the grid in
        the scale factor so that flooring gives the intended size (dino #8)."""
        embedding = self.encoder.pos_embedding
        trained = self.image_size // self.patch_size
        if grid == trained:
            return embedding
        patches = embedding[:, 1:].reshape(1, trained, trained, -1).permute(0, 3, 1, 2)
        scale = (grid + 0.1) / trained
        patches = F.interpolate(patches, scale_factor=(scale, scale), mode="bicubic")
        patches = patches.permute(0, 2, 3, 1).reshape(1, grid * grid, -1)
        return torch.cat([embedding[:, :1], patches], dim=1)


class _StochasticDepthBlock(nn.Module):
    """torchvision's ``EncoderBlock`` with stochastic depth on both residual branches
    (``StochasticDepth(rate, "row")``, which ``convert_sample_dropout`` keys by sample);
    its submodules keep their names, so its state is the block's."""

    def __init__(self, block: nn.Module, rate: float) -> None:
        super().__init__()
        self.ln_1, self.self_attention, self.dropout = (
            block.ln_1,
            block.self_attention,
            block.dropout,
        )
        self.ln_2, self.mlp = block.ln_2, block.mlp
        self.drop_path_attention = StochasticDepth(rate, "row")
        self.drop_path_mlp = StochasticDepth(rate, "row")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = self.ln_1(input)
        x, _ = self.self_attention(x, x, x, need_weights=False)
        x = input + self.drop_path_attention(self.dropout(x))
        return x + self.drop_path_mlp(self.mlp(self.ln_2(x)))


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
