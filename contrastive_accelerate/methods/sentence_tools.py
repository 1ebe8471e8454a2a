"""What sentence-embedding users train with, beside the pair losses: Matryoshka
embeddings (``--matryoshka-dims``), a prompt per column (``--prompts``), retrieval on a
BEIR benchmark (``--eval-beir``), and a sentence-transformers folder taken as it is
(``models.sentence_folder``): its pooling, length and prompts as the options' defaults,
each flag that overrides one said."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from contrastive_accelerate.config import ConfigError, flag, is_set, option
from contrastive_accelerate.data.pairs import split_columns
from contrastive_accelerate.durable_files import content_digest
from contrastive_accelerate.methods.base import Say
from models.sentence_folder import SentenceFolder, read_sentence_folder


@dataclass
class MatryoshkaOptions:
    """Matryoshka embeddings over the pair losses (``losses.matryoshka``), a section of
    ``TrainConfig``."""

    matryoshka_dims: str | None = option(
        None, "pairs: the loss on these leading dims too, e.g. 768,256,64; none: off"
    )
    matryoshka_weights: str | None = option(
        None, "pairs: each --matryoshka-dims term's weight; none: 1 each"
    )


@dataclass
class BeirOptions:
    """Retrieval evaluation on a benchmark in BEIR's format (``data.beir``), a section of
    ``TrainConfig``."""

    eval_beir: str | None = option(
        None, "text pairs: nDCG@10, MRR@10, recall@k on this BEIR folder",
        resume="free",
    )  # fmt: skip
    eval_beir_split: str = option("test", "--eval-beir: its qrels/SPLIT.tsv", resume="free")


def check_beir(config) -> None:
    """Refuse ``--eval-beir-split`` without ``--eval-beir``."""
    if is_set(config, "eval_beir_split") and not config.eval_beir:
        raise ConfigError("--eval-beir-split applies with --eval-beir")


def prompts_of(config) -> dict[str, str]:
    """``--prompts`` by column name (each "COLUMN=PROMPT", split at the first "="),
    checked against ``--columns``; empty when none are given."""
    given = config.prompts if isinstance(config.prompts, tuple) else (config.prompts,)
    prompts: dict[str, str] = {}
    for entry in filter(None, given):
        column, equals, prompt = entry.partition("=")
        if not equals or not column.strip() or column.strip() in prompts:
            raise ConfigError(f"--prompts {entry!r}: give COLUMN=PROMPT, once per column")
        prompts[column.strip()] = prompt
    every = config.columns if isinstance(config.columns, tuple) else (config.columns or "",)
    columns = {name for value in every for name in split_columns(value)}
    if unknown := sorted(set(prompts) - columns):
        raise ConfigError(f"--prompts: {', '.join(unknown)} is not a column of --columns")
    return prompts


def matryoshka_terms(config) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
    """``--matryoshka-dims`` and their weights, checked; None when off."""
    if config.matryoshka_dims is None:
        if config.matryoshka_weights is not None:
            raise ConfigError("--matryoshka-weights applies with --matryoshka-dims")
        return None
    try:
        dims = tuple(int(d) for d in config.matryoshka_dims.split(","))
        weights = tuple(float(w) for w in (config.matryoshka_weights or "").split(",") if w)
    except ValueError:
        raise ConfigError(
            f"--matryoshka-dims {config.matryoshka_dims!r} / --matryoshka-weights "
            f"{config.matryoshka_weights!r}: give comma-separated numbers"
        ) from None
    if any(d < 1 for d in dims) or len(set(dims)) != len(dims):
        raise ConfigError(f"--matryoshka-dims {config.matryoshka_dims}: distinct widths >= 1")
    weights = weights or (1.0,) * len(dims)
    if len(weights) != len(dims) or not all(w > 0 for w in weights):
        raise ConfigError(
            f"--matryoshka-weights {config.matryoshka_weights}: one weight > 0 per dim "
            f"({len(dims)})"
        )
    return dims, weights


def sentence_folder(config) -> SentenceFolder | None:
    """``--text-model``'s sentence-transformers stack (``models.sentence_folder``), or
    None for a plain transformers folder, a hub name or ``scratch``."""
    if not config.text_model or config.text_model == "scratch":
        return None
    return read_sentence_folder(config.text_model)


def folder_prompts(folder: SentenceFolder | None, columns: Sequence[str]) -> dict[str, str]:
    """A sentence-transformers folder's prompts as the columns': its "query" prompt the
    anchors' (the first column), its "document" prompt every other column's."""
    if folder is None:
        return {}
    named = {columns[0]: folder.prompts.get("query", "")}
    named |= {column: folder.prompts.get("document", "") for column in columns[1:]}
    return {column: prompt for column, prompt in named.items() if prompt}


def say_overridden(config, folder: SentenceFolder | None, say: Say) -> None:
    """One notice for each of a sentence-transformers folder's settings that a flag
    overrides (its pooling, its max_seq_length, its prompts)."""
    if folder is None:
        return
    overridden = [
        (name, ours, theirs)
        for name, ours, theirs in (
            ("text_pooling", config.text_pooling, folder.pooling),
            ("max_length", config.max_length, folder.max_seq_length),
            ("prompts", prompts_of(config), folder.prompts),
        )
        if is_set(config, name) and theirs and ours != theirs
    ]
    for name, ours, theirs in overridden:
        say(f"notice: {flag(name)} {ours} overrides --text-model's own {theirs} "
            f"({config.text_model})")  # fmt: skip


def folder_digest(folder: SentenceFolder) -> str:
    """The content digest of what a sentence-transformers folder stacks on its model."""
    tensors = {f"dense.{i}.{name}": tensor for i, dense in enumerate(folder.dense)
               for name, tensor in zip(("weight", "bias"), dense.weights(), strict=True)
               if tensor is not None}  # fmt: skip
    described = {"pooling": folder.pooling, "normalize": folder.normalize,
                 "activations": [dense.activation for dense in folder.dense]}  # fmt: skip
    return content_digest(tensors, described)
