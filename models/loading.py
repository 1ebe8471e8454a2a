"""What loading and exporting a ``transformers`` model, tokenizer or processor share:
safetensors only, no remote code, and errors reported as one line."""

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


def save_without_code(saved: Any, directory: str, **kwargs: Any) -> None:
    """``saved.save_pretrained(directory, **kwargs)`` (a model, tokenizer or processor)
    without ``auto_map``: the input folder's pointer to code of its own, which loading here
    never ran and the export does not hold. Kept, it would send a loader that trusts remote
    code after code that the trained weights were not trained with. ``saved`` is left as
    it was."""
    holders = [getattr(getattr(saved, "config", None), "__dict__", None),
               getattr(saved, "init_kwargs", None)]  # fmt: skip
    held = [(h, h.pop("auto_map")) for h in holders if isinstance(h, dict) and "auto_map" in h]
    try:
        saved.save_pretrained(directory, **kwargs)
    finally:
        for holder, auto_map in held:
            holder["auto_map"] = auto_map


def first_line(error: Exception) -> str:
    """The first line of ``error``'s message: transformers' run to many lines, and the
    user needs one."""
    return (str(error).strip() or type(error).__name__).splitlines()[0]
