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
    """Per-batch re-splitting for one placement: build once (index tables), call per batch.

    `Resplitter(placement)(counts_LE, sweeps=8)` returns weights [L, P]. Only experts with
    replicas on >= 2 distinct GPUs can move tokens. They are coloured so that experts of one
    colour share no GPU: all experts of a colour (in every layer) water-fill in one numpy
    step, exactly as if done one after another. Tables are [L, C, K, X]: C colours, K experts
    per colour, X slots per expert (one per distinct GPU; a second copy on the same GPU gets
    weight 0, since it cannot change that GPU's load), padded with dummy slot P / GPU G.
    `warm=True` starts from the previous call's shares, as a serving loop would (counts of
    consecutive batches are alike, so fewer sweeps are needed).
    """

    def __init__(self, placement: Placement):
        if not isinstance(placement, Placement):
            raise EplbError(f"Resplitter needs a Placement, got {type(placement).__name__}")
        self.placement = placement
        phy2log_LP = placement.phy2log_LP
        L, P = phy2log_LP.shape
        G, S = placement.num_gpus, placement.slots_per_gpu
        gpu_P = placement.gpu_of_slot()
        rows = np.arange(L)[:, None]
        log2phy_LEX = placement.log2phy_LEX
        X = log2phy_LEX.shape[2]
        gpu_LEX = np.where(log2phy_LEX >= 0, gpu_P[np.maximum(log2phy_LEX, 0)], -1)
        # use: the first slot of an expert on each GPU it occupies.
        use_LEX = log2phy_LEX >= 0
        for j in range(1, X):
            dup = (gpu_LEX[:, :, :j] == gpu_LEX[:, :, j:j + 1]).any(axis=2)
            use_LEX[:, :, j] &= ~dup
        n_gpus_LE = use_LEX.sum(axis=2)
        # Starting point: the engine's even split (1 / replicas), so that every sweep, which
        # never raises the busiest GPU it touches, stays at or below the even split.
        self.start_LP = _even_LP(placement)
        # A second copy of an expert on one GPU takes no part in water-filling: its tokens are
        # moved to the expert's first slot on that GPU (same GPU load) before the sweeps, or
        # the sweeps would redistribute the expert's load while the copy kept its share too.
        # home_LP: that first slot, for every slot; None when no GPU holds two copies.
        self._home_flat = None
        phy2log_LGS = phy2log_LP.reshape(L, G, S)
        same_LGSS = phy2log_LGS[:, :, :, None] == phy2log_LGS[:, :, None, :]
        if (same_LGSS.sum(axis=3) > 1).any():
            home_LGS = same_LGSS.argmax(axis=3) + (np.arange(G) * S)[None, :, None]
            self._home_flat = (home_LGS.reshape(L, P) + (np.arange(L) * P)[:, None]).ravel()
        # Greedy colouring, per layer, of the experts that span >= 2 GPUs (most replicas first).
        groups: list[list[list[int]]] = []  # groups[l][c] = experts of colour c in layer l
        for l in range(L):
            multi = np.flatnonzero(n_gpus_LE[l] >= 2)
            multi = multi[np.argsort(-n_gpus_LE[l, multi], kind="stable")]
            colour_of_gpu: list[set[int]] = [set() for _ in range(G)]
            layer: list[list[int]] = []
            for e in multi:
                gpus = gpu_LEX[l, e][use_LEX[l, e]]
                taken = set().union(*(colour_of_gpu[g] for g in gpus))
                c = next(c for c in range(len(layer) + 1) if c not in taken)
                if c == len(layer):
                    layer.append([])
                layer[c].append(int(e))
                for g in gpus:
                    colour_of_gpu[g].add(c)
            groups.append(layer)
        C = max((len(layer) for layer in groups), default=0)
        K = max((len(c) for layer in groups for c in layer), default=0)
        self.expert_LCK = np.zeros((L, C, K), dtype=np.int64)
        self.valid_LCK = np.zeros((L, C, K), dtype=bool)
        for l, layer in enumerate(groups):
            for c, experts in enumerate(layer):
                self.expert_LCK[l, c, :len(experts)] = experts
                self.valid_LCK[l, c, :len(experts)] = True
        r4 = rows[:, :, None, None]
        e4 = self.expert_LCK[:, :, :, None]
        x4 = np.arange(X)
        self.use_LCKX = use_LEX[r4, e4, x4] & self.valid_LCK[:, :, :, None]
        self.slot_LCKX = np.where(self.use_LCKX, log2phy_LEX[r4, e4, x4], P)
        self.gpu_LCKX = np.where(self.use_LCKX, gpu_LEX[r4, e4, x4], G)
        self.num_gpus, self.slots_per_gpu = G, S
        self.C, self.X = C, X
        # Flat indices into the [L, P + 1] flow and [L, G + 1] GPU-load buffers, per colour.
        K = self.slot_LCKX.shape[2]
        layer = np.arange(L)[:, None, None, None]
        self._slot_C = (layer * (P + 1) + self.slot_LCKX).transpose(1, 0, 2, 3).reshape(C, L * K, X)
        self._gpu_C = (layer * (G + 1) + self.gpu_LCKX).transpose(1, 0, 2, 3).reshape(C, L * K, X)
        self._last_LP: np.ndarray | None = None

    def __call__(self, counts_LE, sweeps: int = 8, warm: bool = False) -> np.ndarray:
        """Weights [L, P] for the loads `counts_LE` [L, E] after `sweeps` passes over the experts."""
        p = self.placement
        load = _check_load(p, counts_LE)
        if isinstance(sweeps, bool) or not isinstance(sweeps, (int, np.integer)) or sweeps < 0:
            raise EplbError(f"sweeps must be an integer >= 0, got {sweeps!r}")
        L, P = p.phy2log_LP.shape
        G, S = self.num_gpus, self.slots_per_gpu
        start_LP = self._last_LP if (warm and self._last_LP is not None) else self.start_LP
        flow_LP = np.zeros((L, P + 1))
        flow_LP[:, :P] = np.take_along_axis(load, p.phy2log_LP, axis=1) * start_LP
        if self._home_flat is not None:
            flow_LP[:, :P] = np.bincount(self._home_flat, weights=flow_LP[:, :P].ravel(),
                                         minlength=L * P).reshape(L, P)
        gpu_LG = np.zeros((L, G + 1))
        gpu_LG[:, :G] = flow_LP[:, :P].reshape(L, G, S).sum(axis=2)
        if self.C and sweeps:
            flow, gpu = flow_LP.reshape(-1), gpu_LG.reshape(-1)
            # Rows are (layer, expert) pairs of one colour; unused entries: dummy slot/GPU, base +inf.
            C, K, X = self.expert_LCK.shape[1], self.expert_LCK.shape[2], self.X
            load_CR = np.take_along_axis(load, self.expert_LCK.reshape(L, -1), axis=1).reshape(
                L, C, K).transpose(1, 0, 2).reshape(C, L * K)
            pad_CRX = np.where(self.use_LCKX, 0.0, np.inf).transpose(1, 0, 2, 3).reshape(C, L * K, X)
            ks = np.arange(1, self.X + 1)
            for _ in range(sweeps):
                for c in range(self.C):
                    s_RX, g_RX = self._slot_C[c], self._gpu_C[c]
                    old_RX = flow[s_RX]
                    # Load of each replica's GPU without this expert.
                    base_RX = gpu[g_RX] - old_RX + pad_CRX[c]
                    b_RX = np.sort(base_RX, axis=1)
                    # Water-filling: the level over the k lowest GPUs is (load + their sum) / k; it
                    # rises over the k lowest while it tops the k-th (+inf entries never count).
                    level_RX = (load_CR[c][:, None] + np.cumsum(b_RX, axis=1)) / ks
                    k_R = (b_RX < level_RX).sum(axis=1)
                    level_R = np.where(k_R > 0, level_RX[np.arange(len(k_R)), np.maximum(k_R - 1, 0)], -np.inf)
                    new_RX = np.maximum(level_R[:, None] - base_RX, 0.0)
                    # Experts of one colour use distinct GPUs, so a fancy-index update is safe (only
                    # the dummy column repeats, and it only ever gets 0).
                    gpu[g_RX] += new_RX - old_RX
                    flow[s_RX] = new_RX
        weights_LP = _shares_to_weights(p, load, flow_LP[:, :P])
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
