"""The ``FLATSHARD_*`` environment switches, read once, at ``fs.shard``.

- ``FLATSHARD_GLOO_P2P`` (default 1): flatshard's point-to-point Gloo collectives;
- ``FLATSHARD_GATHER_POOL`` (default 1): reused gather buffers;
- ``FLATSHARD_DEBUG`` (default 0): the cross-rank check before every collective;
- ``FLATSHARD_WATCHDOG`` (default ``raise``): what the collective watchdog does with a
  collective stuck off Gloo (comm/watchdog.py);
- ``FLATSHARD_TIMEOUT_S`` (default 600, read by ``fs.shard``'s options, core/options.py): the
  bound on every wait.

The table with what each does is in docs/engine.md ("Switches"). Every one of them is in the
cross-rank fingerprint (the first three change which collectives run, so ranks that disagree
would hang in the first one; the others would make ranks report the same hang differently): a
rank started with another value fails at ``fs.shard``, on every rank, naming the switch. They
are stored in the model's state and handed from there to whatever needs them (the watchdog,
``fs.GradScaler``); changing the environment afterwards has no effect on a sharded model.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

OFF = ("0", "false", "False", "no", "off")


def _flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    value = environ.get(name, "")
    if value == "":
        return default
    return value not in OFF


@dataclass(frozen=True)
class Switches:
    """The ``FLATSHARD_*`` switches, as read at ``fs.shard`` (kept in the model's state)."""

    gloo_p2p: bool = True
    """``FLATSHARD_GLOO_P2P``: point-to-point Gloo collectives for groups of 2..8 ranks."""
    gather_pool: bool = True
    """``FLATSHARD_GATHER_POOL``: reused gather buffers."""
    debug: bool = False
    """``FLATSHARD_DEBUG``: the cross-rank check before every collective."""
    watchdog: str = "raise"
    """``FLATSHARD_WATCHDOG``: ``raise``, ``abort``, ``report`` or ``off`` (comm/watchdog.py)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Switches:
        env = os.environ if environ is None else environ
        return cls(
            gloo_p2p=_flag(env, "FLATSHARD_GLOO_P2P", True),
            gather_pool=_flag(env, "FLATSHARD_GATHER_POOL", True),
            debug=_flag(env, "FLATSHARD_DEBUG", False),
            watchdog=_watchdog_action(env),
        )

    def describe(self) -> list[str]:
        """Fingerprint lines, one per switch, naming the variable."""
        return [
            f"switch FLATSHARD_{f.name.upper()}={_text(getattr(self, f.name))}"
            for f in fields(self)
        ]


def _text(value: bool | str) -> str:
    """A switch as the environment spells it (flags as 0/1)."""
    return str(int(value)) if isinstance(value, bool) else value


def _watchdog_action(environ: Mapping[str, str]) -> str:
    """As set: ``fs.shard`` checks the value after the ranks agreed on it (a rank that raised
    before the fingerprint would leave the others waiting in it)."""
    return environ.get("FLATSHARD_WATCHDOG", "") or "raise"
