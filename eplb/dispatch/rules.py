"""Weighted and dynamic dispatch: how each expert's tokens are split among its replicas.

Legend: L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU, P = G x S physical
slots, M = most replicated experts in one layer, X = most replicas of one expert.

A placement fixes *where* the replicas are; the dispatch weights `weights_LP` fix *how much*
of its expert's tokens each replica takes (the shares of one expert in one layer sum to 1).
An even split (1 / replicas) is what most engines do today. Two ways to do better:

- `optimal_weights(placement, load_LE)`: the exact weights for one known load: a linear
  program per layer (scipy's HiGHS) that minimises that layer's busiest GPU. Static weights
  like these fit the window they were computed on; on shifted traffic they help less.
- `resplit(placement, counts_LE)` (or a reusable `Resplitter(placement)`): a fast numpy rule,
  run per batch on the counts the router just produced, for all layers at once. It is block
  coordinate descent on the sum of squared GPU loads: each replicated expert in turn
  water-fills its tokens into its replicas' GPUs, lowest GPU first. The GPU-load vectors a
  placement can reach form the base polytope of a (contra-)polymatroid, whose minimum-norm
  point is lexicographically optimal (Fujishige), so the fixed point of this rule also
  minimises the busiest GPU: it converges to the LP optimum, and a few sweeps get close
  (`benchmarks/bench_dispatch.py` reports how close).

How a serving engine applies weights (per layer, after the router picked top-k experts):
1. For each (token, expert) pair, look up the expert's replicas `log2phy_LEX[l, e, :r_e]`
   and their shares `w = weights_LP[l, replicas]`.
2. Choose one replica per pair with probability w: either draw u ~ U[0, 1) and take the first
   replica whose cumulative share exceeds u (`searchsorted(cumsum(w), u)`), or, to hit the
   shares exactly per batch, give the expert's n pairs of this batch to its replicas in
   consecutive runs of round(n x w) pairs (largest-remainder rounding, so the runs sum to n).
3. Dispatch (all-to-all) to the GPU of the chosen slot, `slot // S`, as for an even split.
A weight of 0 means the replica takes no tokens (it still holds the weights, e.g. a second
copy on the same GPU). With dynamic re-splitting, step 2 uses `resplit` of this batch's own
per-expert counts (known right after routing, before the all-to-all) instead of the plan's
static weights; that needs the counts of all ranks (one small all-reduce of [L, E] ints)
or a per-rank re-split of the local counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from eplb.core.placement import Placement
from eplb.dispatch.resplit_score import fill_classes, layout, water_fill
from eplb.dispatch.sglang import SglangDynamic, SglangStatic
from eplb.dispatch.sglang_lp import SglangLp
from eplb.errors import EplbError


def _check_load(placement: Placement, load_LE) -> np.ndarray:
    load = np.asarray(load_LE, dtype=np.float64)
    if load.shape != (placement.num_layers, placement.num_logical_experts):
        raise EplbError(
            f"loads have shape {load.shape}, but the placement needs "
            f"{(placement.num_layers, placement.num_logical_experts)} [layers, logical experts]"
        )
    if not np.all(np.isfinite(load)) or (load.size and load.min() < 0):
        raise EplbError("loads must be finite and non-negative")
    return load


def _even_LP(placement: Placement) -> np.ndarray:
    return 1.0 / np.take_along_axis(placement.replica_count_LE, placement.phy2log_LP, axis=1)


def _shares_to_weights(placement: Placement, load_LE: np.ndarray, flow_LP: np.ndarray) -> np.ndarray:
    """Turn per-slot token amounts into shares that sum to exactly 1 per expert."""
    L, P = flow_LP.shape
    rows = np.arange(L)[:, None]
    flow_LP = np.maximum(flow_LP, 0.0)
    sums_LE = np.zeros((L, placement.num_logical_experts))
    np.add.at(sums_LE, (np.broadcast_to(rows, (L, P)), placement.phy2log_LP), flow_LP)
    sums_LP = np.take_along_axis(sums_LE, placement.phy2log_LP, axis=1)
    load_LP = np.take_along_axis(load_LE, placement.phy2log_LP, axis=1)
    # Experts with no tokens (or, defensively, no flow) keep the even split.
    ok_LP = (load_LP > 0) & (sums_LP > 0)
    return np.where(ok_LP, flow_LP / np.where(ok_LP, sums_LP, 1.0), _even_LP(placement))


def optimal_weights(placement: Placement, load_LE) -> np.ndarray:
    """Exact per-replica shares [L, P] minimising each layer's busiest GPU for `load_LE` [L, E].

    One LP per layer (scipy.optimize.linprog, HiGHS): variables f_p >= 0 (tokens of slot p)
    and t; minimise t subject to sum of f over an expert's replicas = its load, and sum of f
    over a GPU's slots <= t. Experts with zero load get an even split.
    """
    from scipy.optimize import linprog
    from scipy.sparse import csr_matrix

    load = _check_load(placement, load_LE)
    L, P = placement.phy2log_LP.shape
    E, G = placement.num_logical_experts, placement.num_gpus
    gpu_P = placement.gpu_of_slot()
    flow_LP = np.zeros((L, P))
    # GPU rows: sum_{p on g} f_p - t <= 0 (the same for every layer).
    a_ub = csr_matrix(
        (np.r_[np.ones(P), -np.ones(G)], (np.r_[gpu_P, np.arange(G)], np.r_[np.arange(P), np.full(G, P)])),
        shape=(G, P + 1),
    )
    cost = np.zeros(P + 1)
    cost[P] = 1.0
    for l in range(L):
        total = load[l].sum()
        if total <= 0:
            continue
        # Scale to mean GPU load 1 so HiGHS's absolute tolerances mean the same on every layer.
        scale = G / total
        a_eq = csr_matrix((np.ones(P), (placement.phy2log_LP[l], np.arange(P))), shape=(E, P + 1))
        res = linprog(cost, A_ub=a_ub, b_ub=np.zeros(G), A_eq=a_eq, b_eq=load[l] * scale,
                      bounds=(0, None), method="highs")
        if res.status != 0:
            # Always feasible and bounded (every expert has a replica), so this is a solver bug.
            raise RuntimeError(f"HiGHS failed on layer index {l}: {res.message}")
        flow_LP[l] = res.x[:P] / scale
    return _shares_to_weights(placement, load, flow_LP)


class Resplitter:
    """Per-batch re-splitting for one placement: build once, call per batch.

    `Resplitter(placement)(counts_LE, sweeps=8)` returns weights [L, P]: the water-filling of
    `eplb.dispatch.resplit_score` (the exact re-split score's upper bound) run on one window,
    every layer a row. Its `Layout` and colour classes are built here, once per placement. Only
    experts with replicas on >= 2 distinct GPUs can move tokens; a second copy of an expert on
    one GPU gets weight 0 (its tokens go to the expert's first slot there: same GPU load).
    `warm=True` starts from the previous call's shares, as a serving loop would (counts of
    consecutive batches are alike, so fewer sweeps are needed).
    """

    def __init__(self, placement: Placement):
        if not isinstance(placement, Placement):
            raise EplbError(f"Resplitter needs a Placement, got {type(placement).__name__}")
        self.placement = placement
        phy2log_LP = placement.phy2log_LP
        L, P = phy2log_LP.shape
        G, E = placement.num_gpus, placement.num_logical_experts
        self.layout = lay = layout(phy2log_LP, G)
        # Many rows: classes split by GPU span (narrow steps); few rows, as in the runtime shim's
        # one layer per call: one class per colour (fewer steps, each costs numpy's overhead).
        self._classes = fill_classes(lay.gpu_BRX, G, by_span=L >= 8)
        # Starting point: the engine's even split (1 / replicas), so that every sweep, which
        # never raises the busiest GPU it touches, stays at or below the even split.
        self.start_LP = _even_LP(placement)
        valid_LRX = lay.gpu_BRX < G
        rows_LRX = np.broadcast_to(np.arange(L)[:, None, None], lay.gpu_BRX.shape)
        self._valid_LRX = valid_LRX
        # Flat indices (the tables of fixed_loads / flexible_loads, without the sparse product):
        # each flexible expert's load in [L x E], with 0 for the padding experts ...
        self._flex_load = np.where(valid_LRX[:, :, 0], np.arange(L)[:, None] * E + lay.expert_BR, L * E)
        # ... the load of each expert on one GPU, then the GPU of every start term in [L x (G + 1)] ...
        rigid_l, rigid_p = np.divmod(lay.rigid_slot, P)
        self._rigid_load = rigid_l * E + phy2log_LP[rigid_l, rigid_p]
        self._gpu_flat = np.r_[rigid_l * (G + 1) + rigid_p // placement.slots_per_gpu,
                               (rows_LRX * (G + 1) + lay.gpu_BRX).ravel()]
        # ... and the flexible experts' first slot per GPU in [L x P].
        self._flex_slot = (rows_LRX * P + lay.slot_BRX)[valid_LRX]
        # For warm starts: every slot of a flexible expert -> its (layer, expert, GPU) cell, so
        # that the previous shares of all its copies on one GPU add up there.
        cell_LEG = np.full((L, E, G), -1, dtype=np.int64)
        cell_LEG[rows_LRX[valid_LRX], np.broadcast_to(lay.expert_BR[:, :, None], valid_LRX.shape)[valid_LRX],
                 lay.gpu_BRX[valid_LRX]] = np.flatnonzero(valid_LRX.ravel())
        cell_LP = cell_LEG[np.arange(L)[:, None], phy2log_LP, placement.gpu_of_slot()[None, :]].ravel()
        self._warm_slot = np.flatnonzero(cell_LP >= 0)
        self._warm_cell = cell_LP[self._warm_slot]
        self._last_LP: np.ndarray | None = None

    def __call__(self, counts_LE, sweeps: int = 8, warm: bool = False) -> np.ndarray:
        """Weights [L, P] for the loads `counts_LE` [L, E] after `sweeps` passes over the experts."""
        p, lay = self.placement, self.layout
        load = _check_load(p, counts_LE)
        if isinstance(sweeps, bool) or not isinstance(sweeps, (int, np.integer)) or sweeps < 0:
            raise EplbError(f"sweeps must be an integer >= 0, got {sweeps!r}")
        L, P = p.phy2log_LP.shape
        G = p.num_gpus
        # Step 1: the start state, the even split or the previous call's shares per GPU.
        load_1d = np.r_[load.ravel(), 0.0]
        flex = load_1d[self._flex_load][None]
        if warm and self._last_LP is not None:
            share_LRX = np.bincount(self._warm_cell, weights=self._last_LP.ravel()[self._warm_slot],
                                    minlength=lay.gpu_BRX.size).astype(np.float64).reshape(lay.gpu_BRX.shape)
        else:
            share_LRX = lay.even_BRX
        flow = flex[..., None] * share_LRX[None]
        gpu = np.bincount(self._gpu_flat, weights=np.r_[load_1d[self._rigid_load], flow.ravel()],
                          minlength=L * (G + 1)).astype(np.float64, copy=False).reshape(1, L, G + 1)
        gpu[0, :, G] = 0.0
        # Step 2: water-fill.
        water_fill(lay.gpu_BRX, flex, gpu, flow, int(sweeps), self._classes)
        # Step 3: shares per slot that sum to exactly 1 per expert; experts with no tokens keep the even split.
        w = np.zeros(L * P)
        w[lay.rigid_slot] = 1.0
        tot_LR1 = flow[0].sum(axis=2, keepdims=True)
        share_LRX = np.where(tot_LR1 > 0, flow[0] / np.where(tot_LR1 > 0, tot_LR1, 1.0), lay.even_BRX)
        w[self._flex_slot] = share_LRX[self._valid_LRX]
        load_LP = np.take_along_axis(load, p.phy2log_LP, axis=1)
        weights_LP = np.where(load_LP > 0, w.reshape(L, P), self.start_LP)
        self._last_LP = weights_LP
        return weights_LP


def resplit(placement: Placement, counts_LE, sweeps: int = 8) -> np.ndarray:
    """Fast per-batch shares [L, P] for observed counts [L, E] (see Resplitter; build it once
    per placement to skip the table set-up on every batch)."""
    return Resplitter(placement)(counts_LE, sweeps)


def max_gpu_load(placement: Placement, load_LE, weights_LP: np.ndarray | None = None) -> np.ndarray:
    """Busiest GPU's load per layer, [L], under the given shares (the plan's if None)."""
    return placement.gpu_loads(_check_load(placement, load_LE), weights_LP).max(axis=1)


# Dispatch rules ---------------------------------------------------------------------------------
# A rule is what an engine does with a placement: `rule.bind(placement)` once per placement
# (index tables, an engine's rank -> replica map), then `bound(counts_LE) -> weights_LP` per
# batch. Rules that ignore the batch (`per_batch = False`) accept counts_LE=None. Scoring,
# planning, backtests and replay take a rule, so every figure says which rule it used.

BoundRule = Callable[[np.ndarray | None], np.ndarray]
"""A rule bound to one placement: counts [L, E] (or None for rules that ignore them) -> shares [L, P]."""


class DispatchRule(Protocol):
    """How an engine splits each expert's tokens among its replicas."""

    name: str
    per_batch: bool
    """True when the shares depend on the batch's own counts (they must then be given)."""

    def bind(self, placement: Placement) -> BoundRule: ...


@dataclass(frozen=True)
class EvenSplit:
    """1 / replicas for every replica: vLLM's rearranged experts, SGLang's `dynamic` dispatch."""

    name = "even"
    per_batch = False

    def bind(self, placement: Placement) -> BoundRule:
        even_LP = _even_LP(placement)
        return lambda counts_LE=None: even_LP


@dataclass(frozen=True)
class PlanWeights:
    """The placement's own static shares (`dispatch_weights_LP`; even when it has none): eplb's runtime."""

    name = "plan"
    per_batch = False

    def bind(self, placement: Placement) -> BoundRule:
        w_LP = placement.replica_weights()
        return lambda counts_LE=None: w_LP


@dataclass(frozen=True)
class Resplit:
    """Per-batch re-split of each batch's own counts (`Resplitter`): eplb's runtime with resplit."""

    sweeps: int = 8
    name = "resplit"
    per_batch = True

    def bind(self, placement: Placement) -> BoundRule:
        rs = Resplitter(placement)
        return lambda counts_LE: rs(_need_counts(self, counts_LE), self.sweeps)


@dataclass(frozen=True)
class OptimalSplit:
    """The exact per-batch LP (`optimal_weights`): the best any split can do with this placement."""

    name = "optimal"
    per_batch = True

    def bind(self, placement: Placement) -> BoundRule:
        return lambda counts_LE: optimal_weights(placement, _need_counts(self, counts_LE))


def _need_counts(rule, counts_LE):
    if counts_LE is None:
        raise EplbError(f"dispatch rule {rule.name!r} splits each batch by its own counts: pass counts [L, E]")
    return counts_LE


RULES: dict[str, type] = {"even": EvenSplit, "plan": PlanWeights, "resplit": Resplit, "optimal": OptimalSplit,
                          "sglang-static": SglangStatic, "sglang-dynamic": SglangDynamic, "sglang-lp": SglangLp}
"""Dispatch rules by name (`get_rule` reads this table; engine rules are in `ENGINES`)."""

# Engines ----------------------------------------------------------------------------------------
# What each engine does with a placement, read from its source (docs/engines.md says where):
# - vLLM 0.33: each (token, expert) takes replica hash(token index) % replicas
#   (`eplb_map_to_physical_and_record`): an even split.
# - TensorRT-LLM: round-robin over the replicas in arrival order (`moeComputeRouteKernel`): even.
# - SGLang 0.5.23: `--ep-dispatch-algorithm static` (its default with `--init-expert-location`
#   and an all-to-all backend) or `dynamic`, see eplb.dispatch.sglang; or `lp`, a per-batch LP
#   over each replicated expert's slots, solved in five affine-scaling steps (eplb.dispatch.sglang_lp).
ENGINES: dict[str, dict[str, Callable[[], DispatchRule]]] = {
    "sglang": {"static": SglangStatic, "dynamic": SglangDynamic, "lp": SglangLp},
    "vllm": {"even": EvenSplit},
    "trtllm": {"even": EvenSplit},
}
"""engine -> dispatch mode -> rule; the first mode of each engine is its default."""


def engine_rule(engine: str, mode: str | None = None) -> DispatchRule:
    """The rule `engine` applies in dispatch `mode` (default: the engine's default mode)."""
    if engine not in ENGINES:
        raise EplbError(f"unknown engine {engine!r}: choose one of {', '.join(ENGINES)}")
    modes = ENGINES[engine]
    if mode is None:
        mode = next(iter(modes))
    if mode not in modes:
        if mode in ("resplit", "lp", "optimal"):
            raise EplbError(f"engine {engine!r} has no dispatch mode {mode!r}: it splits each expert's tokens evenly "
                            f"(modes: {', '.join(modes)}); to plan for a per-batch re-split serve with --engine sglang "
                            f"--dispatch lp, or drop --engine for eplb's own runtime (--dispatch resplit)")
        raise EplbError(f"engine {engine!r} has no dispatch mode {mode!r}: its modes are {', '.join(modes)}; give one "
                        f"of them")
    return modes[mode]()


def get_rule(rule: str | DispatchRule) -> DispatchRule:
    """A rule by name ("even", "plan", "resplit", "optimal", "sglang-static", ...), or the rule itself."""
    if isinstance(rule, str):
        if rule not in RULES:
            raise EplbError(f"unknown dispatch rule {rule!r}: choose one of {', '.join(sorted(RULES))}")
        return RULES[rule]()
    if not callable(getattr(rule, "bind", None)):
        raise EplbError(f"dispatch rule must be a name or have bind(placement), got {type(rule).__name__}")
    return rule


def rule_gpu_loads(rule: str | DispatchRule, placement: Placement, counts_LE) -> np.ndarray:
    """Tokens each GPU serves, [L, G], when `rule` dispatches `counts_LE` [L, E] on `placement`."""
    rule = get_rule(rule)
    load = _check_load(placement, counts_LE)
    return placement.gpu_loads(load, rule.bind(placement)(load))
