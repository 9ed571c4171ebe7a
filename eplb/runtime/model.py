"""Reference DeepSeek-style model (single device): MLA attention + MoE with V3 routing.

Legend: B = batch, S = sequence, T = tokens (B x S flattened), D = hidden size,
H = attention heads, C = kv_lora_rank (compressed KV latent), R = RoPE dim of q/k,
E = routed (logical) experts, K = top-k, F = expert intermediate size, V = vocab,
L = MoE layers (hidden layers first_moe_layer .. num_layers - 1).

What this is for: the numerical reference the expert-parallel shim (eplb.runtime.ep) must
match, and a model the collectors (eplb.runtime.collect) can record router traces from. It is written
as plain single-device code; placing experts on ranks is a separate step.

- MLA (DeepSeek-V2/V3 multi-head latent attention): keys and values are rebuilt from a
  low-rank joint latent c_kv [T, C] plus one decoupled RoPE key k_pe [T, R] shared by all
  heads. Only (c_kv, k_pe) are cached, so the KV cache costs C + R values per token and layer
  instead of 2 x H x head_dim (see `ModelConfig.kv_bytes_per_token`).
- MoE: shared SwiGLU expert(s) plus E routed SwiGLU experts stored as stacked tensors
  (`w_gate_EFD`, `w_up_EFD`, `w_down_EDF`), so a runtime can slice out the experts a rank holds.
- Router (DeepSeek-V3): sigmoid scores plus a correction bias (bias only affects the choice),
  group-limited top-k (keep the `topk_groups` groups with the largest sum of their top-2
  biased scores, then top-k experts inside them), weights = unbiased scores of the chosen
  experts, normalised to sum 1 and multiplied by `routed_scaling`.
- Trace-driven routing: `Router.drive(freq_E)` replaces the learned choice by sampling K
  distinct experts per token whose inclusion probabilities follow a trace's per-expert
  frequencies, so that real skew (from a DeepSeek-V3 trace, say) reaches the runtime even
  though the weights here are random.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from eplb.errors import EplbError
from eplb.runtime.config import ModelConfig

# Building blocks ------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def swiglu(x_TD: torch.Tensor, w_gate_FD: torch.Tensor, w_up_FD: torch.Tensor,
           w_down_DF: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert: down(silu(gate x) * up x). The EP shim calls this same function."""
    return (F.silu(x_TD @ w_gate_FD.T) * (x_TD @ w_up_FD.T)) @ w_down_DF.T


class MLP(nn.Module):
    """Dense SwiGLU MLP (dense layers and the shared experts)."""

    def __init__(self, dim: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=False)
        self.up_proj = nn.Linear(dim, inter, bias=False)
        self.down_proj = nn.Linear(inter, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope(x: torch.Tensor, positions_S: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding on the last dim of x [..., S, R] (rotate-half convention)."""
    r = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, r, 2, dtype=torch.float32, device=x.device) / r))
    ang = positions_S.to(torch.float32)[:, None] * inv[None, :]          # [S, R/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
    x1, x2 = x[..., : r // 2], x[..., r // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


# Router ---------------------------------------------------------------------------------------

def inclusion_probs(freq_E, k: int) -> np.ndarray:
    """Per-token inclusion probability of each expert, float64 [E], summing to k.

    pi_e is proportional to freq_e except that no expert can be chosen more than once per
    token: experts whose share would exceed 1 are capped at 1 and the rest is spread over the
    others in proportion (the usual fix for sampling K distinct items). Without capping, the
    expected count of expert e over T tokens is exactly T x K x freq_e / sum(freq).
    """
    f = np.asarray(freq_E, dtype=np.float64)
    if f.ndim != 1 or not np.all(np.isfinite(f)) or (f.size and f.min() < 0):
        raise EplbError(f"routing frequencies must be finite and >= 0, one per expert; got shape {f.shape}")
    if np.count_nonzero(f) < k:
        raise EplbError(
            f"routing frequencies give only {np.count_nonzero(f)} experts a non-zero share, "
            f"but each token needs top_k = {k} distinct experts"
        )
    pi = np.zeros_like(f)
    capped = np.zeros(f.shape, dtype=bool)
    while True:
        free = ~capped
        pi[free] = (k - capped.sum()) * f[free] / f[free].sum()
        pi[capped] = 1.0
        over = free & (pi > 1.0)
        if not over.any():
            return pi
        capped |= over


def sample_distinct(pi_E: torch.Tensor, num_tokens: int, k: int,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw K distinct experts for each of T tokens with inclusion probabilities pi_E.

    Systematic sampling over a fresh random order of the experts per token: lay the pi's
    end to end on [0, K) and take the experts hit by u, u+1, ..., u+K-1 (u ~ U[0, 1)).
    Because every pi <= 1 no expert is hit twice, each token gets exactly K experts, and
    expert e is chosen with probability exactly pi_e. Returns int64 [T, K].
    """
    E = pi_E.shape[0]
    dev = pi_E.device
    perm_TE = torch.rand(num_tokens, E, generator=generator, device=dev).argsort(dim=1)
    c_TE = pi_E.to(torch.float64)[perm_TE].cumsum(dim=1)
    c_TE[:, -1] = float(k)  # exact end point: rounding must not lose or add a pick
    prev_TE = torch.cat([torch.zeros(num_tokens, 1, dtype=torch.float64, device=dev), c_TE[:, :-1]], 1)
    u_T1 = torch.rand(num_tokens, 1, generator=generator, device=dev, dtype=torch.float64)
    hit_TE = torch.ceil(c_TE - u_T1) - torch.ceil(prev_TE - u_T1) > 0.5
    pos = hit_TE.nonzero()[:, 1].view(num_tokens, k)
    return perm_TE.gather(1, pos)


class Router(nn.Module):
    """DeepSeek-V3 gate: sigmoid scores, correction bias, group-limited top-k.

    forward(x_TD) -> (topk_ids_TK int64, topk_weights_TK float). With `drive(freq_E)` the
    ids are sampled from given per-expert frequencies instead (weights still come from
    this router's scores, so outputs remain a function of x and the ids).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.num_logical_experts, self.top_k = c.num_logical_experts, c.top_k
        self.num_expert_groups, self.topk_groups = c.num_expert_groups, c.topk_groups
        self.routed_scaling = float(c.routed_scaling)
        self.weight = nn.Parameter(torch.randn(c.num_logical_experts, c.hidden) / math.sqrt(c.hidden))
        # Load-balancing bias of auxiliary-loss-free balancing: steers the choice only.
        self.register_buffer("e_score_correction_bias", torch.zeros(c.num_logical_experts))
        self._pi_E: torch.Tensor | None = None
        self._generator: torch.Generator | None = None

    def drive(self, freq_E=None, generator: torch.Generator | None = None) -> None:
        """Sample expert ids from per-expert frequencies freq_E [E] (None: learned routing)."""
        if freq_E is None:
            self._pi_E, self._generator = None, None
            return
        f = np.asarray(freq_E.detach().cpu() if isinstance(freq_E, torch.Tensor) else freq_E,
                       dtype=np.float64)
        if f.shape != (self.num_logical_experts,):
            raise EplbError(f"routing frequencies must have {self.num_logical_experts} entries (one per expert), "
                            f"got shape {f.shape}")
        self._pi_E = torch.as_tensor(inclusion_probs(f, self.top_k), device=self.weight.device)
        self._generator = generator

    @property
    def driven(self) -> bool:
        return self._pi_E is not None

    def scores(self, x_TD: torch.Tensor) -> torch.Tensor:
        """Sigmoid affinity of each token to each expert, float32 [T, E]."""
        return torch.sigmoid(F.linear(x_TD.float(), self.weight.float()))

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = x_TD.shape[0]
        s_TE = self.scores(x_TD)
        if self._pi_E is not None:
            ids_TK = sample_distinct(self._pi_E.to(x_TD.device), T, self.top_k, self._generator)
        else:
            # Step 1: biased scores choose; group score = sum of a group's top-2.
            b_TE = s_TE + self.e_score_correction_bias
            per_group = self.num_logical_experts // self.num_expert_groups
            g_TGn = b_TE.view(T, self.num_expert_groups, per_group)
            group_score_TG = g_TGn.topk(min(2, per_group), dim=-1).values.sum(-1)
            # Step 2: keep the best topk_groups groups; experts elsewhere cannot be chosen.
            keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool)
            keep_TG.scatter_(1, group_score_TG.topk(self.topk_groups, dim=-1).indices, True)
            # reshape(T, E), not (T, -1): a rank with no tokens (T = 0) must still route.
            keep_TE = (keep_TG[:, :, None].expand(T, self.num_expert_groups, per_group)
                       .reshape(T, self.num_logical_experts))
            # Step 3: top-k experts among the kept groups.
            ids_TK = b_TE.masked_fill(~keep_TE, float("-inf")).topk(self.top_k, dim=-1).indices
        w_TK = s_TE.gather(1, ids_TK)
        w_TK = w_TK / (w_TK.sum(-1, keepdim=True) + 1e-20) * self.routed_scaling
        return ids_TK, w_TK.to(x_TD.dtype)


# MoE ------------------------------------------------------------------------------------------

class MoE(nn.Module):
    """Shared expert(s) plus E routed SwiGLU experts behind a DeepSeek-V3 router."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        E, Fh, D = c.num_logical_experts, c.expert_hidden, c.hidden
        self.num_logical_experts, self.top_k = E, c.top_k
        self.gate = Router(c)
        self.w_gate_EFD = nn.Parameter(torch.randn(E, Fh, D) / math.sqrt(D))
        self.w_up_EFD = nn.Parameter(torch.randn(E, Fh, D) / math.sqrt(D))
        self.w_down_EDF = nn.Parameter(torch.randn(E, D, Fh) / math.sqrt(Fh))
        self.shared = MLP(D, Fh * c.num_shared_experts) if c.num_shared_experts else None

    def routed(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor,
               topk_weights_TK: torch.Tensor) -> torch.Tensor:
        """Routed part only: y_t = sum_k w_tk expert_{id_tk}(x_t), [T, D]."""
        T, K = topk_ids_TK.shape
        flat_ids = topk_ids_TK.reshape(-1)
        # Sort (token, k) pairs by expert so each expert runs once on its tokens.
        order = flat_ids.argsort(stable=True)
        counts_E = torch.bincount(flat_ids, minlength=self.num_logical_experts).tolist()
        tok_sorted = order // K
        # Weights in the activations' dtype (engines often keep router weights in float32):
        # index_add_ needs one dtype, and the EP shim combines the same way.
        w_sorted = topk_weights_TK.reshape(-1)[order].to(x_TD.dtype)
        y_TD = torch.zeros_like(x_TD)
        start = 0
        for e, n in enumerate(counts_E):
            if n == 0:
                continue
            tok = tok_sorted[start:start + n]
            out = swiglu(x_TD[tok], self.w_gate_EFD[e], self.w_up_EFD[e], self.w_down_EDF[e])
            y_TD.index_add_(0, tok, out * w_sorted[start:start + n, None])
            start += n
        return y_TD

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        ids_TK, w_TK = self.gate(x_TD)
        y_TD = self.routed(x_TD, ids_TK, w_TK)
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD)
        return y_TD


# Attention ------------------------------------------------------------------------------------

class LatentCache:
    """MLA KV cache of one layer: the compressed latent and the RoPE key, [B, S, C + R].

    This is all MLA keeps per token; keys and values are rebuilt from it on every step.
    """

    def __init__(self) -> None:
        self.ckv_BSC: torch.Tensor | None = None
        self.kpe_BSR: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.ckv_BSC is None else self.ckv_BSC.shape[1]

    def append(self, ckv_BSC: torch.Tensor, kpe_BSR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ckv_BSC is None:
            self.ckv_BSC, self.kpe_BSR = ckv_BSC, kpe_BSR
        else:
            self.ckv_BSC = torch.cat([self.ckv_BSC, ckv_BSC], 1)
            self.kpe_BSR = torch.cat([self.kpe_BSR, kpe_BSR], 1)
        return self.ckv_BSC, self.kpe_BSR

    def nbytes(self) -> int:
        if self.ckv_BSC is None:
            return 0
        return self.ckv_BSC.numel() * self.ckv_BSC.element_size() + self.kpe_BSR.numel() * self.kpe_BSR.element_size()


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3), causal, with an optional LatentCache."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.c = c
        H = c.num_heads
        if c.q_lora_rank:
            self.q_a_proj = nn.Linear(c.hidden, c.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(c.q_lora_rank, c.norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, H * c.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(c.hidden, H * c.qk_head_dim, bias=False)
        # Joint down-projection: the latent c_kv and the shared RoPE key come out together.
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_norm = RMSNorm(c.kv_lora_rank, c.norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * c.v_head_dim, c.hidden, bias=False)

    def forward(self, x_BSD: torch.Tensor, cache: LatentCache | None = None) -> torch.Tensor:
        c = self.c
        B, S, _ = x_BSD.shape
        H, N, R, Vd = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        past = cache.length if cache is not None else 0
        pos_S = torch.arange(past, past + S, device=x_BSD.device)
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x_BSD))) if c.q_lora_rank else self.q_proj(x_BSD)
        q_BHSQ = q.view(B, S, H, N + R).transpose(1, 2)
        q_nope, q_pe = q_BHSQ.split([N, R], dim=-1)
        q_pe = rope(q_pe, pos_S, c.rope_theta)
        ckv_BSC, kpe_BSR = self.kv_a_proj_with_mqa(x_BSD).split([c.kv_lora_rank, R], dim=-1)
        kpe_BSR = rope(kpe_BSR, pos_S, c.rope_theta)
        if cache is not None:
            ckv_BSC, kpe_BSR = cache.append(ckv_BSC, kpe_BSR)
        Sk = ckv_BSC.shape[1]
        kv = self.kv_b_proj(self.kv_a_norm(ckv_BSC)).view(B, Sk, H, N + Vd).transpose(1, 2)
        k_nope, v_BHSV = kv.split([N, Vd], dim=-1)
        k_BHSQ = torch.cat([k_nope, kpe_BSR[:, None].expand(B, H, Sk, R)], dim=-1)
        q_BHSQ = torch.cat([q_nope, q_pe], dim=-1)
        # Causal over absolute positions: query at past+i sees keys 0..past+i.
        mask_SS = torch.ones(S, Sk, dtype=torch.bool, device=x_BSD.device).tril(diagonal=past)
        o = F.scaled_dot_product_attention(q_BHSQ, k_BHSQ, v_BHSV, attn_mask=mask_SS)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, H * Vd))


# Model ----------------------------------------------------------------------------------------

class Block(nn.Module):
    """Pre-norm transformer block: MLA then a dense MLP or an MoE."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attn_norm = RMSNorm(config.hidden, config.norm_eps)
        self.attn = MLAttention(config)
        self.ffn_norm = RMSNorm(config.hidden, config.norm_eps)
        self.is_moe = layer_id >= config.first_moe_layer
        self.ffn = MoE(config) if self.is_moe else MLP(config.hidden, config.dense_hidden)

    def forward(self, x_BSD: torch.Tensor, cache: LatentCache | None = None) -> torch.Tensor:
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), cache)
        B, S, D = x_BSD.shape
        h_TD = self.ffn_norm(x_BSD).reshape(B * S, D)
        return x_BSD + self.ffn(h_TD).view(B, S, D)


class DeepSeekModel(nn.Module):
    """Embedding, `num_layers` blocks (dense then MoE), final norm, LM head.

    forward(tokens_BS int64, caches=None) -> logits_BSV. Seed torch before building it for
    reproducible weights.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)

    def new_caches(self) -> list[LatentCache]:
        return [LatentCache() for _ in self.layers]

    def forward(self, tokens_BS: torch.Tensor, caches: list[LatentCache] | None = None) -> torch.Tensor:
        x = self.embed(tokens_BS)
        for i, block in enumerate(self.layers):
            x = block(x, None if caches is None else caches[i])
        return self.lm_head(self.norm(x))

    def moe_layers(self) -> list[tuple[int, MoE]]:
        """(hidden_layer_id, MoE) for each MoE layer, in order (L of them)."""
        return [(b.layer_id, b.ffn) for b in self.layers if b.is_moe]

    def drive_routing(self, freq_LE=None, generator: torch.Generator | None = None) -> None:
        """Drive every MoE router from per-layer expert frequencies freq_LE [L, E] (None: off)."""
        moes = self.moe_layers()
        if freq_LE is None:
            for _, m in moes:
                m.gate.drive(None)
            return
        f = np.asarray(freq_LE.detach().cpu() if isinstance(freq_LE, torch.Tensor) else freq_LE,
                       dtype=np.float64)
        if f.shape != (len(moes), self.config.num_logical_experts):
            raise EplbError(
                f"routing frequencies must be [{len(moes)} MoE layers, {self.config.num_logical_experts} experts], "
                f"got shape {f.shape}"
            )
        for (_, m), f_E in zip(moes, f):
            m.gate.drive(f_E, generator)
