"""A whole pretrained dual encoder (``--clip-model``): a ``transformers`` ``CLIPModel`` or
``SiglipModel``, or any model with ``get_image_features`` and ``get_text_features``,
trained as one image-text model: both towers, their projections, the learnable logit
scale and SigLIP's bias, all the checkpoint's own.

    model, tokenizer, processor = load_dual_encoder("path/to/clip")
    clip = DualEncoder(model, tokenizer, processor, max_length=77)
    outputs = clip(images, [(input_ids, attention_mask)], keys)  # images' rows, then texts'
    clip.save_pretrained("final")  # CLIPModel.from_pretrained("final") loads it

``transformers`` is the optional ``[text]`` extra, imported only when a model is loaded.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from models.dropout import sample_randomness
from models.loading import first_line, load_auto_model, save_without_code
from models.lora import is_adapted, save_adapted
from models.text import ImageTextProjections, image_text_forward
from models.vision import DATA_MEAN, DATA_STD

#: The submodules of a CLIP- or SigLIP-style dual encoder that hold each tower.
TOWERS = ("vision_model", "text_model")
#: Where ``save_pretrained`` puts a LoRA adapter, inside the saved model's directory.
ADAPTER_DIR = "adapter"


class DualEncoderError(ValueError):
    """A ``--clip-model`` problem the user must fix: reported as one line."""


def load_dual_encoder(name_or_path: str, dtype: torch.dtype = torch.float32):
    """The model, its tokenizer and its image processor, from safetensors only and
    without remote code. Raises ``DualEncoderError`` for a missing ``transformers``, an
    unloadable model, one without both feature methods, or a tokenizer without padding."""
    model = load_auto_model(name_or_path, dtype, "--clip-model", DualEncoderError)
    if not (hasattr(model, "get_image_features") and hasattr(model, "get_text_features")):
        raise DualEncoderError(
            f"--clip-model {name_or_path!r} ({type(model).__name__}) is not a dual encoder: it "
            "has no get_image_features and get_text_features"
        )
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            name_or_path, trust_remote_code=False
        )
        processor = transformers.AutoImageProcessor.from_pretrained(
            name_or_path, trust_remote_code=False
        )
    except Exception as error:
        raise DualEncoderError(
            f"--clip-model {name_or_path!r} lacks its tokenizer or image processor: "
            f"{first_line(error)}"
        ) from None
    if tokenizer.pad_token_id is None:
        raise DualEncoderError(f"the tokenizer of --clip-model {name_or_path!r} has no pad token")
    return model, tokenizer, processor


class DualEncoder(ImageTextProjections, nn.Module):
    """A dual encoder as ``models.text.ImageTextModel`` is to the image-text method:
    ``forward(images, columns, keys)`` gives the images' projections, then the texts';
    ``image`` and ``text`` each side's; ``embed`` the images' (for the kNN evaluation);
    ``log_logit_scale`` and ``logit_bias`` the model's own parameters.

    Images come normalised as the data give them (``[-1, 1]``) and move to the
    processor's mean and standard deviation inside, as in ``models.vision.VisionTower``.
    """

    def __init__(
        self, model: nn.Module, tokenizer: Any, processor: Any, max_length: int | None = None
    ) -> None:
        super().__init__()
        self.model, self.tokenizer, self.processor = model, tokenizer, processor
        self.max_length = max_length
        mean = torch.tensor(processor.image_mean)
        std = torch.tensor(processor.image_std)
        scale, shift = DATA_STD / std, (DATA_MEAN - mean) / std
        self.register_buffer("scale", scale.view(1, -1, 1, 1), persistent=False)
        self.register_buffer("shift", shift.view(1, -1, 1, 1), persistent=False)

    @property
    def log_logit_scale(self) -> nn.Parameter:
        return self.model.logit_scale  # CLIP and SigLIP keep the scale's log

    @property
    def logit_bias(self) -> nn.Parameter | None:
        return getattr(self.model, "logit_bias", None)

    def image(self, images: torch.Tensor) -> torch.Tensor:
        if len(images) == 0:  # an idle rank: every parameter in the graph, no row kept
            with sample_randomness(torch.zeros(1, dtype=torch.int64, device=images.device)):
                return self.image(images.new_zeros((1, *images.shape[1:])))[:0]
        pixels = images * self.scale.to(images.dtype) + self.shift.to(images.dtype)
        return _features(self.model.get_image_features(pixel_values=pixels))

    def text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if len(input_ids) == 0:
            one_row = input_ids.new_zeros((1, 1)), attention_mask.new_ones((1, 1))
            with sample_randomness(torch.zeros(1, dtype=torch.int64, device=input_ids.device)):
                return self.text(*one_row)[:0]
        features = self.model.get_text_features(input_ids=input_ids, attention_mask=attention_mask)
        return _features(features)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        return self.image(images)

    def forward(
        self,
        images: torch.Tensor,
        columns: Sequence[tuple[torch.Tensor, torch.Tensor]],
        keys: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return image_text_forward(self.image, self.text, images, columns, keys)

    def save_pretrained(self, directory: str) -> None:
        """The model in its own format (``CLIPModel.from_pretrained(directory)``), with its
        tokenizer and processor; adapted, the merged model there and its LoRA adapter
        in ``adapter/``."""
        self.save_exports(directory)

    def save_exports(
        self,
        directory: str,
        whole: Callable[[nn.Module], AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        """``save_pretrained`` inside ``whole(self.model)`` (``TextPairModel``'s): both
        towers at once, as transformers saves one model (and writes its own
        ``model.safetensors`` over the streamed one)."""
        with whole(self.model):
            if is_adapted(self.model):
                save_adapted(self.model, directory, os.path.join(directory, ADAPTER_DIR))
            else:
                save_without_code(self.model, directory, safe_serialization=True)
        save_without_code(self.tokenizer, directory)
        save_without_code(self.processor, directory)


def _features(output: Any) -> torch.Tensor:
    """transformers 5 returns a ``ModelOutput`` whose pooled output is the projection;
    earlier versions the tensor."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output
