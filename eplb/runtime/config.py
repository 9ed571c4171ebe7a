"""The shape of a DeepSeek-style model (`ModelConfig`), for the reference model in
eplb/runtime/model.py and the expert-parallel runtime; plain values, no torch.

Legend: D = hidden size, H = attention heads, C = kv_lora_rank (compressed KV latent),
R = RoPE dim of q/k, E = routed (logical) experts, K = top-k, F = expert intermediate size.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from eplb.errors import EplbError


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a DeepSeek-style model; defaults are tiny (tests, CPU demos)."""

    hidden: int = 64
    """D: hidden size."""
    num_layers: int = 4
    """Hidden (transformer) layers in total, dense and MoE."""
    first_moe_layer: int = 1
    """Dense layers before the first MoE layer (DeepSeek-V3: 3)."""
    num_heads: int = 4
    """H: attention heads."""
    q_lora_rank: int = 32
    """Rank of the low-rank query projection; 0 = full-rank query projection (V2-Lite)."""
    kv_lora_rank: int = 32
    """C: size of the compressed joint KV latent (what the cache stores, with the RoPE key)."""
    qk_nope_head_dim: int = 16
    """Per-head query/key dims without position encoding."""
    qk_rope_head_dim: int = 8
    """R: per-head query/key dims with RoPE (the key part is shared by all heads)."""
    v_head_dim: int = 16
    """Per-head value dims."""
    num_logical_experts: int = 16
    """E: routed (logical) experts per MoE layer."""
    top_k: int = 4
    """K: routed experts each token uses."""
    num_expert_groups: int = 4
    """Expert groups for group-limited routing (DeepSeek-V3: 8 groups of 32)."""
    topk_groups: int = 2
    """Groups each token may choose experts from (DeepSeek-V3: 4)."""
    expert_hidden: int = 32
    """F: intermediate size of one routed (and one shared) expert."""
    num_shared_experts: int = 1
    """Shared experts every token goes through (fused into one MLP of width F x this)."""
    routed_scaling: float = 2.5
    """Factor applied to the normalised routed weights (DeepSeek-V3: 2.5)."""
    vocab: int = 256
    """V: vocabulary size."""
    dense_hidden: int = 128
    """Intermediate size of the dense MLP in layers before first_moe_layer."""
    rope_theta: float = 10000.0
    """RoPE base."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    name: str = "deepseek-tiny"
    """Model name written into trace metadata."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("name", "routed_scaling", "rope_theta", "norm_eps"):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise EplbError(f"ModelConfig.{f.name} must be an integer, got {v!r}")
            low = 0 if f.name in ("first_moe_layer", "q_lora_rank", "num_shared_experts") else 1
            if v < low:
                raise EplbError(f"ModelConfig.{f.name} must be >= {low}, got {v}")
        if self.first_moe_layer >= self.num_layers:
            raise EplbError(
                f"first_moe_layer ({self.first_moe_layer}) must be below num_layers "
                f"({self.num_layers}): the model needs at least one MoE layer"
            )
        if self.num_logical_experts % self.num_expert_groups:
            raise EplbError(
                f"num_logical_experts ({self.num_logical_experts}) must be divisible by "
                f"num_expert_groups ({self.num_expert_groups})"
            )
        if self.topk_groups > self.num_expert_groups:
            raise EplbError(f"topk_groups ({self.topk_groups}) must be <= num_expert_groups ({self.num_expert_groups})")
        reachable = self.topk_groups * (self.num_logical_experts // self.num_expert_groups)
        if self.top_k > reachable:
            raise EplbError(
                f"top_k ({self.top_k}) exceeds the {reachable} experts in the {self.topk_groups} "
                f"chosen groups of {self.num_logical_experts // self.num_expert_groups}: "
                f"raise topk_groups or lower top_k"
            )
        if self.qk_rope_head_dim % 2:
            raise EplbError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even for RoPE")
        if not self.routed_scaling > 0:
            raise EplbError(f"routed_scaling must be > 0, got {self.routed_scaling}")

    @classmethod
    def deepseek_v3(cls) -> ModelConfig:
        """The published DeepSeek-V3 / R1 shape (for sizes and KV arithmetic; too big to build)."""
        return cls(hidden=7168, num_layers=61, first_moe_layer=3, num_heads=128, q_lora_rank=1536,
                   kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   num_logical_experts=256, top_k=8, num_expert_groups=8, topk_groups=4, expert_hidden=2048,
                   num_shared_experts=1, routed_scaling=2.5, vocab=129280, dense_hidden=18432,
                   name="deepseek-v3")

    @property
    def num_moe_layers(self) -> int:
        """L: MoE layers (hidden layers first_moe_layer .. num_layers - 1)."""
        return self.num_layers - self.first_moe_layer

    @property
    def moe_layer_ids(self) -> list[int]:
        """Hidden-layer index of each MoE layer (a trace's `layer_ids`)."""
        return list(range(self.first_moe_layer, self.num_layers))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes per token with MLA: layers x (kv_lora_rank + RoPE dim) x bytes."""
        return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * int(dtype_bytes)

    def mha_kv_bytes_per_token(self, kv_heads: int | None = None, head_dim: int | None = None,
                               dtype_bytes: int = 2) -> int:
        """KV-cache bytes per token of plain MHA/GQA: 2 x layers x kv_heads x head_dim x bytes.

        Defaults: kv_heads = num_heads (MHA), head_dim = v_head_dim (the d_h of the
        DeepSeek-V2 paper's comparison: 128 for V3).
        """
        kv_heads = self.num_heads if kv_heads is None else int(kv_heads)
        head_dim = self.v_head_dim if head_dim is None else int(head_dim)
        return 2 * self.num_layers * kv_heads * head_dim * int(dtype_bytes)

    def trace_meta(self) -> dict:
        """Trace metadata (eplb.core.trace.REQUIRED_META keys, plus topk_groups) describing this model."""
        return {
            "model": self.name,
            "num_hidden_layers": self.num_layers,
            "num_experts": self.num_logical_experts,
            "top_k": self.top_k,
            "num_expert_groups": self.num_expert_groups,
            "topk_groups": self.topk_groups,
            "tokens_per_window": None,
            "source": None,
            "synthetic": False,
        }
