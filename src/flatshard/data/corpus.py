"""The embedded training corpus: text that ships with every CPython, so training needs no download.

Documents, in this order:

1. every entry of ``pydoc_data.topics.topics`` (the text behind ``help("if")`` etc.), sorted by
   topic name;
2. the docstrings of the standard library's modules, classes and functions, read by *parsing* the
   source files with :mod:`ast` (importing 600 stdlib modules would run their import-time code),
   in sorted path order and source order within a file.

Docstrings shorter than :data:`MIN_DOCSTRING_CHARS` are dropped (mostly "Return self." noise), and
exact duplicates keep their first occurrence. The result is identical across processes and runs on
the same Python installation; another Python version gives a different (but equally stable) corpus.

Parsing takes ~2 s, so the result is cached twice: in-process (:func:`functools.lru_cache`) and
in a JSON file under ``$FLATSHARD_CACHE_DIR`` (default ``~/.cache/flatshard``), keyed by the Python
version and a fingerprint of the stdlib files. The file cache is an optimisation only: any problem
reading or writing it falls back to parsing.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["MIN_DOCSTRING_CHARS", "embedded_documents"]

MIN_DOCSTRING_CHARS = 32
"""Docstrings shorter than this are dropped: one-liners like "Return self." teach little."""

# Bump when the extraction rules change so that old cache files are ignored.
_FORMAT_VERSION = 1

# Directory names never walked: test suites (huge, repetitive), the IDLE GUI, demos, and third-party
# packages, which are not part of "every CPython".
_SKIP_DIRS = frozenset({"idlelib", "turtledemo", "site-packages", "dist-packages", "__pycache__"})

_DocNode = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


@functools.lru_cache(maxsize=1)
def embedded_documents() -> list[str]:
    """Return the embedded corpus as a list of documents (see the module docstring).

    The list is cached: do not mutate it (copy it first).
    """
    root = _stdlib_root()
    files = _stdlib_sources(root)
    cache_file = _cache_path(root, files)
    cached = _read_cache(cache_file) if cache_file is not None else None
    if cached is not None:
        return cached
    docs = _dedupe([*_topic_documents(), *_docstring_documents(files)])
    if cache_file is not None:
        _write_cache(cache_file, docs)
    return docs


def _stdlib_root() -> Path:
    """The directory holding the pure-Python standard library (the base install, not a venv)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _skip_dir(name: str) -> bool:
    return name in _SKIP_DIRS or name.startswith(("test", "."))


def _stdlib_sources(root: Path) -> list[Path]:
    """All ``.py`` files of the stdlib, in a deterministic (sorted) order."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorting in place makes os.walk itself deterministic.
        dirnames[:] = sorted(d for d in dirnames if not _skip_dir(d))
        found.extend(Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return found


def _topic_documents() -> list[str]:
    """The ``pydoc_data.topics`` entries, sorted by topic name."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def _docstring_documents(files: list[Path]) -> Iterator[str]:
    """Docstrings of modules, classes and functions, file by file, in source order."""
    for path in files:
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, OSError):
            continue  # e.g. a file written for another Python version: not worth failing for
        yield from _docstrings(tree)


def _docstrings(node: ast.AST) -> Iterator[str]:
    """Depth-first, source-ordered docstrings of ``node`` and everything nested in it."""
    if isinstance(node, _DocNode):
        doc = ast.get_docstring(node, clean=True)
        if doc is not None and len(doc) >= MIN_DOCSTRING_CHARS:
            yield doc
    for child in ast.iter_child_nodes(node):
        yield from _docstrings(child)


def _dedupe(docs: list[str]) -> list[str]:
    """Drop exact duplicates, keeping the first occurrence (so the order stays deterministic)."""
    return list(dict.fromkeys(docs))


def _cache_path(root: Path, files: list[Path]) -> Path | None:
    """Cache file for this Python + stdlib; ``None`` if the fingerprint cannot be computed."""
    digest = hashlib.sha256(f"{_FORMAT_VERSION}|{sys.version}|{root}".encode())
    try:
        for path in files:  # size + mtime catch an edited or upgraded stdlib
            st = path.stat()
            digest.update(f"|{path.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}".encode())
    except OSError:
        return None
    base = os.environ.get("FLATSHARD_CACHE_DIR") or Path.home() / ".cache" / "flatshard"
    tag = sys.implementation.cache_tag or "py"
    return Path(base) / f"corpus-{tag}-{digest.hexdigest()[:16]}.json"


def _read_cache(path: Path) -> list[str] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, list) or not all(isinstance(d, str) for d in data):
        return None
    return data


def _write_cache(path: Path, docs: list[str]) -> None:
    """Write atomically (temp file + rename): several ranks may build the corpus at once."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    except OSError:
        return  # read-only home...: the cache is only an optimisation
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(docs, f, ensure_ascii=False)
        os.replace(tmp, path)
    except (OSError, ValueError):
        Path(tmp).unlink(missing_ok=True)  # full disk...: leave no half-written file behind
