"""Budgeted local search: improve the served placement with as few moves as the budget allows.

Legend: L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU, P = G x S slots,
A = layers still being improved, K = expert groups, N = nodes. Slot p lives on GPU p // S.

`budgeted_search` runs in three stages: `_search_settings` checks the input, `prepare_search`
builds the counts the prices read (a `SearchState`), and the numba kernel
(`_search_kernel.search`) applies the changes in place. The numpy reference of the kernel
(tests/oracles/search.py) starts from the same `SearchState`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.errors import EplbError, finite_number, is_whole, shown
from eplb.migration import _search_kernel
from eplb.migration.checks import check_count, check_load_and_maps, check_nodes


@dataclass(frozen=True)
class Budget:
    """How much migration a plan may cause."""

    max_moves: int | None = None
    """Moves in total over all layers (None: unlimited)."""
    max_moves_per_gpu: int | None = None
    """Moves onto any one GPU, summed over layers (None: unlimited). Bounds the rounds."""
    move_cost: float = 0.0
    """A move is made only if it lowers its layer's busiest-GPU load by at least this
    fraction of the layer's mean GPU load (0.002 = 0.2% per copied expert). With bytes per
    expert B, this is a price of move_cost / B of balance per byte."""
    span_cost: float = 1.0
    """With several nodes and expert groups: each (group, node) pair a change adds to a layer
    (a group reaching a node it had no replica on) is priced like this many moves, net of
    pairs the change clears. It keeps the node locality of a node-aware plan (the trade of
    balance for group span is measured by benchmarks/bench_migration.py, part 4). Prices the
    choice only; the budget counts moves."""
    bytes_per_expert: int | None = None
    """Size of one expert's weights in bytes, to report the bytes a migration moves (None:
    moves are counted, bytes are not)."""

    def __post_init__(self) -> None:
        # Stored as int / float (Budget(max_moves=2.0) holds 2), as the reports that echo them print.
        for name, low in (("max_moves", 0), ("max_moves_per_gpu", 0), ("bytes_per_expert", 1)):
            v = getattr(self, name)
            if v is not None:
                if not is_whole(v) or v < low:
                    raise EplbError(f"{name} must be a whole number >= {low} or None, got {shown(v)}")
                object.__setattr__(self, name, int(v))
        for name in ("move_cost", "span_cost"):
            object.__setattr__(self, name, finite_number(name, getattr(self, name), 0))

    @property
    def limited(self) -> bool:
        return self.max_moves is not None or self.max_moves_per_gpu is not None or self.move_cost > 0


def span_priced(num_nodes: int, num_expert_groups: int | None, budget: Budget) -> bool:
    """Does the search price spreading expert groups over nodes (Budget.span_cost)?"""
    return num_nodes > 1 and num_expert_groups is not None and budget.span_cost > 0


@dataclass
class SearchState:
    """Working state of one budgeted search (not a value: the kernel updates the arrays in place)."""

    load_LE: np.ndarray
    """Load of each expert, float64 [L, E], C-ordered."""
    phy2log_LP: np.ndarray
    """The placement being improved, int64 [L, P]; starts as a copy of old_LP."""
    cnt_LEG: np.ndarray
    """Replicas of each expert on each GPU, int16 [L, E, G] (a GPU's row is contiguous)."""
    old_LEG: np.ndarray
    """Does the GPU hold the expert in old_LP, bool [L, E, G] (what a move is counted against)."""
    r_LE: np.ndarray
    """Replicas of each expert, int64 [L, E]."""
    in_G: np.ndarray
    """Moves onto each GPU so far, int64 [G]."""
    total: int
    """Moves so far."""
    cap_total: float
    """Budget.max_moves (inf: none)."""
    cap_gpu: float
    """Budget.max_moves_per_gpu (inf: none)."""
    min_gain_L: np.ndarray
    """Least drop of a layer's busiest GPU one move must buy, float64 [L]."""
    active_A: np.ndarray
    """Layers with load, int64 [A], ascending."""
    slots_per_gpu: int
    partners: int
    """C: lightest GPUs a replica of the busiest GPU may swap with."""
    donors: int
    """D: cheapest donor slots a replication may overwrite, per layer."""
    iters: int
    """Iteration limit (per layer)."""
    span_price: float
    """Moves one added (group, node) pair costs; 0: not priced."""
    grp_E: np.ndarray
    """Expert group of each expert, int64 [E] (a dummy [1] when span_price is 0)."""
    node_G: np.ndarray
    """Node of each GPU, int64 [G] (a dummy [1] when span_price is 0)."""
    gn_LKN: np.ndarray
    """Replicas of each group on each node, int64 [L, K, N] (a dummy [L, 1, 1] when span_price is 0)."""

    @property
    def num_gpus(self) -> int:
        return self.cnt_LEG.shape[2]


def _search_settings(load_LE, old_LP, num_gpus, budget, num_nodes, num_expert_groups, donors, partners, max_iters):
    """The search's input checked, first errors first: (load_LE as float64, donors, partners, max_iters)."""
    if not isinstance(budget, Budget):
        raise EplbError(f"budget must be a Budget, got {type(budget).__name__}")
    load_LE, _, _ = check_load_and_maps(load_LE, num_gpus, old_LP=old_LP)
    # The search prices every slot as a replica (an empty one would be read as expert E - 1
    # and its counts go wrong): restore_missing fills them first.
    if (np.asarray(old_LP) < 0).any():
        l, p = np.argwhere(np.asarray(old_LP) < 0)[0]
        raise EplbError(f"old_LP has an empty slot ({p} of layer index {l}): fill it with "
                        f"restore_missing(load_LE, old_LP, num_gpus) before searching")
    donors, partners = check_count("donors", donors), check_count("partners", partners)
    if max_iters is not None:
        max_iters = check_count("max_iters", max_iters, 0)
    return load_LE, donors, partners, max_iters


def _span_settings(E, G, budget, num_nodes, num_expert_groups):
    """(num_nodes, num_expert_groups, span priced?) checked; groups only where they are priced."""
    num_nodes = check_count("num_nodes", num_nodes)
    span = span_priced(num_nodes, num_expert_groups, budget)
    if span:
        num_nodes = check_nodes(G, num_nodes)
        num_expert_groups = check_count("num_expert_groups", num_expert_groups)
        if E % num_expert_groups:
            raise EplbError(f"node locality needs the {E} experts divisible by num_expert_groups ({num_expert_groups})")
    return num_nodes, num_expert_groups, span


def prepare_search(load_LE, old_LP, num_gpus: int, budget: Budget, *, num_nodes=1, num_expert_groups=None,
                   donors=8, partners=8, max_iters=None) -> SearchState:
    """Check the input of `budgeted_search` and build the state its kernel starts from."""
    load_LE, donors, partners, max_iters = _search_settings(
        load_LE, old_LP, num_gpus, budget, num_nodes, num_expert_groups, donors, partners, max_iters)
    phy = np.array(old_LP, dtype=np.int64, copy=True)
    L, P = phy.shape
    E = load_LE.shape[1]
    G, S = num_gpus, P // num_gpus
    cnt_LEG = _search_kernel.holdings_LEG(phy, G, E)          # phy is old_LP: one count serves both
    old_LEG = cnt_LEG > 0
    r_LE = cnt_LEG.sum(axis=2).astype(np.int64)
    if (r_LE == 0).any():
        l, e = np.argwhere(r_LE == 0)[0]
        raise EplbError(f"expert {e} has no replica in layer index {l}: restore it before searching")
    mean_L = load_LE.sum(axis=1) / G
    num_nodes, num_expert_groups, span = _span_settings(E, G, budget, num_nodes, num_expert_groups)
    if span:
        grp_E = np.arange(E, dtype=np.int64) // (E // num_expert_groups)
        node_G = np.arange(G, dtype=np.int64) // (G // num_nodes)
        gn_LKN = np.zeros((L, num_expert_groups, num_nodes), dtype=np.int64)     # no empty slots here
        np.add.at(gn_LKN, (np.arange(L)[:, None], grp_E[phy], node_G[np.arange(P) // S][None, :]), 1)
    else:
        # One row per layer even unpriced: the kernel takes gn_LKN[l] before it knows span is off.
        grp_E, node_G, gn_LKN = np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros((L, 1, 1), np.int64)
    return SearchState(
        load_LE=np.array(load_LE, order="C"), phy2log_LP=phy, cnt_LEG=cnt_LEG, old_LEG=old_LEG, r_LE=r_LE,
        in_G=np.zeros(G, dtype=np.int64), total=0,
        cap_total=np.inf if budget.max_moves is None else float(budget.max_moves),
        cap_gpu=np.inf if budget.max_moves_per_gpu is None else float(budget.max_moves_per_gpu),
        # Gains below 1e-9 of the layer's mean load are rounding noise, not progress.
        min_gain_L=np.maximum(budget.move_cost, 1e-9) * mean_L,
        active_A=np.flatnonzero(mean_L > 0).astype(np.int64), slots_per_gpu=S,
        partners=min(partners, G - 1), donors=min(donors, P),
        iters=min(max_iters, 2**62) if max_iters is not None else 4 * P,     # an int64 in the kernel
        span_price=float(budget.span_cost) if span else 0.0, grp_E=grp_E, node_G=node_G, gn_LKN=gn_LKN)


def budgeted_search(load_LE: np.ndarray, old_LP: np.ndarray, num_gpus: int, budget: Budget,
                    *, num_nodes: int = 1, num_expert_groups: int | None = None, donors: int = 8,
                    partners: int = 8, max_iters: int | None = None) -> np.ndarray:
    """Start from old_LP and apply the best replica changes per move until the budget is spent.

    Per layer and iteration, two kinds of change are priced exactly (even dispatch among
    replicas, loads of every GPU recomputed):
    - swap: exchange a replica on the busiest GPU with one on one of the `partners` lightest
      GPUs (replica counts unchanged; up to 2 moves, fewer if an expert returns to a GPU that
      held it);
    - replicate: overwrite a donor slot (an expert with >= 2 replicas, among the `donors`
      cheapest per layer) with another replica of an expert on the busiest GPU (1 move).
    Every active layer takes its change with the best gain per move in each iteration; when
    the budget cannot pay for all, the best gains per move over all layers go first.
    Few partners make many swaps between the same few light GPUs, which the schedule must
    then stage as 2-cycles (more network transfers); more donors rarely find a better one.
    num_nodes > 1 with num_expert_groups (expert groups of group-limited routing,
    E / num_expert_groups consecutive experts each): a change that spreads a group onto one
    more node is priced `budget.span_cost` extra moves (see Budget), so the search keeps most
    of the node locality a node-aware plan such as `hierarchical` built.
    old_LP may lack experts (failed ranks): call `restore_missing` first. Returns phy2log_LP.
    """
    state = prepare_search(load_LE, old_LP, num_gpus, budget, num_nodes=num_nodes,
                           num_expert_groups=num_expert_groups, donors=donors, partners=partners,
                           max_iters=max_iters)
    if state.num_gpus < 2:
        return state.phy2log_LP
    s = state
    s.total = _search_kernel.search(
        s.load_LE, s.phy2log_LP, s.r_LE, s.cnt_LEG, s.old_LEG, s.in_G, s.total, s.cap_total, s.cap_gpu,
        s.min_gain_L, s.active_A, s.num_gpus, s.slots_per_gpu, s.partners, s.donors, s.iters, s.span_price,
        s.grp_E, s.node_G, s.gn_LKN)
    return s.phy2log_LP
