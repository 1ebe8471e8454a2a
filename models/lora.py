"""LoRA adapters (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models")
on a pretrained tower (a ``transformers`` model, a timm model), through ``peft``: each
adapted linear layer computes

    h = W x + (alpha / r) * B A dropout(x),        A: r x d_in,  B: d_out x r,  B = 0 at start

with ``W`` frozen. ``peft`` is the optional ``[lora]`` extra, imported only here.

    encoder = add_lora(encoder, rank=16, alpha=32, dropout=0.1, targets=None, what="--text-model")
    # ... train; then final/: the adapter for PeftModel.from_pretrained, and the merged model
    save_adapted(encoder, "final/tower0", "final/adapter0")

``peft`` draws ``dropout(x)`` with an ``nn.Dropout``, which ``convert_sample_dropout``
keys by sample like every other dropout: 1 and N processes train the same adapters.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from contrastive_accelerate.config import ConfigError, field_names, flag, is_set, option
from models.loading import save_without_code

#: The query and value projections, which the LoRA paper adapts, under the names of
#: BERT-style (``query``, ``value``) and CLIP-, SigLIP- and ViT-style attention, and
#: timm's fused query-key-value projection (``qkv``), which holds them.
DEFAULT_TARGETS = ("query", "value", "q_proj", "v_proj", "qkv")


@dataclass
class LoRAOptions:
    """LoRA adapters on the pretrained towers (``--image-model``, ``--timm-model``,
    ``--clip-model``, ``--text-model``), a section of ``TrainConfig``."""

    lora_rank: int = option(
        0, "LoRA adapters of this rank on the pretrained towers; 0: train every weight",
        at_least=0,
    )  # fmt: skip
    lora_alpha: float = option(8.0, "LoRA: scale alpha (adapters add alpha / rank * BA)", above=0.0)
    lora_dropout: float = option(
        0.0, "LoRA: dropout of the adapters' input", at_least=0.0, below=1.0
    )
    lora_target_modules: str | None = option(
        None, "LoRA: linear layers to adapt, e.g. query,value; none: the query and value ones"
    )


def check_lora_options(config, pretrained: bool) -> None:
    """Refuse LoRA's options without ``--lora-rank``, and adapters where no tower is
    ``pretrained`` (a tower from scratch trains every weight)."""
    if not config.lora_rank:
        for name in field_names(LoRAOptions)[1:]:
            if is_set(config, name):
                raise ConfigError(f"{flag(name)} applies with --lora-rank")
    elif not pretrained:
        raise ConfigError(
            "--lora-rank adapts a pretrained tower (--image-model, --timm-model, --clip-model, "
            "--text-model); a tower from scratch trains every weight"
        )


class LoraError(ValueError):
    """An adapter problem the user must fix: reported as one line."""


def add_lora(
    encoder: nn.Module,
    rank: int,
    alpha: float,
    dropout: float,
    targets: Sequence[str] | None,
    what: str,
    *,
    towers: Sequence[str] = (),
    also_trained: Sequence[str] = (),
) -> nn.Module:
    """``encoder`` as a ``peft.PeftModel`` with LoRA adapters of ``rank`` on the linear
    layers named ``targets`` (the last part of a module's name; None: those of
    ``DEFAULT_TARGETS`` it has), every other weight frozen. ``what`` names the tower in
    errors. Raises ``LoraError`` when ``peft`` is missing or nothing matches.

    A dual encoder (CLIP) adapts only the layers inside its ``towers`` (submodule names);
    ``also_trained`` modules (its projections, a tower trained whole) train in full and
    are saved with the adapter (peft's ``modules_to_save``), and its own top-level
    parameters (the logit scale and bias) train too."""
    try:
        import peft
    except ImportError:
        raise LoraError("--lora-rank needs peft: pip install -e '.[lora]'") from None
    linear = sorted(
        {name.rsplit(".", 1)[-1] for name, m in encoder.named_modules()
         if isinstance(m, nn.Linear) and (not towers or name.split(".", 1)[0] in towers)}
    )  # fmt: skip
    chosen = list(targets) if targets else [name for name in DEFAULT_TARGETS if name in linear]
    missing = [name for name in chosen if name not in linear]
    if not chosen or missing:
        asked = (
            f"--lora-target-modules {','.join(missing)} matches no linear layer of {what}"
            if missing
            else f"--lora-rank: {what} has none of {', '.join(DEFAULT_TARGETS)}; name its layers "
            "with --lora-target-modules"
        )
        raise LoraError(f"{asked} (its linear layers: {', '.join(linear) or 'none'})")
    where: str | list[str] = chosen
    if towers:  # a full match of the module's name: inside a tower, ending in a target
        where = rf"({'|'.join(towers)})\..*\.({'|'.join(chosen)})"
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=where,
        modules_to_save=list(also_trained) or None,
    )  # fmt: skip
    top_level = [name for name, _ in encoder.named_parameters(recurse=False)] if towers else []
    adapted = peft.get_peft_model(encoder, config)
    for name in top_level:
        getattr(adapted.get_base_model(), name).requires_grad_(True)
    return adapted


def is_adapted(encoder: nn.Module) -> bool:
    """Whether ``encoder`` carries ``peft`` adapters (``add_lora``)."""
    return hasattr(encoder, "peft_config") and hasattr(encoder, "merge_and_unload")


def save_adapted(encoder: nn.Module, merged_directory: str, adapter_directory: str) -> None:
    """The adapter in ``adapter_directory`` (``adapter_config.json`` and
    ``adapter_model.safetensors``: what ``PeftModel.from_pretrained`` loads onto the base
    model), and a merged copy of the model (``W + (alpha / r) B A``, no peft needed) in
    ``merged_directory``, which ``AutoModel`` loads. The trained model is left as it is."""
    save_without_code(encoder, adapter_directory, safe_serialization=True)
    merged = copy.deepcopy(encoder).merge_and_unload()
    save_without_code(merged, merged_directory, safe_serialization=True)
