"""What composes with what: every method's families (``MethodRow.families``) against
the kinds of source and of image tower, and the one place that says why a combination
does not train.

A run's kinds come from its options: a mixture with several ``--dataset``, a stream
with ``--streaming``, else a table; ``--clip-model``'s towers, ``--image-model``'s, or
``--model``'s from scratch. ``refusal`` is the only author of the reason: the options
ask it before anything is built (``check``, against every family the method may be),
and the data ask it again once they tell which family it is (``check_family``: text
or image-text pairs). ``cells`` lays out every combination, for the composition test
and ``docs/composition.md`` (``python -m contrastive_accelerate.methods``
writes it).

Example::

    refusal(DINO.families[0], "stream", "scratch")
    # '--method dino trains on a table, not on streamed shards (--streaming)'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from contrastive_accelerate.config import ConfigError, flag, is_set
from contrastive_accelerate.launch import TrainerError
from contrastive_accelerate.methods.base import Family, MethodRow
from models.lora import check_lora_options
from models.towers import (
    IMAGE_TOWER_KINDS,
    IMAGE_TOWERS,
    TOWER_KINDS,
    TOWER_OPTIONS,
    image_tower_kind,
    towers_reading,
)

#: The kinds of source, as a refusal names them.
SOURCES = {
    "table": "a table",
    "stream": "streamed shards (--streaming)",
    "mixture": "a mixture (several --dataset)",
}
#: The kinds of image tower, as a refusal names them (``models.towers.TOWER_KINDS``).
TOWERS = IMAGE_TOWER_KINDS


def source_kind(config) -> str:
    """The kind of source the options name (a key of ``SOURCES``)."""
    return "mixture" if config.mixed else "stream" if config.streaming else "table"


def tower_kind(config) -> str:
    """The kind of image tower the options name (a key of ``TOWERS``)."""
    return image_tower_kind(config)


def refusal(family: Family, source: str, tower: str | None) -> str | None:
    """Why ``family`` does not train on a ``source`` with an image ``tower`` (None: no
    tower named; "scratch" is also what a family without images gets when no option
    names one); None: it trains."""
    if source not in family.sources:
        return (
            f"{family.name} trains on {_either(family.sources, SOURCES)}, not on {SOURCES[source]}"
        )
    if tower in (None, "scratch") and family.towers is None:  # no option names a tower
        return None
    if family.towers is None:
        return f"{family.name} takes no image tower, not {TOWERS[tower]}"
    if tower is not None and tower not in family.towers:
        instead = TOWER_KINDS[tower].instead
        return f"{family.name} trains {_either(family.towers, TOWERS)}, not {TOWERS[tower]}" + (
            f": {instead}" if instead else ""
        )
    return None


def check(config, row: MethodRow) -> None:
    """Refuse, before anything is built, the source and tower of the options unless one
    of the method's families trains them: the reason of the first family that takes
    the tower named (a family without images, where one is named, is the last resort)."""
    tower = tower_kind(config)
    families = [f for f in row.families if f.towers is not None or tower == "scratch"]
    reasons = [refusal(family, source_kind(config), tower) for family in families or row.families]
    if all(reasons):
        raise ConfigError(reasons[0])


def check_tower_options(config, row: MethodRow) -> None:
    """Refuse the towers' options (``models.towers.TOWER_OPTIONS``) that no chosen tower
    reads: neither ``--model``'s row nor the method's other towers (``Family.reads``: a
    text tower checkpoints its layers)."""
    read = {*IMAGE_TOWERS[config.model].options, *(n for f in row.families for n in f.reads)}
    for name in TOWER_OPTIONS:
        if getattr(config, name) and name not in read:  # resolved: dropout 0.0
            towers = ", ".join(towers_reading(name))
            raise ConfigError(f"{flag(name)} applies to {towers}, not --model {config.model}")


def check_tower_kind(config) -> None:
    """Refuse what the named kind of tower holds in its own checkpoint (its row's
    ``replaces``: a CLIP checkpoint's text tower, a vision model's dropout), what only
    a kind not named reads (``reads``: ``--image-pooling`` without ``--image-model``),
    and LoRA adapters on no pretrained tower."""
    named = TOWER_KINDS[tower_kind(config)]
    check_lora_options(config, pretrained=named.loader is not None or bool(config.text_model))
    for name in named.replaces:
        if is_set(config, name) and getattr(config, name):  # resolved: dropout 0.0
            raise ConfigError(f"{flag(name)} does not apply with {flag(named.option)} (its own)")
    for row in TOWER_KINDS.values():
        for name in row.reads if row is not named else ():
            if is_set(config, name):
                raise ConfigError(f"{flag(name)} applies to {flag(row.option)}")


def check_family(config, family: Family) -> None:
    """Refuse the options' source and tower for the family the data tell."""
    if reason := refusal(family, source_kind(config), tower_kind(config)):
        raise TrainerError(reason)


@dataclass(frozen=True)
class Cell:
    """One combination: a method's family, a kind of image tower (None: the family
    takes no images) and a kind of source; ``reason`` None where it trains."""

    method: str
    family: Family
    tower: str | None
    source: str
    reason: str | None


def cells(methods: dict[str, MethodRow]) -> list[Cell]:
    """Every family of every method, with every kind of tower and of source."""
    return [
        Cell(method, family, tower, source, refusal(family, source, tower))
        for method, row in methods.items()
        for family in row.families
        for tower in (TOWERS if family.towers is not None else (None,))
        for source in SOURCES
    ]


def matrix(methods: dict[str, MethodRow]) -> str:
    """``cells`` as a markdown table: a row per family and tower, a column per source."""
    header = ["family", "image tower", *SOURCES]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    rows: dict[tuple[str, str | None], dict[str, str | None]] = {}
    for cell in cells(methods):
        rows.setdefault((cell.family.name, cell.tower), {})[cell.source] = cell.reason
    numbers = {reason: number for number, reason in enumerate(reasons_of(methods), 1)}
    for (family, tower), reasons in rows.items():
        marks = [
            "trains" if reasons[source] is None else f"refused ({numbers[reasons[source]]})"
            for source in SOURCES
        ]
        lines.append(f"| {family} | {tower or '(none)'} | " + " | ".join(marks) + " |")
    return "\n".join(lines)


def reasons_of(methods: dict[str, MethodRow]) -> list[str]:
    """Every reason of a refusal, each once, in the order of ``cells``."""
    return list(dict.fromkeys(cell.reason for cell in cells(methods) if cell.reason))


def _either(kinds: Sequence[str], names: dict[str, str]) -> str:
    described = [names[kind] for kind in kinds]
    return (
        described[0] if len(described) == 1 else ", ".join(described[:-1]) + " or " + described[-1]
    )


def page(methods: dict[str, MethodRow]) -> str:
    """The text of docs/composition.md: the matrix and every reason of a refusal."""
    return "\n".join([
        "# Composition: method x image tower x source",
        "",
        "Generated by `python -m contrastive_accelerate.methods` from the methods",
        "table (`MethodRow.families`); `tests/test_composition.py` checks that this",
        "page is current, trains every cell marked *trains* on 1 and 2 processes and on 3",
        "with `--fsdp` (an uneven last batch: 1 + 1 + 0 rows; float64, within 1e-9), a",
        "pretrained tower's stream and mixture cells on 1 and 2 (their tower's 3 with",
        "`--fsdp` is its table cell's, their source's every scratch tower's), and shows",
        "every cell marked *refused* refused with its reason below, in one line.",
        "",
        matrix(methods),
        "",
        "The reasons, as a refused run prints them:",
        "",
        *[f"{number}. {reason}" for number, reason in enumerate(reasons_of(methods), 1)],
        "",
    ])  # fmt: skip


#: Where ``page`` is written (``python -m contrastive_accelerate.methods``), from the
#: repository's root.
PAGE = "docs/composition.md"
