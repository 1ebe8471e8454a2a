"""What loading a ``transformers`` model, tokenizer or processor shares: its errors
reported as one line."""

from __future__ import annotations


def first_line(error: Exception) -> str:
    """The first line of ``error``'s message: transformers' run to many lines, and the
    user needs one."""
    return (str(error).strip() or type(error).__name__).splitlines()[0]
