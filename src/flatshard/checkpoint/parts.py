"""One checkpoint over several model parts: this rank's pipeline stages, and every pp rank's.

[Note: checkpoints across pipeline stages]
Under pipeline parallelism each rank holds one or more stage modules, each sharded over the
data-parallel mesh, and each stage keeps the whole model's parameter names (torchtitan cuts
stages that way: a copy of the model with the other stages' layers removed). ``fs.save(path,
model=[stages], optimizer=[one per stage], across=mesh["pp"])`` writes *one* checkpoint of the
whole model:

* **Ranks.** The save runs over every rank of the pipeline: the union, over ``across``, of the
  stages' data-parallel meshes (``checkpoint_group``). Each rank writes the fragments of its own
  stages; DCP merges the chunks into one entry per parameter, as for a single model.
* **Description.** Every rank describes its parts; the descriptions are gathered over the
  group and merged (``merge_descriptions``): the union of parameters and buffers (a name held by
  two stages must agree in shape and dtype), the optimizer's param groups of every stage. Rank 0
  commits the merged one, so the checkpoint reads like a single model's.
* **Optimizer param groups** are matched by parameter, not by position (``"by_param"`` in the
  description): a checkpoint of two stages with one group each loads into one optimizer with
  one group over the whole model, and back, as long as the parameters of a group were saved
  with equal hyperparameters. The DCP copies of the groups (for torch's tools) use torch's
  flattened keys, ``optimizer.param_groups.<name>.<hyper>``, which never collide across stages.
* **Loading** with ``across`` checks the checkpoint against the names of every stage of the
  pipeline (an entry no stage holds is "unexpected"); each rank reads its stages' pieces.
* **Tied weights** (an embedding on the first stage, its copy as the head on the last, see
  parallel/pipeline_tied.py): a tied model writes the weight and its optimizer state under every
  name (contents.py), so the last stage reads ``head.weight`` from its own keys; a tied model
  reading a pipeline's checkpoint takes the first name and treats the other as its alias.

So ``fs.save`` at pp 2 x dp 2 loads at dp 4 without a pipeline (``fs.load(path, model=m)``),
and a dp 4 checkpoint loads into pp 2 x dp 2 stages, at any world size and wrap plan.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from flatshard.checkpoint import agree
from flatshard.checkpoint.contents import ModelLayout, model_layout
from flatshard.core.mesh import members_group
from flatshard.core.state import get_state


def as_list(value, what: str) -> list:
    """``value`` (one object, a sequence of them, or ``None``) as a list."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{what}=[] is empty; pass the module(s) this rank holds")
        return list(value)
    return [value]


def model_parts(
    model: nn.Module | Sequence[nn.Module], optimizer
) -> tuple[list[nn.Module], list[torch.optim.Optimizer | None]]:
    """The model parts and one optimizer (or ``None``) per part."""
    models = as_list(model, "model")
    optimizers = as_list(optimizer, "optimizer")
    if not optimizers:
        return models, [None] * len(models)
    if len(optimizers) != len(models):
        raise ValueError(
            f"optimizer= has {len(optimizers)} optimizer(s) for {len(models)} model part(s); "
            "pass one optimizer per stage module, in the same order as model="
        )
    return models, optimizers


def checkpoint_group(models: list[nn.Module], across) -> dist.ProcessGroup:
    """Every rank that takes part: the parts' mesh, joined over ``across`` (the pp group)."""
    # by members, not identity: each stage made TP builds its own group of the same ranks
    groups = {tuple(dist.get_process_group_ranks(g)): g for g in map(agree.model_group, models)}
    if len(groups) != 1:
        raise ValueError(
            "the model parts given to one fs.save/fs.load are sharded over different meshes; "
            "shard every stage of this rank over the same data-parallel mesh"
        )
    group = next(iter(groups.values()))
    if across is None:
        return group
    across_group = across.get_group() if hasattr(across, "get_group") else across
    mine = tuple(dist.get_process_group_ranks(group))
    every: list = [None] * dist.get_world_size(across_group)
    dist.all_gather_object(every, mine, group=across_group)
    ranks = tuple(sorted({r for ranks in every for r in ranks}))
    made = get_state(models[0]).topology.made  # kept with the first part's groups
    return members_group(ranks, str(dist.get_backend(group)), made)


def merged_layout(models: list[nn.Module]) -> ModelLayout:
    """The layouts of this rank's parts as one (names must not repeat across parts)."""
    merged = ModelLayout({}, {}, {}, [])
    for model in models:
        layout = model_layout(model)
        for name in layout.params:
            if name in merged.params:
                raise ValueError(
                    f"parameter {name!r} appears in two model parts on this rank; each stage "
                    "must hold its own parameters under the whole model's names"
                )
        merged.params.update(layout.params)
        merged.buffers.update(layout.buffers)
        merged.aliases.update(layout.aliases)
        merged.keys += [k for k in layout.keys if k not in merged.keys]
    return merged


def merge_descriptions(descriptions: list[dict]) -> dict:
    """The ranks' descriptions (each of its own parts) as the whole model's; ``ValueError``
    when two ranks describe one name differently."""
    merged = dict(descriptions[0])
    model = {"params": {}, "buffers": {}, "aliases": {}, "keys": []}
    for desc in descriptions:
        for section in ("params", "buffers"):
            for name, entry in desc["model"][section].items():
                seen = model[section].setdefault(name, entry)
                if seen["shape"] != entry["shape"] or seen["dtype"] != entry["dtype"]:
                    raise ValueError(
                        f"{name!r} is {seen['shape']} {seen['dtype']} on one stage and "
                        f"{entry['shape']} {entry['dtype']} on another; tied or shared "
                        "entries must be the same on every stage"
                    )
        model["aliases"].update(desc["model"]["aliases"])
        model["keys"] += [k for k in desc["model"]["keys"] if k not in model["keys"]]
    merged["model"] = model
    merged["optimizer"] = _merge_optimizers([d["optimizer"] for d in descriptions])
    return merged


def _merge_optimizers(optimizers: list[dict | None]) -> dict | None:
    if all(o is None for o in optimizers):
        return None
    if any(o is None for o in optimizers):
        raise ValueError(
            "some ranks save optimizer state and others do not; pass optimizer= on every rank"
        )
    groups: list[dict] = []
    texts: set[str] = set()
    state: dict = {}
    for optimizer in optimizers:
        for group in optimizer["param_groups"]:  # dp peers of a stage hold the same groups
            text = json.dumps(group, sort_keys=True)
            if text not in texts:
                texts.add(text)
                groups.append(group)
        state.update(optimizer["state"])
    classes = sorted({o["class"] for o in optimizers})
    return {"class": "+".join(classes), "param_groups": groups, "state": state, "by_param": True}


def gather_descriptions(description: dict, group: dist.ProcessGroup) -> list[dict]:
    """Every rank's description, in group-rank order."""
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, description, group=group)
    return every


def names_everywhere(layout: ModelLayout, group: dist.ProcessGroup) -> set[str]:
    """The parameter and buffer names held by any rank of ``group`` (every stage's)."""
    mine = sorted(layout.params) + sorted(layout.buffers)
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    return {name for names in every for name in names}


def add_optimizer(described: dict | None, desc: dict) -> dict:
    """This rank's optimizer description with one more part's optimizer ``desc`` in it."""
    if described is None:
        return desc
    if described["class"] != desc["class"]:
        raise ValueError(
            f"the stages' optimizers are of different classes ({described['class']} and "
            f"{desc['class']}); use the same optimizer class for every stage"
        )
    return {
        "class": desc["class"],
        "param_groups": described["param_groups"] + desc["param_groups"],
        "state": {**described["state"], **desc["state"]},
    }


def agree_on_parts(
    items: dict, description: dict, error: Exception | None, group: dist.ProcessGroup
) -> dict:
    """The whole model's description, the same on every rank of ``group``; a rank's error is
    raised on every rank, and so is a disagreement between ranks that hold the same stage."""
    kinds = sorted((key, type(value).__name__) for key, value in items.items())
    mine = {
        "description": {k: v for k, v in description.items() if k != "extra"},
        "kinds": json.dumps(kinds),
        "error": error and f"{error}",
        "kind": type(error).__name__,
    }
    every = gather_descriptions(mine, group)
    for rank, entry in enumerate(every):
        if entry["error"] is not None:
            exc_type = TypeError if entry["kind"] == "TypeError" else ValueError
            source = dist.get_global_rank(group, rank)
            agree.raise_if(f"rank {source}: {entry['error']}", exc_type)
    by_stage: dict[str, str] = {}
    for entry in every:  # ranks with the same parameters (dp peers) must save the same
        stage = json.dumps(sorted(entry["description"]["model"]["params"]))
        if by_stage.setdefault(stage, entry["kinds"]) != entry["kinds"]:
            agree.raise_if(
                "ranks that hold the same stage disagree on what to save (optimizer state "
                "keys or param groups differ); build every stage's optimizer the same way"
            )
    try:
        merged = merge_descriptions([e["description"] for e in every])
    except ValueError as err:
        agree.raise_if(str(err))
    merged["extra"] = description.get("extra", {})  # rank 0 commits: its extra is saved
    return merged
