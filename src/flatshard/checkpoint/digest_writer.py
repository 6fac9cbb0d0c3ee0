"""A DCP ``FileSystemWriter`` that computes each data file's sha256 while writing it.

[Note: hashing while writing]
The manifest needs the size and sha256 of every data file. Instead of reading the files back
after ``dcp.save`` to hash them (a second pass over everything written), ``DigestWriter`` gives
DCP a file system whose write streams pass every byte through a ``hashlib.sha256`` on its way
to the file, in DCP's own writer threads. The hash itself is most of the cost (~130 ms of CPU
per 200 MB on one core here, against ~20 ms for the read-back pass; docs/checkpoints.md), and
it would otherwise run beside an idle wait: the final ``fsync``. So after each large block the
stream asks the kernel to start writing that range to disk (Linux
``sync_file_range(SYNC_FILE_RANGE_WRITE)``: non-blocking, not a durability promise, DCP still
fsyncs every file), and the disk writes block i while the CPU hashes and serialises block i+1.
Elsewhere (no such call) the stream only hashes. A digest is only trusted when the stream was
written strictly in order: a ``seek`` (which no DCP version does today), a short write, or a
size on disk that differs from the bytes hashed makes ``data_files`` hash that file the old
way, by reading it back. The manifest, and what ``fs.load`` verifies, are unchanged.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from flatshard.checkpoint.safety import describe_file

DATA_SUFFIX = ".distcp"
WRITEBACK_BYTES = 1 << 20  # after a write at least this large, start its writeback
_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _sync_file_range() -> Callable | None:
    """libc's ``sync_file_range`` (Linux), or ``None`` where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


class _HashingStream:
    """A binary write stream that hashes, in order, what it writes to ``raw``."""

    def __init__(self, raw) -> None:
        self._raw = raw
        self.sha256 = hashlib.sha256()
        self.written = 0
        self.in_order = True  # False after a seek or a short write: the digest is not trusted

    def write(self, data) -> int:
        view = memoryview(data)
        count = self._raw.write(view)
        if count is not None and count != view.nbytes:
            self.in_order = False
        start, self.written = self.written, self.written + view.nbytes
        kick = _sync_file_range() if view.nbytes >= WRITEBACK_BYTES else None
        if kick is not None:
            self._raw.flush()
            kick(self._raw.fileno(), start, view.nbytes, _SYNC_FILE_RANGE_WRITE)  # best effort
        self.sha256.update(view)  # hashlib releases the GIL on large blocks
        return view.nbytes if count is None else count

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.in_order = False
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        self._raw.close()

    @property
    def closed(self) -> bool:
        return self._raw.closed

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._raw.seekable()


class _HashingFileSystem(FileSystem):
    """DCP's local file system; data files opened for writing are hashed as they are written."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, dict] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator:
        if mode != "wb" or not str(path).endswith(DATA_SUFFIX):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _HashingStream(raw)
            yield stream
        if stream.in_order:  # reached only when DCP wrote the file without an error
            digest = {"bytes": stream.written, "sha256": stream.sha256.hexdigest()}
            with self._lock:
                self.digests[Path(path).name] = digest


class DigestWriter(FileSystemWriter):
    """``dcp.FileSystemWriter`` (files synced) that records each data file's size and sha256."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(str(path), sync_files=True)
        self.fs = _HashingFileSystem()

    def data_files(self, directory: Path, rank: int) -> dict[str, dict]:
        """Size and sha256 of the data files DCP wrote for ``rank`` (``__<rank>_<n>.distcp``):
        the digests taken while writing, or a read-back hash for any file without a trusted
        one (written out of order, or changed on disk since)."""
        files = {}
        for path in sorted(directory.glob(f"__{rank}_*{DATA_SUFFIX}")):
            digest = self.fs.digests.get(path.name)
            if digest is None or digest["bytes"] != path.stat().st_size:
                digest = describe_file(path)
            files[path.name] = digest
        return files
