"""Lazy package exports (PEP 562): importing ``gefen``/``gefen_ckpt`` does not import torch until
a name that needs it is used."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(namespace: dict, names: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for a package whose ``names`` (name -> module) load on first use."""

    def __getattr__(name: str):
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
