"""A streaming safetensors writer: the header first, then tensors one at a time.

``safetensors.torch.save_file`` needs every tensor in memory at once. The format is simple
enough to stream: an 8-byte little-endian header length, a JSON header giving each tensor's
dtype, shape and ``[begin, end)`` byte range in the data section, then the raw little-endian
bytes. Shapes and dtypes are known before any data is read (from the sharded model or the
checkpoint's description), so the header is written up front and each tensor's bytes follow in
header order; peak memory is what the caller holds, not the model.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import uuid
from pathlib import Path

import torch

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


class StreamingSafetensorsWriter:
    """Write ``entries`` (name, dtype, shape), in this order, into ``out`` atomically."""

    def __init__(
        self,
        out: str | os.PathLike,
        entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.out = Path(out)
        header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
        self._order: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        offset = 0
        for name, dtype, shape in entries:
            if dtype not in DTYPE_CODES:
                raise ValueError(f"{name!r} has dtype {dtype}, which safetensors cannot store")
            if name in header:
                raise ValueError(f"{name!r} appears twice in the export")
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {
                "dtype": DTYPE_CODES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._order.append((name, dtype, tuple(shape)))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # align the data section to 8 bytes, as safetensors does
        self._tmp = self.out.with_name(f"{self.out.name}.tmp-{uuid.uuid4().hex[:12]}")
        self._file = open(self._tmp, "wb")  # noqa: SIM115 - closed in close()/abort()
        self._file.write(len(raw).to_bytes(8, "little") + raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor; it must be the one the header lists next."""
        want_name, dtype, shape = self._order[self._next]
        if name != want_name or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise AssertionError(
                f"export wrote {name} {tensor.dtype} {tuple(tensor.shape)}, header expects "
                f"{want_name} {dtype} {shape}"
            )
        data = tensor.detach().to("cpu").contiguous()
        if data.numel():
            # Raw bytes without .numpy(): numpy would pin the storage as non-resizable, and a
            # gathered unit's buffer must stay resizable (it is freed on reshard).
            raw = (ctypes.c_ubyte * data.nbytes).from_address(data.data_ptr())
            self._file.write(memoryview(raw))
        self._next += 1

    def close(self) -> Path:
        """Check that every tensor was written, flush to disk and move the file into place."""
        if self._next != len(self._order):
            self.abort()
            raise AssertionError(f"export wrote {self._next} of {len(self._order)} tensors")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.out)
        return self.out

    def abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)


# Reading: the header parsed (JSON only, never a pickle), each tensor's bytes read by range.
CODE_DTYPES: dict[str, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def read_header(f, file: Path) -> tuple[dict, int]:
    """The JSON header of the safetensors file open as ``f``, and where its data starts."""
    size = os.fstat(f.fileno()).st_size
    length = int.from_bytes(f.read(8), "little") if size >= 8 else -1
    if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
        raise ValueError(f"{file} is not a safetensors file (header length {length})")
    try:
        header = json.loads(f.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{file} has a damaged safetensors header ({err})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file} has a damaged safetensors header (not a JSON object)")
    return header, 8 + length


def header_entry(header: dict, name: str, file: Path, data_start: int, size: int) -> tuple:
    """``name``'s dtype, shape and first byte in the file (of ``size`` bytes), checked for
    consistency, so that a damaged file fails here, before any rank starts reading."""
    entry = header.get(name)
    try:
        dtype = CODE_DTYPES[entry["dtype"]]
        shape = [int(n) for n in entry["shape"]]
        begin, end = (int(n) for n in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{file}: entry {name!r} is missing or malformed ({entry!r})") from None
    if begin < 0 or end - begin != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"{file}: entry {name!r} has byte range {[begin, end]} for {shape}")
    if data_start + end > size:
        raise ValueError(f"{file} is truncated: entry {name!r} ends past its {size} bytes")
    return dtype, shape, data_start + begin


def read_into(f, offset: int, out: torch.Tensor, file: Path) -> None:
    """Read ``out.nbytes`` bytes at ``offset`` of ``f`` (an unbuffered binary file) into the
    contiguous tensor ``out``: the kernel copies straight into the tensor's memory.

    ``seek`` + ``readinto`` rather than ``os.preadv``, which Windows lacks. The tensor's memory
    is exposed through ``ctypes`` (standard library, every platform), not ``.numpy()``: numpy
    would pin the storage as non-resizable, and is no dependency. Not
    ``safetensors.safe_open(...).get_slice``: it memory-maps the file, and on the bench
    (docs/checkpoints.md, "Host memory of pretrained loading") it took 1.3-1.7x the CPU time of
    this read and kept the pages it copied from resident while the file was mapped."""
    if not out.numel():
        return
    view = memoryview((ctypes.c_ubyte * out.nbytes).from_address(out.data_ptr()))
    f.seek(offset)
    done = 0
    while done < out.nbytes:
        count = f.readinto(view[done:])
        if not count:
            raise ValueError(f"{file} is truncated: no bytes at offset {offset + done}")
        done += count
