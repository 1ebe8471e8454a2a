"""Every tower, one table: ``TOWER_KINDS`` has a row per kind of tower (from scratch,
a ``transformers`` vision model, a whole CLIP or SigLIP checkpoint, a timm model, a
``transformers`` text model), and the towers from scratch (``--model``) are the rows of
``IMAGE_TOWERS``, each of which says what the tower is made of and builds it.

A kind's row says the option that names it, what it embeds, the options only it
reads and those its own configuration holds (both refused where they do not apply:
``methods.composition``), how it loads (imported then: an image-only run never
imports ``transformers``) and what ``final/`` exports of it. The methods' families
say which kinds they train (``methods.base.Family.towers``).

A row is what the options and the methods ask of a tower: the options it reads
(``options``: set for a tower without them, they are refused), whether it holds
BatchNorm (the heads on it have BatchNorm too, as in the papers; SyncBatchNorm and
gradient caching care), whether it takes other input sizes than ``--image-size``
(DINO's local crops), and ``build``, which makes the encoder and says its width. Every
tower starts from random weights: nothing downloads.

Adding a tower from scratch, a checklist: its builder and one row of ``IMAGE_TOWERS``;
its tests grow from the table (``tests/test_towers.py`` builds every row and checks
what it says). Adding a kind of tower (as timm was): its loader in a module of its own
(``models.timm_tower``), one row of ``TOWER_KINDS`` and its options in
``PretrainedTowerOptions``, its branch where a method loads a pretrained tower
(``methods.image_text.pretrained_image_tower``), its name in the families that train
it (``methods.base.IMAGE_METHOD_TOWERS``); then ``tests/test_composition.py`` trains or
refuses every method on it, and fails until its command line has the kind's flags (a
tiny one made by ``tests/launch.py``).

Example::

    encoder, width = IMAGE_TOWERS["resnet18"].build(32, 3, 0.0, 0.0)
    features = encoder(images)                   # (batch, width)
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision.ops import StochasticDepth

from contrastive_accelerate.config import option

#: Vision Transformers (Dosovitskiy et al., 2021) in DeiT's sizes (Touvron et al., 2021),
#: and ``vit_micro``, 4 blocks of width 64 that train in minutes on a CPU (the digits, the
#: tests): layers, heads, width, MLP width.
VIT_SIZES = {
    "vit_micro": (4, 4, 64, 256),
    "vit_tiny": (12, 3, 192, 768),
    "vit_small": (12, 6, 384, 1536),
}
#: Images of at most this many pixels get the CIFAR stem on a ResNet (3x3 stride-1 conv,
#: no max-pool), as in the SimCLR paper's CIFAR-10 runs.
SMALL_IMAGE_MAX_SIZE = 64
#: The mlp's hidden width.
MLP_WIDTH = 256


@dataclass(frozen=True)
class ImageTower:
    """One ``--model``: what it is made of, and how it is built."""

    #: ``build(image_size, in_channels, dropout, drop_path) -> (encoder, feature width)``.
    build: Callable[[int, int, float, float], tuple[nn.Module, int]]
    #: The options of ``TOWER_OPTIONS`` it reads.
    options: tuple[str, ...]
    #: Whether it has BatchNorm layers (then the heads on it have BatchNorm too).
    batch_norm: bool
    #: Whether it takes inputs at other sizes than ``image_size`` (DINO's local crops).
    any_input_size: bool
    #: Whether its output is a linear layer's (a head on it starts with a ReLU).
    linear_output: bool = False
    #: ``--dropout`` when left at None.
    default_dropout: float = 0.0
    #: ``patch_size(image_size)``, for a tower of patches; None: not one.
    patch_size: Callable[[int], int] | None = None


def resnet(name: str) -> Callable[[int, int, float, float], tuple[nn.Module, int]]:
    """A torchvision ResNet without its classifier; the CIFAR stem for small images."""

    def build(image_size: int, in_channels: int, dropout: float, drop_path: float):
        network = torchvision.models.get_model(name, weights=None)
        if image_size <= SMALL_IMAGE_MAX_SIZE:  # CIFAR stem: keep the few pixels there are
            network.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1,
                                      bias=False)  # fmt: skip
            network.maxpool = nn.Identity()
        elif in_channels != 3:
            network.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3,
                                      bias=False)  # fmt: skip
        width = network.fc.in_features
        network.fc = nn.Identity()
        return network, width

    return build


def vision_transformer(name: str) -> Callable[[int, int, float, float], tuple[nn.Module, int]]:
    """torchvision's ViT in ``VIT_SIZES[name]``, of any input size (``MultiResolutionViT``),
    the class token as feature."""

    def build(image_size: int, in_channels: int, dropout: float, drop_path: float):
        if in_channels != 3:
            raise ValueError(f"{name} takes 3 channels, not {in_channels}")
        network = _vision_transformer(name, image_size, dropout, drop_path)
        return network, network.hidden_dim

    return build


def mlp(image_size: int, in_channels: int, dropout: float, drop_path: float):
    """A small BatchNorm-free encoder of flattened pixels, for fast exactness checks."""
    network = nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_channels * image_size * image_size, MLP_WIDTH),
        nn.ReLU(),
        *([nn.Dropout(dropout)] if dropout else []),
        nn.Linear(MLP_WIDTH, MLP_WIDTH),
    )
    return network, MLP_WIDTH


def vit_patch_size(image_size: int) -> int:
    """The ViTs' patch size at ``image_size``: 16 pixels above 64 px, else ``image_size / 8``."""
    return 16 if image_size > 64 else max(1, image_size // 8)


def micro_patch_size(image_size: int) -> int:
    """``vit_micro``'s: 16 pixels above 64 px, else ``image_size / 4``. A 4 x 4 grid of
    small images: on the 8-px digits its 2-px patches start at 44% kNN and learn, where
    1-px patches (one pixel's intensity a token) start at 23% and barely move."""
    return 16 if image_size > 64 else max(1, image_size // 4)


def _vision_transformer(name: str, image_size: int, dropout: float, drop_path: float) -> nn.Module:
    layers, heads, width, mlp_width = VIT_SIZES[name]
    patch_size = IMAGE_TOWERS[name].patch_size(image_size)
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
        return self.heads(self.tokens(x)[:, 0])

    def tokens(
        self,
        x: torch.Tensor,
        masks: torch.Tensor | None = None,
        mask_token: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``(n, 1 + patches, hidden)``: the class token's and every patch's last hidden
        state, layer-normed. With ``masks`` (``(n, patches)`` boolean) the masked patches'
        embeddings are ``mask_token`` (``(hidden,)``) before the position embeddings are
        added (``mask_patches``)."""
        n, _, height, width = x.shape
        if height != width or height % self.patch_size:
            raise ValueError(
                f"the ViT takes square inputs divisible by {self.patch_size} px, got "
                f"{height}x{width}"
            )
        patches = self.conv_proj(x).flatten(2).transpose(1, 2)
        if masks is not None:
            patches = mask_patches(patches, masks, mask_token)
        x = torch.cat([self.class_token.expand(n, -1, -1), patches], dim=1)
        x = x + self.position_embedding(height // self.patch_size)
        encoder = self.encoder
        return encoder.ln(encoder.layers(encoder.dropout(x)))

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


def mask_patches(
    patches: torch.Tensor, masks: torch.Tensor, mask_token: torch.Tensor, layout: str = "NLC"
) -> torch.Tensor:
    """``patches``' embeddings with each one that ``masks`` (``(n, P)`` boolean, row-major
    over the grid) marks replaced by ``mask_token`` (``(C,)``), as iBOT's and DINOv2's
    student sees them. ``layout`` is timm's name of the embeddings' shape: ``NLC`` (a
    ViT's patch tokens), ``NCHW`` (a convolution's output) or ``NHWC``. ``torch.where``
    keeps the token in the graph when no patch is masked (DDP expects a gradient for it)."""
    if layout == "NCHW":
        masks, mask_token = masks.view(len(masks), 1, *patches.shape[2:]), mask_token[:, None, None]
    else:
        masks = masks.view(*patches.shape[:-1], 1)
    return torch.where(masks, mask_token.to(patches.dtype), patches)


@contextlib.contextmanager
def patches_masked(
    embedding: nn.Module, masks: torch.Tensor | None, mask_token: torch.Tensor, grid: str
) -> Iterator[None]:
    """While open, ``embedding``'s output (a pretrained ViT's patch embedding) has the
    patches that ``masks`` marks replaced by ``mask_token`` (``mask_patches``): ``grid`` is
    the layout of its 4-d outputs (``NCHW``, a convolution's; ``NHWC``, timm's on any
    size), a 3-d one is ``NLC``. Nothing is hooked without ``masks``."""
    if masks is None:
        yield
        return
    hook = embedding.register_forward_hook(
        lambda module, inputs, patches: mask_patches(
            patches, masks, mask_token, grid if patches.dim() == 4 else "NLC"
        )
    )
    try:
        yield
    finally:
        hook.remove()


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


def _loaded(*args) -> tuple[nn.Module, int]:
    raise ValueError("a pretrained tower is loaded (models.vision), not built")


#: What the heads ask of a pretrained tower (``models.vision.VisionTower``,
#: ``models.timm_tower.TimmTower``): no BatchNorm, a normalised output, one input size.
PRETRAINED_TOWER = ImageTower(_loaded, (), batch_norm=False, any_input_size=False)

#: What only the towers read; each tower reads its row's ``options``.
TOWER_OPTIONS = ("dropout", "drop_path", "gradient_checkpointing")
_RESNET = {"options": ("gradient_checkpointing",), "batch_norm": True, "any_input_size": True}
_VIT = {"options": TOWER_OPTIONS, "batch_norm": False, "any_input_size": True,
        "default_dropout": 0.1}  # fmt: skip

IMAGE_TOWERS: dict[str, ImageTower] = {
    "resnet18": ImageTower(resnet("resnet18"), **_RESNET),
    "resnet34": ImageTower(resnet("resnet34"), **_RESNET),
    "resnet50": ImageTower(resnet("resnet50"), **_RESNET),
    "vit_micro": ImageTower(vision_transformer("vit_micro"), **_VIT, patch_size=micro_patch_size),
    "vit_tiny": ImageTower(vision_transformer("vit_tiny"), **_VIT, patch_size=vit_patch_size),
    "vit_small": ImageTower(vision_transformer("vit_small"), **_VIT, patch_size=vit_patch_size),
    "mlp": ImageTower(
        mlp, ("dropout",), batch_norm=False, any_input_size=False, linear_output=True
    ),  # fmt: skip
}


def image_tower(name: str) -> ImageTower:
    """The row of ``name``; a ``ValueError`` naming the choices for another name."""
    if name not in IMAGE_TOWERS:
        raise ValueError(f"unknown backbone {name!r}; choose one of {', '.join(IMAGE_TOWERS)}")
    return IMAGE_TOWERS[name]


def towers_reading(option: str) -> tuple[str, ...]:
    """The towers whose rows read ``option``."""
    return tuple(name for name, row in IMAGE_TOWERS.items() if option in row.options)


@dataclass
class TowerOptions:
    """The options of the towers from scratch, a section of ``TrainConfig``
    (``contrastive_accelerate.options``): each a ``--flag`` and a config-file key, read
    where a row of ``IMAGE_TOWERS`` says (``towers_reading``)."""

    model: str = option("resnet18", "encoder", choices=IMAGE_TOWERS)
    dropout: float | None = option(
        None, "vit, mlp: dropout; none: 0.1 for the vits, else 0", at_least=0.0, below=1.0
    )
    drop_path: float = option(
        0.0, "vit: stochastic depth of the last block, linear from 0 (DINO: 0.1)",
        at_least=0.0, below=1.0,
    )  # fmt: skip
    sync_batchnorm: bool = option(True, "BatchNorm statistics of the global batch when W > 1")
    gradient_checkpointing: bool = option(
        False,
        "recompute each block in backward: resnets, vits, transformers towers",
        resume="apply",
    )


#: ``--image-model``'s poolings (``models.vision.VisionTower``): ``pooled``, the model's own
#: pooled output (CLIP's and DINOv2's layer-normed class token, SigLIP's attention
#: pooling head, ViT's pooler); ``cls``: the first token's last hidden state; ``mean``:
#: the mean of the patch tokens' (class and register tokens left out).
IMAGE_POOLINGS = ("pooled", "cls", "mean")


@dataclass
class PretrainedTowerOptions:
    """The options that name a pretrained tower (the ``option`` of a ``TOWER_KINDS`` row)
    and what only such a tower reads, a section of ``TrainConfig``."""

    text_model: str | None = option(None, "pairs: a transformers model directory or hub name")
    clip_model: str | None = option(
        None, "image-text: a whole CLIP or SigLIP model directory or hub name, both towers"
    )
    image_model: str | None = option(
        None, "image-text: a transformers vision model directory or hub name, for --model"
    )
    image_pooling: str = option(
        "pooled", "--image-model: its pooled output, the first token or the patches' mean",
        choices=IMAGE_POOLINGS,
    )  # fmt: skip
    timm_model: str | None = option(
        None, "a timm model: a folder in timm's hub layout, or an architecture name"
    )
    timm_weights: str | None = option(
        None, "--timm-model NAME's weights: a safetensors file; none: random weights"
    )


@dataclass(frozen=True)
class TowerKind:
    """A kind of tower: how the options name it, what it takes, how it loads and what
    ``final/`` exports of it."""

    #: As a refusal names it.
    description: str
    #: The option that names it (None: none yet).
    option: str | None
    #: What it embeds: "images", "texts" or both.
    embeds: tuple[str, ...]
    #: The options that only this kind reads: set with another kind, they are refused.
    reads: tuple[str, ...] = ()
    #: The options whose part its own checkpoint holds: set with it, they are refused.
    replaces: tuple[str, ...] = ()
    #: ``"module:function"`` that loads it from a directory or a hub name (imported
    #: when a run loads one); None: built from a row of ``IMAGE_TOWERS``, or none yet.
    loader: str | None = None
    #: What ``final/`` holds of it, and how it is read back.
    exports: str = ""
    #: What a method that does not train it takes instead, as its refusal says.
    instead: str = ""

    def load(self, *args, **kwargs):
        """The loader's result for ``args``: the tower and its tokenizer or processor."""
        module, name = self.loader.split(":")
        return getattr(importlib.import_module(module), name)(*args, **kwargs)


TOWER_KINDS: dict[str, TowerKind] = {
    "scratch": TowerKind(
        "a tower from scratch (--model)", "model", ("images",),
        exports="final/: the tower and the method's heads, the model class's from_pretrained",
    ),
    "transformers": TowerKind(
        "a transformers vision tower (--image-model)", "image_model", ("images",),
        reads=("image_pooling",), replaces=("model", "dropout", "drop_path"),
        loader="models.vision:load_vision_encoder",
        exports="final/image/: AutoModel.from_pretrained, its image processor beside it",
    ),
    "clip": TowerKind(
        "a whole CLIP or SigLIP model (--clip-model)", "clip_model", ("images", "texts"),
        replaces=("text_model", "image_model", "model", "dropout", "drop_path",
                  "projection_dim", "text_pooling", "image_pooling", "logit_scale_init",
                  "logit_bias_init"),
        loader="models.dual_encoder:load_dual_encoder",
        exports="final/: AutoModel.from_pretrained, both towers, tokenizer and processor",
        instead="its vision tower alone is an --image-model (CLIPVisionModel, SiglipVisionModel)",
    ),
    "timm": TowerKind(
        "a timm model (--timm-model)", "timm_model", ("images",), reads=("timm_weights",),
        replaces=("model", "dropout", "drop_path", "image_model", "clip_model"),
        loader="models.timm_tower:load_timm_tower",
        exports="final/image/: timm.create_model(architecture, pretrained=True, "
        "pretrained_cfg_overlay={'file': .../model.safetensors}, **model_args)",
    ),
    "text": TowerKind(
        "a transformers text tower (--text-model)", "text_model", ("texts",),
        loader="models.text:load_text_encoder",
        exports="final/tower<i>/: AutoModel.from_pretrained; final/sentence_transformer/",
    ),
}  # fmt: skip

#: The kinds of image tower, as a refusal names them (the composition matrix's rows).
IMAGE_TOWER_KINDS = {
    kind: row.description for kind, row in TOWER_KINDS.items() if "images" in row.embeds
}


def scratch_tower(config) -> ImageTower | None:
    """The row of ``IMAGE_TOWERS`` that the options train, where they name a tower from
    scratch; None for a pretrained one."""
    return IMAGE_TOWERS[config.model] if image_tower_kind(config) == "scratch" else None


def image_tower_kind(config) -> str:
    """The kind of image tower the options name: the first pretrained kind whose option
    is set (a whole checkpoint first), else the tower from scratch."""
    named = [kind for kind, row in TOWER_KINDS.items()
             if kind != "scratch" and "images" in row.embeds and row.option
             and getattr(config, row.option)]  # fmt: skip
    return max(named, key=lambda kind: len(TOWER_KINDS[kind].embeds), default="scratch")
