"""flatshard train's data pipeline: corpus loading, user files, bad files reported by the CLI."""

from __future__ import annotations

import json

import pytest

from flatshard.tools.train.cli import main
from flatshard.tools.train.config import DataConfig
from flatshard.tools.train.data import (
    TOKENIZER,
    load_corpus,
    make_sampler,
    to_batch,
    validation_steps,
)


def _jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")


def test_embedded_corpus_pieces_fit_rows():
    corpus = load_corpus(DataConfig(seq_len=64))
    assert len(corpus.train) > 10_000 and len(corpus.val) > 50
    assert all(2 <= len(p) <= 64 for p in corpus.train + corpus.val)
    assert 2 <= corpus.attention_length <= 64
    assert "embedded corpus" in corpus.source


def test_user_jsonl_directory(tmp_path):
    texts = [f"document number {i} " * (i + 1) for i in range(40)]
    _jsonl(tmp_path / "a.jsonl", texts[:20])
    _jsonl(tmp_path / "b.jsonl", texts[20:])
    corpus = load_corpus(DataConfig(path=str(tmp_path), seq_len=32, val_fraction=0.1))
    assert corpus.val and corpus.train
    joined = b"".join(bytes(t for t in p if t < 256) for p in corpus.train + corpus.val)
    assert sorted(joined) == sorted("".join(texts).encode())  # every byte once, in pieces
    assert "2 file(s)" in corpus.source


def test_single_txt_document_holds_out_its_tail(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("All work and no play. " * 100, encoding="utf-8")
    corpus = load_corpus(DataConfig(path=str(path), seq_len=64, val_fraction=0.1))
    n = len(corpus.train) + len(corpus.val)
    assert len(corpus.val) == -(-n // 10) and corpus.train  # the last 10% of the pieces


def test_packing_off_gives_one_piece_per_row():
    corpus = load_corpus(DataConfig(seq_len=64))
    cfg = DataConfig(seq_len=64, rows=4, packing=False)
    sampler = make_sampler(corpus.train, cfg, rank=0, world=2, seed=0, train=True)
    (micro,) = next(iter(sampler))
    assert len(micro) == 4
    batch = to_batch(corpus.train, micro, cfg, "cpu")
    assert batch.input_ids.shape == (4, 64)
    for row, idx in zip(batch.input_ids, micro, strict=True):
        assert (row != TOKENIZER.pad_id).sum() == len(corpus.train[idx])


def test_validation_steps_are_the_same_count_on_every_rank():
    corpus = load_corpus(DataConfig(seq_len=64))
    cfg = DataConfig(seq_len=64, rows=2)
    per_rank = [validation_steps(corpus.val, cfg, rank=r, world=3, count=5) for r in range(3)]
    assert [len(s) for s in per_rank] == [5, 5, 5]
    tiny = corpus.val[:3]  # fewer bins than ranks x count: padded, still equal
    per_rank = [validation_steps(tiny, cfg, rank=r, world=3, count=5) for r in range(3)]
    assert len({len(s) for s in per_rank}) == 1


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.txt", None, "no such file or directory"),
        ("d.csv", "a,b\n", "unsupported file type '.csv'"),
        ("e.txt", "  \n", "file is empty"),
        ("l.txt", b"ok\n\xe9\n", "not valid UTF-8 at byte offset 3 (line 2)"),
        ("b.jsonl", '{"text": "x"}\n{oops\n', "line 2 is not valid JSON"),
        ("c.jsonl", '{"body": "x"}\n', 'line 1: missing the "text" field'),
    ],
)
def test_bad_data_files_are_reported_by_the_cli(tmp_path, capsys, name, content, message):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    # checked before any worker starts: no launch, status 2, one line naming the file
    assert main(["--data", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flatshard train: error: ") and name in err and message in err
    assert not (tmp_path / "out").exists()
