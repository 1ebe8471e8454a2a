"""Pretrained vision towers: a ``transformers`` vision model (``--image-model``), its
image processor's normalisation, and a pooling of its tokens.

``transformers`` is the optional ``[text]`` extra: this module imports it only when a
tower is loaded.

    encoder, processor = load_vision_encoder("path/to/vit")
    tower = VisionTower(encoder, "cls", processor.image_mean, processor.image_std)
    features = tower(images)          # images normalised to [-1, 1], as the data give them
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from torch import nn

from models.dropout import sample_randomness
from models.loading import first_line, load_auto_model, save_without_code
from models.lora import is_adapted, save_adapted
from models.sync_batchnorm import has_batch_statistics
from models.towers import IMAGE_POOLINGS, patches_masked

#: The data's normalisation (``contrastive_accelerate.data.NORMALIZE``): pixels in [-1, 1].
DATA_MEAN, DATA_STD = 0.5, 0.5


class VisionError(ValueError):
    """A vision tower problem the user must fix: reported as one line."""


def load_vision_encoder(name_or_path: str, dtype: torch.dtype = torch.float32):
    """``AutoModel`` and ``AutoImageProcessor`` from a local directory or the hub, from
    safetensors only and without remote code. Raises ``VisionError`` for a missing
    ``transformers``, an unloadable model, a dual encoder (``--clip-model`` loads
    those) or a model that takes no ``pixel_values``."""
    encoder = load_auto_model(name_or_path, dtype, "--image-model", VisionError)
    if hasattr(encoder, "get_text_features"):
        raise VisionError(
            f"--image-model {name_or_path!r} is a dual encoder ({type(encoder).__name__}): "
            "load both of its towers with --clip-model"
        )
    if "pixel_values" not in inspect.signature(encoder.forward).parameters:
        raise VisionError(
            f"--image-model {name_or_path!r} ({type(encoder).__name__}) takes no pixel_values: "
            "it is not a vision model"
        )
    import transformers

    try:
        processor = transformers.AutoImageProcessor.from_pretrained(
            name_or_path, trust_remote_code=False
        )
    except Exception as error:
        raise VisionError(
            f"--image-model {name_or_path!r} has no image processor: {first_line(error)}"
        ) from None
    return encoder, processor


def processor_image_size(processor) -> int:
    """The side of the square images the processor would give the model: its crop size
    when it crops, else its resize target."""
    size = processor.crop_size if getattr(processor, "do_center_crop", False) else processor.size
    size = dict(size or {})
    side = size.get("height") or size.get("shortest_edge") or size.get("width")
    if not side:
        raise VisionError(f"the image processor gives no image size ({size}): set --image-size")
    return int(side)


class VisionTower(nn.Module):
    """A ``transformers`` vision encoder on images normalised as the data give them
    (``[-1, 1]``): ``forward`` moves them to the processor's ``image_mean`` and
    ``image_std``, runs the encoder, and pools its tokens (``IMAGE_POOLINGS``). A model
    with position embeddings interpolates them to the images' size (``transformers``'
    ``interpolate_pos_encoding``), so it embeds crops of other sizes (DINO's local ones).

    The normalisation is an affine map inside the model, so the data pipeline, its
    per-sample augmentation and the evaluation images stay those of every tower.
    """

    def __init__(
        self,
        encoder: nn.Module,
        pooling: str = "pooled",
        image_mean: Sequence[float] = (0.5, 0.5, 0.5),
        image_std: Sequence[float] = (0.5, 0.5, 0.5),
    ) -> None:
        super().__init__()
        if pooling not in IMAGE_POOLINGS:
            raise ValueError(f"pooling must be one of {IMAGE_POOLINGS}, got {pooling!r}")
        self.encoder, self.pooling = encoder, pooling
        # A ViT-like model interpolates its position embeddings to other input sizes (DINO's
        # local crops) when asked; at its own size the interpolation returns them as they are.
        model = encoder.get_base_model() if is_adapted(encoder) else encoder
        arguments = inspect.signature(model.forward).parameters
        self.interpolates = "interpolate_pos_encoding" in arguments
        # Where DINOv2's mask token goes (``tokens``), found once: its name, since a module
        # held here would be a second path to the same weights in the state.
        names = (name for name, _ in encoder.named_modules())
        self.patch_embedding = next(
            (name for name in names if name.rpartition(".")[2] in PATCH_EMBEDDINGS), None
        )
        mean, std = torch.tensor(image_mean), torch.tensor(image_std)
        # x_model = (x01 - mean) / std with x01 = x * DATA_STD + DATA_MEAN, as one affine map
        # (not saved: the processor holds it).
        scale, shift = DATA_STD / std, (DATA_MEAN - mean) / std
        self.register_buffer("scale", scale.view(1, -1, 1, 1), persistent=False)
        self.register_buffer("shift", shift.view(1, -1, 1, 1), persistent=False)

    @property
    def output_dim(self) -> int:
        config = self.encoder.config
        if sizes := getattr(config, "hidden_sizes", None):  # a convolutional model's stages
            return sizes[-1]
        return getattr(config, "hidden_size", None) or config.vision_config.hidden_size

    @property
    def patch_size(self) -> int | None:
        """The side of its patches in pixels for a model of patch tokens (a ViT: what
        ``tokens`` takes); None for another (a convolutional model)."""
        config = self.encoder.config
        if getattr(config, "hidden_sizes", None) or self.patch_embedding is None:
            return None
        size = getattr(config, "patch_size", None)
        return size if isinstance(size, int) or size is None else int(size[0])

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if len(images) == 0 and not has_batch_statistics(self):
            return on_one_blank_image(self, images)
        return self._pooled(self._encoded(images), images)

    def tokens(
        self,
        images: torch.Tensor,
        masks: torch.Tensor | None = None,
        mask_token: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``(n, 1 + patches, hidden)``: the tower's features (``forward``'s), then each
        patch's last hidden state. With ``masks`` (``(n, patches)`` boolean) the masked
        patches' embeddings are ``mask_token`` (``models.towers.mask_patches``) as the
        model's patch embedding gives them, before its position embeddings, as
        ``MultiResolutionViT.tokens`` does (DINOv2's student)."""
        if len(images) == 0 and not has_batch_statistics(self):
            return on_one_blank_image(self.tokens, images, masks, mask_token=mask_token)
        embedding = self.encoder.get_submodule(self.patch_embedding)
        # a convolution's (n, C, h, w) (CLIP, SigLIP), else (n, P, C) (ViT, DINOv2)
        with patches_masked(embedding, masks, mask_token, "NCHW"):
            output = self._encoded(images)
        patches = output.last_hidden_state[:, -self._patches(images) :]
        return torch.cat([self._pooled(output, images).unsqueeze(1), patches], dim=1)

    def _encoded(self, images: torch.Tensor):
        pixels = images * self.scale.to(images.dtype) + self.shift.to(images.dtype)
        extra = {"interpolate_pos_encoding": True} if self.interpolates else {}
        return self.encoder(pixel_values=pixels, **extra)

    def _patches(self, images: torch.Tensor) -> int:
        """The number of patch tokens, the last ones of its hidden states (after its class
        and register tokens, where it has them)."""
        patch = self.encoder.config.patch_size
        return (images.shape[-2] // patch) * (images.shape[-1] // patch)

    def _pooled(self, output, images: torch.Tensor) -> torch.Tensor:
        if self.pooling == "pooled":
            if getattr(output, "pooler_output", None) is None:
                raise VisionError(
                    f"{type(self.encoder).__name__} has no pooled output: use "
                    "--image-pooling cls or mean"
                )
            return output.pooler_output.flatten(1)  # a ResNet's is (n, C, 1, 1)
        hidden = output.last_hidden_state
        if self.pooling == "cls":
            return hidden[:, 0]
        return hidden[:, -self._patches(images) :].mean(dim=1)


#: The names transformers gives a ViT's patch embedding: ``ViTPatchEmbeddings`` (ViT,
#: DINOv2), the convolution of CLIP's and SigLIP's vision towers.
PATCH_EMBEDDINGS = ("patch_embeddings", "patch_embedding")


def on_one_blank_image(
    function: Callable[..., torch.Tensor], images: torch.Tensor, *per_image: torch.Tensor | None,
    **others,
) -> torch.Tensor:  # fmt: skip
    """``function``'s output on no rows of ``images`` (an idle rank's): DDP needs every
    parameter in this rank's graph, and a ViT cannot run no rows, so it runs one black
    image (and one row of zeros of each of ``per_image``, a None kept), kept none. A
    tower with BatchNorm runs its no rows instead (its statistics would count the image)."""
    blank = [None if rows is None else rows.new_zeros((1, *rows.shape[1:])) for rows in per_image]
    with sample_randomness(torch.zeros(1, dtype=torch.int64, device=images.device)):
        return function(images.new_zeros((1, *images.shape[1:])), *blank, **others)[:0]


class PretrainedImageModel(nn.Module):
    """A pretrained vision tower (``VisionTower``, ``models.timm_tower.TimmTower``) and
    CLIP's linear projection (no bias) into the shared width: the image side of
    ``ImageTextModel``. ``embed`` gives the tower's features; ``save_pretrained`` writes
    the tower in its own format through ``export`` (``save_vision_tower`` with its
    processor, ``save_timm_tower``)."""

    def __init__(self, tower: nn.Module, projection_dim: int, export: Callable[..., None]) -> None:
        super().__init__()
        self.encoder = tower
        self.projection = nn.Linear(tower.output_dim, projection_dim, bias=False)
        self.export = export

    def save_pretrained(self, directory: str, adapter_directory: str | None = None) -> None:
        """The tower in ``directory``; an adapted one merged there and its adapter in
        ``adapter_directory``."""
        self.export(self.encoder, directory, adapter_directory)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        return self.encoder(images)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.projection(self.encoder(images))


def save_vision_tower(
    tower: VisionTower, directory: str, adapter_directory: str | None = None, *, processor=None
) -> None:
    """``tower``'s encoder and ``processor`` in ``directory``, where ``AutoModel`` and
    ``AutoImageProcessor`` load them; an adapted encoder merged there and its adapter in
    ``adapter_directory`` (none: ``directory`` + "_adapter")."""
    encoder = tower.encoder
    if is_adapted(encoder):
        save_adapted(encoder, directory, adapter_directory or directory + "_adapter")
    else:
        save_without_code(encoder, directory, safe_serialization=True)
    if processor is not None:
        save_without_code(processor, directory)
