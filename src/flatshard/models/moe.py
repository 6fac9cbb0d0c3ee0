"""A small Mixture-of-Experts decoder with optional expert parallelism (EP).

Structure (``named_parameters`` names follow it)::

    MoEGPT
      tok_emb   nn.Embedding(vocab_size, d_model)
      rope      RotaryEmbedding (no parameters)
      layers    nn.ModuleList[MoEBlock]          <- wrap policy: fs.wrap.by_type(MoEBlock)
        attn_norm, attn (flatshard.models.Attention), moe_norm,
        moe     MoELayer
          router   Router: gate nn.Linear(d_model, n_experts), softmax, top-k
          experts  Experts: w1 [E_l, d, h], w2 [E_l, h, d], w3 [E_l, d, h] (SwiGLU only)
      norm, lm_head (weight tied to tok_emb when configured)

Routing is token-choice top-k as in Mixtral / Qwen-MoE: softmax over all experts, keep the ``k``
largest probabilities and renormalise them to sum to 1. Every token is processed by all ``k`` of
its experts: there is no capacity factor and no token dropping, so an expert may receive any
number of tokens (zero included) and results never depend on how tokens are spread over ranks.

Expert parallelism: with ``ep_group`` (a ProcessGroup or a 1-D DeviceMesh of ``ep`` ranks) each
rank holds ``E_l = n_experts // ep`` consecutive experts (rank ``j``: ``j*E_l ..``), and routed
tokens travel to them and back by all-to-all (``moe_dispatch``). Build the local experts only
with ``MoEGPT(config, ep_group=g)``, or slice a full model with :func:`shard_experts`; from the
same seed both equal the full model's slice. Gradient semantics (what a data-parallel wrapper
must do): non-expert parameters are replicated on every rank and their gradients average over
all ``ep * dp`` ranks; an expert's local gradient already sums the contributions of the whole EP
group's tokens, so expert gradients are summed over the ``dp`` replicas holding the same experts
and divided by ``ep * dp`` (torchtitan's "data divide factor" for experts).

Load balancing: each :class:`Router` keeps the Switch-Transformer auxiliary loss of its last
forward, ``E * sum_e f_e * P_e`` (``f_e``: share of the ``N*k`` assignments routed to expert
``e``; ``P_e``: its mean router probability; 1 when balanced), over the tokens this rank routed.
``MoEGPT(..., labels=...)`` adds ``aux_loss_coef`` times the mean over layers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from flatshard.models.block import Attention, make_norm
from flatshard.models.config import GPTConfig
from flatshard.models.gpt import Decoder
from flatshard.models.moe_dispatch import as_process_group, combine, dispatch, local_expert_range

__all__ = [
    "MOE_PRESETS",
    "Experts",
    "MoEBlock",
    "MoEConfig",
    "MoEGPT",
    "MoELayer",
    "Router",
    "shard_experts",
]

EpGroup = ProcessGroup | DeviceMesh


@dataclass(frozen=True)
class MoEConfig(GPTConfig):
    """A :class:`GPTConfig` whose blocks use a Mixture-of-Experts MLP (``d_ff``/``mlp`` describe
    one expert: its hidden width and SwiGLU or GELU)."""

    n_experts: int = 8
    """Experts per MoE layer, counted over all EP ranks; ``ep`` must divide it."""
    top_k: int = 2
    """Experts each token is routed to (at most ``n_experts``)."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (mean over layers) in the training loss; 0 = off."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("n_experts", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.top_k > self.n_experts:
            raise ValueError(
                f"top_k={self.top_k} exceeds n_experts={self.n_experts}; route each token to at "
                "most n_experts experts"
            )
        coef = self.aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0:
            raise ValueError(f"aux_loss_coef={coef!r} must be a number >= 0")

    @classmethod
    def preset(cls, name: str, **overrides) -> MoEConfig:
        """The named preset from :data:`MOE_PRESETS`, with ``overrides`` replaced."""
        if name not in MOE_PRESETS:
            raise ValueError(f"unknown MoE preset {name!r}; choose one of {', '.join(MOE_PRESETS)}")
        return dataclasses.replace(MOE_PRESETS[name], **overrides)

    def num_params(self, *, exclude_embeddings: bool = False, active: bool = False) -> int:
        """Parameter count (tied weights once); ``active``: only the ``top_k`` experts a token
        uses per layer (the count that sets the compute per token)."""
        dense = super().num_params(exclude_embeddings=exclude_embeddings)
        one_expert = (3 if self.mlp == "swiglu" else 2) * self.d_model * self.ffn_dim
        experts = self.top_k if active else self.n_experts
        router = self.d_model * self.n_experts
        return dense + self.n_layers * ((experts - 1) * one_expert + router)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: :meth:`GPTConfig.flops_per_token`'s PaLM formula over the
        *active* parameters (router + ``top_k`` experts per layer, output head included)."""
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError(f"seq_len={seq_len!r} must be a positive int")
        n = self.num_params(exclude_embeddings=True, active=True) + self.vocab_size * self.d_model
        return 6 * n + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len


MOE_PRESETS: dict[str, MoEConfig] = {
    # Tests: 4 experts, top-2, two layers, a 64-token vocabulary.
    "tiny": MoEConfig(
        vocab_size=64, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_seq_len=32, n_experts=4
    ),
}
"""Named MoE configurations."""


class Router(nn.Module):
    """Softmax router with top-k selection and renormalised weights (Mixtral / Qwen-MoE)."""

    def __init__(self, d_model: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.gate = nn.Linear(d_model, n_experts, bias=False)
        self.aux_loss: torch.Tensor | None = None  # of the last forward

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [N, C]`` -> weights ``[N, k]`` (fp32, rows sum to 1) and expert ids ``[N, k]``."""
        probs = F.softmax(self.gate(x).float(), dim=-1)  # [N, E]
        top_probs, expert_ids = probs.topk(self.top_k, dim=-1)  # [N, k] each
        weights = top_probs / top_probs.sum(dim=-1, keepdim=True)  # [N, k]
        self.aux_loss = load_balancing_loss(probs, expert_ids)
        return weights, expert_ids

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.gate.weight, mean=0.0, std=std)


def load_balancing_loss(probs: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's ``E * sum_e f_e * P_e`` for ``probs [N, E]``, ``expert_ids [N, k]``."""
    n_experts = probs.shape[-1]
    assigned = torch.bincount(expert_ids.flatten(), minlength=n_experts)  # [E]
    share = assigned.float() / max(expert_ids.numel(), 1)  # [E], f_e (no gradient: discrete)
    return n_experts * (share * probs.mean(dim=0)).sum()


class Experts(nn.Module):
    """``n_local`` expert MLPs stored stacked, applied to rows grouped by expert.

    Holds experts ``first .. first + n_local - 1`` of ``n_total``; the full set when
    ``n_local == n_total``. ``w1``/``w3`` map ``d_model -> hidden`` (``w3`` is SwiGLU's up
    projection, ``None`` for GELU) and ``w2`` maps ``hidden -> d_model``.
    """

    def __init__(
        self,
        n_total: int,
        d_model: int,
        hidden: int,
        mlp: str = "swiglu",
        *,
        first: int = 0,
        n_local: int | None = None,
    ) -> None:
        super().__init__()
        if mlp not in ("swiglu", "gelu"):
            raise ValueError(f"mlp={mlp!r} is not supported; use 'swiglu' or 'gelu'")
        n_local = n_total - first if n_local is None else n_local
        if not 0 <= first < first + n_local <= n_total:
            raise ValueError(f"experts {first}..{first + n_local - 1} are not within 0..{n_total}")
        self.n_total, self.first, self.n_local, self.mlp = n_total, first, n_local, mlp
        self.w1 = nn.Parameter(torch.empty(n_local, d_model, hidden))  # [E_l, C, H]
        self.w2 = nn.Parameter(torch.empty(n_local, hidden, d_model))  # [E_l, H, C]
        swiglu = mlp == "swiglu"
        self.w3 = nn.Parameter(torch.empty(n_local, d_model, hidden)) if swiglu else None

    def flatshard_placement(self) -> dict[str, tuple[int, int, int]]:
        """Where this rank's experts sit among all ``n_total``: slice ``[first, first +
        n_local)`` of dim 0 of every stacked weight (flatshard's checkpoints read it; see
        [Note: per-unit meshes] in flatshard/parallel/unit_mesh.py)."""
        names = ("w1", "w2", "w3")
        return {n: (0, self.first, self.n_total) for n in names if getattr(self, n) is not None}

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``rows [M, C]`` grouped by local expert (``counts[e]`` rows for expert ``e``) ->
        ``[M, C]``. A grouped loop: each expert multiplies only the rows it received (none
        costs nothing, and its weights still get a zero gradient)."""
        outputs = []
        for e, x in enumerate(torch.split(rows, counts)):  # x [M_e, C]
            h = x @ self.w1[e]  # [M_e, H]
            gelu = self.w3 is None
            h = F.gelu(h, approximate="tanh") if gelu else F.silu(h) * (x @ self.w3[e])
            outputs.append(h @ self.w2[e])  # [M_e, C]
        return torch.cat(outputs)  # [M, C]

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float) -> None:
        """Normal init, drawn expert by expert over all ``n_total`` experts and kept for the
        local ones: a rank holding a slice draws the same numbers as the full module."""
        stds = {"w1": std, "w3": std, "w2": out_std}
        for name, sd in stds.items():
            param = getattr(self, name)
            if param is None:
                continue
            for e in range(self.n_total):
                drawn = torch.empty(param.shape[1:], device=param.device).normal_(0.0, sd)
                if self.first <= e < self.first + self.n_local:
                    param[e - self.first].copy_(drawn)

    def extra_repr(self) -> str:
        return f"experts {self.first}..{self.first + self.n_local - 1} of {self.n_total}"


class MoELayer(nn.Module):
    """Router + experts: ``x [B, T, C]`` -> ``sum_k weight_k * expert_k(x)`` per token."""

    def __init__(self, config: MoEConfig, ep_group: EpGroup | None = None) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.ep_group = None if ep_group is None else as_process_group(ep_group)
        first, n_local = local_expert_range(config.n_experts, self.ep_group)
        self.router = Router(config.d_model, config.n_experts, config.top_k)
        self.experts = Experts(
            config.n_experts,
            config.d_model,
            config.ffn_dim,
            config.mlp,
            first=first,
            n_local=n_local,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, C]`` -> ``[B, T, C]``; with an EP group, every rank of it must call this."""
        B, T, C = x.shape
        tokens = x.reshape(B * T, C)  # [N, C]
        weights, expert_ids = self.router(tokens)  # [N, k] each
        flat_ids = expert_ids.flatten()  # [N*k], assignment a = token a // k
        order = torch.argsort(flat_ids, stable=True)  # [N*k]: assignments by expert id
        token_of = order // self.top_k  # [N*k]
        rows = tokens[token_of]  # [N*k, C], grouped by global expert
        counts = torch.bincount(flat_ids, minlength=self.router.n_experts)  # [E]
        if self.ep_group is None:
            out = self.experts(rows, counts.tolist())  # [N*k, C]; a host read (split sizes)
        else:
            local_rows, route = dispatch(rows, counts, self.ep_group)  # [M, C]
            local_out = self.experts(local_rows, route.local_counts)  # [M, C]
            out = combine(local_out, route, self.ep_group)  # [N*k, C]
        weighted = out * weights.flatten()[order].to(out.dtype).unsqueeze(1)  # [N*k, C]
        combined = torch.zeros_like(tokens).index_add(0, token_of, weighted)  # [N, C]
        return combined.view(B, T, C)


class MoEBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + moe(norm(x))``."""

    def __init__(self, config: MoEConfig, ep_group: EpGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.attn_norm = make_norm(config)
        self.attn = Attention(config)
        self.moe_norm = make_norm(config)
        self.moe = MoELayer(config, ep_group)
        self.drop = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        """``x [B, T, C]`` -> ``[B, T, C]`` (see :meth:`Attention.forward` for the rest)."""
        h = self.attn(self.attn_norm(x), cos, sin, cu_seqlens, max_seqlen)  # [B, T, C]
        x = x + self.drop(h)  # [B, T, C]
        return x + self.drop(self.moe(self.moe_norm(x)))  # [B, T, C]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init as :class:`flatshard.models.Block`: attention, router, then experts."""
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers)
        self.attn_norm.reset_parameters()
        self.attn.reset_parameters(std, out_std)
        self.moe_norm.reset_parameters()
        self.moe.router.reset_parameters(std)
        self.moe.experts.reset_parameters(std, out_std)


class MoEGPT(Decoder):
    """Decoder-only MoE transformer; see the module docstring for structure, EP and the loss."""

    def __init__(self, config: MoEConfig, ep_group: EpGroup | None = None) -> None:
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        super().__init__(config, lambda: MoEBlock(config, ep_group))

    def training_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy + ``aux_loss_coef`` * :attr:`aux_loss`."""
        return self.loss(logits, labels) + self.config.aux_loss_coef * self.aux_loss

    @property
    def aux_loss(self) -> torch.Tensor:
        """Mean over layers of the routers' load-balancing losses of the last forward."""
        losses = [layer.moe.router.aux_loss for layer in self.layers]
        if any(loss is None for loss in losses):
            raise RuntimeError("aux_loss is only defined after a forward pass")
        return torch.stack(losses).mean()


def shard_experts(model: nn.Module, ep_group: EpGroup) -> nn.Module:
    """Keep only this rank's experts in every :class:`MoELayer` of ``model``, in place.

    ``model`` holds every expert (built without an EP group); afterwards each layer holds the
    ``n_experts // ep`` experts of this rank of ``ep_group`` and dispatches tokens over it.
    Optimizers must be created afterwards (the expert Parameters are replaced). Returns ``model``.
    """
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no MoELayer; nothing to shard")
    group = as_process_group(ep_group)
    for layer in layers:
        experts = layer.experts
        if layer.ep_group is not None or experts.n_local != experts.n_total:
            raise ValueError("shard_experts got a model whose experts are already sharded")
        first, n_local = local_expert_range(experts.n_total, group)
        for name in ("w1", "w2", "w3"):
            full = getattr(experts, name)
            if full is not None:
                local = full.detach()[first : first + n_local].clone()
                setattr(experts, name, nn.Parameter(local, requires_grad=full.requires_grad))
        experts.first, experts.n_local = first, n_local
        layer.ep_group = group
    return model
