"""``python -m contrastive_accelerate.methods``: write docs/composition.md, the
composition matrix of ``METHODS`` (``methods.composition.page``)."""

from pathlib import Path

from contrastive_accelerate.methods import METHODS
from contrastive_accelerate.methods.composition import PAGE, page

(Path(__file__).resolve().parents[2] / PAGE).write_text(page(METHODS), encoding="utf-8")
