"""Pairs (``--method pairs``, ``--columns``): a dataset whose items are a row's columns,
an ``embed`` that runs each column through its tower, and a two-tower loss whose
positives sit at their global index. The data decide which: text-text pairs
(``methods.text_pairs``) or image-text ones (``methods.image_text``). What both share is
here: the row of ``METHODS``, the text tower and the texts' helpers."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from contrastive_accelerate.collectives import is_distributed
from contrastive_accelerate.config import ConfigError, field_names, flag, is_set, option
from contrastive_accelerate.data.augmentation import ImageOptions
from contrastive_accelerate.data.pairs import (
    MixedPairs,
    PairData,
    count_truncated,
    load_mixture,
    load_pair_dataset,
    load_streamed_pairs,
    split_columns,
    training_texts,
)
from contrastive_accelerate.durable_files import content_digest
from contrastive_accelerate.hub import unreachable_reason
from contrastive_accelerate.launch import TrainerError
from contrastive_accelerate.methods import composition
from contrastive_accelerate.methods.base import (
    DTYPES,
    EVERY_SOURCE,
    Family,
    Method,
    MethodRow,
    Say,
    dataset_options,
)
from contrastive_accelerate.methods.loss_table import INITIAL_LOGIT_SCALE, LOSSES, options_of
from contrastive_accelerate.methods.sentence_tools import (
    BeirOptions,
    MatryoshkaOptions,
    check_beir,
    folder_digest,
    matryoshka_terms,
    prompts_of,
    sentence_folder,
)
from losses.matryoshka import matryoshka
from models import convert_sample_dropout, sample_randomness
from models.checkpointing import checkpoint_transformer_layers
from models.dropout import switch_off_kernel_dropout
from models.lora import LoRAOptions
from models.text import POOLINGS
from models.towers import IMAGE_TOWER_KINDS, TOWER_KINDS, TowerOptions


@dataclass
class PairsOptions:
    """What only pairs read (``--method pairs``), besides LoRA's and the pair losses'.
    Declared once here, each a ``--flag`` and a config-file key of ``TrainConfig``
    (``contrastive_accelerate.options``), which holds this section."""

    columns: str | tuple[str, ...] | None = option(
        None, "pairs: anchor,positive[,negative...]; one for all --dataset or one each"
    )
    text_pooling: str | None = option(
        None, "pairs: the token states' pooling; none: the folder's (modules.json), else mean",
        choices=POOLINGS,
    )  # fmt: skip
    max_length: int | None = option(
        None, "pairs: tokens per text; none: the folder's max_seq_length, else 128", at_least=2
    )
    two_towers: bool = option(False, "pairs: one tower for the anchors, one for the rest")
    unique_texts: bool = option(False, "pairs: no text twice in a global batch")
    projection_dim: int = option(0, "pairs: a linear projection's width; 0: none", at_least=0)
    zero_shot_template: str | None = option(
        None, 'image-text: zero-shot evaluation with e.g. "a photo of a {}"', resume="free"
    )
    attention_mask: bool = option(True, "pairs: --no-attention-mask attends to the padding")
    prompts: str | tuple[str, ...] | None = option(
        None, 'text pairs: "COLUMN=PROMPT", the column\'s prefix ("anchor=query: "); repeatable'
    )
    lora_towers: str = option(
        "both", "LoRA: the transformers towers it adapts", choices=("both", "text", "image")
    )


#: The LoRA options pairs read besides the towers' own (``models.lora.LoRAOptions``).
LORA_OPTIONS = (*field_names(LoRAOptions), "lora_towers")

#: The two kinds of pairs, as the data tell them apart: text pairs read any source and
#: take no image; image-text pairs read any source and take every image tower.
TEXT_PAIRS = Family(
    "--method pairs (text pairs)", ("table", "stream", "mixture"), None,
    reads=("gradient_checkpointing",), losses=("mnrl", "gist"),
)  # fmt: skip
IMAGE_TEXT = Family(
    "--method pairs (image-text)", EVERY_SOURCE, ("scratch", "transformers", "clip", "timm"),
    reads=("gradient_checkpointing",), losses=("infonce", "siglip"),
)  # fmt: skip
#: The ``--loss`` of ``--method pairs``: text-text pairs take mnrl, image-text ones
#: infonce (CLIP) or siglip.
TEXT_PAIR_LOSSES, IMAGE_TEXT_LOSSES = TEXT_PAIRS.losses, IMAGE_TEXT.losses
PAIR_LOSSES = (*TEXT_PAIR_LOSSES, *IMAGE_TEXT_LOSSES)

#: What only pairs read.
#: (The kinds of tower with a text tower are pairs' alone; ``--image-model`` and its
#: pooling are the image methods' too: ``composition`` refuses them where they do not apply.)
TEXT_OPTIONS = (
    *field_names(PairsOptions), *field_names(MatryoshkaOptions), *field_names(BeirOptions),
    *(TOWER_KINDS[kind].option for kind in ("text", "clip")),
    *options_of(TEXT_PAIR_LOSSES),
)  # fmt: skip

#: What text-text pairs never read (no image tower, no labels to probe): set, refused.
IMAGE_OPTIONS = (
    *field_names(ImageOptions),
    *(name for name in field_names(TowerOptions) if name not in TEXT_PAIRS.reads),
    *(name for kind, row in TOWER_KINDS.items() if kind in IMAGE_TOWER_KINDS
      for name in (row.option, *row.reads) if name not in (None, "model")),
    *options_of(IMAGE_TEXT_LOSSES),
    "augmentation_seeding",  # of the images' draws
    "zero_shot_template",  # class names under images
    "linear_probe",  # of an image tower
)  # fmt: skip
#: What ``--clip-model``'s two towers, projections, scale and bias replace.


class PairsMethod(Method):
    """What text-text and image-text pairs share: ``--unique-texts``' keys, the loss row's
    call over each Matryoshka prefix, no state."""

    unique_texts: bool = False
    #: ``--matryoshka-dims`` and their weights (``matryoshka_terms``); None: off.
    matryoshka: tuple[tuple[int, ...], tuple[float, ...]] | None = None

    def pair_loss(
        self,
        columns: list[torch.Tensor],
        sizes: Sequence[int] | None,
        labels: Any = None,
    ) -> torch.Tensor:
        """The loss row's call on the columns' embeddings (``LossRow.call``; ``labels``:
        mnrl's ``PairBatch.identities``, gist's guide embeddings), or with
        ``--matryoshka-dims`` its weighted sum over their leading dims
        (``losses.matryoshka``: a dim wider than the embeddings is a ``ValueError`` on every
        rank alike, one line)."""

        def loss(embeddings: list[torch.Tensor]) -> torch.Tensor:
            return self.row.call(self.criterion, self.model, embeddings, labels, sizes)

        if self.matryoshka is None:
            return loss(columns)
        return matryoshka(loss, columns, *self.matryoshka)

    def duplicate_keys(self) -> list[tuple[int, ...]] | None:
        """Each row's texts as keys with ``--unique-texts``: no text twice in a batch."""
        return self.dataset.duplicate_keys() if self.unique_texts else None


def pair_data(config) -> PairData:
    """The columns of ``--dataset`` named by ``--columns``: text, or an image and text."""
    if config.mixed:
        given = config.columns if isinstance(config.columns, tuple) else (config.columns,)
        columns = [split_columns(value) for value in given] * (len(config.dataset) // len(given))
        weights = config.mixture_weights
        return load_mixture(
            config.dataset, columns, streaming=config.streaming, streams=config.streams,
            shuffle_buffer=config.shuffle_buffer, mixture=config.mixture,
            weights=[float(w) for w in weights.split(",")] if weights else None,
            temperature=config.mixture_temperature,
        )  # fmt: skip
    columns = split_columns(config.columns)
    if config.streaming:
        return load_streamed_pairs(
            config.dataset, columns, config.streams, config.shuffle_buffer,
            config_name=config.dataset_config, split=config.split,
        )  # fmt: skip
    return load_pair_dataset(config.dataset, columns, **dataset_options(config))


def build(config, data: PairData, world_size: int, say: Say, **kwargs) -> PairsMethod:
    """Text-text (``TextPairsMethod``) or image-text (``ImageTextMethod``) pairs, as
    ``data``'s columns are."""
    from contrastive_accelerate.methods.image_text import ImageTextMethod
    from contrastive_accelerate.methods.text_pairs import TextPairsMethod

    if data.image_column is not None:
        return ImageTextMethod(config, data, world_size, say, **kwargs)
    return TextPairsMethod(config, data, world_size, say, **kwargs)


def defaults(config) -> dict[str, Any]:
    """AdamW, as CLIP and sentence-transformers train; sentence-transformers' 5e-5 for a
    pretrained text tower; the CLIP-style loss's initial scale."""
    values: dict[str, Any] = {"optimizer": "adamw"}
    if config.text_model != "scratch":
        values["lr"] = 5e-5
    # A sentence-transformers folder's own pooling and length, unless a flag overrides
    # them; a CLIP checkpoint pools its own texts.
    folder = sentence_folder(config)
    if not config.clip_model:
        values["text_pooling"] = folder.pooling if folder else "mean"
    values["max_length"] = (folder.max_seq_length if folder else None) or 128
    loss = config.loss or IMAGE_TEXT_LOSSES[0]  # the data decide between mnrl and infonce
    if loss in INITIAL_LOGIT_SCALE and not config.clip_model:  # a checkpoint has its own
        values["logit_scale_init"] = INITIAL_LOGIT_SCALE[loss]
    return values


def check(config) -> None:
    if not config.columns:
        raise ConfigError("--method pairs needs --columns anchor,positive[,negative...]")
    if config.loss is not None and config.loss not in PAIR_LOSSES:
        raise ConfigError(f"--loss {config.loss} does not apply to --method pairs")
    if config.loss == "gist" and not config.gist_guide:
        raise ConfigError("--loss gist needs --gist-guide, the frozen guide model's folder")
    matryoshka_terms(config)
    prompts_of(config)
    check_beir(config)
    if not config.lora_rank and is_set(config, "lora_towers"):
        raise ConfigError("--lora-towers applies with --lora-rank")
    image_tower = config.image_model or config.clip_model or config.timm_model
    if config.lora_rank and config.lora_towers == "image" and not image_tower:
        raise ConfigError(
            "--lora-towers image needs a pretrained image tower: --image-model or --timm-model"
        )
    template = config.zero_shot_template
    if template is not None:
        try:
            one_place = template.format("") != template and template.count("{}") == 1
        except (IndexError, KeyError, ValueError):
            one_place = False
        if not one_place:
            raise ConfigError(
                f"--zero-shot-template {template!r}: mark the class name's place with one {{}}"
                ', e.g. "a photo of a {}"'
            )


def check_data(config, data: PairData) -> None:
    """What needs the data: text or image-text, their losses and options, labels for
    the zero-shot evaluation, a text tower."""
    if config.text_model is None and config.clip_model is None:
        raise TrainerError(
            "--columns needs --text-model: a transformers model directory, a hub name, or "
            "scratch (a small BERT from random weights); or, for image-text, --clip-model"
        )
    composition.check_family(config, family(data))
    if data.image_column is None:
        loss = config.loss or TEXT_PAIR_LOSSES[0]
        if loss not in TEXT_PAIR_LOSSES:
            raise TrainerError(f"--loss {config.loss}: text pairs train with mnrl or gist")
        for name in (name for name in other_text_rows(loss) if is_set(config, name)):
            raise TrainerError(f"{flag(name)} does not apply to --loss {loss}")
        # Only the data tell text pairs from image-text: the options cannot refuse these.
        defaults = type(config)(
            dataset=config.dataset, columns=config.columns, loss=config.loss,
            max_steps=config.max_steps, streaming=config.streaming, gist_guide=config.gist_guide,
        ).resolved()  # fmt: skip
        for name in IMAGE_OPTIONS:
            if getattr(config, name) != getattr(defaults, name):
                raise TrainerError(
                    f"{flag(name)} does not apply to text pairs: --columns {config.columns} "
                    "names no image"
                )
        return
    loss = config.loss or IMAGE_TEXT_LOSSES[0]
    if loss not in IMAGE_TEXT_LOSSES:
        raise TrainerError(f"--loss {config.loss}: image-text pairs train with infonce or siglip")
    for name in image_text_unread(loss):
        if is_set(config, name):
            raise TrainerError(
                f"{flag(name)} does not apply to image-text pairs with --loss {loss}"
            )
    held = held_out_pairs(config, data)
    if config.zero_shot_template and (held.label_column is None or held.evaluation is None):
        raise TrainerError(
            "--zero-shot-template needs labels and held-out images: a label column (or "
            "--label-column), --knn-k > 0, and an evaluation split or --eval-holdout"
        )


def held_out_pairs(config, data: PairData | MixedPairs) -> PairData:
    """What image-text's retrieval and zero-shot read: ``--eval-dataset``'s table, read
    with the (first) source's image and caption columns, whose evaluation split they
    read (a stream or a mixture has no held-out rows); else ``data`` itself."""
    if config.eval_dataset is None:
        return data
    source = data.sources[0] if isinstance(data, MixedPairs) else data
    columns = (source.image_column, source.text_columns[0])
    held = load_pair_dataset(config.eval_dataset, columns)
    if held.evaluation is None:
        raise TrainerError(f"--eval-dataset {config.eval_dataset!r}: it has no evaluation split")
    return held


#: What image-text pairs never read (one tower per kind, InfoNCE or SigLIP): set, refused.
TEXT_PAIR_OPTIONS = ("two_towers", "prompts", *field_names(BeirOptions),
                     *options_of(TEXT_PAIR_LOSSES))  # fmt: skip
#: The learnable scale of image-text pairs, and SigLIP's bias.
SCALE_OPTIONS = options_of(IMAGE_TEXT_LOSSES)


def image_text_unread(loss: str) -> tuple[str, ...]:
    """What image-text pairs with ``loss`` do not read: the text pairs' own options, and
    the scale options its row leaves out (SigLIP's bias for InfoNCE)."""
    return (*TEXT_PAIR_OPTIONS, *(n for n in SCALE_OPTIONS if n not in LOSSES[loss].options))


def other_text_rows(loss: str) -> tuple[str, ...]:
    """The options of the text-pair loss rows that ``loss``'s row does not read."""
    return tuple(name for name in options_of(TEXT_PAIR_LOSSES) if name not in LOSSES[loss].options)


def reads(config) -> tuple[str, ...]:
    """Without ``--loss`` the data decide between text and image-text (``check_data``
    refuses what the data's kind does not read); with it, the loss does."""
    everything = ("loss", *TEXT_OPTIONS, *SCALE_OPTIONS)
    if config.loss in TEXT_PAIR_LOSSES:
        unread = (*IMAGE_OPTIONS, *SCALE_OPTIONS, *other_text_rows(config.loss))
        return tuple(name for name in everything if name not in unread)
    if config.loss in IMAGE_TEXT_LOSSES:
        unread = image_text_unread(config.loss)
        return tuple(name for name in everything if name not in unread)
    return everything


def family(data: PairData) -> Family:
    """Text or image-text pairs, as ``data``'s columns are."""
    return TEXT_PAIRS if data.image_column is None else IMAGE_TEXT


PAIRS = MethodRow(
    build,
    pair_data,
    options=("loss", *TEXT_OPTIONS, *SCALE_OPTIONS),
    sections=(PairsOptions, MatryoshkaOptions, BeirOptions),
    reads=reads,
    defaults=defaults,
    check=check,
    check_data=check_data,
    families=(TEXT_PAIRS, IMAGE_TEXT),
)


def text_encoder(config, data: PairData, columns):
    """``--text-model``'s encoder and tokenizer, or with ``scratch`` a small BERT and a
    vocabulary of ``columns``' texts; and what was loaded as content digests, for the
    method's ``inputs``."""
    from models.text import SCRATCH, scratch_text_encoder

    folder = sentence_folder(config)  # a sentence-transformers folder's model: its own
    if config.text_model == SCRATCH:
        texts = training_texts(data, columns)
        encoder, tokenizer = scratch_text_encoder(texts, config.max_length, DTYPES[config.dtype])
    else:
        if reason := unreachable_reason(config.text_model, "models"):
            raise TrainerError(f"cannot load --text-model {config.text_model!r}: {reason}")
        path = os.path.join(config.text_model, folder.transformer) if folder else config.text_model
        encoder, tokenizer = TOWER_KINDS["text"].load(path, DTYPES[config.dtype])
        check_text_model_limits(encoder, tokenizer, config.max_length, "--text-model",
                                config.text_model)  # fmt: skip
    digests = {"text_model": text_model_digests(encoder, tokenizer)}
    if folder is not None:
        digests["text_model"]["stack"] = folder_digest(folder)
    return adapted(encoder, config, "text", "--text-model"), tokenizer, digests


def adapted(
    encoder: nn.Module,
    config,
    tower: str,
    what: str,
    *,
    towers: dict[str, str] | None = None,
    also_trained: tuple[str, ...] = (),
    checkpoint: Callable[[nn.Module], None] = checkpoint_transformer_layers,
) -> nn.Module:
    """A pretrained model as the options train it: its layers checkpointed with
    ``--gradient-checkpointing`` (``checkpoint``: a transformers model's layers by
    default), and LoRA adapters (``--lora-rank``) when ``--lora-towers`` names its
    ``tower`` ("text" or "image"; an image method's tower is "image"). A dual encoder
    gives ``towers``, each kind's submodule: the towers ``--lora-towers`` leaves out
    train whole, as do ``also_trained`` (its projections)."""
    from models.lora import add_lora

    if config.gradient_checkpointing:
        checkpoint(encoder)
    if not config.lora_rank:
        return encoder
    targets = config.lora_target_modules
    targets = [name.strip() for name in targets.split(",")] if targets else None
    if towers is None:
        if config.lora_towers not in ("both", tower):
            return encoder
        return add_lora(encoder, config.lora_rank, config.lora_alpha, config.lora_dropout,
                        targets, what)  # fmt: skip
    chosen = [name for kind, name in towers.items() if config.lora_towers in ("both", kind)]
    whole = tuple(name for name in towers.values() if name not in chosen)
    return add_lora(encoder, config.lora_rank, config.lora_alpha, config.lora_dropout, targets,
                    what, towers=chosen, also_trained=(*also_trained, *whole))  # fmt: skip


def text_model_digests(encoder: nn.Module, tokenizer) -> dict[str, str]:
    """What a text model is, whatever its path: the digest of its configuration and
    weights, and that of its tokenizer (vocabulary, rules, special tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    rules = {
        "vocabulary": backend.to_str() if backend else sorted(tokenizer.get_vocab().items()),
        "special_tokens": tokenizer.all_special_tokens,
        "sides": [tokenizer.padding_side, tokenizer.truncation_side],
    }
    return {"weights": weights_digest(encoder), "tokenizer": content_digest({}, rules)}


def weights_digest(encoder: nn.Module) -> str:
    """The digest of a ``transformers`` model's configuration (its paths left out) and
    weights, as loaded: before any training."""
    config = {key: value for key, value in encoder.config.to_dict().items()
              if key not in ("_name_or_path", "transformers_version")}  # fmt: skip
    return content_digest(encoder.state_dict(), config)


def check_text_model_limits(
    encoder: nn.Module, tokenizer, max_length: int, named: str, path: str
) -> None:
    """Refuse what the model (option ``named``, at ``path``) cannot embed, before a step
    would fail on it: token ids beyond its vocabulary, and texts of ``max_length`` tokens
    (one probe forward: the positions a model takes are its own business, e.g. RoBERTa's
    offset)."""
    vocabulary = getattr(encoder.config, "vocab_size", None)
    if vocabulary is not None and len(tokenizer) > vocabulary:
        raise TrainerError(
            f"the tokenizer of {named} {path!r} has {len(tokenizer)} tokens, "
            f"more than the model's vocabulary of {vocabulary}"
        )
    probe = torch.full((1, max_length), tokenizer.pad_token_id, dtype=torch.long)
    try:
        with torch.no_grad():
            encoder(input_ids=probe, attention_mask=torch.ones_like(probe))
    except (IndexError, RuntimeError, ValueError) as error:
        limit = getattr(encoder.config, "max_position_embeddings", "fewer")
        raise TrainerError(
            f"--max-length {max_length}: {named} {path!r} takes "
            f"{limit} positions ({str(error).strip().splitlines()[0][:120]})"
        ) from None


def text_dropout(tower: nn.Module, tokenizer, config, world_size: int, say: Say) -> nn.Module:
    """The text tower's dropout keyed by sample (``tower_dropout``), probed on one text."""
    probe = tokenizer(["probe"], return_tensors="pt")
    return tower_dropout(tower, (probe["input_ids"], probe["attention_mask"]), config,
                         world_size, say)  # fmt: skip


def tower_dropout(
    tower: nn.Module, probe: tuple[torch.Tensor, ...], config, world_size: int, say: Say
) -> nn.Module:
    """The tower's own dropout keyed by sample (``--dropout-masks per-sample``), and the
    dropout no key reaches switched off (``tower(*probe)`` shows which); or, the control,
    torch's per-process masks."""
    if config.dropout_masks == "per-sample":
        tower = convert_sample_dropout(tower)
        switch_off_kernel_dropout(tower, probe, say)
    elif world_size > 1 or config.accumulation_chunks > 1:
        say(
            "warning: --dropout-masks per-process draws the towers' dropout masks from "
            "each process's RNG: training is not world-size invariant"
        )
    return tower


def freeze_unreached(model: nn.Module, probe: tuple[torch.Tensor, ...], say: Say) -> list[str]:
    """Freeze the parameters that ``model(*probe)`` takes no gradient into (a pretrained
    model's pooler or final norm that the chosen pooling skips): DDP would wait for
    their gradients, and weight decay would still shrink them. Says so; returns their
    names."""
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    with sample_randomness(torch.zeros(len(probe[0]), dtype=torch.int64)):
        output = model(*probe)
    gradients = torch.autograd.grad(output.sum(), [p for _, p in trained], allow_unused=True)
    unreached = [name for (name, _), g in zip(trained, gradients, strict=True) if g is None]
    for name, parameter in trained:
        if name in unreached:
            parameter.requires_grad_(False)
    if unreached:
        say(f"notice: {len(unreached)} parameters that the pooling never reaches are frozen "
            f"(e.g. {unreached[0]})")  # fmt: skip
    return unreached


def say_truncated(data: PairData, columns, tokenizer, max_length: int, say: Say) -> None:
    """One notice for the texts that ``max_length`` truncates, counted once at start-up by
    the main process, the one that prints it."""
    if is_distributed() and torch.distributed.get_rank() != 0:
        return
    truncated, total = count_truncated(training_texts(data, columns), tokenizer, max_length)
    if truncated:
        texts = "texts of the first shard" if data.streamed else "texts"
        say(
            f"notice: {truncated} of {total} {texts} are longer than --max-length {max_length} "
            "tokens and are truncated"
        )
