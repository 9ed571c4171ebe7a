"""Hardware cost model: modeled MoE step time of a placement, per layer and GPU.

Legend: L = MoE layers, E = logical experts, G = GPUs, N = nodes, S = slots per GPU,
P = G x S physical slots, B = tokens in one step's batch (over the whole expert-parallel
group), K = experts per token (top-k), D = model width, F = expert width.

Per layer and step, on each GPU (docs/cost-model.md has the derivation and the sources):
- routed experts: every replica that gets n > 0 rows costs
  `overhead + max(n x 6DF / peak FLOP/s, (3DF x weight bytes + n x row bytes) / HBM bandwidth)`
  (a roofline: SwiGLU's three D x F matrices, streamed once per active replica). Decode
  batches are memory-bound (the count of *active* replicas sets the time), prefill batches
  compute-bound (tokens set it).
- dispatch and combine: a token's hidden state goes once to each GPU other than its own that
  holds one of its chosen replicas (DeepEP-style dispatch), and its partial result comes
  back once from each (combine); bytes split into intra-node (NVLink) and inter-node
  (RDMA). A phase takes `latency + max(intra bytes / NVLink, inter bytes / NIC)`, bytes
  being the larger of what the GPU sends and receives. Tokens sit on GPU b % G (attention is
  data-parallel). Which tokens share a GPU is known exactly from per-token traces; from
  count traces it is the expectation under independence (a token picks each expert
  independently of its other picks).
- layer time: all-to-all is a barrier, so without overlap it is
  `max_g dispatch + max_g experts + max_g combine`; with `overlap=True` (two micro-batches,
  communication hidden under computation) `max(max_g experts, max_g dispatch + max_g combine)`.
A second copy of an expert on the same GPU is counted with the first (an engine would run
one GEMM for both). Step time = the sum over layers (MoE layers only: attention, dense
layers and shared experts are the same for every placement and are not modeled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from eplb.core.hardware import Hardware, get_hardware
from eplb.core.placement import Placement
from eplb.core.topology import Topology
from eplb.errors import EplbError, a_name, is_whole
from eplb.stats.capacity import DTYPE_BITS, ModelShape, get_model

PHASES = ("decode", "prefill")
PHASE_TOKENS_PER_GPU = {"decode": 128, "prefill": 4096}
"""Default batch per GPU when none is given: DeepEP's benchmark settings (128 tokens per rank
for its low-latency decode kernels, 4096 per rank for its prefill kernels)."""


def _bytes(dtype: str) -> float:
    if dtype not in DTYPE_BITS:
        raise EplbError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPE_BITS)}")
    return DTYPE_BITS[dtype] / 8


@dataclass(frozen=True)
class CostModel:
    """A model's expert shape on one kind of hardware, and how the engine runs it."""

    model: ModelShape
    """Shapes (hidden size, expert width, top-k, experts) from eplb.stats.capacity's presets."""
    hardware: Hardware
    """Peak numbers per GPU (eplb.core.hardware)."""
    expert_dtype: str = "fp8"
    """dtype of the routed experts' weights and of their GEMMs (DeepSeek-V3 ships fp8)."""
    dispatch_dtype: str = "fp8"
    """dtype of hidden states sent in dispatch (DeepEP dispatches fp8)."""
    combine_dtype: str = "bf16"
    """dtype of expert outputs sent back in combine (DeepEP combines bf16)."""
    overlap: bool = False
    """Communication hidden under computation (two-micro-batch overlap)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelShape) or not self.model.is_moe:
            raise EplbError(f"cost model needs an MoE model shape, got {getattr(self.model, 'name', self.model)!r}")
        if not isinstance(self.hardware, Hardware):
            raise EplbError(f"cost model needs a Hardware profile, got {type(self.hardware).__name__}")
        for name in ("expert_dtype", "dispatch_dtype", "combine_dtype"):
            _bytes(getattr(self, name))
        self.hardware.flops(self.expert_dtype)  # refuse a dtype the profile has no figure for
        if not isinstance(self.overlap, (bool, np.bool_)):
            raise EplbError(f"overlap must be true or false, got {self.overlap!r}")

    # Constants of one replica ------------------------------------------------------------------

    @property
    def weight_bytes(self) -> float:
        """One expert's three matrices."""
        return self.model.expert_params() * _bytes(self.expert_dtype)

    @property
    def flops_per_row(self) -> float:
        """FLOPs of one (token, expert) row: 2 x 3 x D x F."""
        return 2.0 * self.model.expert_params()

    @property
    def row_bytes(self) -> float:
        """Activation bytes one row moves through HBM: its input and its output."""
        D = self.model.hidden_size
        return D * (_bytes(self.dispatch_dtype) + _bytes(self.combine_dtype))

    def replica_seconds(self, rows) -> np.ndarray:
        """Time of replicas with `rows` rows each (any shape; 0 rows cost nothing)."""
        n = np.asarray(rows, dtype=np.float64)
        hw = self.hardware
        compute = n * (self.flops_per_row / hw.flops(self.expert_dtype))
        memory = (self.weight_bytes + n * self.row_bytes) / hw.hbm_bytes_per_s
        return np.where(n > 0, hw.expert_overhead_s + np.maximum(compute, memory), 0.0)

    def knee_rows(self) -> float:
        """Rows above which one replica is compute-bound (the roofline's ridge)."""
        hw = self.hardware
        slope = self.flops_per_row / hw.flops(self.expert_dtype) - self.row_bytes / hw.hbm_bytes_per_s
        return float("inf") if slope <= 0 else self.weight_bytes / hw.hbm_bytes_per_s / slope

    def check_placement(self, placement: Placement) -> None:
        """Refuse a placement of another model, naming both shapes."""
        E = self.model.num_logical_experts
        L = self.model.num_moe_layers
        if placement.num_logical_experts != E:
            raise EplbError(f"the placement has {placement.num_layers} layers x {placement.num_logical_experts} "
                            f"experts but {self.model.name} has {L} MoE layers x {E} experts: pick the model the "
                            f"placement was planned for")

    def describe(self) -> str:
        hw = self.hardware
        return (f"{self.model.name} experts ({self.expert_dtype}, {self.weight_bytes / 2**20:.1f} MiB each) on "
                f"{hw.name}: {_rate(hw.flops(self.expert_dtype), 'FLOP/s')}, HBM {_rate(hw.hbm_bytes_per_s, 'B/s')}, "
                f"NVLink {_rate(hw.nvlink_bytes_per_s, 'B/s')}, inter-node {_rate(hw.internode_bytes_per_s, 'B/s')} "
                f"per GPU; memory-bound below {self.knee_rows():,.3g} rows per replica"
                + ("; communication overlapped" if self.overlap else ""))


def _rate(v: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if v >= scale:
            return f"{v / scale:,.3g} {prefix}{unit}"
    return f"{v:,.3g} {unit}"


def cost_model(model: str | ModelShape = "deepseek-v3", hardware: str | Hardware = "h200",
               **settings) -> CostModel:
    """A CostModel from a preset model name and a hardware name or profile file."""
    shape = model if isinstance(model, ModelShape) else get_model(model)
    return CostModel(shape, get_hardware(hardware), **settings)


def default_batch_tokens(phase: str, num_gpus: int) -> int:
    """Tokens per step over the group when none is given: PHASE_TOKENS_PER_GPU x G."""
    if phase not in PHASES:
        raise EplbError(f"unknown phase {phase!r}: choose one of {', '.join(PHASES)}")
    return PHASE_TOKENS_PER_GPU[phase] * int(num_gpus)


# Rows per slot ---------------------------------------------------------------------------------


def first_copy_LP(placement: Placement) -> np.ndarray:
    """Flat index (l * P + p) of the first slot on the same GPU holding the same expert, [L, P]."""
    L, P = placement.phy2log_LP.shape
    G, S = placement.num_gpus, placement.slots_per_gpu
    phy_LGS = placement.phy2log_LP.reshape(L, G, S)
    same_LGSS = phy_LGS[:, :, :, None] == phy_LGS[:, :, None, :]
    first_LGS = same_LGSS.argmax(axis=3) + (np.arange(G) * S)[None, :, None]
    return first_LGS.reshape(L, P) + (np.arange(L) * P)[:, None]


def slot_rows(placement: Placement, counts_LE, weights_LP: np.ndarray | None = None) -> np.ndarray:
    """Rows each slot computes, float64 [L, P], when `weights_LP` splits `counts_LE` [L, E].

    Whole-number counts are split into whole rows by largest remainder (what an engine does with
    a batch: 3 rows over 2 replicas are 2 + 1, one row wakes one replica); other counts are
    split as they are. Rows of a second copy of an expert on one GPU go to the first copy.
    """
    L, P = placement.phy2log_LP.shape
    counts = np.asarray(counts_LE, dtype=np.float64)
    if counts.shape != (L, placement.num_logical_experts):
        raise EplbError(f"counts have shape {counts.shape}, but the placement needs "
                        f"{(L, placement.num_logical_experts)} [layers, logical experts]")
    w_LP = placement.replica_weights() if weights_LP is None else np.asarray(weights_LP, dtype=np.float64)
    share_LP = np.take_along_axis(counts, placement.phy2log_LP, axis=1) * w_LP
    if np.array_equal(counts, np.floor(counts)):
        share_LP = _round_per_expert(placement, counts, share_LP)
    return np.bincount(first_copy_LP(placement).ravel(), weights=share_LP.ravel(), minlength=L * P).reshape(L, P)


def _round_per_expert(placement: Placement, counts_LE: np.ndarray, share_LP: np.ndarray) -> np.ndarray:
    """Largest-remainder rounding of each expert's shares to whole rows summing to its count."""
    L, P = share_LP.shape
    floor_LP = np.floor(share_LP + 1e-9)
    rem_LP = share_LP - floor_LP
    rows = np.arange(L)[:, None]
    short_LE = counts_LE.copy()
    np.add.at(short_LE, (np.broadcast_to(rows, (L, P)), placement.phy2log_LP), -floor_LP)
    # Rank of each slot's remainder among its expert's replicas (largest first, then slot order).
    order_LP = np.lexsort((np.broadcast_to(np.arange(P), (L, P)), -rem_LP, placement.phy2log_LP), axis=-1)
    e_sorted = np.take_along_axis(placement.phy2log_LP, order_LP, axis=1)
    first_LE = np.cumsum(placement.replica_count_LE, axis=1) - placement.replica_count_LE
    rank_sorted = np.arange(P)[None, :] - np.take_along_axis(first_LE, e_sorted, axis=1)
    rank_LP = np.empty_like(rank_sorted)
    np.put_along_axis(rank_LP, order_LP, rank_sorted, axis=1)
    short_LP = np.take_along_axis(np.rint(short_LE), placement.phy2log_LP, axis=1)
    return floor_LP + (rank_LP < short_LP)


# Step time --------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class StepCost:
    """Modeled time of one step's MoE layers on one placement."""

    compute_s_LG: np.ndarray
    """Routed-expert time per layer and GPU, seconds [L, G]."""
    dispatch_s_LG: np.ndarray
    """Dispatch time per layer and GPU, seconds [L, G]."""
    combine_s_LG: np.ndarray
    """Combine time per layer and GPU, seconds [L, G]."""
    layer_s_L: np.ndarray
    """Time of each MoE layer (barriers and overlap applied), seconds [L]."""
    intra_bytes_per_token_L: np.ndarray
    """Dispatch + combine bytes per token over NVLink, per layer [L]."""
    inter_bytes_per_token_L: np.ndarray
    """Dispatch + combine bytes per token between nodes, per layer [L]."""
    rows_LG: np.ndarray
    """Rows each GPU computes, [L, G]."""
    active_LG: np.ndarray
    """Active replicas (slots with rows) per GPU, [L, G]."""
    batch_tokens: int
    """Tokens in the step's batch."""

    @property
    def seconds(self) -> float:
        """The step's MoE time: all layers."""
        return float(self.layer_s_L.sum())

    @property
    def straggler_time(self) -> float:
        """Busiest GPU's expert time / mean GPU's, summed over layers (1 = balanced in time)."""
        mean = self.compute_s_LG.mean(axis=1).sum()
        return float(self.compute_s_LG.max(axis=1).sum() / mean) if mean > 0 else 1.0

    @property
    def straggler_tokens(self) -> float:
        """Busiest GPU's rows / mean GPU's, summed over layers."""
        mean = self.rows_LG.mean(axis=1).sum()
        return float(self.rows_LG.max(axis=1).sum() / mean) if mean > 0 else 1.0

    @property
    def busiest_compute_seconds(self) -> float:
        """Sum over layers of the busiest GPU's expert time (what the experts add to the step)."""
        return float(self.compute_s_LG.max(axis=1).sum())


def step_cost(cost: CostModel, placement: Placement, rows_LP: np.ndarray, batch_tokens: int,
              pair_slot_BLK: np.ndarray | None = None) -> StepCost:
    """Modeled time of one step, given the rows of each slot [L, P] (see `slot_rows`).

    pair_slot_BLK: the slot each (token, layer, pick) row went to (from per-token traces,
    `assign_pairs`); without it the all-to-all bytes are the expectation under independence.
    """
    L, P = rows_LP.shape
    G, S, N = placement.num_gpus, placement.slots_per_gpu, placement.num_nodes
    compute_LG = cost.replica_seconds(rows_LP).reshape(L, G, S).sum(axis=2)
    rows_LG = rows_LP.reshape(L, G, S).sum(axis=2)
    active_LG = (rows_LP > 0).reshape(L, G, S).sum(axis=2)
    traffic = (_traffic_from_hits(_expected_hits(rows_LP, G, batch_tokens), G, N, batch_tokens)
               if pair_slot_BLK is None else _traffic_from_pairs(pair_slot_BLK, S, G, N))
    dispatch_LG, combine_LG, layer_L = _layer_seconds(cost, compute_LG, traffic)
    per_token = cost.model.hidden_size * (_bytes(cost.dispatch_dtype) + _bytes(cost.combine_dtype))
    per_token /= max(batch_tokens, 1)
    return StepCost(compute_LG, dispatch_LG, combine_LG, layer_L, traffic[0].sum(axis=1) * per_token,
                    traffic[2].sum(axis=1) * per_token, rows_LG, active_LG, int(batch_tokens))


def expected_layer_seconds(cost: CostModel, placement: Placement, rows_LP: np.ndarray, batch_tokens: int,
                           compute_LG: np.ndarray) -> np.ndarray:
    """`step_cost(...).layer_s_L` alone, [L], for a rule that has summed each GPU's expert seconds
    (compute_LG [L, G]); rows [L, P] may stack several splits of one batch (2L rows for two)."""
    G, N = placement.num_gpus, placement.num_nodes
    traffic = _traffic_from_hits(_expected_hits(rows_LP, G, batch_tokens), G, N, batch_tokens)
    return _layer_seconds(cost, compute_LG, traffic)[2]


def _layer_seconds(cost: CostModel, compute_LG: np.ndarray, traffic):
    """Dispatch and combine seconds [L, G] from the tokens each GPU sends and receives (intra-
    and inter-node), and each layer's time [L]: a barrier, or communication under the experts."""
    hw, D = cost.hardware, cost.model.hidden_size
    intra_LG, inter_LG = np.maximum(traffic[0], traffic[1]), np.maximum(traffic[2], traffic[3])
    dispatch_LG, combine_LG = (hw.a2a_latency_s + np.maximum(intra_LG * (D * _bytes(d)) / hw.nvlink_bytes_per_s,
                                                             inter_LG * (D * _bytes(d)) / hw.internode_bytes_per_s)
                               for d in (cost.dispatch_dtype, cost.combine_dtype))
    comm_L, comp_L = dispatch_LG.max(axis=1) + combine_LG.max(axis=1), compute_LG.max(axis=1)
    return dispatch_LG, combine_LG, np.maximum(comp_L, comm_L) if cost.overlap else comp_L + comm_L


def ideal_layer_seconds(cost: CostModel, counts_LE, step: StepCost) -> np.ndarray:
    """Perfect balance, the physical limit per layer [L]: every expert's rows on one replica
    (its weights streamed once), that work spread evenly over the GPUs, and the all-to-all
    of `step` spread evenly too."""
    counts = np.asarray(counts_LE, dtype=np.float64)
    G = step.compute_s_LG.shape[1]
    comp_L = cost.replica_seconds(counts).sum(axis=1) / G
    comm_L = step.dispatch_s_LG.mean(axis=1) + step.combine_s_LG.mean(axis=1)
    return np.maximum(comp_L, comm_L) if cost.overlap else comp_L + comm_L


def _expected_hits(rows_LP: np.ndarray, num_gpus: int, batch_tokens: int) -> np.ndarray:
    """P(a token sends to GPU g), [L, G], if its picks are independent: 1 - prod over g's
    slots of (1 - rows / B) (a token takes one row of an expert at most)."""
    L, P = rows_LP.shape
    log_miss_LGS = np.log1p(np.clip(rows_LP / -max(batch_tokens, 1), -(1.0 - 1e-12), 0.0)).reshape(L, num_gpus, -1)
    # A product with ones sums the short slot axis several times faster than .sum(axis=2).
    return -np.expm1(log_miss_LGS @ np.ones(P // num_gpus))


def _traffic_from_hits(hit_LG: np.ndarray, G: int, N: int, B: int):
    """Tokens each GPU sends and receives, intra- and inter-node, from hit probabilities."""
    per_node = G // N
    node_G = np.arange(G) // per_node
    same_GG = node_G[:, None] == node_G[None, :]
    np.fill_diagonal(same_GG, False)
    other_GG = node_G[:, None] != node_G[None, :]
    src = B / G  # tokens on each GPU
    out_intra = src * hit_LG @ same_GG.T.astype(float)
    out_inter = src * hit_LG @ other_GG.T.astype(float)
    in_intra = src * (per_node - 1) * hit_LG
    in_inter = src * (G - per_node) * hit_LG
    return out_intra, in_intra, out_inter, in_inter


def _traffic_from_pairs(pair_slot_BLK: np.ndarray, S: int, G: int, N: int):
    """Tokens each GPU sends and receives, from the slot of every (token, layer, pick) row."""
    B, L, K = pair_slot_BLK.shape
    per_node = G // N
    dest_BLK = np.sort(pair_slot_BLK // S, axis=2)
    first_BLK = np.ones_like(dest_BLK, dtype=bool)
    first_BLK[:, :, 1:] = dest_BLK[:, :, 1:] != dest_BLK[:, :, :-1]    # each destination GPU once
    src_B = np.arange(B) % G
    src_BLK = np.broadcast_to(src_B[:, None, None], dest_BLK.shape)
    send = first_BLK & (dest_BLK != src_BLK)
    inter = send & (dest_BLK // per_node != src_BLK // per_node)
    intra = send & ~inter
    layer_BLK = np.broadcast_to(np.arange(L)[None, :, None], dest_BLK.shape)

    def count(mask, gpu):
        return np.bincount((layer_BLK[mask] * G + gpu[mask]), minlength=L * G).reshape(L, G).astype(float)

    return count(intra, src_BLK), count(intra, dest_BLK), count(inter, src_BLK), count(inter, dest_BLK)


def assign_pairs(placement: Placement, topk_BLK: np.ndarray, rows_LP: np.ndarray) -> np.ndarray:
    """Slot of every (token, layer, pick) row, [B, L, K], when slot p takes rows_LP[l, p] rows
    of its expert: an expert's rows go, in token order, to its replicas in slot order in runs
    of their row counts (the engine's weighted split)."""
    B, L, K = topk_BLK.shape
    E, P = placement.num_logical_experts, placement.num_slots
    ids_LN = np.ascontiguousarray(np.transpose(topk_BLK, (1, 0, 2))).reshape(L, B * K).astype(np.int64)
    key = (np.arange(L)[:, None] * E + ids_LN).ravel()
    order = np.argsort(key, kind="stable")
    n_LE = np.bincount(key, minlength=L * E)
    start = np.cumsum(n_LE) - n_LE
    rank = np.empty(key.size, dtype=np.int64)
    rank[order] = np.arange(key.size) - start[key[order]]
    log2phy_LEX = placement.log2phy_LEX
    slots_NX = log2phy_LEX.reshape(L * E, -1)[key]                      # [L*B*K, X]
    rows_NX = np.where(slots_NX >= 0, rows_LP.ravel()[(np.arange(L).repeat(B * K) * P)[:, None]
                                                     + np.maximum(slots_NX, 0)], 0.0)
    cum_NX = np.cumsum(rows_NX, axis=1)
    x_N = (rank[:, None] >= cum_NX - 1e-9).sum(axis=1)
    x_N = np.minimum(x_N, (slots_NX >= 0).sum(axis=1) - 1)             # rounding slack: last replica
    slot_N = slots_NX[np.arange(key.size), x_N]
    return np.transpose(slot_N.reshape(L, B, K), (1, 0, 2))


def check_batch(batch_tokens) -> int:
    if not is_whole(batch_tokens) or batch_tokens < 1:
        raise EplbError(f"batch tokens must be a whole number >= 1, got {batch_tokens!r}")
    return int(batch_tokens)


# The time objective ------------------------------------------------------------------------------

OBJECTIVES = ("tokens", "time")


@dataclass(frozen=True)
class TimeObjective:
    """Plan for modeled per-GPU time instead of tokens (`plan(..., objective=TimeObjective(cost))`).

    Planners balance a load; for time each expert's load is its expected time per step on one
    replica, E[t(n)] for n ~ Binomial(B, p) rows (p = the share of tokens that pick it, B the
    batch): in decode that is about the chance the expert is woken at all times its weight
    stream, in prefill about its tokens times their FLOPs. A GPU's sum of load / replicas is
    then its expected time when a per-batch time dispatch (`eplb.dispatch.timed.TimeDispatch`)
    sends an expert's rows to one replica. The objective is linear in the load, so `ilp` takes
    it as it takes tokens.
    """

    cost: CostModel
    """Model shape and hardware."""
    batch_tokens: int | None = None
    """Tokens per step over the whole group; None = the phase's default per GPU x GPUs."""
    phase: str = "decode"
    """"decode" or "prefill": the regime (and default batch) planned for."""

    name = "time"

    def __post_init__(self) -> None:
        if not isinstance(self.cost, CostModel):
            raise EplbError(f"TimeObjective needs a CostModel (eplb.dispatch.cost.cost_model(model, hardware)), got "
                            f"{type(self.cost).__name__}")
        if self.phase not in PHASES:
            raise EplbError(f"unknown phase {self.phase!r}: choose one of {', '.join(PHASES)}")
        if self.batch_tokens is not None:
            object.__setattr__(self, "batch_tokens", check_batch(self.batch_tokens))

    def tokens_for(self, num_gpus: int) -> int:
        """The batch planned for on `num_gpus` GPUs."""
        return self.batch_tokens if self.batch_tokens is not None else default_batch_tokens(self.phase, num_gpus)

    def planning_load(self, load_LE, topology: Topology) -> np.ndarray:
        """Expected seconds per step of each expert on one replica of `topology`, [L, E] (or
        [T, L, E]): its compute, E[t(n)], plus the all-to-all its rows bring to the GPU that holds it.

        The all-to-all term is mean rows x one row's dispatch + combine bytes over the link its
        sources use, taken as spread evenly over the GPUs (1/G of them local, the rest of the
        node over NVLink, the other nodes over the inter-node link; the model runs the two links
        side by side, so the slower share counts). Without it, a batch of thousands of tokens,
        whose step is mostly all-to-all, is planned as if only weight streams mattered.
        """
        load = np.asarray(load_LE, dtype=np.float64)
        if load.shape[-1] != self.cost.model.num_logical_experts:
            raise EplbError(f"the trace has {load.shape[-2]} layers x {load.shape[-1]} experts but "
                            f"{self.cost.model.name} has {self.cost.model.num_moe_layers} MoE layers x "
                            f"{self.cost.model.num_logical_experts} experts: pick the model the trace was "
                            f"recorded from")
        flat = load.reshape(-1, load.shape[-1])
        B = self.tokens_for(topology.num_gpus)
        out = np.stack([expected_replica_seconds(self.cost, row[None], B)[0] for row in flat])
        total = flat.sum(axis=1, keepdims=True)
        rows = B * self.cost.model.top_k * flat / np.where(total > 0, total, 1.0)
        return (out + rows * row_link_seconds(self.cost, topology)).reshape(load.shape)

    def describe(self, num_gpus: int) -> dict:
        return {"objective": "time", "phase": self.phase, "batch_tokens": self.tokens_for(num_gpus),
                "model": self.cost.model.name, "hardware": self.cost.hardware.name,
                "expert_dtype": self.cost.expert_dtype}


def row_link_seconds(cost: CostModel, topology: Topology) -> float:
    """All-to-all seconds one row adds to the GPU of `topology` that receives it, its source GPU
    spread evenly (dispatch and combine; the intra- and inter-node links run side by side)."""
    b = cost.model.hidden_size * (_bytes(cost.dispatch_dtype) + _bytes(cost.combine_dtype))
    hw = cost.hardware
    num_gpus = topology.num_gpus
    per_node = num_gpus // topology.num_nodes
    intra = (per_node - 1) / num_gpus
    inter = (num_gpus - per_node) / num_gpus
    return b * max(intra / hw.nvlink_bytes_per_s, inter / hw.internode_bytes_per_s)


def check_objective(objective) -> str | TimeObjective:
    """"tokens", or a TimeObjective; "time" alone is refused (it needs a cost model)."""
    if isinstance(objective, TimeObjective):
        return objective
    a_name("objective", objective, OBJECTIVES)
    if objective == "tokens":
        return "tokens"
    if objective == "time":
        raise EplbError("objective 'time' needs a cost model: pass objective=eplb.dispatch.cost.TimeObjective("
                        "eplb.dispatch.cost.cost_model('deepseek-v3', 'h200')) "
                        "(CLI: --objective time --model M --hardware H)")
    raise EplbError(f"unknown objective {objective!r}: choose one of {', '.join(OBJECTIVES)} (time as a TimeObjective)")


_GRID = 256  # rows up to which E[t(n)] is summed exactly over the binomial law


def expected_replica_seconds(cost: CostModel, load_LE, batch_tokens: int) -> np.ndarray:
    """E[t(n)] per expert, [L, E], n ~ Binomial(B, p_e), p_e = K x load_e / sum of the layer.

    Exact over n = 0..256 where the law lives there (mean + 8 sd + 8 <= 256); beyond, t(mean)
    (t is linear in n on both sides of the roofline's ridge, so the two differ little).
    """
    load = np.asarray(load_LE, dtype=np.float64)
    B = check_batch(batch_tokens)
    K = cost.model.top_k
    total_L1 = load.sum(axis=1, keepdims=True)
    p = np.clip(np.where(total_L1 > 0, K * load / np.where(total_L1 > 0, total_L1, 1.0), 0.0), 0.0, 1.0)
    mean, sd = B * p, np.sqrt(B * p * (1 - p))
    out = cost.replica_seconds(mean)
    top = min(B, _GRID)
    exact = (mean + 8 * sd + 8 <= top) | (B <= _GRID)
    if exact.any():
        q = np.clip(p[exact], 1e-300, 1 - 1e-16)
        n = np.arange(top + 1, dtype=np.float64)
        log_choose = np.array([math.lgamma(B + 1) - math.lgamma(k + 1) - math.lgamma(B - k + 1)
                               for k in range(top + 1)])
        log_pmf = log_choose[None, :] + n[None, :] * np.log(q)[:, None] + (B - n)[None, :] * np.log1p(-q)[:, None]
        out[exact] = np.exp(log_pmf) @ cost.replica_seconds(n)
    return out
