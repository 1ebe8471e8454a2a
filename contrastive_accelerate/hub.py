"""Names on the Hugging Face Hub: say at once when one cannot be fetched.

Without a network and without ``HF_HUB_OFFLINE``, ``from_pretrained`` and
``load_dataset`` retry for about a minute (52 s measured here) before they fail. A name
that is neither a local path nor in the hub's cache is refused at once when the hub's
host does not answer within ``PROBE_TIMEOUT_S``, or when ``HF_HUB_OFFLINE`` is set.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 3.0


def unreachable_reason(name: str, kind: str) -> str | None:
    """Why ``name`` (a hub name of ``kind``: "models" or "datasets") cannot be loaded
    now, or None: it is local, cached, or the hub answers."""
    if os.path.exists(name) or _cached(name, kind):
        return None
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return "it is not a local path nor in the cache, and HF_HUB_OFFLINE is set"
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    address = urlparse(endpoint)
    port = address.port or (443 if address.scheme == "https" else 80)
    try:
        socket.create_connection((address.hostname, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as error:
        return (
            f"it is not a local path nor in the cache, and the hub ({endpoint}) cannot be "
            f"reached ({error.strerror or type(error).__name__})"
        )
    return None


def _cached(name: str, kind: str) -> bool:
    """Whether the hub's cache holds a snapshot of ``name`` (``kind``--owner--name)."""
    from huggingface_hub.constants import HF_HUB_CACHE

    return os.path.isdir(os.path.join(HF_HUB_CACHE, f"{kind}--{name.replace('/', '--')}"))
