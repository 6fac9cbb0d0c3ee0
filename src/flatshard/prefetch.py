"""``fs.Prefetch``: how far ahead parameters are gathered while a unit computes."""

from __future__ import annotations

from dataclasses import dataclass

BACKWARD_MODES = ("pre", "post", "none")


@dataclass(frozen=True)
class Prefetch:
    """Overlap of all-gathers with compute. The unit order is recorded on the first iteration
    (which therefore runs without prefetch) and replayed afterwards.

    The defaults are the fastest safe choice: one unit ahead in both directions, issued
    before the current unit computes; memory then holds at most the current unit, the next one
    and the root (kept gathered from forward to backward).
    """

    forward: int = 1
    """How many units ahead the forward gathers (0 turns forward prefetch off). Each extra
    unit of depth holds one more gathered unit in memory."""

    backward: str = "pre"
    """When the backward gathers the next unit: ``"pre"`` as the current unit's backward starts
    (most overlap, two units gathered), ``"post"`` once it has finished (one unit gathered,
    less overlap), ``"none"`` only when the next unit needs it."""

    def __post_init__(self) -> None:
        if not isinstance(self.forward, int) or self.forward < 0:
            raise ValueError(
                f"Prefetch(forward={self.forward!r}): a number of units ahead, 0 or more "
                "(0 disables forward prefetch)"
            )
        if self.backward not in BACKWARD_MODES:
            raise ValueError(
                f"Prefetch(backward={self.backward!r}): choose one of {BACKWARD_MODES}"
            )
