"""The job's parallel layout checked once, on every rank and before any worker starts."""

from __future__ import annotations

from flatshard.tools.train.config import TrainConfig

__all__ = ["check_layout"]


def check_layout(cfg: TrainConfig, world: int, device_type: str | None = None) -> None:
    """Refuse tp, pp, ep or cp settings this job of ``world`` ranks cannot run (``ValueError``
    naming the value and the fix); with ``device_type`` (on the workers) also what that device
    cannot run."""
    from flatshard.tools.train.cp_plan import check_cp
    from flatshard.tools.train.moe import check_ep
    from flatshard.tools.train.pipeline import check_pp
    from flatshard.tools.train.tp_plan import check_tp

    check_tp(cfg, world)
    check_pp(cfg, world)
    check_ep(cfg, world)
    check_cp(cfg, world, device_type)
