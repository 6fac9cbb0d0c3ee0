"""``OUT/hf/``: the final weights of a ``--model.hf`` run as a ``from_pretrained`` directory.

Unpipelined, ``fs.save_pretrained`` streams the sharded model unit by unit. A pipelined run
holds the model as stages spread over the pp ranks, which no single ``save_pretrained`` call
sees; so rank 0 turns a checkpoint of the whole model into the directory
(``export_pretrained``: one tensor batch at a time, with the model's own ``config.json`` and
``generation_config.json``; the names are the unsplit model's: [Note: an HF stage reproduces
the unsplit model's mask and positions]). That is the run's own checkpoint of its last step
when it checkpoints (it always saves the last step); otherwise every rank first saves its
stages into a weights-only one (``fs.save(..., across=pp)``), removed after. A tied model's
matrix is written under both names there (each stage saved its own copy; equal values), which
``from_pretrained`` ties again.
"""

from __future__ import annotations

import shutil
from typing import Any

import torch.distributed as dist

import flatshard as fs

__all__ = ["EXPORT_SCRATCH", "export_hf"]

EXPORT_SCRATCH = ".hf_export_checkpoint"
"""The weights-only checkpoint a pipelined export of a run without checkpoints goes through,
under ``OUT`` (removed)."""


def export_hf(run: Any) -> None:
    """Write ``run.out / "hf"`` (a collective: every rank calls it), with the model's tokenizer
    when the run used it."""
    out = run.out / "hf"
    if run.pipe is None:
        fs.save_pretrained(run.model, out)
    else:
        from flatshard.checkpoint.pretrained import export_pretrained

        # the run's own checkpoint of this step when it wrote one (always at the last step)
        saved = run.ckpt is not None and run.ckpt.due(run.step, run.cfg.steps)
        source = run.ckpt.path(run.step) if saved else run.out / EXPORT_SCRATCH
        if not saved:
            fs.save(source, model=run.pipe.stages, across=run.pipe.mesh["pp"])
        if run.env.rank == 0:
            export_pretrained(source, out, config=run.cfg.model.hf)
            if not saved:
                shutil.rmtree(source)
        dist.barrier()  # nobody reads OUT/hf before it is whole
    tok = getattr(run.corpus.tokenizer, "tok", None)  # the model's own tokenizer, if used
    if tok is not None and run.env.rank == 0:
        tok.save_pretrained(out)
