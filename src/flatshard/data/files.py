"""Loading the user's own training text from ``.txt`` and ``.jsonl`` files.

Formats (the file suffix decides, case-insensitively):

``.txt``
    UTF-8 text. The whole file is one document, unless it contains lines consisting only of a form
    feed (``\\f``, ASCII 12): those lines separate documents. Leading and trailing newlines of each
    document are stripped. (Blank lines are *not* separators: paragraphs of one text belong in one
    document, and long documents are chunked to the sequence length by the trainer anyway.)
``.jsonl``
    UTF-8, one JSON object per line with a string field ``"text"``; other fields are ignored.
    Blank lines are skipped.
A directory
    Every ``.txt`` and ``.jsonl`` file below it, recursively, in sorted path order; other files and
    hidden files/directories (name starting with ``.``) are ignored.

A UTF-8 byte-order mark at the start of a file is ignored. Documents that are empty or only
whitespace are skipped and counted (:attr:`TextDocuments.skipped_empty`; :func:`load_text_documents`
logs the count as a warning). Everything else that is wrong raises an error naming the file and,
where it applies, the line: a missing path (``FileNotFoundError``), an unsupported suffix, an
empty file, invalid UTF-8 (with the byte offset and line), a ``.jsonl`` line that is not a JSON
object with a string ``"text"``, and a path that yields no documents at all (``ValueError``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SUFFIXES", "TextDocuments", "load_text_documents", "read_text_documents"]

SUFFIXES = (".txt", ".jsonl")
"""File suffixes :func:`read_text_documents` understands."""

_log = logging.getLogger(__name__)
_BOM = b"\xef\xbb\xbf"
_FORM_FEED_LINE = "\f"


@dataclass(frozen=True)
class TextDocuments:
    """What :func:`read_text_documents` found."""

    documents: list[str]
    """The non-empty documents, in file order then in-file order."""
    files: list[Path]
    """The files read, in the order read."""
    skipped_empty: int
    """How many empty or whitespace-only documents were skipped."""


def load_text_documents(path: str | os.PathLike[str]) -> list[str]:
    """Documents of a ``.txt``/``.jsonl`` file or a directory of them (formats: module docstring).

    Logs a warning with the count when empty documents were skipped.
    """
    found = read_text_documents(path)
    if found.skipped_empty:
        _log.warning("%s: skipped %d empty document(s)", path, found.skipped_empty)
    return found.documents


def read_text_documents(path: str | os.PathLike[str]) -> TextDocuments:
    """Like :func:`load_text_documents`, but also returns the files read and the skipped count."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(
            f"{root}: no such file or directory (expected a .txt or .jsonl file)"
        )
    files = _data_files(root) if root.is_dir() else [_check_suffix(root)]
    docs: list[str] = []
    skipped = 0
    for file in files:
        texts = _read_file(file)
        kept = [t for t in texts if t.strip()]
        skipped += len(texts) - len(kept)
        docs.extend(kept)
    if not docs:
        raise ValueError(
            f"{root}: no documents found ({skipped} empty ones skipped); "
            "give a file or directory containing non-empty text"
        )
    return TextDocuments(documents=docs, files=files, skipped_empty=skipped)


def _check_suffix(file: Path) -> Path:
    if file.suffix.lower() not in SUFFIXES:
        raise ValueError(
            f"{file}: unsupported file type {file.suffix or '(no suffix)'!r}; "
            f"use one of {', '.join(SUFFIXES)} (plain text or JSON lines with a 'text' field)"
        )
    return file


def _data_files(directory: Path) -> list[Path]:
    """Data files below ``directory``, sorted, skipping hidden entries."""
    files = [
        p
        for p in directory.rglob("*")
        if p.is_file()
        and p.suffix.lower() in SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    ]
    if not files:
        raise ValueError(
            f"{directory}: directory contains no {' or '.join(SUFFIXES)} files; "
            "put the training text in such files"
        )
    return sorted(files)


def _read_file(file: Path) -> list[str]:
    """All documents of one file, empty ones included (the caller counts them)."""
    data = file.read_bytes()
    if not data.strip():
        raise ValueError(f"{file}: file is empty; remove it or add text")
    text = _decode_utf8(file, data)
    if file.suffix.lower() == ".jsonl":
        return _parse_jsonl(file, text)
    return _split_txt(text)


def _decode_utf8(file: Path, data: bytes) -> str:
    """Strict UTF-8 decode whose error names the byte offset and line of the first bad byte."""
    offset = len(_BOM) if data.startswith(_BOM) else 0
    try:
        return data[offset:].decode("utf-8")
    except UnicodeDecodeError as err:
        pos = offset + err.start
        line = data.count(b"\n", 0, pos) + 1
        bad = data[pos : pos + 4]
        raise ValueError(
            f"{file}: not valid UTF-8 at byte offset {pos} (line {line}): {err.reason} "
            f"(bytes {bad!r}); re-encode the file as UTF-8, e.g. "
            f"`iconv -f latin1 -t utf-8 {file.name} > fixed{file.suffix}`"
        ) from None


def _split_txt(text: str) -> list[str]:
    """Split at form-feed-only lines; strip each document's surrounding newlines."""
    docs: list[list[str]] = [[]]
    for line in text.splitlines(keepends=True):
        if line.rstrip("\r\n") == _FORM_FEED_LINE:
            docs.append([])
        else:
            docs[-1].append(line)
    return ["".join(lines).strip("\r\n") for lines in docs]


def _parse_jsonl(file: Path, text: str) -> list[str]:
    """The ``"text"`` field of each non-blank line."""
    docs = []
    # split("\n"), not splitlines(): JSON strings may legally contain U+2028 and friends, which
    # splitlines() would treat as line breaks.
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{file}: line {lineno} is not valid JSON ({err.msg} at column {err.colno}); "
                'each line must be one object like {"text": "..."}'
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"{file}: line {lineno}: {_describe_bad_record(record)}")
        docs.append(record["text"])
    return docs


def _describe_bad_record(record: object) -> str:
    """Why a parsed JSON line is not ``{"text": <str>, ...}``, and the fix."""
    fix = 'each line must be an object with a string "text" field, e.g. {"text": "..."}'
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}; {fix}"
    if "text" not in record:
        keys = ", ".join(repr(k) for k in list(record)[:8]) or "none"
        return f'missing the "text" field (keys: {keys}); {fix}'
    return f'"text" is {type(record["text"]).__name__}, not a string; {fix}'
