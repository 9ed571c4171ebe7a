"""Capacity planning: how many redundant expert slots fit next to the KV cache on each GPU.

Legend: E = routed (logical) experts, G = GPUs (ranks), S = slots per GPU, P = G x S physical
slots, R = P - E redundant slots, L_moe = MoE layers. Bytes are bytes (GiB = 2**30 bytes).

Redundant experts cost memory that the KV cache also wants. One physical slot per GPU holds
one expert in *every* MoE layer, so one more slot per GPU costs L_moe x bytes per expert on
every GPU (DeepSeek-V3, fp8: 58 x 44.0 MB = 2.55 GB). The KV cache per token is
- MHA/GQA: 2 (K and V) x layers x kv_heads x head_dim x bytes
- MLA (DeepSeek-V3, Kimi-K2): layers x (kv_lora_rank + qk_rope_head_dim) x bytes, one
  compressed latent shared by all heads, ~1/57 of what MHA with 128 heads would need.
Worked figures checked by the tests: Llama-3.1-70B in fp16 needs 2 x 80 x 8 x 128 x 2 =
327,680 bytes (320 KiB) per token, 100k tokens ~32.8 GB; fp8 halves that. DeepSeek-V3 in
bf16 needs 61 x 576 x 2 = 70,272 bytes per token.

Memory model of one GPU (assumptions, stated because engines differ):
- usable = GPU memory x `memory_utilization` (like vLLM's gpu_memory_utilization; the rest is
  CUDA context, activations, communication buffers).
- routed experts: S slots x L_moe layers x bytes per expert, S = ceil(E / G) + redundant per GPU.
- everything else (attention, dense MLPs, shared experts, router, embeddings, norms):
  `attention="dp"` (default; data-parallel attention, as in SGLang/vLLM wide-EP deployments of
  DeepSeek) keeps a full copy on every GPU; `attention="tp"` splits it evenly over the G GPUs.
- KV cache: with "dp" each sequence lives on one GPU (ceil(concurrency / G) sequences on the
  busiest); with "tp" every GPU holds a share of every sequence: its ceil(kv_heads / G) whole
  KV heads for GQA (1/min(G, kv_heads) when G divides kv_heads or exceeds it), and all of it
  for MLA (the latent cannot be split by head, so TP replicates it).
- dtypes: bits per element only; quantisation scales (fp8 block scales ~0.02%, NVFP4 one
  fp8 scale per 16 values = +12.5% on fp4) are not counted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from eplb.errors import EplbError, fraction, is_number, positive_integer, whole_number

DTYPE_BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8, "fp4": 4}
"""Bits per element of the dtypes the planner knows (scales not counted)."""

GPU_MEMORY_MIB = {"h100": 81559, "h800": 81559, "h200": 143771, "b200": 183359}
"""Total memory `nvidia-smi` reports for common GPUs, in MiB (what the driver can hand out)."""

ATTENTION_MODES = ("dp", "tp")


def dtype_bits(name: str) -> int:
    """Bits per element of a dtype name (bf16, fp16, fp8, fp4, fp32)."""
    key = str(name).lower()
    if key not in DTYPE_BITS:
        raise EplbError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPE_BITS)}")
    return DTYPE_BITS[key]


def _nbytes(elements: int, bits: int) -> int:
    return -(-int(elements) * int(bits) // 8)


def parse_memory(text: str | int | float) -> int:
    """GPU memory in bytes from '80GiB', '141GB', '81559MiB', 'h200' or a bare number of GiB."""
    if is_number(text):
        value, unit = float(text), "gib"
    else:
        s = str(text).strip().lower().replace(" ", "")
        if s in GPU_MEMORY_MIB:
            return GPU_MEMORY_MIB[s] * 2**20
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)(gib|gb|mib|mb|tib|tb|g|m)?", s)
        if not m:
            raise EplbError(
                f"GPU memory {text!r} is not a size: write e.g. 80GiB, 141GB, 81559MiB, a bare number "
                f"of GiB, or a GPU name ({', '.join(GPU_MEMORY_MIB)})"
            )
        value, unit = float(m.group(1)), (m.group(2) or "gib")
    scale = {"gib": 2**30, "g": 2**30, "gb": 10**9, "mib": 2**20, "m": 2**20, "mb": 10**6,
             "tib": 2**40, "tb": 10**12}[unit]
    nbytes = int(value * scale)
    if nbytes <= 0:
        raise EplbError(f"GPU memory must be positive, got {text!r}")
    return nbytes


def gib(nbytes: float) -> float:
    return nbytes / 2**30


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a transformer's config that decide its weight and KV-cache memory."""

    name: str
    """Display name."""
    num_hidden_layers: int
    """Transformer blocks (dense and MoE)."""
    hidden_size: int
    """Model width."""
    vocab_size: int
    """Tokenizer vocabulary (embedding and LM-head rows)."""
    num_attention_heads: int
    """Query heads."""
    num_kv_heads: int
    """K/V heads of MHA/GQA (equal to query heads for MHA); not used by MLA's cache."""
    head_dim: int
    """Per-head dim of MHA/GQA queries, keys and values; for MLA the no-RoPE part of q/k
    (qk_nope_head_dim)."""
    intermediate_size: int
    """Width of the dense SwiGLU MLP (dense layers only)."""
    num_dense_layers: int = 0
    """Leading blocks with a dense MLP instead of MoE (DeepSeek-V3: 3; dense models: all)."""
    num_logical_experts: int = 0
    """E: routed experts per MoE layer (0 = dense model)."""
    moe_intermediate_size: int = 0
    """Width of one routed expert's SwiGLU MLP."""
    num_shared_experts: int = 0
    """Always-active experts per MoE layer (same width as a routed one)."""
    top_k: int = 0
    """Routed experts each token uses."""
    kv_lora_rank: int = 0
    """MLA compressed-KV width (0 = not MLA)."""
    q_lora_rank: int = 0
    """MLA compressed-query width (0 = plain query projection)."""
    qk_rope_head_dim: int = 0
    """MLA decoupled RoPE key width (cached once per token, shared by heads)."""
    v_head_dim: int = 0
    """MLA value head dim (0 = head_dim)."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix."""

    def __post_init__(self) -> None:
        for name in ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads",
                     "num_kv_heads", "head_dim"):
            object.__setattr__(self, name, positive_integer(f"model {self.name}: {name}", getattr(self, name)))
        for name in ("intermediate_size", "num_dense_layers", "num_logical_experts", "moe_intermediate_size",
                     "num_shared_experts", "top_k", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                     "v_head_dim"):
            object.__setattr__(self, name, whole_number(f"model {self.name}: {name}", getattr(self, name), 0))
        if not 0 <= self.num_dense_layers <= self.num_hidden_layers:
            raise EplbError(f"model {self.name}: num_dense_layers ({self.num_dense_layers}) must be in "
                            f"0..num_hidden_layers ({self.num_hidden_layers})")
        if self.num_logical_experts and self.top_k > self.num_logical_experts:
            raise EplbError(f"model {self.name}: top_k ({self.top_k}) must be at most num_logical_experts "
                            f"({self.num_logical_experts})")
        if self.num_logical_experts and not self.moe_intermediate_size:
            raise EplbError(f"model {self.name}: {self.num_logical_experts} experts need moe_intermediate_size > 0")
        if self.num_logical_experts and self.num_dense_layers == self.num_hidden_layers:
            raise EplbError(f"model {self.name}: {self.num_logical_experts} experts but every layer is dense: "
                            f"lower num_dense_layers")
        if not self.num_logical_experts and self.num_dense_layers != self.num_hidden_layers:
            # A dense model: every block has the dense MLP.
            object.__setattr__(self, "num_dense_layers", self.num_hidden_layers)
        if self.num_dense_layers and not self.intermediate_size:
            raise EplbError(f"model {self.name}: {self.num_dense_layers} dense layers need intermediate_size > 0")
        if self.kv_lora_rank and not self.qk_rope_head_dim:
            raise EplbError(f"model {self.name}: MLA (kv_lora_rank {self.kv_lora_rank}) needs qk_rope_head_dim > 0")
        if not self.kv_lora_rank and self.num_attention_heads % self.num_kv_heads:
            raise EplbError(f"model {self.name}: num_attention_heads ({self.num_attention_heads}) must be "
                            f"a multiple of num_kv_heads ({self.num_kv_heads})")

    # Shape ------------------------------------------------------------------------------------

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        return self.num_logical_experts > 0

    @property
    def num_moe_layers(self) -> int:
        """L_moe: blocks whose MLP is routed experts."""
        return self.num_hidden_layers - self.num_dense_layers if self.is_moe else 0

    # Elements ---------------------------------------------------------------------------------

    def kv_elements_per_token(self) -> int:
        """Cached values per token over all layers (MLA latent + RoPE key, or K and V)."""
        if self.is_mla:
            return self.num_hidden_layers * (self.kv_lora_rank + self.qk_rope_head_dim)
        return 2 * self.num_hidden_layers * self.num_kv_heads * self.head_dim

    def attention_params_per_layer(self) -> int:
        """Weights of one attention block (projections and their norms)."""
        h, H = self.hidden_size, self.num_attention_heads
        if self.is_mla:
            qk = self.head_dim + self.qk_rope_head_dim
            v = self.v_head_dim or self.head_dim
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * H * qk
            else:
                q = h * H * qk
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank \
                + self.kv_lora_rank * H * (self.head_dim + v)
            return q + kv + H * v * h
        d, K = self.head_dim, self.num_kv_heads
        return h * H * d + 2 * h * K * d + H * d * h

    def expert_params(self) -> int:
        """Weights of one routed expert in one layer (SwiGLU: gate, up, down)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def dense_params(self) -> int:
        """Every weight that is not a routed expert (attention, dense MLPs, shared experts,
        routers, embeddings, norms)."""
        h = self.hidden_size
        n = self.num_hidden_layers * (self.attention_params_per_layer() + 2 * h)  # + two RMSNorms
        n += self.num_dense_layers * 3 * h * self.intermediate_size
        n += self.num_moe_layers * (self.num_shared_experts * self.expert_params() + self.num_logical_experts * h)
        n += self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        return n

    def total_params(self) -> int:
        """All weights: the figure a model card quotes (without MTP/draft layers)."""
        return self.dense_params() + self.num_moe_layers * self.num_logical_experts * self.expert_params()

    def describe(self) -> str:
        attn = (f"MLA kv_lora_rank {self.kv_lora_rank} + rope {self.qk_rope_head_dim}" if self.is_mla
                else f"GQA {self.num_attention_heads} q / {self.num_kv_heads} kv heads x {self.head_dim}")
        moe = (f"{self.num_moe_layers} MoE layers x {self.num_logical_experts} experts (top-{self.top_k}, "
               f"{self.num_shared_experts} shared, width {self.moe_intermediate_size})" if self.is_moe else "dense")
        return (f"{self.name}: {self.num_hidden_layers} layers, hidden {self.hidden_size}, {attn}; {moe}; "
                f"{self.total_params() / 1e9:.1f}B params")


# Architecture numbers from each model's published config.json (Hugging Face).
PRESETS: dict[str, ModelShape] = {
    "deepseek-v3": ModelShape(
        "DeepSeek-V3", num_hidden_layers=61, hidden_size=7168, vocab_size=129280,
        num_attention_heads=128, num_kv_heads=128, head_dim=128, intermediate_size=18432,
        num_dense_layers=3, num_logical_experts=256, moe_intermediate_size=2048, num_shared_experts=1,
        top_k=8, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128),
    "deepseek-v2-lite": ModelShape(
        "DeepSeek-V2-Lite", num_hidden_layers=27, hidden_size=2048, vocab_size=102400,
        num_attention_heads=16, num_kv_heads=16, head_dim=128, intermediate_size=10944,
        num_dense_layers=1, num_logical_experts=64, moe_intermediate_size=1408, num_shared_experts=2,
        top_k=6, kv_lora_rank=512, q_lora_rank=0, qk_rope_head_dim=64, v_head_dim=128),
    "kimi-k2": ModelShape(
        "Kimi-K2", num_hidden_layers=61, hidden_size=7168, vocab_size=163840,
        num_attention_heads=64, num_kv_heads=64, head_dim=128, intermediate_size=18432,
        num_dense_layers=1, num_logical_experts=384, moe_intermediate_size=2048, num_shared_experts=1,
        top_k=8, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128),
    "qwen3-235b-a22b": ModelShape(
        "Qwen3-235B-A22B", num_hidden_layers=94, hidden_size=4096, vocab_size=151936,
        num_attention_heads=64, num_kv_heads=4, head_dim=128, intermediate_size=12288,
        num_dense_layers=0, num_logical_experts=128, moe_intermediate_size=1536, num_shared_experts=0,
        top_k=8),
    "llama-3.1-70b": ModelShape(
        "Llama-3.1-70B", num_hidden_layers=80, hidden_size=8192, vocab_size=128256,
        num_attention_heads=64, num_kv_heads=8, head_dim=128, intermediate_size=28672),
}


def get_model(name: str) -> ModelShape:
    """A preset by name (case-insensitive; 'deepseek-r1' is DeepSeek-V3's shape)."""
    key = str(name).lower().replace("_", "-")
    key = {"deepseek-r1": "deepseek-v3", "qwen3-235b": "qwen3-235b-a22b", "llama-70b": "llama-3.1-70b",
           "llama3.1-70b": "llama-3.1-70b", "kimi-k2-instruct": "kimi-k2"}.get(key, key)
    if key not in PRESETS:
        raise EplbError(f"unknown model {name!r}: choose one of {', '.join(PRESETS)} (or give the numbers)")
    return PRESETS[key]


def kv_bytes_per_token(model: ModelShape, kv_dtype: str = "bf16") -> int:
    """KV-cache bytes one token takes over all layers of the model."""
    return _nbytes(model.kv_elements_per_token(), dtype_bits(kv_dtype))


def bytes_per_expert(model: ModelShape, dtype: str = "fp8") -> int:
    """Bytes of one routed expert in one layer."""
    if not model.is_moe:
        raise EplbError(f"{model.name} is a dense model: it has no experts to replicate")
    return _nbytes(model.expert_params(), dtype_bits(dtype))


@dataclass(frozen=True)
class Deployment:
    """Where and how the model is served."""

    num_gpus: int
    """G: GPUs the model is spread over (expert-parallel ranks)."""
    gpu_memory: int
    """Bytes of memory per GPU (as nvidia-smi reports the total)."""
    context: int
    """Tokens of KV cache per sequence (prompt + output)."""
    concurrency: int | None = None
    """Sequences in flight over the whole deployment; None = find the most that fit."""
    weight_dtype: str = "fp8"
    """dtype of the non-expert weights (and of the experts unless expert_dtype is given)."""
    expert_dtype: str | None = None
    """dtype of the routed experts (None = weight_dtype)."""
    kv_dtype: str = "bf16"
    """dtype of the KV cache."""
    attention: str = "dp"
    """"dp": non-expert weights replicated, each sequence's KV on one GPU; "tp": non-expert
    weights split over GPUs, KV split by head (MLA: replicated)."""
    memory_utilization: float = 0.9
    """Share of GPU memory the engine may use for weights and KV (rest: context, activations)."""

    def __post_init__(self) -> None:
        for name in ("num_gpus", "gpu_memory", "context"):
            object.__setattr__(self, name, positive_integer(name, getattr(self, name)))
        if self.concurrency is not None:
            object.__setattr__(self, "concurrency", positive_integer("concurrency", self.concurrency))
        for name in ("weight_dtype", "kv_dtype"):
            dtype_bits(getattr(self, name))
        if self.expert_dtype is not None:
            dtype_bits(self.expert_dtype)
        if self.attention not in ATTENTION_MODES:
            raise EplbError(f"attention must be one of {', '.join(ATTENTION_MODES)}, got {self.attention!r}")
        object.__setattr__(self, "memory_utilization", fraction("memory_utilization", self.memory_utilization))


@dataclass(frozen=True)
class CapacityReport:
    """Memory of one GPU (the busiest) for a model on a deployment, and what fits."""

    model: ModelShape
    deployment: Deployment
    kv_bytes_per_token: int
    """KV cache of one token over all layers."""
    kv_bytes_per_sequence_per_gpu: float
    """KV one sequence of `context` tokens puts on a GPU that holds it (tp: its share)."""
    bytes_per_expert: int
    """One routed expert in one layer (0 for dense models)."""
    bytes_per_slot: int
    """One slot per GPU = one expert in every MoE layer: the cost of one more slot per GPU."""
    dense_bytes_per_gpu: int
    """Non-expert weights on each GPU."""
    base_slots_per_gpu: int
    """ceil(E / G): slots needed to hold every expert once."""
    usable_bytes: int
    """GPU memory x memory_utilization."""
    redundant_per_gpu: int | None
    """Redundant slots per GPU: chosen, or the most that fit next to `concurrency` (None:
    dense model, or nothing fits)."""
    concurrency: int
    """Sequences the deployment serves: given, or the most that fit with redundant_per_gpu."""
    kv_bytes_per_gpu: float
    """KV cache on the busiest GPU at `concurrency`."""
    expert_bytes_per_gpu: int
    """Routed-expert weights per GPU at redundant_per_gpu."""
    free_bytes_per_gpu: float
    """usable - dense - experts - KV (negative: does not fit)."""
    tradeoff: list = field(default_factory=list)
    """(redundant slots per GPU, most sequences that fit) for a few choices."""

    @property
    def fits(self) -> bool:
        return self.free_bytes_per_gpu >= 0 and self.concurrency >= 1

    @property
    def slots_per_gpu(self) -> int | None:
        return None if self.redundant_per_gpu is None else self.base_slots_per_gpu + self.redundant_per_gpu

    def to_dict(self) -> dict[str, Any]:
        d = self.deployment
        return {
            "model": self.model.name, "total_params": self.model.total_params(),
            "num_moe_layers": self.model.num_moe_layers, "num_experts": self.model.num_logical_experts,
            "gpus": d.num_gpus, "gpu_memory_bytes": d.gpu_memory, "context": d.context,
            "weight_dtype": d.weight_dtype, "expert_dtype": d.expert_dtype or d.weight_dtype,
            "kv_dtype": d.kv_dtype, "attention": d.attention, "memory_utilization": d.memory_utilization,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes_per_sequence_per_gpu": self.kv_bytes_per_sequence_per_gpu,
            "bytes_per_expert": self.bytes_per_expert, "bytes_per_slot": self.bytes_per_slot,
            "dense_bytes_per_gpu": self.dense_bytes_per_gpu, "usable_bytes": self.usable_bytes,
            "base_slots_per_gpu": self.base_slots_per_gpu, "redundant_per_gpu": self.redundant_per_gpu,
            "slots_per_gpu": self.slots_per_gpu,
            "redundant_total": None if self.redundant_per_gpu is None else self.redundant_total,
            "concurrency": self.concurrency, "kv_bytes_per_gpu": self.kv_bytes_per_gpu,
            "expert_bytes_per_gpu": self.expert_bytes_per_gpu, "free_bytes_per_gpu": self.free_bytes_per_gpu,
            "fits": self.fits,
            "tradeoff": [{"redundant_per_gpu": r, "max_concurrency": c} for r, c in self.tradeoff],
        }

    @property
    def redundant_total(self) -> int:
        """R = P - E over all GPUs (includes padding when G does not divide E)."""
        return self.deployment.num_gpus * (self.slots_per_gpu or 0) - self.model.num_logical_experts


def _kv_split(model: ModelShape, dep: Deployment) -> float:
    """How many ways tensor-parallel attention splits one sequence's KV, as the busiest GPU
    sees it (1 = replicated): KV heads go to GPUs whole, so the busiest holds
    ceil(kv_heads / G) of them (G = 3 with 8 KV heads: 3 of 8, not a third)."""
    if dep.attention == "dp" or model.is_mla:
        return 1
    return model.num_kv_heads / -(-model.num_kv_heads // dep.num_gpus)


def _kv_per_gpu(model: ModelShape, dep: Deployment, kv_seq: float, concurrency: int) -> float:
    if dep.attention == "dp":
        return -(-concurrency // dep.num_gpus) * kv_seq
    return concurrency * kv_seq


def _max_concurrency(model: ModelShape, dep: Deployment, budget: float, kv_seq: float) -> int:
    """Most sequences whose KV fits in `budget` bytes on the busiest GPU."""
    if budget < kv_seq:
        return 0
    per_gpu = int(budget // kv_seq)
    return per_gpu * dep.num_gpus if dep.attention == "dp" else per_gpu


def plan_capacity(model: ModelShape, deployment: Deployment, *, redundant_per_gpu: int | None = None,
                  tradeoff_rows: int = 6) -> CapacityReport:
    """What fits on each GPU: redundant slots next to `concurrency`, or sequences next to a
    chosen `redundant_per_gpu` (give at most one of the two unknowns; with neither, the
    redundancy defaults to 0 and the concurrency that fits is reported)."""
    dep = deployment
    G, E = dep.num_gpus, model.num_logical_experts
    if redundant_per_gpu is not None:
        redundant_per_gpu = whole_number("redundant slots per GPU", redundant_per_gpu, 0)
        if not model.is_moe:
            raise EplbError(f"{model.name} is a dense model: redundant expert slots do not apply")
    expert_dtype = dep.expert_dtype or dep.weight_dtype
    kvt = kv_bytes_per_token(model, dep.kv_dtype)
    kv_seq = dep.context * kvt / _kv_split(model, dep)
    dense_all = _nbytes(model.dense_params(), dtype_bits(dep.weight_dtype))
    dense = dense_all if dep.attention == "dp" else -(-dense_all // G)
    usable = int(dep.gpu_memory * dep.memory_utilization)
    if model.is_moe:
        per_expert = bytes_per_expert(model, expert_dtype)
        per_slot = per_expert * model.num_moe_layers
        base = -(-E // G)
        max_redundant = E - base  # a GPU never needs two replicas of one expert: S <= E
    else:
        per_expert = per_slot = base = max_redundant = 0

    def experts_at(r: int) -> int:
        return (base + r) * per_slot

    def concurrency_at(r: int) -> int:
        return _max_concurrency(model, dep, usable - dense - experts_at(r), kv_seq)

    if dep.concurrency is not None and redundant_per_gpu is None and model.is_moe:
        kv_gpu = _kv_per_gpu(model, dep, kv_seq, dep.concurrency)
        room = usable - dense - experts_at(0) - kv_gpu
        fit = int(room // per_slot) if room >= 0 else None
        r = None if fit is None else min(fit, max_redundant)
        concurrency = dep.concurrency
    else:
        r = redundant_per_gpu if model.is_moe else None
        if r is None and model.is_moe:
            r = 0
        if r is not None and r > max_redundant:
            raise EplbError(f"{r} redundant slots per GPU give {base + r} slots per GPU, more than the {E} "
                            f"experts of {model.name}: use at most {max_redundant}")
        concurrency = dep.concurrency if dep.concurrency is not None else concurrency_at(r or 0)
        kv_gpu = _kv_per_gpu(model, dep, kv_seq, concurrency)
    r_eff = r or 0
    free = usable - dense - experts_at(r_eff) - kv_gpu
    rows = []
    if model.is_moe:
        start = max(0, (r_eff if r is not None else 0) - tradeoff_rows // 2)
        for rr in range(start, min(max_redundant, start + tradeoff_rows - 1) + 1):
            rows.append((rr, concurrency_at(rr)))
    return CapacityReport(
        model=model, deployment=dep, kv_bytes_per_token=kvt, kv_bytes_per_sequence_per_gpu=kv_seq,
        bytes_per_expert=per_expert, bytes_per_slot=per_slot, dense_bytes_per_gpu=dense,
        base_slots_per_gpu=base, usable_bytes=usable, redundant_per_gpu=r, concurrency=concurrency,
        kv_bytes_per_gpu=kv_gpu, expert_bytes_per_gpu=experts_at(r_eff), free_bytes_per_gpu=free,
        tradeoff=rows,
    )


def auto_slots_per_gpu(model: ModelShape, deployment: Deployment, num_logical_experts: int) -> CapacityReport:
    """The capacity report behind `eplb plan --slots-per-gpu auto`: the most slots per GPU
    that fit next to the deployment's concurrency; errors when none fit or E disagrees."""
    if deployment.concurrency is None:
        raise EplbError("--slots-per-gpu auto needs --concurrency (sequences in flight) to size the KV cache")
    if not model.is_moe:
        raise EplbError(f"{model.name} is a dense model: it has no experts to place")
    if model.num_logical_experts != num_logical_experts:
        raise EplbError(f"model {model.name} has {model.num_logical_experts} experts but the trace has "
                        f"{num_logical_experts}: pick the model the trace was recorded from")
    rep = plan_capacity(model, deployment)
    if rep.redundant_per_gpu is None:
        need = -rep.free_bytes_per_gpu
        raise EplbError(
            f"{model.name} on {deployment.num_gpus} GPUs of {gib(deployment.gpu_memory):.1f} GiB does not fit "
            f"{deployment.concurrency} sequences x {deployment.context} tokens even without redundant experts "
            f"({gib(need):.2f} GiB short per GPU): lower --concurrency or --context, or add GPUs"
        )
    return rep


def with_overrides(model: ModelShape, **numbers: int | None) -> ModelShape:
    """A preset with some numbers replaced (None values are ignored)."""
    changes = {k: v for k, v in numbers.items() if v is not None}
    return replace(model, **changes) if changes else model
