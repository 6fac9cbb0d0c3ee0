"""The data files' sha256 is computed while DCP writes them (digest_writer.py), never by reading
them back, and equals the hash of the bytes on disk; a stream written out of order is re-hashed.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from flatshard.checkpoint import digest_writer, safety
from patching import patched_attr


def _no_read_back(path):
    raise AssertionError(f"{path} was read back to hash it")


def test_digests_are_taken_while_writing(tmp_path):
    # a large block (the writeback path) and small ones, in one data file
    state = {"big": torch.randn(300_000), "small": torch.arange(10), "step": torch.tensor(3.0)}
    writer = digest_writer.DigestWriter(tmp_path)
    with patched_attr(digest_writer, "describe_file", _no_read_back):
        dcp.save(state, storage_writer=writer)
        files = writer.data_files(tmp_path, 0)
    on_disk = sorted(tmp_path.glob("__0_*.distcp"))
    assert sorted(files) == [p.name for p in on_disk] and on_disk
    for p in on_disk:
        assert files[p.name] == safety.describe_file(p)


def test_a_stream_written_out_of_order_is_hashed_from_disk(tmp_path):
    writer = digest_writer.DigestWriter(tmp_path)
    with writer.fs.create_stream(tmp_path / "__0_0.distcp", "wb") as stream:
        stream.seek(3)  # the same bytes in all, so only the order tells
        stream.write(b"def")
        stream.seek(0)
        stream.write(b"abc")
    with writer.fs.create_stream(tmp_path / "__0_1.distcp", "wb") as stream:
        stream.write(b"in order")
    (tmp_path / "__0_1.distcp").write_bytes(b"changed on disk since")  # another size
    files = writer.data_files(tmp_path, 0)
    assert (tmp_path / "__0_0.distcp").read_bytes() == b"abcdef"
    for name in ("__0_0.distcp", "__0_1.distcp"):
        assert files[name] == safety.describe_file(tmp_path / name)
