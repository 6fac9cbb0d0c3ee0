"""Wrap policies and the wrap plan: which modules become units and which unit owns each parameter.

A policy is any ``callable(module) -> bool``. Matched modules become units bottom-up (a matched
module nested in another matched module is its own unit); everything left belongs to the root unit.
A policy may also return a ``DeviceMesh`` (or ``ProcessGroup``) for a module: that module becomes a
unit sharded over that mesh instead of the model's (per-unit meshes, see parallel/unit_mesh.py).

[Note: ownership of shared parameters]
A parameter object registered in several modules (tied embeddings, a weight shared between two
blocks) is owned by exactly one unit: the innermost unit whose subtree contains every module that
registers it (the lowest common ancestor unit). That unit is gathered for its whole forward and
its whole backward, which encloses every use of the tensor, so tied weights need no special case
at run time and their gradient contributions meet in one flat buffer before the reduce-scatter.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

log = logging.getLogger("flatshard")

Policy = Callable[[nn.Module], object]  # bool, or the mesh of the unit it makes


class by_type:
    """Wrap every module that is an instance of one of ``classes``."""

    def __init__(self, *classes: type[nn.Module]) -> None:
        if not classes:
            raise ValueError("wrap.by_type() got no classes; pass e.g. wrap.by_type(MyBlock)")
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise TypeError(
                    f"wrap.by_type() got {cls!r}, which is not an nn.Module subclass; "
                    "pass module classes such as wrap.by_type(nn.TransformerEncoderLayer)"
                )
        self.classes = classes

    def __call__(self, module: nn.Module) -> bool:
        return isinstance(module, self.classes)

    def __repr__(self) -> str:
        return f"by_type({', '.join(c.__name__ for c in self.classes)})"


class by_size:
    """Wrap every module whose subtree holds at least ``min_params`` parameters not already wrapped.

    Decided bottom-up, as torch's ``size_based_auto_wrap_policy``: parameters that went into a
    wrapped child no longer count for the parent.
    """

    def __init__(self, min_params: int) -> None:
        if not isinstance(min_params, int) or min_params <= 0:
            raise ValueError(
                f"wrap.by_size(min_params={min_params!r}): min_params must be a positive int "
                "(a number of parameter elements, e.g. 1_000_000)"
            )
        self.min_params = min_params

    def __call__(self, module: nn.Module) -> bool:
        # The plan builder calls ``decide`` instead; a bare call counts the whole subtree.
        return sum(p.numel() for p in module.parameters()) >= self.min_params

    def decide(self, module: nn.Module, unwrapped_numel: int) -> bool:
        return unwrapped_numel >= self.min_params

    def __repr__(self) -> str:
        return f"by_size({self.min_params})"


class root_only:
    """No units besides the root: the whole model is gathered at once (small models)."""

    def __call__(self, module: nn.Module) -> bool:
        return False

    def __repr__(self) -> str:
        return "root_only()"


class auto:
    """Wrap the repeated block class (e.g. the transformer layer), found from the model.

    Candidates are module classes with at least two instances that have children of their own
    (so not Linear/LayerNorm) and are not containers; the outermost ones (not nested inside
    another candidate's instances) win, and among those the one holding the most parameters.
    ``fs.shard`` uses this when no policy is given; the choice is logged (``flatshard`` logger)
    and readable afterwards as ``policy.chosen``.
    """

    def __init__(self) -> None:
        self.chosen: type[nn.Module] | None = None

    def bind(self, root: nn.Module) -> None:
        self.chosen = _repeated_block_class(root)
        if self.chosen is None:
            log.info(
                "wrap.auto(): no repeated block class in %s; one root unit", type(root).__name__
            )
        else:
            log.info("wrap.auto(): wrapping every %s", self.chosen.__name__)

    def __call__(self, module: nn.Module) -> bool:
        return self.chosen is not None and type(module) is self.chosen

    def __repr__(self) -> str:
        return f"auto(chosen={self.chosen.__name__ if self.chosen else None})"


def _repeated_block_class(root: nn.Module) -> type[nn.Module] | None:
    counts = Counter(
        type(m)
        for m in root.modules()
        if m is not root and not isinstance(m, CONTAINERS) and any(True for _ in m.children())
    )
    candidates = {cls for cls, n in counts.items() if n >= 2}
    nested = set()
    for m in root.modules():
        if type(m) in candidates:
            nested |= {type(d) for d in m.modules() if d is not m and type(d) in candidates}
    outermost = candidates - nested
    if not outermost:
        return None
    size: Counter[type] = Counter()
    for m in root.modules():
        if type(m) in outermost:
            size[type(m)] += sum(p.numel() for p in m.parameters())
    return max(outermost, key=lambda cls: (size[cls], cls.__name__))


@dataclass
class WrapPlan:
    """The result of applying a policy: units (root last) and each parameter's owning unit."""

    unit_modules: list[nn.Module]  # post-order, the root module last
    owner: dict[int, int]  # id(parameter) -> index into unit_modules
    matched_any: bool
    # id(unit module) -> the DeviceMesh or ProcessGroup the policy returned for it (a unit
    # sharded over its own mesh, e.g. experts over the expert-data-parallel mesh)
    meshes: dict[int, object] = field(default_factory=dict)


def build_plan(root: nn.Module, policy: Policy | None) -> WrapPlan:
    """Apply ``policy`` bottom-up and assign every parameter to its owning unit."""
    bind = getattr(policy, "bind", None)  # a policy that needs the model first (fs.wrap.auto)
    if bind is not None:
        bind(root)
    unit_modules: list[nn.Module] = []
    meshes: dict[int, object] = {}
    matched = _collect_units(root, policy, unit_modules, meshes, is_root=True)[1]
    unit_of_module = _innermost_unit_of_each_module(root, unit_modules)
    owner = _owners(root, unit_modules, unit_of_module)
    return WrapPlan(unit_modules, owner, matched, meshes)


def _collect_units(
    module: nn.Module, policy: Policy | None, out: list[nn.Module], meshes: dict, *, is_root: bool
) -> tuple[int, bool]:
    """Post-order walk. Returns (numel not yet wrapped below and at ``module``, matched any)."""
    unwrapped = sum(p.numel() for p in module.parameters(recurse=False))
    matched_any = False
    for child in module.children():
        child_numel, child_matched = _collect_units(child, policy, out, meshes, is_root=False)
        unwrapped += child_numel
        matched_any |= child_matched
    if is_root:
        out.append(module)
        return 0, matched_any
    if policy is not None and (decision := _matches(policy, module, unwrapped)):
        out.append(module)
        if decision is not True:  # a mesh: the unit is sharded over it
            meshes[id(module)] = decision
        return 0, True
    return unwrapped, matched_any


# Containers never run a forward of their own, so their hooks would never gather.
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def _matches(policy: Policy, module: nn.Module, unwrapped_numel: int) -> object:
    """False, True, or the mesh (DeviceMesh or ProcessGroup) the policy returned."""
    if isinstance(policy, by_size):
        return not isinstance(module, CONTAINERS) and policy.decide(module, unwrapped_numel)
    decision = policy(module)
    matched = bool(decision) if not _is_mesh(decision) else True
    if matched and isinstance(module, CONTAINERS):
        raise ValueError(
            f"policy={policy!r} matched a {type(module).__name__}, which has no forward of its "
            "own, so flatshard could never gather it; make the policy match its elements "
            "(e.g. the block class) instead"
        )
    return decision if matched and _is_mesh(decision) else matched


def _is_mesh(value: object) -> bool:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(value, DeviceMesh | dist.ProcessGroup)


def _innermost_unit_of_each_module(
    root: nn.Module, unit_modules: list[nn.Module]
) -> dict[int, int]:
    """id(module) -> index of the innermost unit containing it."""
    unit_index = {id(m): i for i, m in enumerate(unit_modules)}
    result: dict[int, int] = {}

    def visit(module: nn.Module, current: int) -> None:
        current = unit_index.get(id(module), current)
        result[id(module)] = current
        for child in module.children():
            visit(child, current)

    visit(root, unit_index[id(root)])
    return result


def _unit_ancestors(root: nn.Module, unit_modules: list[nn.Module]) -> dict[int, list[int]]:
    """unit index -> chain of unit indices from the root down to it (inclusive)."""
    unit_index = {id(m): i for i, m in enumerate(unit_modules)}
    chains: dict[int, list[int]] = {}

    def visit(module: nn.Module, chain: list[int]) -> None:
        if id(module) in unit_index:
            chain = [*chain, unit_index[id(module)]]
            chains[chain[-1]] = chain
        for child in module.children():
            visit(child, chain)

    visit(root, [])
    return chains


def _owners(
    root: nn.Module, unit_modules: list[nn.Module], unit_of_module: dict[int, int]
) -> dict[int, int]:
    chains = _unit_ancestors(root, unit_modules)
    users: dict[int, set[int]] = {}
    for module in root.modules():
        for param in module.parameters(recurse=False):
            users.setdefault(id(param), set()).add(unit_of_module[id(module)])
    owner: dict[int, int] = {}
    for pid, units in users.items():
        owner[pid] = _lowest_common_ancestor([chains[u] for u in units])
    return owner


def _lowest_common_ancestor(chains: list[list[int]]) -> int:
    common = chains[0]
    for chain in chains[1:]:
        depth = 0
        while depth < min(len(common), len(chain)) and common[depth] == chain[depth]:
            depth += 1
        common = common[:depth]
    return common[-1]
