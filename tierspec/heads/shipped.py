"""Draft heads that ship inside the package (``tierspec/heads/``), found by the target's identity."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

from ..models import LoadedModel

HEADS_DIR = Path(__file__).resolve().parent  # the head files lie beside this module
_LOADED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def shipped_head_path(target: LoadedModel) -> Path | None:
    """The shipped head file made for ``target`` (by its identity), or None."""
    from ..identity import ModelIdentity

    for meta in sorted(HEADS_DIR.glob("*.json")):
        try:
            info = json.loads(meta.read_text())
            identity = ModelIdentity(**info["model"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if identity.matches(target.identity) and meta.with_suffix(".safetensors").exists():
            return meta.with_suffix(".safetensors")
    return None


def shipped_head(target: LoadedModel):
    """The shipped ``DraftHead`` for ``target`` (loaded once per model instance), or None."""
    from .draft import DraftHead

    cached = _LOADED.get(target.model)
    if cached is not None:
        return cached
    path = shipped_head_path(target)
    if path is None:
        return None
    head = DraftHead.load(path, target)
    _LOADED[target.model] = head
    return head
