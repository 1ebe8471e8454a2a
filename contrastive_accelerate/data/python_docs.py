"""Offline text pairs from the documentation that ships with Python (``pydoc_data``).

Each paragraph of the language reference's help topics gives one pair, the inverse
cloze task (Lee et al., 2019): its first sentence as the anchor, the rest of the
paragraph as the positive. About 760 pairs, nothing downloaded::

    python -m contrastive_accelerate.data.python_docs runs/python_docs.jsonl
    accelerate launch trainer.py --dataset runs/python_docs.jsonl --columns anchor,positive \\
        --text-model scratch
"""

from __future__ import annotations

import json
import os
import re
import sys

#: Paragraphs shorter than this, or code and tables, make no pair.
MIN_PARAGRAPH_CHARS = 120


def python_docs_pairs() -> list[dict[str, str]]:
    """``{"anchor", "positive"}`` rows, in the topics' sorted order."""
    from pydoc_data.topics import topics

    rows = []
    for _, text in sorted(topics.items()):
        for paragraph in re.split(r"\n\s*\n", text):
            paragraph = " ".join(paragraph.split())
            if len(paragraph) < MIN_PARAGRAPH_CHARS or paragraph.startswith(("*", ">>>", "|")):
                continue
            first, *rest = re.split(r"(?<=[.!?])\s+", paragraph)
            if rest:
                rows.append({"anchor": first, "positive": " ".join(rest)})
    return rows


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else os.path.join("runs", "python_docs.jsonl")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    rows = python_docs_pairs()
    with open(path, "w") as file:
        file.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"{len(rows)} pairs from Python's documentation in {path}")


if __name__ == "__main__":
    main()
