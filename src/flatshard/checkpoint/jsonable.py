"""JSON encoding of small user state (``extra``) and optimizer hyperparameters.

JSON rather than pickle so that loading a checkpoint never runs code. Tensors (an RNG state,
a tensor learning rate) and tuples (``random.getstate()``) are tagged so they round-trip with
their types; everything else must be a JSON value (str keys, numbers, strings, bools, None).
"""

from __future__ import annotations

import base64
import math
from typing import Any

import torch

TENSOR_TAG, TUPLE_TAG = "__flatshard_tensor__", "__flatshard_tuple__"


def encode(value: Any, where: str = "extra") -> Any:
    """A JSON-serialisable form of ``value``; ``TypeError`` naming the offending entry."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            return {"__flatshard_float__": repr(value)}
        return value
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu", copy=True).contiguous()
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        buf = bytearray(raw.numel())  # copied out by torch alone: numpy is no dependency
        if buf:
            torch.frombuffer(buf, dtype=torch.uint8).copy_(raw)
        data = base64.b64encode(buf).decode("ascii")
        spec = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        return {TENSOR_TAG: {**spec, "data": data}}
    if isinstance(value, tuple):
        return {TUPLE_TAG: [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise TypeError(f"{where} has the key {key!r}; use str keys (JSON)")
        return {k: encode(v, f"{where}[{k!r}]") for k, v in value.items()}
    raise TypeError(
        f"{where} has type {type(value).__name__}; checkpoints store only JSON values (dict with "
        "str keys, list, tuple, str, int, float, bool, None) and tensors. Convert it first "
        "(e.g. numpy arrays with torch.from_numpy)"
    )


def decode(value: Any) -> Any:
    """The inverse of ``encode``."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if TENSOR_TAG in value:
        return _decode_tensor(value[TENSOR_TAG])
    if TUPLE_TAG in value:
        return tuple(decode(v) for v in value[TUPLE_TAG])
    if "__flatshard_float__" in value:
        return float(value["__flatshard_float__"])
    return {k: decode(v) for k, v in value.items()}


def _decode_tensor(spec: dict) -> torch.Tensor:
    dtype = getattr(torch, spec["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"checkpoint extra holds a tensor of unknown dtype {spec['dtype']!r}")
    raw = bytearray(base64.b64decode(spec["data"]))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(spec["shape"]).clone()
