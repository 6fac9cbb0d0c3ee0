"""torchao's float8 parallel styles in flatshard's tensor-parallel plans (``--model.float8`` with
``--parallelism.tp``), on any backend.

[Note: float8 under TP]
A GPT whose block linears are torchao ``Float8Linear``s (converted *before* the plan: the
styles check the module type) gets torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel``
for them, as torchtitan applies them: each casts its input, and its output's gradient, to float8
as a DTensor, so every scale comes from the whole tensor's amax (an all-reduce over tp), as in
one process. Two gathers would move float8 bytes, which Gloo cannot carry ("Invalid scalar
type"), so flatshard moves them in the compute dtype and casts after, with the same global
scale, hence the same float8 numbers:

* the activations gathered at the attention and MLP inputs: the plain ``PrepareModuleInput``
  (not torchao's ``PrepareFloat8ModuleInput``) on every backend;
* under sequence parallelism, a rowwise output's gradient, which torchao casts to float8 and
  then all-gathers (the backward of the reduce-scatter): on a backend without float8
  (:func:`carries_float8`) :class:`GatherThenCastRowwise` gathers it first, then casts.

Both cost 2 bytes per element on the wire instead of 1 (bf16); the weights still travel in
float8 through ``fs.shard``'s own gathers, which move float8 as bytes on any backend.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from flatshard.comm.collectives import waits_on_host

__all__ = ["carries_float8", "float8_styles", "has_float8_linears"]


def has_float8_linears(model: nn.Module) -> bool:
    """Whether torchao converted some of ``model``'s linears (``Float8Linear``)."""
    return any(type(m).__name__ == "Float8Linear" for m in model.modules())


def carries_float8(tp_mesh: DeviceMesh) -> bool:
    """Whether the tp group's backend moves float8 tensors: NCCL does; Gloo (the groups whose
    waits block the host) does not."""
    return not waits_on_host(tp_mesh.get_group())


def float8_styles(tp_mesh: DeviceMesh) -> tuple[type, type]:
    """The colwise and rowwise styles for ``Float8Linear``s on ``tp_mesh`` (see the Note)."""
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
    )

    if carries_float8(tp_mesh):
        return Float8ColwiseParallel, Float8RowwiseParallel
    return Float8ColwiseParallel, _gather_then_cast_rowwise(Float8RowwiseParallel)


@functools.cache  # one class, whatever the number of blocks
def _gather_then_cast_rowwise(base: type) -> type:
    """torchao's rowwise style with its output's gradient cast to float8 *after* the
    redistribution's backward (an all-gather under sequence parallelism), not before."""
    from torchao.float8.float8_scaling_utils import NoopFwToFloat8BwDynamic

    class GatherThenCastRowwise(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def _prepare_output_fn(
            output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any,
            device_mesh: DeviceMesh,
        ) -> Any:  # fmt: skip
            # forward: nothing; backward: the gradient, already gathered, cast with its
            # whole amax (a Replicate DTensor: the same scale as torchao's cast of the shards)
            outputs = NoopFwToFloat8BwDynamic.apply(
                outputs, mod.linear_mm_config, mod.config.cast_config_grad_output.target_dtype
            )
            if outputs.placements != output_layouts:  # partial sums: all-reduce or scatter
                outputs = outputs.redistribute(placements=output_layouts, async_op=True)
            return outputs.to_local() if use_local_output else outputs

    return GatherThenCastRowwise
