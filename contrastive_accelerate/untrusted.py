"""The one reader of the JSON and YAML in a user's files, and the one way an error quotes a
user's value.

Every file a user points us at is untrusted: a config file, a stream's rows and members, a
checkpoint's ``trainer_state.json`` and ``shards.json``. A parser's every failure becomes a
``ValueError`` with one short line, so that the caller's own ``except ValueError`` names
the file and the row: malformed text, a document nested deeper than the parser's stack
(``RecursionError``) or too large to hold (``MemoryError``). ``tests/test_repository.py``
checks that no other module calls ``json.load``, ``json.loads`` or ``yaml``.
"""

from __future__ import annotations

import json
from typing import Any

#: The characters of a value an error message quotes at most.
PREVIEW_CHARS = 60


def parse_json(text: str | bytes) -> Any:
    """The value of the JSON document ``text``; ``ValueError`` (one line) if it is none."""
    try:
        return json.loads(text)
    except ValueError as error:
        raise ValueError(_first_line(error)) from None
    except RecursionError:
        raise ValueError("nested too deeply to read") from None
    except MemoryError:
        raise ValueError("too large to read") from None


def read_json(path: str) -> Any:
    """The JSON document in the file ``path``: ``OSError`` if it cannot be read,
    ``ValueError`` (one line) if it holds no JSON value."""
    with open(path, "rb") as file:
        return parse_json(file.read())


def parse_yaml(text: str) -> Any:
    """The value of the YAML document ``text`` read with ``yaml.safe_load`` (plain data:
    no tags, so no object is built); ``ValueError`` (one line) if it is none."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(_first_line(error)) from None
    except RecursionError:
        raise ValueError("nested too deeply to read") from None
    except MemoryError:
        raise ValueError("too large to read") from None


def preview(value: Any, limit: int = PREVIEW_CHARS) -> str:
    """``value`` as an error message quotes it: whole if short, else its type, its length
    and its first ``limit`` characters (``repr``), so that a 2 MB member or an image's
    bytes never fill the terminal."""
    shown = repr(value)
    if len(shown) <= limit:
        return shown
    length = f", {len(value):,} long" if hasattr(value, "__len__") else ""
    return f"{type(value).__name__}{length}: {shown[:limit]}..."


def _first_line(error: Exception) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:200]
