"""OUT/loss.png and OUT/memory.png, redrawn from the metrics rows as training goes.

matplotlib is imported here and only here, lazily, and through its object-oriented API with the
Agg canvas: no pyplot global state, no GUI backend, nothing imported by ``import flatshard``.
Each image is written to a temporary file and renamed, so a viewer never sees half a PNG.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

__all__ = ["plot_loss", "plot_memory", "write_plots"]


def _figure() -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=110, layout="tight")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)


def plot_loss(rows: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """Training loss per step (line) and validation loss (points)."""
    fig, ax = _figure()
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1, label="train")
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val, strict=True), "o-", ms=4, label="validation")
    ax.set(xlabel="step", ylabel="loss (nats / token)", title=title or "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)


def plot_memory(rows: list[dict[str, Any]], path: Path, what: str) -> None:
    """Peak memory per step (max over ranks)."""
    fig, ax = _figure()
    ax.plot([r["step"] for r in rows], [r["peak_mem_mb"] for r in rows], lw=1)
    ax.set(xlabel="step", ylabel="MB", title=f"peak memory per rank ({what}, max over ranks)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    _save(fig, path)


def write_plots(rows: list[dict[str, Any]], out: Path, *, title: str, memory_kind: str) -> str:
    """Both plots; returns "" once both are written, else why not (plots never stop a run)."""
    if not rows:
        return "no steps recorded yet"
    try:
        plot_loss(rows, out / "loss.png", title)
        plot_memory(rows, out / "memory.png", memory_kind)
    except ImportError as e:
        return _import_failure(e)
    except (OSError, ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def _import_failure(e: ImportError) -> str:
    # matplotlib absent (the [train] extra not installed) and a broken install need different
    # fixes; find_spec asks whether it is there without importing it again
    if importlib.util.find_spec("matplotlib") is None:
        return (
            "matplotlib is not installed; pip install 'flatshard[train]' (or pip install "
            "matplotlib) to get them"
        )
    return f"matplotlib could not be imported ({e}); reinstall it: pip install -U matplotlib"
