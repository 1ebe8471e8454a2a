"""Image-text pairs, CLIP's or SigLIP's two towers: ``--columns image,caption``."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from contrastive_accelerate.config import flag
from contrastive_accelerate.data import evaluation_images
from contrastive_accelerate.data.mixture import Mixture
from contrastive_accelerate.data.pairs import ImageCaptions, ImageTextBatch, MixedPairs, PairData
from contrastive_accelerate.durable_files import content_digest
from contrastive_accelerate.hub import unreachable_reason
from contrastive_accelerate.knn import KnnData, zero_shot_top1
from contrastive_accelerate.launch import TrainerError
from contrastive_accelerate.methods.base import (
    DTYPES,
    SIMCLR_HEAD,
    Say,
    augmentation_options,
    head_shape,
    image_model,
    view_halves,
)
from contrastive_accelerate.methods.loss_table import LOSSES
from contrastive_accelerate.methods.pairs import (
    PairsMethod,
    adapted,
    freeze_unreached,
    held_out_pairs,
    say_truncated,
    text_dropout,
    text_encoder,
    text_model_digests,
    tower_dropout,
    weights_digest,
)
from contrastive_accelerate.methods.sentence_tools import matryoshka_terms
from contrastive_accelerate.retrieval import embed_texts, first_texts, paired_retrieval
from contrastive_accelerate.sharding import reshard_after_evaluation
from models import SimCLR, sample_keys
from models.checkpointing import checkpoint_timm_blocks, running_statistics_kept
from models.towers import TOWER_KINDS

#: CLIP clamps its learnable logit scale at 100.
MAX_LOGIT_SCALE = 100.0


class ImageTextMethod(PairsMethod):
    """Image-text pairs: the image through ``--model`` and its projection head, the
    caption (one of a row's list, drawn from (seed, epoch, index)) through a
    ``transformers`` tower and a projection, scored by ``InfoNCELoss`` (``--loss
    infonce``, CLIP, the default) or ``SigLIPLoss`` over the global batch with the
    model's learnable scale, which ``after_step`` clamps at 100 as CLIP does, and
    SigLIP's bias.

    With ``--zero-shot-template`` ("a photo of a {}") and labels, ``evaluate`` gives CLIP's
    zero-shot top-1 on the held-out images: each class name in the template, embedded
    by the text tower, is a classifier row.
    """

    def __init__(
        self,
        config,
        data: PairData,
        world_size: int,
        say: Say,
        *,
        total_steps: int | None = None,
        device: torch.device | str = "cpu",
    ):
        self.seed, self.unique_texts = config.seed, config.unique_texts
        if config.clip_model:
            self.model, image_size, self.inputs = dual_encoder(config, world_size, say)
            self.tokenizer = self.model.tokenizer
            self.loss_name = clip_loss(config, self.model)
        else:
            self.loss_name = config.loss or "infonce"
            self.model, image_size = self._towers(config, data, world_size, say)
        say_truncated(data, data.text_columns, self.tokenizer, config.max_length, say)

        def captions(source: PairData) -> ImageCaptions:
            (caption_column,) = source.text_columns
            return ImageCaptions(
                source.train, source.image_column, caption_column, self.tokenizer,
                config.max_length, image_size, config.seed, config.augment,
                **augmentation_options(config),
            )  # fmt: skip

        if isinstance(data, MixedPairs):  # each source its own columns
            self.dataset = Mixture([captions(source) for source in data.sources], data.names,
                                   data.weights)  # fmt: skip
        else:
            self.dataset = captions(data)
        self.row = LOSSES[self.loss_name]
        self.criterion = self.row.make(config)
        self.matryoshka = matryoshka_terms(config)
        self.template = config.zero_shot_template
        held = held_out_pairs(config, data)  # the training data's own, or --eval-dataset's
        self.class_names = class_names(held) if self.template else None
        self.evaluation, self.caption_column = held.evaluation, held.text_columns[0]
        self.image_column, self.image_size = held.image_column, image_size

    def _towers(self, config, data: PairData, world_size: int, say: Say):
        """``--text-model``'s tower and ``--model``'s or ``--image-model``'s, projected into
        one width, with a learnable scale (and SigLIP's bias); and the image size."""
        from models.text import ImageTextModel, TextTower

        encoder, self.tokenizer, self.inputs = text_encoder(config, data, data.text_columns)
        width = config.projection_dim or SIMCLR_HEAD[2]
        if config.image_model or config.timm_model:
            image, image_size, inputs = pretrained_image_model(config, width, world_size, say)
            self.inputs.update(inputs)
        else:
            shape = head_shape((*SIMCLR_HEAD[:2], width))
            image = image_model(config, world_size, say, SimCLR, **shape)
            image_size = config.image_size
        text = TextTower(  # in the run's dtype already for text_dropout's probe forward
            encoder, config.text_pooling, width, use_attention_mask=config.attention_mask
        ).to(DTYPES[config.dtype])
        model = ImageTextModel(
            image,
            text_dropout(text, self.tokenizer, config, world_size, say),
            self.tokenizer,
            logit_scale=config.logit_scale_init,
            logit_bias=config.logit_bias_init if self.loss_name == "siglip" else None,
            max_length=config.max_length,
        ).to(DTYPES[config.dtype])
        return model, image_size

    def embed(self, model: nn.Module, chunk: ImageTextBatch, step: int) -> torch.Tensor:
        """The images' projections, then the captions'; dropout keyed by (seed, step, row
        index, 0) in the image tower and (..., 1) in the text tower."""
        parameter = next(model.parameters())
        device = parameter.device
        images = chunk.images.to(device, parameter.dtype, non_blocking=True)
        columns = [(ids.to(device, non_blocking=True), mask.to(device, non_blocking=True))
                   for ids, mask in chunk.columns]  # fmt: skip
        keys = tuple(
            sample_keys(self.seed, step, chunk.indices, view).to(device) for view in (0, 1)
        )
        return model(images, columns, keys)

    def loss(
        self,
        outputs: list[torch.Tensor],
        batch: ImageTextBatch,
        sizes: Sequence[int] | None,
        step: int,
    ) -> torch.Tensor:
        return self.pair_loss(list(view_halves(outputs)), sizes)

    def after_step(self, step: int) -> None:
        """CLIP's clamp of the learnable scale at 100, in place, the same on every rank."""
        with torch.no_grad():
            self.model.log_logit_scale.clamp_(max=math.log(MAX_LOGIT_SCALE))

    def evaluate(self, knn: KnnData | None) -> dict[str, float]:
        """On the held-out images: retrieval in both directions (each image's caption among
        all of theirs, and the reverse: ``image_to_text_recall@k``, ``text_to_image_...``),
        and CLIP's zero-shot top-1 with ``--zero-shot-template``."""
        if self.evaluation is None:
            return {}
        model = self.model
        parameter = next(model.parameters())
        captions = first_texts(self.evaluation[self.caption_column])

        def images(rows):
            pixels = torch.zeros(0, 3, self.image_size, self.image_size)
            if rows:
                pixels, _ = evaluation_images(self.evaluation, self.image_column,
                                              self.image_size, indices=list(rows))  # fmt: skip
            return model.project_images(pixels.to(parameter.device, parameter.dtype))

        def texts(rows):
            return embed_texts(model.project_texts, self.tokenizer, [captions[i] for i in rows],
                               model.max_length, parameter.device)  # fmt: skip

        figures = {}
        model.eval()
        try:
            with torch.no_grad():
                for name, (queries, documents) in {
                    "image_to_text": (images, texts), "text_to_image": (texts, images)
                }.items():  # fmt: skip
                    found = paired_retrieval(queries, documents, len(captions), parameter.device)
                    figures |= {f"{name}_{k}": v for k, v in found.items() if k != "mrr@10"}
                if self.template is not None and knn is not None:
                    prompts = [self.template.format(name) for name in self.class_names]
                    classes = embed_texts(model.project_texts, self.tokenizer, prompts,
                                          model.max_length, parameter.device)  # fmt: skip
                    figures["zero_shot_top1"] = zero_shot_top1(ImageProjections(model), classes,
                                                               knn)  # fmt: skip
        finally:
            model.train()
            reshard_after_evaluation(model)
        return figures


def pretrained_image_model(
    config, width: int, world_size: int, say: Say
) -> tuple[nn.Module, int, dict[str, dict[str, str]]]:
    """``--image-model``'s or ``--timm-model``'s tower (``pretrained_image_tower``),
    projected into ``width`` as CLIP's is; the image size (``--image-size``, else the
    tower's own); the content digests of what it loaded, by option."""
    from models.vision import PretrainedImageModel

    loaded = pretrained_image_tower(config, world_size, say)
    model = PretrainedImageModel(loaded.tower, width, loaded.export).to(DTYPES[config.dtype])
    return model, loaded.size, loaded.inputs


def load_vision_tower(config) -> tuple[nn.Module, Any, dict[str, str]]:
    """``--image-model``'s encoder as the options train it (``adapted``: checkpointed
    layers, LoRA), pooled (``--image-pooling``) and normalised as its processor says
    (``models.vision.VisionTower``); its processor; the digests of its weights."""
    from models.vision import VisionTower

    name = config.image_model
    if reason := unreachable_reason(name, "models"):
        raise TrainerError(f"cannot load --image-model {name!r}: {reason}")
    encoder, processor = TOWER_KINDS["transformers"].load(name, DTYPES[config.dtype])
    digests = {"weights": weights_digest(encoder)}  # before adapters rename its weights
    encoder = adapted(encoder, config, "image", "--image-model")
    tower = VisionTower(encoder, config.image_pooling, processor.image_mean, processor.image_std)
    return tower, processor, digests


@dataclass
class PretrainedTower:
    """A pretrained image tower as a method trains it (``pretrained_image_tower``)."""

    tower: nn.Module
    #: How ``final/`` writes it in its own format: ``export(tower, directory,
    #: adapter_directory)`` (its LoRA adapter in the latter; none: ``directory_adapter``).
    export: Callable[..., None]
    #: The content digests of what it loaded, by option (``Method.inputs``).
    inputs: dict[str, dict[str, str]]
    #: The size of the crops it takes: ``--image-size``, else its processor's or its
    #: ``pretrained_cfg``'s.
    size: int


def pretrained_image_tower(
    config, world_size: int, say: Say, other_size: int | None = None
) -> PretrainedTower:
    """``--image-model``'s tower (``load_vision_tower``) or ``--timm-model``'s
    (``models.timm_tower``) for a method's heads, in the run's dtype, its layers
    checkpointed with ``--gradient-checkpointing`` and adapted with ``--lora-rank``, its
    dropout keyed by sample and what its pooling never reaches frozen. Its crops are
    ``--image-size`` (else its own size), and ``other_size`` if given (DINO's local
    crops: a ViT's position embeddings are then interpolated; a tower that cannot embed
    them is refused in one line)."""
    from models.timm_tower import save_timm_tower
    from models.vision import processor_image_size, save_vision_tower

    if config.timm_model:
        tower = TOWER_KINDS["timm"].load(
            config.timm_model, config.timm_weights, DTYPES[config.dtype],
            other_sizes=other_size is not None,
        )  # fmt: skip
        built = {"architecture": tower.architecture, "model_args": tower.model_args,
                 "mean": tower.mean, "std": tower.std}  # fmt: skip
        inputs = {"timm_model": {"weights": content_digest(tower.encoder.state_dict(), built)}}
        size = config.image_size or tower.image_size
        tower.encoder = adapted(tower.encoder, config, "image", "--timm-model",
                                checkpoint=checkpoint_timm_blocks)  # fmt: skip
        export = save_timm_tower
    else:
        tower, processor, digests = load_vision_tower(config)
        export = partial(save_vision_tower, processor=processor)
        inputs = {"image_model": {**digests, "processor": processor_digest(processor)}}
        size = config.image_size or processor_image_size(processor)
    tower = tower.to(DTYPES[config.dtype])
    # Two images, for a tower with BatchNorm (one value per channel cannot be normalised),
    # whose running statistics the probes leave as they were.
    probe = image_probe(tower, config, size, count=2)
    if other_size is not None:
        image_probe(tower, config, other_size, count=2, named="--local-crop-size")
    with running_statistics_kept(tower):
        tower = tower_dropout(tower.train(), probe, config, world_size, say)
        freeze_unreached(tower, probe, say)
    return PretrainedTower(tower, export, inputs, size)


def image_probe(
    model: nn.Module, config, size: int, count: int = 1, named: str = "--image-size"
) -> tuple[torch.Tensor]:
    """``count`` black images of ``size`` (the option ``named``'s) that ``model`` (a
    pretrained tower) embeds in eval mode, as the probe of its dropout; a size it cannot
    embed is one line."""
    probe = (torch.zeros(count, 3, size, size, dtype=DTYPES[config.dtype]),)
    try:
        with torch.no_grad():
            model.eval()(*probe)
    except (AssertionError, IndexError, RuntimeError, ValueError) as error:  # timm asserts
        option = flag("timm_model") if config.timm_model else flag("image_model")
        tower = config.timm_model or config.image_model
        raise TrainerError(
            f"{named} {size}: {option} {tower!r} cannot embed it "
            f"({str(error).strip().splitlines()[0][:160]})"
        ) from None
    return probe


def dual_encoder(config, world_size: int, say: Say) -> tuple[nn.Module, int, dict]:
    """``--clip-model``'s whole model (``models.dual_encoder.DualEncoder``): its dropout
    keyed by sample, its layers checkpointed and adapted as the options say; the image
    size (``--image-size``, else its processor's); and the digests of what it loaded."""
    from models.dual_encoder import TOWERS, DualEncoder
    from models.vision import processor_image_size

    name, dtype = config.clip_model, DTYPES[config.dtype]
    if reason := unreachable_reason(name, "models"):
        raise TrainerError(f"cannot load --clip-model {name!r}: {reason}")
    model, tokenizer, processor = TOWER_KINDS["clip"].load(name, dtype)
    digests = {**text_model_digests(model, tokenizer),  # its weights, its tokenizer
               "processor": processor_digest(processor)}  # fmt: skip
    projections = tuple(n for n in ("visual_projection", "text_projection") if hasattr(model, n))
    towers = dict(zip(("image", "text"), TOWERS, strict=True))
    model = adapted(model, config, "both", "--clip-model", towers=towers, also_trained=projections)
    size = config.image_size or processor_image_size(processor)
    clip = DualEncoder(model, tokenizer, processor, config.max_length).to(dtype)
    text = tokenizer(["probe"], return_tensors="pt")
    probe = (torch.zeros(1, 3, size, size, dtype=dtype),
             [(text["input_ids"], text["attention_mask"])])  # fmt: skip
    long = torch.full((1, config.max_length), tokenizer.pad_token_id, dtype=torch.long)
    try:
        with torch.no_grad():
            clip.eval()(probe[0], [(long, torch.ones_like(long))])
    except (IndexError, RuntimeError, ValueError) as error:
        raise TrainerError(
            f"--image-size {size} or --max-length {config.max_length}: --clip-model {name!r} "
            f"cannot embed it ({str(error).strip().splitlines()[0][:160]})"
        ) from None
    clip = tower_dropout(clip.train(), probe, config, world_size, say)
    return clip, size, {"clip_model": digests}


def processor_digest(processor) -> str:
    """The digest of an image processor's settings (its private keys left out)."""
    values = {key: value for key, value in processor.to_dict().items() if not key.startswith("_")}
    return content_digest({}, values)


def clip_loss(config, model: nn.Module) -> str:
    """The loss of ``--clip-model``: ``--loss``, else SigLIP's for a model with a logit bias
    and CLIP's otherwise; a loss that would leave the bias untrained, or need one, is
    refused."""
    has_bias = model.logit_bias is not None
    loss = config.loss or ("siglip" if has_bias else "infonce")
    if has_bias != (loss == "siglip"):
        kind = type(model.model.get_base_model() if hasattr(model.model, "get_base_model")
                    else model.model).__name__  # fmt: skip
        raise TrainerError(
            f"--loss {loss}: --clip-model is a {kind}, "
            + ("whose logit bias only --loss siglip trains" if has_bias
               else "without the logit bias that --loss siglip needs: use --loss infonce")
        )  # fmt: skip
    return loss


class ImageProjections(nn.Module):
    """An image-text model's image projections as ``embed``, for the zero-shot classifier."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        return self.model.project_images(images)


def class_names(data: PairData) -> list[str]:
    """The label column's class names in ``knn_data``'s label order (sorted labels): a
    ``ClassLabel``'s names, else each label as a string."""
    labels = sorted(set(data.train[data.label_column]) | set(data.evaluation[data.label_column]))
    names = getattr(data.train.features[data.label_column], "names", None)
    return [names[label] if names else str(label) for label in labels]
