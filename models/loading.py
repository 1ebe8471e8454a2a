"""What loading a ``transformers`` model, tokenizer or processor shares: safetensors
only, no remote code, and errors reported as one line."""

from __future__ import annotations

from typing import Any


def load_auto_model(name_or_path: str, dtype: Any, option: str, error: type[ValueError]):
    """``AutoModel.from_pretrained`` for ``option`` (``--text-model``, ...): weights from
    safetensors only, and ``trust_remote_code=False`` (not None: with None, transformers
    asks on standard input whether to run a folder's own code, and runs it on "y").
    A missing ``transformers`` or an unloadable model raises ``error`` in one line."""
    try:
        import transformers
    except ImportError:
        raise error(f"{option} needs transformers: pip install -e '.[text]'") from None
    try:
        return transformers.AutoModel.from_pretrained(
            name_or_path, use_safetensors=True, trust_remote_code=False, dtype=dtype
        )
    except Exception as caught:  # transformers raises many types; the user needs one line
        raise error(f"cannot load {option} {name_or_path!r}: {first_line(caught)}") from None


def first_line(error: Exception) -> str:
    """The first line of ``error``'s message: transformers' run to many lines, and the
    user needs one."""
    return (str(error).strip() or type(error).__name__).splitlines()[0]
