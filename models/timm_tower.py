"""A timm model as an image tower (``--timm-model``): a local folder in timm's hub layout
(``config.json`` with its ``architecture``, ``model_args`` and ``pretrained_cfg``, and
``model.safetensors``), or an architecture name with ``--timm-weights`` (a safetensors
file) or without (random weights). Weights are read with safetensors only: a ``.pth`` or
``.bin`` is refused, since reading it would unpickle it. The normalisation is the
``pretrained_cfg``'s mean and standard deviation; ``final/image/`` is written in the same
layout, which ``timm.create_model(architecture, pretrained=True,
pretrained_cfg_overlay={"file": "final/image/model.safetensors"}, **model_args)`` loads.

``timm`` is an optional extra (``pip install -e '.[timm]'``): this module imports it
only when a tower is loaded.

    tower = load_timm_tower("path/to/convnext_folder", None, torch.float32)
    features = tower(images)        # images normalised to [-1, 1], as the data give them
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Sequence

import torch
from torch import nn

from contrastive_accelerate.untrusted import read_json
from models.lora import is_adapted
from models.sync_batchnorm import has_batch_statistics
from models.towers import patches_masked
from models.vision import DATA_MEAN, DATA_STD, on_one_blank_image

#: What a weights file may be: safetensors (nothing in it runs on reading).
SAFE_WEIGHTS = ".safetensors"


class TimmError(ValueError):
    """A ``--timm-model`` that cannot be loaded, in one line."""


class TimmTower(nn.Module):
    """A timm model without its classifier (``num_classes=0``: its pooled features),
    the data's pixels normalised as its ``pretrained_cfg`` says inside the model, as
    ``models.vision.VisionTower`` does; ``architecture`` and ``model_args`` say how to
    build it again (``save_timm_tower``)."""

    def __init__(
        self,
        encoder: nn.Module,
        architecture: str,
        model_args: dict,
        mean: Sequence[float] = (0.5, 0.5, 0.5),
        std: Sequence[float] = (0.5, 0.5, 0.5),
    ) -> None:
        super().__init__()
        self.encoder, self.architecture, self.model_args = encoder, architecture, model_args
        self.mean, self.std = tuple(mean), tuple(std)
        mean_t, std_t = torch.tensor(self.mean), torch.tensor(self.std)
        scale, shift = DATA_STD / std_t, (DATA_MEAN - mean_t) / std_t
        self.register_buffer("scale", scale.view(1, -1, 1, 1), persistent=False)
        self.register_buffer("shift", shift.view(1, -1, 1, 1), persistent=False)

    @property
    def output_dim(self) -> int:
        return self.encoder.num_features

    @property
    def image_size(self) -> int:
        """The size it was built for: its ``img_size`` argument (a ViT's), else its
        ``pretrained_cfg``'s ``input_size``, else 224."""
        if "img_size" in self.model_args:
            size = self.model_args["img_size"]
            return int(size if isinstance(size, int) else size[-1])
        configured = getattr(self._model(), "pretrained_cfg", {})
        return int(configured.get("input_size", (3, 224, 224))[-1])

    @property
    def patch_size(self) -> int | None:
        """The side of its patches in pixels for a ViT-like model (patch tokens after
        ``num_prefix_tokens`` class and register tokens: what ``tokens`` takes); None for
        another."""
        model = self._model()
        if not hasattr(model, "num_prefix_tokens") or not hasattr(model, "patch_embed"):
            return None
        return int(model.patch_embed.patch_size[0])

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if len(images) == 0 and not has_batch_statistics(self):
            return on_one_blank_image(self, images)
        return self.encoder(self._normalised(images))

    def tokens(
        self,
        images: torch.Tensor,
        masks: torch.Tensor | None = None,
        mask_token: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``(n, 1 + patches, width)``: the tower's features (``forward``'s: timm's
        ``forward_head`` of its ``forward_features``), then each patch's token. With
        ``masks`` (``(n, patches)`` boolean) the masked patches' embeddings are
        ``mask_token`` (``models.towers.mask_patches``) as its ``patch_embed`` gives them,
        before its position embeddings (DINOv2's student)."""
        if len(images) == 0 and not has_batch_statistics(self):
            return on_one_blank_image(self.tokens, images, masks, mask_token=mask_token)
        model = self._model()
        # channels last on a grid where it takes any size (dynamic_img_size), else (n, P, C)
        with patches_masked(model.patch_embed, masks, mask_token, "NHWC"):
            tokens = model.forward_features(self._normalised(images))
        features = model.forward_head(tokens, pre_logits=True)
        return torch.cat([features.unsqueeze(1), tokens[:, model.num_prefix_tokens :]], dim=1)

    def _normalised(self, images: torch.Tensor) -> torch.Tensor:
        return images * self.scale.to(images.dtype) + self.shift.to(images.dtype)

    def _model(self) -> nn.Module:
        """The timm model (an adapted one's base model, whose layers hold the adapter)."""
        return self.encoder.get_base_model() if is_adapted(self.encoder) else self.encoder


def load_timm_tower(
    name_or_path: str, weights: str | None, dtype: torch.dtype, *, other_sizes: bool = False
) -> TimmTower:
    """``name_or_path``'s timm model (a hub-layout folder, or an architecture name with
    ``weights``, a safetensors file, or none: random weights), its classifier removed, in
    ``dtype``; with ``other_sizes`` a ViT-like model built to take inputs of any size (its
    position embeddings interpolated: timm's ``dynamic_img_size``), for DINO's local
    crops. Anything else is a ``TimmError`` in one line."""
    try:
        import timm
    except ImportError:
        raise TimmError("--timm-model needs timm: pip install -e '.[timm]'") from None
    architecture, model_args, cfg = name_or_path, {}, {}
    if os.path.isdir(name_or_path):
        weights = _folder_weights(name_or_path, weights)
        try:
            config = read_json(os.path.join(name_or_path, "config.json"))
        except (OSError, ValueError) as error:
            raise TimmError(
                f"--timm-model {name_or_path!r}: no readable config.json ({error})"
            ) from None
        architecture = config.get("architecture") if isinstance(config, dict) else None
        if not isinstance(architecture, str):
            raise TimmError(f"--timm-model {name_or_path!r}: config.json names no architecture")
        model_args = {
            k: v for k, v in (config.get("model_args") or {}).items() if k != "num_classes"
        }
        cfg = config.get("pretrained_cfg") or {}
    if weights is not None and not weights.endswith(SAFE_WEIGHTS):
        raise TimmError(
            f"--timm-weights {weights!r}: only safetensors files are read (a .pth or .bin "
            "would be unpickled)"
        )
    encoder = _build(timm, architecture, model_args)
    if other_sizes and getattr(encoder, "dynamic_img_size", True) is False:
        # Only the models that have the argument take it; the others (convolutional
        # networks) take any size already.
        model_args = {**model_args, "dynamic_img_size": True}
        encoder = _build(timm, architecture, model_args)
    if weights is not None:
        _load_weights(encoder, weights)
    mean = cfg.get("mean", encoder.pretrained_cfg.get("mean", (0.5,) * 3))
    std = cfg.get("std", encoder.pretrained_cfg.get("std", (0.5,) * 3))
    return TimmTower(encoder, architecture, model_args, mean, std).to(dtype)


def _build(timm, architecture: str, model_args: dict) -> nn.Module:
    """timm's ``architecture`` with ``model_args``, random weights, no classifier."""
    try:
        return timm.create_model(architecture, pretrained=False, num_classes=0, **model_args)
    except Exception as error:  # timm raises RuntimeError, KeyError, TypeError...
        raise TimmError(f"cannot build --timm-model {architecture!r}: {error}") from None


def _folder_weights(folder: str, weights: str | None) -> str:
    """The safetensors weights of a hub-layout folder; a folder of pickles is refused."""
    if weights is not None:
        raise TimmError("--timm-weights applies to an architecture name, not a folder")
    path = os.path.join(folder, "model" + SAFE_WEIGHTS)
    if not os.path.isfile(path):
        pickles = [name for name in os.listdir(folder) if name.endswith((".pth", ".bin"))]
        found = f"only {pickles[0]}, which would be unpickled" if pickles else "none"
        raise TimmError(f"--timm-model {folder!r}: no model.safetensors ({found})")
    return path


def _load_weights(encoder: nn.Module, path: str) -> None:
    """``path``'s tensors into ``encoder``, its classifier's (which the tower drops) left
    out; a missing or unexpected tensor is refused."""
    from safetensors.torch import load_file

    try:
        state = load_file(path)
    except Exception as error:  # safetensors raises its own error types
        raise TimmError(f"cannot read --timm weights {path!r}: {error}") from None
    # The classifier's weights (timm's pretrained_cfg names its module) are the head that
    # num_classes=0 removed.
    classifier = (encoder.pretrained_cfg.get("classifier") or "head") + "."
    state = {name: tensor for name, tensor in state.items() if not name.startswith(classifier)}
    missing, unexpected = encoder.load_state_dict(state, strict=False)
    if missing or unexpected:
        what = f"missing {missing[0]!r}" if missing else f"unexpected {unexpected[0]!r}"
        raise TimmError(f"{path!r} does not fit the timm model: {what}")


def save_timm_tower(tower: TimmTower, directory: str, adapter_directory: str | None = None) -> None:
    """``tower`` in timm's hub layout in ``directory``: ``model.safetensors`` (its classifier
    absent) and ``config.json`` (architecture, model arguments, normalisation). An adapted
    tower (``models.lora``) is merged there (``W + (alpha / r) B A``), and its adapter
    written in ``adapter_directory`` (none: ``directory`` + "_adapter") for
    ``PeftModel.from_pretrained(timm.create_model(...), adapter_directory)``."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    encoder = tower.encoder
    if is_adapted(encoder):
        encoder.save_pretrained(adapter_directory or directory + "_adapter",
                                safe_serialization=True)  # fmt: skip
        encoder = copy.deepcopy(encoder).merge_and_unload()
    state = {name: t.detach().contiguous() for name, t in encoder.state_dict().items()}
    save_file(state, os.path.join(directory, "model" + SAFE_WEIGHTS))
    config = {
        "architecture": tower.architecture,
        "num_classes": 0,
        "num_features": tower.output_dim,
        "model_args": tower.model_args,
        "pretrained_cfg": {"mean": list(tower.mean), "std": list(tower.std)},
    }
    with open(os.path.join(directory, "config.json"), "w") as file:
        json.dump(config, file, indent=2)
