"""Tensor-parallel (DTensor) parameters inside flat groups: FSDP x TP on one DeviceMesh.

[Note: tensor-parallel parameters]
``parallelize_module(model, tp_mesh, plan)`` turns the parameters its plan names into DTensors
on the TP mesh (``Shard(0)`` for a colwise weight, ``Shard(1)`` rowwise, ``Replicate()`` for a
SequenceParallel norm). flatshard shards what each rank holds of them:

* **Layout.** A flat group stores the parameter's TP-local tensor (``to_local()``), laid out
  and split over the data-parallel ranks like any plain parameter. Fragments are 1-D plain
  tensors of that local tensor; the optimizer never sees a DTensor.
* **Forward and backward.** Wherever a unit installs full-shape views (forward,
  recomputation, the lazy root's placeholders, ``summon_full_params``), a TP parameter gets
  ``DTensor.from_local(view, tp_mesh, placements)`` with its global shape and stride, so the
  plan's module hooks and DTensor ops run exactly as without flatshard. ``from_local``'s
  backward hands the view the *local* gradient in the parameter's own placements (a
  SequenceParallel norm's ``Partial`` gradient is all-reduced over tp there), so what
  reaches ``UnitViews`` is a plain local gradient and the data-parallel reduction is the same
  as for any parameter: averaged over the dp ranks only.
* **Pooled buffers.** Autograd saves the DTensors, which flatshard's saved-tensor hooks cannot
  rebuild on another buffer, so groups with TP parameters never borrow pooled gather buffers:
  they gather into their own buffer, whose storage is freed and regathered in place.
* **Mesh contract** (``data_parallel_mesh``): every TP parameter of a model lives on one 1-D
  TP mesh; ``mesh=`` is the data-parallel mesh (1-D; 2-D (replicate, shard) for hybrid), or a
  named mesh that contains the TP dim, which is then removed (``("dp", "tp")`` -> ``dp``;
  ``("replicate", "shard", "tp")`` -> the 2-D hybrid mesh). The two must cross at this rank
  only (``check_disjoint``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from flatshard.core.mesh import Topology


@dataclass(frozen=True)
class TPSpec:
    """How a parameter was tensor-parallel before ``fs.shard``: enough to rebuild its DTensor
    around a view of the TP-local data."""

    mesh: object  # the DeviceMesh of its DTensor (1-D: the TP mesh)
    placements: tuple
    shape: torch.Size  # the global shape
    stride: tuple[int, ...]  # the global stride
    origin: tuple[int, ...]  # where this rank's TP-local block starts in the global tensor

    @property
    def is_sharded(self) -> bool:
        """Split over tp (``Shard``), rather than replicated on every tp rank."""
        return any(p.is_shard() for p in self.placements)

    def describe(self) -> str:
        names = self.mesh.mesh_dim_names or ("?",)
        return f"{list(self.placements)} on tp mesh {names} of size {self.mesh.size()}"


def _dtensor_type():
    from torch.distributed.tensor import DTensor

    return DTensor


def is_dtensor(tensor: object) -> bool:
    return isinstance(tensor, _dtensor_type())


def spec_of(param: torch.Tensor) -> TPSpec | None:
    """The parameter's TP description, None for a plain tensor."""
    if not is_dtensor(param):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = param.device_mesh, tuple(param.placements)
    _, origin = compute_local_shape_and_global_offset(param.shape, mesh, placements)
    return TPSpec(mesh, placements, param.shape, tuple(param.stride()), tuple(origin))


def local_of(param: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``param``: its TP-local tensor, or ``param`` itself."""
    if is_dtensor(param):
        return param.detach().to_local()
    return param


def as_dtensor(view: torch.Tensor, spec: TPSpec) -> torch.Tensor:
    """``view`` (TP-local data) as the parameter's DTensor; differentiable."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        view, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
    )


def wrap_views(views: list[list[torch.Tensor]], specs: list[list[TPSpec | None]]) -> list[list]:
    """Per group, ``views`` with every TP parameter's view made its DTensor."""
    return [
        [v if s is None else as_dtensor(v, s) for v, s in zip(vs, ss, strict=True)]
        for vs, ss in zip(views, specs, strict=True)
    ]


def tp_parameters(model: nn.Module) -> dict[str, TPSpec]:
    """Name -> TP description of every DTensor parameter of ``model`` (each tensor once)."""
    seen: set[int] = set()
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen and (spec := spec_of(p)) is not None:
            out[name] = spec
        seen.add(id(p))
    return out


def model_tp_mesh(model: nn.Module):
    """The one TP mesh of ``model``'s DTensor parameters (None: no TP); ``ValueError`` for
    several meshes, a mesh of more than one dim, or placements flatshard cannot shard."""
    specs = tp_parameters(model)
    mesh, first = None, None
    for name, spec in specs.items():
        _check_placements(name, spec)
        if mesh is None:
            mesh, first = spec.mesh, name
        elif spec.mesh != mesh:
            raise ValueError(
                f"fs.shard: parameters {first!r} ({_mesh_text(mesh)}) and {name!r} "
                f"({_mesh_text(spec.mesh)}) are DTensors on different meshes; flatshard "
                "supports one tensor-parallel mesh per model: apply every parallelize_module "
                "plan with the same tp mesh (e.g. mesh['tp'])"
            )
    return mesh


def _check_placements(name: str, spec: TPSpec) -> None:
    from torch.distributed.tensor import Replicate, Shard

    if spec.mesh.ndim != 1:
        raise ValueError(
            f"fs.shard: parameter {name!r} is a DTensor on a {spec.mesh.ndim}-D mesh "
            f"{_mesh_text(spec.mesh)}; flatshard shards over the data-parallel dims itself, "
            "so a parameter must be a DTensor on the 1-D tensor-parallel mesh only: apply "
            "parallelize_module with mesh['tp'] (not a mesh that includes a data-parallel dim)"
        )
    for placement in spec.placements:
        if type(placement) not in (Shard, Replicate):
            raise ValueError(
                f"fs.shard: parameter {name!r} has placement {placement!r}; flatshard takes "
                "tensor-parallel parameters placed Shard(dim) or Replicate() on the tp mesh "
                "(a Partial or strided parameter cannot be sharded further)"
            )


def _mesh_text(mesh) -> str:
    ranks = mesh.mesh.flatten().tolist()
    return f"mesh dims {mesh.mesh_dim_names} over ranks {ranks}"


def data_parallel_mesh(model: nn.Module, mesh):
    """``mesh=`` of ``fs.shard`` with the TP dim removed when it names it (see the Note);
    unchanged for a model without TP parameters or a mesh that is only data-parallel."""
    tp_mesh = model_tp_mesh(model)
    if tp_mesh is None or mesh is None or isinstance(mesh, dist.ProcessGroup):
        return mesh
    names = getattr(mesh, "mesh_dim_names", None) or ()
    tp_name = (tp_mesh.mesh_dim_names or (None,))[0]
    if tp_name not in names:
        return mesh
    if mesh[tp_name] != tp_mesh:
        raise ValueError(
            f"fs.shard: mesh={mesh!r} has a dim {tp_name!r}, but the parameters' tensor-parallel "
            f"mesh is another one ({_mesh_text(tp_mesh)}); parallelize with mesh[{tp_name!r}] "
            "of the mesh you pass, or pass the data-parallel mesh itself"
        )
    rest = tuple(n for n in names if n != tp_name)
    if not rest:
        raise ValueError(
            f"fs.shard: mesh={mesh!r} has only the tensor-parallel dim {tp_name!r} (the mesh "
            "the parameters are DTensors on); pass the data-parallel mesh, e.g. mesh['dp'] "
            "of init_device_mesh(dev, (dp, tp), mesh_dim_names=('dp', 'tp')), or that whole mesh"
        )
    return mesh[rest[0]] if len(rest) == 1 else mesh[rest]


def check_disjoint(model: nn.Module, topology: Topology) -> None:
    """The TP mesh and the data-parallel mesh must cross at this rank only: a TP peer that is
    also a dp peer would average a gradient with a different shard of the same parameter."""
    tp_mesh = model_tp_mesh(model)
    if tp_mesh is None:
        return
    tp_ranks = set(tp_mesh.mesh.flatten().tolist())
    dp_ranks = set(dist.get_process_group_ranks(topology.mesh_group))
    shared = sorted(tp_ranks & dp_ranks)
    if shared != [dist.get_rank()]:  # world: ranks of both meshes are global ranks
        raise ValueError(
            f"fs.shard: the tensor-parallel mesh (ranks {sorted(tp_ranks)}) and the "
            f"data-parallel mesh (ranks {sorted(dp_ranks)}) share ranks {shared}; they must be "
            "two different dims of one DeviceMesh: init_device_mesh(dev, (dp, tp), "
            "mesh_dim_names=('dp', 'tp')), parallelize with mesh['tp'], shard with mesh['dp']"
        )


@dataclass(frozen=True)
class TPGroups:
    """The tensor-parallel side of a sharded model (None on ``ShardedState.tp`` without TP)."""

    mesh: object  # the 1-D TP DeviceMesh
    group: dist.ProcessGroup  # its group (this rank's tp peers)
    # Every rank of the model (dp x tp): agreements and "the model's first rank" of the
    # state-dict helpers span both axes.
    model_group: dist.ProcessGroup

    @property
    def is_tp_first(self) -> bool:
        return dist.get_rank(self.group) == 0


def tp_groups(model: nn.Module, topology: Topology) -> TPGroups | None:
    """Check the meshes (``check_disjoint``) and make the model's TP groups; None without
    TP. The model's ranks are the union of the dp meshes of this rank's tp peers (one
    object all-gather over tp, at ``fs.shard``)."""
    tp_mesh = model_tp_mesh(model)
    if tp_mesh is None:
        return None
    check_disjoint(model, topology)
    group = tp_mesh.get_group()
    dp_ranks = dist.get_process_group_ranks(topology.mesh_group)
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, dp_ranks, group=group)
    ranks = tuple(sorted({r for ranks in every for r in ranks}))
    from flatshard.core.mesh import members_group

    backend = str(dist.get_backend(group))
    return TPGroups(tp_mesh, group, members_group(ranks, backend, topology.made))


def full_tensor(view: torch.Tensor, spec: TPSpec | None) -> torch.Tensor:
    """The whole parameter from its TP-local ``view`` (every tp peer must call it: it
    gathers over tp); ``view`` itself for a plain parameter."""
    if spec is None:
        return view
    return as_dtensor(view, spec).full_tensor()


def local_part(whole: torch.Tensor, spec: TPSpec | None) -> torch.Tensor:
    """This rank's TP-local part of the whole parameter ``whole`` (held alike by every tp
    peer; no communication)."""
    if spec is None:
        return whole
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole, spec.mesh, spec.placements, src_data_rank=None).to_local()
