"""FSDP x tensor parallel on one DeviceMesh: the cases behind tests/test_tensor_parallel.py.

World 4 = dp 2 x tp 2 (world 8 = replicate 2 x shard 2 x tp 2 for hybrid). A tiny
transformer (embedding, pre-norm blocks of local-head attention and an MLP, final norm, head)
is made tensor-parallel with torch's real ``parallelize_module`` the way torchtitan does it:
q/k/v and the MLP's first layer colwise, the output projections rowwise, the embedding
rowwise, the head colwise; with ``sp`` the norms are ``SequenceParallel`` and the attention
and MLP inputs are all-gathered by ``PrepareModuleInput``; with ``loss_parallel`` the logits
stay sharded over the vocabulary and the loss runs under ``loss_parallel()``.

Engines: ``flatshard`` (``fs.shard(model, policy=by_type(Block), mesh=...)``) and ``fsdp2``
(``fully_shard`` per block and on the root over ``mesh["dp"]``: the control). Each trains
``STEPS`` steps on this dp rank's half of the global batch; the reference is a single
process training the same model (no TP, no sharding) on the whole batch. Reported: the
largest relative error of the full state dict after the last step (on the ranks that hold
it) and of the gradient norm (every step, every rank).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

import flatshard as fs

VOCAB, DIM, HEADS, FFN, SEQ = 16, 8, 2, 12, 4
ROWS = 2  # sequences per dp rank
# Exactness is checked in float64, where rounding is ~1e-16 and any engine error stands out;
# fp32 (rounding ~1e-7, amplified on near-zero biases to ~1e-6 for FSDP2 alike) is compared
# side by side with FSDP2.
DTYPES = {"float64": torch.float64, "float32": torch.float32}
STEPS = 3
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
}


class Attention(nn.Module):
    """Causal attention on the local heads (the Megatron pattern: q/k/v colwise with local
    outputs, so the attention itself runs on plain tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.o = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.shape[0], x.shape[1]
        q, k, v = (
            p(x).view(B, T, -1, DIM // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H_local, T, D]
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, ffn: int = FFN) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, ffn), nn.Linear(ffn, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, ffn: int = FFN) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn, self.mlp = Attention(), MLP(ffn)
        self.checkpointed = ""  # activation checkpointing of the body: reentrant, non_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return checkpoint(self._body, x, use_reentrant=self.checkpointed == "reentrant")
        return self._body(x)

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, blocks: int = 2, tied: bool = False, ffn: int = FFN) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(ffn) for _ in range(blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(tied: bool = False, ffn: int = FFN) -> Model:
    torch.manual_seed(0)
    return Model(tied=tied, ffn=ffn)


def parallelize(model: Model, tp_mesh, *, sp: bool, loss_par: bool) -> None:
    """torchtitan's llama plan, shrunk to this model."""
    seq = Shard(1) if sp else Replicate()  # the activations between blocks
    root_plan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "head": ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_par else Replicate(),
            use_local_output=not loss_par,
        ),
    }
    if sp:
        root_plan["norm"] = SequenceParallel()
    tied = model.head.weight is model.embed.weight
    parallelize_module(model, tp_mesh, root_plan)
    if tied:  # each style distributed its own copy: tie the DTensors again (both Shard(0))
        model.head.weight = model.embed.weight
    gather_input = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
    )
    for block in model.blocks:
        plan = {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(output_layouts=seq),
            # DTensor output: an uneven ffn split cannot be rebuilt from local shapes (the
            # rowwise layer would assume even shards); an even one does not care
            "mlp.up": ColwiseParallel(use_local_output=False),
            "mlp.down": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            plan |= {
                "norm1": SequenceParallel(),
                "norm2": SequenceParallel(),
                "attn": gather_input,
                "mlp": gather_input,
            }
        parallelize_module(block, tp_mesh, plan)


def loss_of(model: nn.Module, tokens: torch.Tensor, target: torch.Tensor, loss_par: bool):
    """Mean cross-entropy, backpropagated here (under ``loss_parallel`` when the logits are
    sharded over the vocabulary: its backward must run inside the context too)."""
    logits = model(tokens)
    if loss_par:
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
            loss.backward()
        return loss.full_tensor().detach()
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
    loss.backward()
    return loss.detach()


def global_batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    shape = (dp * ROWS, SEQ)
    return torch.randint(VOCAB, shape, generator=g), torch.randint(VOCAB, shape, generator=g)


_MESHES: dict = {}


def mesh_of(shape: tuple, names: tuple):
    """One mesh per (shape, names) for the life of the pool's workers (DTensor caches by
    mesh value; making a mesh is a world collective every rank runs in the same order)."""
    key = (shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
    return err if err == err else float("inf")


def _meshes(hybrid: bool):
    """(whole mesh, tp mesh, dp mesh or dims, dp size, this rank's dp index)."""
    if hybrid:
        mesh = mesh_of((2, 2, 2), ("replicate", "shard", "tp"))
        dp = mesh["replicate", "shard"]
        index = dp.get_local_rank(0) * 2 + dp.get_local_rank(1)
        return mesh, mesh["tp"], dp, 4, index
    mesh = mesh_of((2, 2), ("dp", "tp"))
    return mesh, mesh["tp"], mesh["dp"], 2, mesh["dp"].get_local_rank()


def _shard(model: Model, spec: dict, mesh, dp_mesh) -> None:
    if spec["engine"] == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kw = dict(mesh=dp_mesh, mp_policy=mp if spec.get("bf16") else MixedPrecisionPolicy())
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        return
    mp = fs.MixedPrecision(param_dtype=torch.bfloat16) if spec.get("bf16") else None
    where = mesh if spec.get("whole_mesh") else dp_mesh
    strategy = spec.get("strategy", "hybrid_shard" if spec.get("hybrid") else "full_shard")
    from flatshard.features import root_split

    saved_min = root_split.LAZY_MIN_BYTES
    root_split.LAZY_MIN_BYTES = spec.get("lazy_min_bytes", saved_min)  # a tiny root made lazy
    try:
        fs.shard(
            model, policy=fs.wrap.by_type(Block), mesh=where, strategy=strategy, mixed_precision=mp
        )
    finally:
        root_split.LAZY_MIN_BYTES = saved_min


def _clip(model: nn.Module, engine: str, max_norm: float) -> float:
    if engine == "fsdp2":
        return _fsdp2_clip(model, max_norm)
    return fs.clip_grad_norm_(model, max_norm).item()


def _fsdp2_clip(model: nn.Module, max_norm: float) -> float:
    """torch's clip on FSDP2+TP gradients, one norm per mesh (dp for plain parameters, dp x
    tp for TP ones: torch cannot stack norms of two meshes, pytorch#180346), combined."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    by_mesh: dict = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh, []).append(g)
    squares = [torch.nn.utils.get_total_norm(gs, 2.0).full_tensor() ** 2 for gs in by_mesh.values()]
    total = torch.stack(squares).sum().sqrt().item()
    coef = min(1.0, max_norm / (total + 1e-6))
    for g in grads:
        g.mul_(coef)
    return total


def _full_state(model: nn.Module, engine: str) -> dict:
    if engine == "fsdp2":
        return {k: v.full_tensor() for k, v in model.state_dict().items()}
    return fs.full_state_dict(model)


MAX_NORM = 0.5  # below the first steps' norms: clipping is exercised, not only measured


def _meta_copy(ref: Model) -> Model:
    """``ref``'s architecture on the meta device (no storage): ``fs.shard`` materialises
    each parameter whole, initialises it and keeps this rank's TP-local block."""
    with torch.device("meta"):
        model = Model(
            tied=ref.head.weight is ref.embed.weight, ffn=ref.blocks[0].mlp.up.out_features
        )
    return model.to(ref.embed.weight.dtype)


def _load_everywhere(ref: nn.Module, state: dict) -> None:
    """Rank 0's full state dict into ``ref`` on every rank."""
    box = [state if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)  # world: the test's reference lives on every rank
    ref.load_state_dict(box[0])


def train(spec: dict) -> dict:
    """One spec on this rank: {"err": state-dict error, "norm_err": worst norm error,
    "holds": whether this rank holds the full state dict}."""
    mesh, tp_mesh, dp_mesh, dp_size, dp_index = _meshes(spec.get("hybrid", False))
    ref = build(spec.get("tied", False), spec.get("ffn", FFN))
    ref = ref.to(DTYPES[spec.get("dtype", "float64")])
    model = _meta_copy(ref) if spec.get("meta") else copy.deepcopy(ref)
    parallelize(model, tp_mesh, sp=spec.get("sp", False), loss_par=spec.get("loss_par", False))
    ac = spec.get("ac", "")
    for block in [*model.blocks, *ref.blocks] if ac in ("reentrant", "non_reentrant") else ():
        block.checkpointed = ac  # torch.utils.checkpoint inside the block's forward
    if ac == "wrapper":  # torch's checkpoint_wrapper around each block (torchtitan's route)
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
        )

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    if spec.get("compile"):
        for block in model.blocks:
            block.compile(backend="aot_eager", fullgraph=True)
    _shard(model, spec, mesh, dp_mesh)
    if ac == "fs":  # flatshard's own route, after fs.shard
        fs.checkpoint_activations(model, fs.wrap.by_type(Block))
    if spec.get("meta"):  # the reference starts where the materialised model does
        _load_everywhere(ref, fs.full_state_dict(model))
    opt, ref_opt = (
        OPTIMIZERS[spec["optim"]](model.parameters()),
        OPTIMIZERS[spec["optim"]](ref.parameters()),
    )
    norm_err = 0.0
    for step in range(STEPS):
        tokens, target = global_batch(step, dp_size)
        mine = slice(dp_index * ROWS, (dp_index + 1) * ROWS)
        loss_of(model, tokens[mine], target[mine], spec.get("loss_par", False))
        norm = _clip(model, spec["engine"], MAX_NORM)
        opt.step()
        opt.zero_grad()
        loss_of(ref, tokens, target, False)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item()
        ref_opt.step()
        ref_opt.zero_grad()
        norm_err = max(norm_err, abs(norm - ref_norm) / ref_norm)
    state, ref_state = _full_state(model, spec["engine"]), ref.state_dict()
    err = max((rel_err(state[k], ref_state[k]) for k in ref_state), default=0.0) if state else 0.0
    return {"err": err, "norm_err": norm_err, "holds": bool(state)}


def run_specs(specs: list[dict]) -> list[dict]:
    """Every spec in order; a spec that raises reports its error (the others still run)."""
    out = []
    for spec in specs:
        try:
            out.append(train(spec))
        except Exception as exc:  # reported, never re-raised: the pool keeps its workers
            out.append({"error": f"{type(exc).__name__}: {exc}"})
        dist.barrier()
    return out


def _expect_error(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _shard_tiny(model: nn.Module, mesh) -> nn.Module:
    return fs.shard(model, policy=fs.wrap.by_type(Block), mesh=mesh)


def errors() -> dict[str, str]:
    """What bad TP input raises, by case (every rank runs every case)."""
    mesh = mesh_of((2, 2), ("dp", "tp"))
    other = mesh_of((2, 2), ("dp2", "tp2"))  # the same ranks under other names: another mesh
    out = {}

    def overlapping():  # sharded over the tp ranks (given as a group: nothing to strip)
        model = build()
        parallelize(model, mesh["tp"], sp=False, loss_par=False)
        _shard_tiny(model, mesh["tp"].get_group())

    def on_both_dims():  # a parameter already a DTensor over (dp, tp)
        from torch.distributed.tensor import distribute_tensor

        model = build()
        weight = model.blocks[0].mlp.up.weight
        model.blocks[0].mlp.up.weight = nn.Parameter(
            distribute_tensor(weight.detach(), mesh, [Shard(0), Shard(1)])
        )
        _shard_tiny(model, mesh["dp"])

    def two_tp_meshes():
        model = build()
        parallelize(model, mesh["tp"], sp=False, loss_par=False)
        parallelize_module(model.blocks[1].norm1, other["tp2"], SequenceParallel())
        _shard_tiny(model, mesh["dp"])

    def only_tp_dim():
        model = build()
        parallelize(model, mesh["tp"], sp=False, loss_par=False)
        _shard_tiny(model, mesh["tp"])

    def plan_after_shard():
        model = _shard_tiny(build(), mesh["dp"])
        parallelize_module(model.blocks[0], mesh["tp"], {"mlp.up": ColwiseParallel()})
        model(torch.zeros(1, SEQ, dtype=torch.long))

    for name, fn in [
        ("overlapping", overlapping),
        ("on_both_dims", on_both_dims),
        ("two_tp_meshes", two_tp_meshes),
        ("only_tp_dim", only_tp_dim),
        ("plan_after_shard", plan_after_shard),
    ]:
        out[name] = _expect_error(fn)
        dist.barrier()
    return out
