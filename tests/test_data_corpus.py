"""Embedded corpus, train/val split, byte tokenizer and user text-file loading."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from flatshard.data import (
    MIN_DOCSTRING_CHARS,
    ByteTokenizer,
    embedded_documents,
    load_text_documents,
    read_text_documents,
    train_val_split,
)

_DIGEST_SCRIPT = (
    "import hashlib; from flatshard.data import embedded_documents as e; d = e(); "
    "print(len(d), hashlib.sha256('\\x00'.join(d).encode()).hexdigest())"
)


def _digest(docs: list[str]) -> str:
    return f"{len(docs)} {hashlib.sha256(chr(0).join(docs).encode()).hexdigest()}"


# --- embedded corpus -------------------------------------------------------------------------


def test_corpus_size_and_content() -> None:
    from pydoc_data.topics import topics

    docs = embedded_documents()
    assert len(docs) >= 79
    assert sum(map(len, docs)) >= 1_000_000
    # Topics first, sorted by name; "if" and "else" share one text, kept once.
    unique_topics = list(dict.fromkeys(topics[k] for k in sorted(topics)))
    assert docs[: len(unique_topics)] == unique_topics
    assert len(set(docs)) == len(docs), "duplicates must be removed"
    assert all(len(d) >= MIN_DOCSTRING_CHARS for d in docs[len(unique_topics) :])
    assert embedded_documents() is docs  # cached in-process


def test_corpus_identical_across_processes_with_and_without_file_cache(tmp_path: Path) -> None:
    expected = _digest(embedded_documents())
    env = {**os.environ, "FLATSHARD_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    outputs = []
    for _ in range(2):  # first run parses and writes the cache, the second reads it
        run = subprocess.run(
            [sys.executable, "-c", _DIGEST_SCRIPT],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        outputs.append(run.stdout.strip())
    assert len(list(tmp_path.glob("corpus-*.json"))) == 1
    assert outputs == [expected, expected]


# --- train/val split -------------------------------------------------------------------------


def test_split_deterministic_disjoint_and_order_independent() -> None:
    docs = embedded_documents()
    train, val = train_val_split(docs, val_fraction=0.01, seed=0)
    assert (train, val) == train_val_split(docs, val_fraction=0.01, seed=0)
    assert len(train) + len(val) == len(docs)
    assert not set(train) & set(val)
    assert 0.005 * len(docs) < len(val) < 0.02 * len(docs)
    shuffled = list(docs)
    random.Random(1).shuffle(shuffled)
    assert set(train_val_split(shuffled, 0.01, seed=0)[1]) == set(val)
    assert set(train_val_split(docs, 0.01, seed=1)[1]) != set(val)


def test_split_small_dataset_gets_both_sides_and_validates() -> None:
    train, val = train_val_split(["a", "b", "c"], val_fraction=0.01)
    assert len(val) == 1 and len(train) == 2
    train, val = train_val_split(["a", "b"], val_fraction=0.99)
    assert len(val) == 1 and len(train) == 1
    assert train_val_split(["a", "b"], val_fraction=0.0) == (["a", "b"], [])
    with pytest.raises(ValueError, match="val_fraction"):
        train_val_split(["a"], val_fraction=1.0)


# --- tokenizer -------------------------------------------------------------------------------


def test_tokenizer_round_trip_and_special_ids() -> None:
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (258, 256, 257)
    text = "héllo, wörld — ∑ 🙂\n\ttabs"
    ids = tok.encode(text)
    assert ids[-1] == tok.eos_id and max(ids[:-1]) < 256
    assert tok.encode(text, add_eos=False) == ids[:-1]
    assert tok.decode(ids) == text
    assert tok.decode([104, 105, tok.pad_id, tok.eos_id, 999, 33]) == "hi!"
    assert tok.decode([0xFF]) == "\ufffd"
    assert tok.encode_documents(["a", "bc"]) == [[97, 256], [98, 99, 256]]


# --- user files ------------------------------------------------------------------------------


def test_txt_jsonl_and_directory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "b.txt").write_text("first doc\n\npara two\n\f\nsecond doc\n\f\n  \n", "utf-8")
    rows = [{"text": "j1", "id": 1}, {"text": "  "}, {"text": "j2\u2028x"}]
    (tmp_path / "a.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n\n", "utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.TXT").write_bytes(b"\xef\xbb\xbfwith bom")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.txt").write_text("ignored", "utf-8")
    (tmp_path / "notes.md").write_text("ignored", "utf-8")

    found = read_text_documents(tmp_path)
    assert found.documents == ["j1", "j2\u2028x", "first doc\n\npara two", "second doc", "with bom"]
    assert [p.name for p in found.files] == ["a.jsonl", "b.txt", "c.TXT"]
    assert found.skipped_empty == 2
    with caplog.at_level(logging.WARNING, logger="flatshard.data.files"):
        assert load_text_documents(tmp_path / "b.txt") == ["first doc\n\npara two", "second doc"]
    assert "skipped 1 empty document" in caplog.text


def test_bad_files_name_file_and_position(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.txt"):
        load_text_documents(tmp_path / "nope.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n", "utf-8")
    with pytest.raises(ValueError, match=r"empty\.txt: file is empty"):
        load_text_documents(empty)
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"ok line\ncaf\xe9\n")
    with pytest.raises(
        ValueError, match=r"latin\.txt: not valid UTF-8 at byte offset 11 \(line 2\)"
    ):
        load_text_documents(latin)
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "fine"}\n\n{"text": oops}\n', "utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 3 is not valid JSON"):
        load_text_documents(bad_json)
    no_text = tmp_path / "notext.jsonl"
    no_text.write_text('{"text": "fine"}\n{"body": "x"}\n', "utf-8")
    with pytest.raises(ValueError, match=r"notext\.jsonl: line 2: missing the \"text\" field"):
        load_text_documents(no_text)
    not_str = tmp_path / "num.jsonl"
    not_str.write_text('{"text": 3}\n', "utf-8")
    with pytest.raises(ValueError, match=r"line 1: \"text\" is int, not a string"):
        load_text_documents(not_str)
    with pytest.raises(ValueError, match=r"unsupported file type '\.csv'"):
        (tmp_path / "d.csv").write_text("a,b", "utf-8")
        load_text_documents(tmp_path / "d.csv")


def test_no_documents_errors(tmp_path: Path) -> None:
    blanks = tmp_path / "blank.jsonl"
    blanks.write_text('{"text": ""}\n{"text": " "}\n', "utf-8")
    with pytest.raises(ValueError, match=r"no documents found \(2 empty ones skipped\)"):
        load_text_documents(blanks)
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match=r"contains no \.txt or \.jsonl files"):
        load_text_documents(tmp_path / "sub")
