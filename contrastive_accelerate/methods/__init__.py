"""Training methods: SimCLR and its losses, MoCo, BYOL, DINO, DINOv2, SwAV, distillation,
text and image-text pairs.

The loop (``trainer.py``) knows nothing of towers, views or losses: it calls a
``Method`` (``methods.base``) through its members and hooks, and nothing else of it.
``METHODS`` has one row per ``--method``: how it is built, its data, the options only
it reads (set for another method, they are refused), its defaults and its refusals,
which ``TrainConfig`` applies before anything is built, and its families: the kinds of
source and of image tower it trains on, against which ``composition`` refuses the
others, with the one reason each, and draws the matrix (docs/composition.md). Each
method family is one module: ``simclr``, ``momentum`` (MoCo v3, BYOL), ``dino``,
``dinov2``, ``swav``, ``distill`` (the last four share ``multicrop``), and
``pairs`` (``text_pairs`` and ``image_text``, as the data are); every ``--loss`` of
every method is a row of one table, ``loss_table.LOSSES``, and a family names the rows
it takes (``Family.losses``).

Adding a method, a checklist:

1. One module here: a ``Method`` subclass (override the hooks it needs), its options
   tuple, ``defaults(config)``, ``check(config)`` and ``check_data(config, data)`` where
   it has any, and its ``MethodRow`` with its ``Family``. Options that no method had
   before are its own section, a dataclass of ``option`` fields in its module (as
   ``dino.DINOOptions``), named in its row's ``sections`` (``TrainConfig`` holds every
   row's: ``contrastive_accelerate.options.SECTIONS``); the row's ``options`` are the
   section's ``field_names``.
2. One row in ``METHODS`` below, and ``python -m contrastive_accelerate.methods`` to
   redraw docs/composition.md.
3. Its tests, found from the table: ``tests/test_composition.py`` trains every cell of
   its families on 1 and 2 processes and with ``--fsdp``, refuses the others, resumes
   its table cell mid-epoch on another number of processes and breaks it with
   per-process dropout (it fails until ``FAMILY_FLAGS`` has the family's command
   line); and the method's own negative controls. ``test_a_toy_method_...`` there shows
   that nothing else must change.
"""

from __future__ import annotations

from contrastive_accelerate.methods.base import DTYPES, Method, MethodRow
from contrastive_accelerate.methods.dino import DINO, DINO_OPTIONS
from contrastive_accelerate.methods.dinov2 import DINOV2
from contrastive_accelerate.methods.distill import DISTILL
from contrastive_accelerate.methods.loss_table import LOSSES, LossRow
from contrastive_accelerate.methods.momentum import BYOL, MOCO, TEACHER_OPTIONS
from contrastive_accelerate.methods.pairs import LORA_OPTIONS, PAIR_LOSSES, PAIRS, TEXT_OPTIONS
from contrastive_accelerate.methods.simclr import SIMCLR, SIMCLR_LOSSES, SimCLRMethod
from contrastive_accelerate.methods.swav import SWAV

METHODS: dict[str, MethodRow] = {
    "simclr": SIMCLR,
    "moco": MOCO,
    "byol": BYOL,
    "dino": DINO,
    "dinov2": DINOV2,
    "swav": SWAV,
    "distill": DISTILL,
    "pairs": PAIRS,
}

#: Options that only some methods read: a value other than the default is refused elsewhere.
METHOD_OPTIONS = tuple(dict.fromkeys(name for row in METHODS.values() for name in row.options))

__all__ = [
    "DINO_OPTIONS",
    "DTYPES",
    "LORA_OPTIONS",
    "LOSSES",
    "SIMCLR_LOSSES",
    "LossRow",
    "METHODS",
    "METHOD_OPTIONS",
    "PAIR_LOSSES",
    "TEACHER_OPTIONS",
    "TEXT_OPTIONS",
    "Method",
    "MethodRow",
    "SimCLRMethod",
]
