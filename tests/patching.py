"""Temporary changes to the environment and to attributes, undone however the block ends.

Case functions run inside the pool's worker processes, where pytest's ``monkeypatch`` does not
reach; these context managers work in both places (``conftest.py`` exposes them as fixtures).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_MISSING = object()


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


@contextmanager
def patched_env(**variables: str | None) -> Iterator[None]:
    """Set (``None``: remove) environment variables for the block."""
    saved = {name: os.environ.get(name) for name in variables}
    try:
        for name, value in variables.items():
            _set_env(name, value)
        yield
    finally:
        for name, value in saved.items():
            _set_env(name, value)


@contextmanager
def patched_attr(owner: Any, name: str, value: Any) -> Iterator[None]:
    """Set ``owner.name = value`` for the block."""
    saved = getattr(owner, name, _MISSING)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if saved is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, saved)
