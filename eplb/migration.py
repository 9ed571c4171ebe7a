"""Migration: move a served placement to a new one cheaply (few copies) and safely (no gaps).

Legend: L = MoE layers, E = logical experts, G = GPUs (ranks), N = nodes, S = slots per GPU,
P = G x S physical slots, M = transfers, R = rounds, A = layers still being improved,
D = donor slots considered per layer. Slot p lives on GPU p // S.

Three parts:
1. Counting. A *move* is a replica copied onto a GPU that did not hold that expert before
   (in that layer); reshuffling slots inside a GPU is free. `count_moves` counts them.
2. Migration-aware planning. `relabel` renames the GPUs (and nodes) of a new plan so that it
   keeps as many of the old replicas as possible (an assignment problem per layer, solved
   with scipy's linear_sum_assignment), then keeps every replica that stays on its GPU in
   its old slot. `budgeted_search` starts from the old placement and applies the replica
   changes that lower each layer's busiest GPU most per move, until a move budget (total,
   per GPU) is spent or no change buys at least `move_cost`. `migrate` combines the two.
3. Scheduling. `schedule` orders the copies into rounds in which every rank sends at most
   one and receives at most one expert, such that every logical expert keeps at least one
   complete replica serving tokens at every moment; `MigrationPlan.serving(k)` gives the
   placement to serve with during round k (slots being written get dispatch weight 0).
   Cycles (two GPUs exchanging the only replicas of two experts) are broken by *staging*:
   one expert is first copied into a slot whose own expert has another complete replica
   (one exists whenever P > E), and that slot is restored afterwards; see `schedule`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.errors import EplbError, whole_number

CHECKPOINT = -1
"""Source rank of a transfer that reloads an expert from the checkpoint (no replica survived)."""



def _kernel_ints(a) -> np.ndarray:
    """a as a writable, C-ordered int64 array (copied only when it is not one already).

    numba compiles one machine-code version per argument type, and a read-only array (every
    Placement's) is another type than a writable one: feeding the kernels one kind keeps it
    to one version each, which `warm_up` compiles or loads ahead of the first decision."""
    a = np.asarray(a)
    if a.dtype == np.int64 and a.flags.c_contiguous and a.flags.writeable:
        return a
    return np.array(a, dtype=np.int64, order="C")


def _check_maps(num_gpus: int, num_logical_experts: int, **maps) -> tuple[int, int]:
    """Validate [L, P] expert maps (keyword = name in the error): 2-D, whole numbers, one shape,
    P a multiple of num_gpus, entries in -1..num_logical_experts-1 (-1 = empty slot). Returns (L, P).

    The compiled kernels index arrays by these values and do not check bounds, so a bad
    map must fail here, with its name and the offending value, not corrupt memory there."""
    if isinstance(num_gpus, bool) or int(num_gpus) != num_gpus or num_gpus < 1:
        raise EplbError(f"num_gpus must be a positive whole number, got {num_gpus!r}")
    if (isinstance(num_logical_experts, bool) or int(num_logical_experts) != num_logical_experts
            or num_logical_experts < 1):
        raise EplbError(f"num_logical_experts must be a positive whole number, got {num_logical_experts!r}")
    shape = None
    for name, m in maps.items():
        a = np.asarray(m)
        if a.ndim != 2 or a.shape[1] == 0:
            raise EplbError(f"{name} must be a [layers, slots] map, got shape {a.shape}")
        if a.dtype.kind not in "iu" and not (a.dtype.kind == "f" and np.array_equal(a, np.round(a))):
            raise EplbError(f"{name} must hold whole expert ids, got dtype {a.dtype}")
        if shape is not None and a.shape != shape:
            raise EplbError(f"{name} has shape {a.shape} but {next(iter(maps))} has {shape}: "
                            f"maps of the same layers and slots are needed")
        shape = a.shape
        if a.shape[1] % num_gpus:
            raise EplbError(f"{name} has {a.shape[1]} slots, which do not split evenly over {num_gpus} GPUs")
        bad = (a < -1) | (a >= num_logical_experts)
        if bad.any():
            l, p = np.argwhere(bad)[0]
            raise EplbError(f"{name} holds expert {a[l, p]} in slot {p} of layer index {l}: expert ids are "
                            f"0..{num_logical_experts - 1} (-1 = empty slot)")
    return shape


def _check_count(name: str, v, lo: int = 1) -> int:
    """v as an int, if it is a whole number >= lo (bools refused: True is no count)."""
    return whole_number(name, v, lo)


def _check_nodes(num_gpus: int, num_nodes) -> int:
    """num_nodes as an int, if it is a positive whole number that splits the GPUs evenly (the
    compiled GPU assignment fills num_nodes x (num_gpus // num_nodes) columns and no more)."""
    num_nodes = _check_count("num_nodes", num_nodes)
    if num_gpus % num_nodes:
        raise EplbError(f"num_nodes ({num_nodes}) must divide the {num_gpus} GPUs evenly")
    return num_nodes


def _check_load(load_LE) -> np.ndarray:
    """load_LE as float64 [layers, E >= 1], finite and >= 0."""
    load_LE = np.asarray(load_LE, dtype=np.float64)
    if load_LE.ndim != 2 or load_LE.shape[1] == 0:
        raise EplbError(f"load must be [layers, experts] with at least one expert, got shape {load_LE.shape}")
    if not np.isfinite(load_LE).all() or (load_LE < 0).any():
        raise EplbError("load must be finite and >= 0")
    return load_LE


def _check_load_and_maps(load_LE, num_gpus: int, **maps) -> tuple[np.ndarray, int, int]:
    """load_LE checked as float64 [L, E] (finite, >= 0) together with the [L, P] maps it is
    planned on (see _check_maps, with E from the load). Returns (load_LE, L, P)."""
    load_LE = _check_load(load_LE)
    L, P = _check_maps(num_gpus, load_LE.shape[1], **maps)
    if load_LE.shape[0] != L:
        raise EplbError(f"load must be [layers, experts] for the {L} layers of the maps, got shape {load_LE.shape}")
    return load_LE, L, P


def _span_priced(num_nodes: int, num_expert_groups: int | None, budget: "Budget") -> bool:
    """Does the search price spreading expert groups over nodes (Budget.span_cost)?"""
    return num_nodes > 1 and num_expert_groups is not None and budget.span_cost > 0


def warm_up() -> float:
    """Load (or, on a fresh install, compile: ~10 s) the numba kernels of this module now,
    so that the first rebalance decision does not pay for it; returns the seconds it took.
    A no-op after the first call in a process."""
    import time

    t0 = time.perf_counter()
    from eplb import _schedule_kernel, _search_kernel  # noqa: F401  (numba import, ~0.5 s)

    # Two layers, 3 experts, 2 GPUs x 2 slots: runs every kernel on the argument types the
    # real calls use (all sizes share one compiled version).
    old = np.array([[0, 1, 2, 0], [0, 1, 2, 2]])
    new = np.array([[1, 0, 2, 1], [2, 1, 0, 0]])
    load = np.array([[3.0, 1.0, 1.0], [1.0, 1.0, 3.0]])
    count_moves(old, new, 2, 3)
    relabel(old, new, 2, 3)
    keep_slots(old, new, 2)
    budgeted_search(load, old, 2, Budget(move_cost=0.001))
    budgeted_search(load, old, 2, Budget(max_moves=1))
    schedule(old, new, 2, 3)
    return time.perf_counter() - t0


# 1. Counting ------------------------------------------------------------------------------------

def holdings(phy2log_LP: np.ndarray, num_gpus: int, num_logical_experts: int) -> np.ndarray:
    """Replicas of each expert on each GPU, int64 [L, G, E]. Entries < 0 in phy2log_LP (empty) are skipped."""
    phy2log_LP = np.asarray(phy2log_LP)
    L, P = phy2log_LP.shape
    S = P // num_gpus
    gpu_P = np.arange(P) // S
    flat = (np.arange(L)[:, None] * num_gpus + gpu_P[None, :]) * num_logical_experts + phy2log_LP
    flat = flat[phy2log_LP >= 0]
    return np.bincount(flat, minlength=L * num_gpus * num_logical_experts).reshape(L, num_gpus, num_logical_experts)


def count_moves(old_LP: np.ndarray, new_LP: np.ndarray, num_gpus: int, num_logical_experts: int,
                *, compiled: bool = True) -> np.ndarray:
    """Moves onto each GPU, int64 [L, G]: experts the GPU holds in new_LP but not in old_LP.
    compiled=False: the numpy version (the tests' reference)."""
    _check_maps(num_gpus, num_logical_experts, old_LP=old_LP, new_LP=new_LP)
    if compiled:
        # Called ~5 times per rebalance decision; the [L, G, E] holdings cost ~1.5 ms each.
        from eplb import _search_kernel

        L, P = np.shape(new_LP)
        R, S = L * num_gpus, P // num_gpus
        return _search_kernel.count_moves(_kernel_ints(old_LP).reshape(R, S),
                                          _kernel_ints(new_LP).reshape(R, S)).reshape(L, num_gpus)
    old = holdings(old_LP, num_gpus, num_logical_experts) > 0
    new = holdings(new_LP, num_gpus, num_logical_experts) > 0
    return (new & ~old).sum(axis=2)


# 2a. Relabelling --------------------------------------------------------------------------------

def _gpu_assignment(keep_LGG: np.ndarray, num_nodes: int, *, compiled: bool = True) -> np.ndarray:
    """For each layer, which new GPU goes to each old GPU position, int64 [L, G].

    keep_LGG[l, a, b]: experts new GPU a would keep if it became old GPU b. With several
    nodes a node's GPUs move as a whole (node-aware planners packed them together): first
    the best GPU matching for every (new node, old node) pair, then the best node matching.
    compiled=True: a Hungarian method in numba (with 4 nodes, 17 small matchings per layer
    cost ~7 ms of scipy calls at DeepSeek-V3 shape); compiled=False: scipy's
    linear_sum_assignment (the tests' reference: same kept totals, ties may differ).
    """
    if compiled:
        from eplb import _search_kernel

        return _search_kernel.gpu_assignment(np.ascontiguousarray(keep_LGG, dtype=np.float64), int(num_nodes))
    from scipy.optimize import linear_sum_assignment

    L, G, _ = keep_LGG.shape
    out = np.empty((L, G), dtype=np.int64)
    if num_nodes == 1:
        for l in range(L):
            rows, cols = linear_sum_assignment(keep_LGG[l], maximize=True)
            out[l, cols] = rows
        return out
    n = G // num_nodes
    for l in range(L):
        node_keep = np.empty((num_nodes, num_nodes))
        inner = {}
        for a in range(num_nodes):
            for b in range(num_nodes):
                block = keep_LGG[l, a * n:(a + 1) * n, b * n:(b + 1) * n]
                rows, cols = linear_sum_assignment(block, maximize=True)
                node_keep[a, b] = block[rows, cols].sum()
                inner[a, b] = (rows, cols)
        na, nb = linear_sum_assignment(node_keep, maximize=True)
        for a, b in zip(na, nb):
            rows, cols = inner[a, b]
            out[l, b * n + cols] = a * n + rows
    return out


def _keep_counts(old_LP: np.ndarray, new_LP: np.ndarray, num_gpus: int, num_logical_experts: int,
                 *, compiled: bool = True) -> np.ndarray:
    """keep_LGG[l, a, b]: experts new GPU a holds that old GPU b held too, float64 [L, G, G].
    compiled=False: the numpy version (the tests' reference)."""
    _check_maps(num_gpus, num_logical_experts, old_LP=old_LP, new_LP=new_LP)
    if compiled:
        # Two [L, G, E] holdings and a batched matmul cost ~3 ms at DeepSeek-V3 shape.
        from eplb import _search_kernel

        return _search_kernel.keep_counts(_kernel_ints(old_LP), _kernel_ints(new_LP), num_gpus, num_logical_experts)
    old_h = (holdings(old_LP, num_gpus, num_logical_experts) > 0).astype(np.float64)
    new_h = (holdings(new_LP, num_gpus, num_logical_experts) > 0).astype(np.float64)
    return new_h @ old_h.transpose(0, 2, 1)


def relabel(old_LP: np.ndarray, new_LP: np.ndarray, num_gpus: int, num_logical_experts: int,
            num_nodes: int = 1) -> np.ndarray:
    """Slot permutation perm_LP that makes new_LP[l, perm_LP[l]] keep the most old replicas.

    The GPUs of one layer are interchangeable as wholes (and nodes, as wholes of GPUs), so a
    new plan loses nothing by renaming them; the renaming that keeps the most (GPU, expert)
    pairs of old_LP is an assignment problem. Inside a GPU, an expert it already held goes
    back to the slot it occupied, so a kept replica is not even copied locally.
    """
    L, P = _check_maps(num_gpus, num_logical_experts, old_LP=old_LP, new_LP=new_LP)
    num_nodes = _check_nodes(num_gpus, num_nodes)
    old_LP = np.asarray(old_LP)
    new_LP = np.asarray(new_LP)
    G, S = num_gpus, P // num_gpus
    keep_LGG = _keep_counts(old_LP, new_LP, G, num_logical_experts)
    gsrc_LG = _gpu_assignment(keep_LGG, num_nodes)             # new GPU placed at each old GPU position
    # Slots of new GPU gsrc[l, b] placed on GPU b, still in their own order.
    base_LP = (gsrc_LG[:, :, None] * S + np.arange(S)[None, None, :]).reshape(L, P)
    moved_LP = np.take_along_axis(new_LP, base_LP, axis=1)

    return np.take_along_axis(base_LP, keep_slots(old_LP, moved_LP, G), axis=1)


def keep_slots(old_LP: np.ndarray, new_LP: np.ndarray, num_gpus: int, *, compiled: bool = True) -> np.ndarray:
    """Within-GPU slot permutation perm_LP: new_LP[l, perm_LP[l]] has each expert that a GPU
    keeps in the slot it held in old_LP (GPUs are not renamed), so kept replicas are not
    even copied locally. compiled=False runs the numpy version (the tests' reference)."""
    old_LP = np.asarray(old_LP)
    new_LP = np.asarray(new_LP)
    L, P = _check_maps(num_gpus, max(int(old_LP.max(initial=0)), int(new_LP.max(initial=0))) + 1,
                       old_LP=old_LP, new_LP=new_LP)
    G, S = num_gpus, P // num_gpus
    if compiled:
        # ~6 ms of numpy per call at DeepSeek-V3 shape, twice per rebalance decision.
        from eplb import _search_kernel

        src_RS = _search_kernel.keep_slots(_kernel_ints(old_LP).reshape(L * G, S),
                                           _kernel_ints(new_LP).reshape(L * G, S))
        return src_RS.reshape(L, P) + (np.arange(P) // S * S)[None, :]
    moved_LP = new_LP
    # Match the k-th copy of expert e in the new slots to the k-th copy of e
    # in the old slots (keys e * S + k are unique within a GPU) and keep matched ones in place.
    R = L * G
    new_RS = moved_LP.reshape(R, S)
    old_RS = old_LP.reshape(R, S)

    def keys(x_RS):
        order = np.argsort(x_RS, axis=1, kind="stable")
        xs = np.take_along_axis(x_RS, order, axis=1)
        run_start = np.concatenate([np.ones((R, 1), bool), xs[:, 1:] != xs[:, :-1]], axis=1)
        idx = np.where(run_start, np.arange(S)[None, :], 0)
        occ = np.arange(S)[None, :] - np.maximum.accumulate(idx, axis=1)
        k = np.empty_like(occ)
        np.put_along_axis(k, order, occ, axis=1)
        return np.where(x_RS >= 0, x_RS * S + k, -1 - np.arange(S)[None, :])  # empties never match

    kn, ko = keys(new_RS), keys(old_RS)
    eq_RSS = kn[:, :, None] == ko[:, None, :]
    matched_RS = eq_RSS.any(axis=2)                          # new slot j keeps an old position
    pos_RS = eq_RSS.argmax(axis=2)
    taken_RS = eq_RSS.any(axis=1)                            # old position already kept
    src_RS = np.full((R, S), -1, dtype=np.int64)             # new slot (within GPU) for each position
    r_idx, j_idx = np.nonzero(matched_RS)
    src_RS[r_idx, pos_RS[r_idx, j_idx]] = j_idx
    # Unmatched new slots fill the free positions, both in order.
    free_order = np.argsort(taken_RS, axis=1, kind="stable")        # free positions first
    unm_order = np.argsort(matched_RS, axis=1, kind="stable")       # unmatched slots first
    n_free = (~taken_RS).sum(axis=1)
    fill = np.arange(S)[None, :] < n_free[:, None]
    rr = np.broadcast_to(np.arange(R)[:, None], (R, S))
    src_RS[rr[fill], free_order[fill]] = unm_order[fill]
    assert (src_RS >= 0).all()
    within_LP = src_RS.reshape(L, P) + (np.arange(P) // S * S)[None, :]
    return within_LP


# 2b. Budgeted local search ----------------------------------------------------------------------

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
    pairs the change clears. It keeps the node locality of a node-aware plan: on real
    DeepSeek-V3 loads (4 nodes, 8 groups, hierarchical plans, 56 workload pairs) a 15% budget
    spreads groups over 3.34 nodes at 0, 2.25 at 1 and 2.0 at 4, for busiest GPUs 0.28%,
    0.47% and 0.76% above a from-scratch hierarchical plan (benchmarks/bench_migration.py,
    part 4). Prices the choice only; the budget counts moves."""
    bytes_per_expert: int | None = None
    """Size of one expert's weights in bytes, to report the bytes a migration moves (None:
    moves are counted, bytes are not)."""

    def __post_init__(self) -> None:
        v = self.bytes_per_expert
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
            raise EplbError(f"bytes_per_expert must be a whole number >= 1 or None, got {v!r}")
        for name in ("max_moves", "max_moves_per_gpu"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or int(v) != v or v < 0):
                raise EplbError(f"{name} must be a whole number >= 0 or None, got {v!r}")
        for name in ("move_cost", "span_cost"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
                    or not np.isfinite(v) or v < 0:
                raise EplbError(f"{name} must be a finite number >= 0, got {v!r}")

    @property
    def limited(self) -> bool:
        return self.max_moves is not None or self.max_moves_per_gpu is not None or self.move_cost > 0


def budgeted_search(load_LE: np.ndarray, old_LP: np.ndarray, num_gpus: int, budget: Budget,
                    *, num_nodes: int = 1, num_expert_groups: int | None = None, donors: int = 8,
                    partners: int = 8, max_iters: int | None = None, compiled: bool = True) -> np.ndarray:
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
    donors=8 (was 16): on the 56 real DeepSeek-V3 workload pairs of
    benchmarks/bench_migration.py the same balance to 0.01% (worst pair 0.9984 of the scratch
    plan's either way) in ~85% of the time. partners=4 would save another ~20% of the
    decision but makes the schedule stage ~1.8x more copies (more swaps between the same few
    light GPUs become 2-cycles): 6% more network transfers, which cost more than milliseconds
    of planning.
    num_nodes > 1 with num_expert_groups (expert groups of group-limited routing, E / num_expert_groups
    consecutive experts each): a change that spreads a group onto one more node is priced
    `budget.span_cost` extra moves (see Budget), so the search keeps most of the node
    locality a node-aware plan such as `hierarchical` built. Compiled only.
    old_LP may lack experts (failed ranks): call `restore_missing` first. Returns phy2log_LP.
    compiled=True runs the per-layer loop of `eplb._search_kernel` (numba; identical results,
    ~10x faster at DeepSeek-V3 shape); compiled=False runs the numpy version below, kept as
    the reference the tests compare against.
    """
    if not isinstance(budget, Budget):
        raise EplbError(f"budget must be a Budget, got {type(budget).__name__}")
    load_LE, _, _ = _check_load_and_maps(load_LE, num_gpus, old_LP=old_LP)
    # The search prices every slot as a replica (an empty one would be read as expert E - 1
    # and its counts go wrong): restore_missing fills them first.
    if (np.asarray(old_LP) < 0).any():
        l, p = np.argwhere(np.asarray(old_LP) < 0)[0]
        raise EplbError(f"old_LP has an empty slot ({p} of layer index {l}): fill it with "
                        f"restore_missing(load_LE, old_LP, num_gpus) before searching")
    donors, partners = _check_count("donors", donors), _check_count("partners", partners)
    if max_iters is not None:
        max_iters = _check_count("max_iters", max_iters, 0)
    phy = np.array(old_LP, dtype=np.int64, copy=True)
    L, P = phy.shape
    E = load_LE.shape[1]
    G, S = num_gpus, P // num_gpus
    gpu_P = np.arange(P) // S
    # [L, E, G] layout: the GPUs of one (layer, expert) are contiguous, so the gathers below
    # read short rows instead of scattered bytes.
    # phy starts as a copy of old_LP: one holdings serves both.
    if compiled:
        from eplb import _search_kernel

        cnt_LEG = _search_kernel.holdings_LEG(phy, G, E)
    else:
        cnt_LEG = np.ascontiguousarray(holdings(phy, G, E).transpose(0, 2, 1)).astype(np.int16)
    old_LEG = cnt_LEG > 0
    r_LE = cnt_LEG.sum(axis=2).astype(np.int64)
    if (r_LE == 0).any():
        l, e = np.argwhere(r_LE == 0)[0]
        raise EplbError(f"expert {e} has no replica in layer index {l}: restore it before searching")
    in_G = ((cnt_LEG > 0) & ~old_LEG).sum(axis=(0, 1))          # moves onto each GPU so far
    state = {"total": int(in_G.sum())}
    cap_total = np.inf if budget.max_moves is None else budget.max_moves
    cap_gpu = np.inf if budget.max_moves_per_gpu is None else budget.max_moves_per_gpu
    mean_L = load_LE.sum(axis=1) / G
    # Gains below 1e-9 of the layer's mean load are rounding noise, not progress.
    min_gain_L = np.maximum(budget.move_cost, 1e-9) * mean_L
    active = np.flatnonzero(mean_L > 0)
    D = min(donors, P)
    C = min(partners, G - 1)
    H = 1                                                       # busy GPUs priced per layer
    iters = min(max_iters, 2**62) if max_iters is not None else 4 * P      # an int64 in the kernel
    num_nodes = _check_count("num_nodes", num_nodes)
    span = _span_priced(num_nodes, num_expert_groups, budget)
    if span:
        num_nodes = _check_nodes(G, num_nodes)
        num_expert_groups = _check_count("num_expert_groups", num_expert_groups)
        if E % num_expert_groups:
            raise EplbError(f"node locality needs the {E} experts divisible by num_expert_groups ({num_expert_groups})")
        if not compiled:
            raise EplbError("the numpy reference (compiled=False) does not keep group span: "
                            "use compiled=True, or num_nodes=1")
    if G < 2:
        return phy
    if compiled:
        # Imported here: numba costs ~0.5 s to import, and `eplb plan` must start fast.
        from eplb import _search_kernel
        if span:
            grp_E = np.arange(E, dtype=np.int64) // (E // num_expert_groups)
            node_G = np.arange(G, dtype=np.int64) // (G // num_nodes)
            gn_LKN = np.zeros((L, num_expert_groups, num_nodes), dtype=np.int64)     # no empty slots here
            np.add.at(gn_LKN, (np.arange(L)[:, None], grp_E[phy], node_G[np.arange(P) // S][None, :]), 1)
        else:
            grp_E, node_G, gn_LKN = np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros((1, 1, 1), np.int64)
        state["total"] = _search_kernel.search(
            np.array(load_LE, order="C"), phy, r_LE, cnt_LEG, old_LEG, in_G, state["total"], float(cap_total), float(cap_gpu),
            min_gain_L, active.astype(np.int64), G, S, C, D, iters, float(budget.span_cost) if span else 0.0,
            grp_E, node_G, gn_LKN)
        return phy
    s_idx = np.arange(S)
    gpu_G = np.arange(G)

    def fits(g_list, d_list):
        """Can every change of a batch be paid for, in any order? (positive parts only)"""
        pos = [np.maximum(d, 0) for d in d_list]
        if sum(int(p.sum()) for p in pos) > cap_total - state["total"]:
            return False
        if np.isfinite(cap_gpu):
            need = np.zeros(G, dtype=np.int64)
            for g, p in zip(g_list, pos):
                np.add.at(need, g, p)
            return bool((in_G + need <= cap_gpu).all())
        return True

    def apply_swaps(l, a_slot, q):
        """Swap slot a_slot with slot q in layers l (distinct layers); False where the budget refused."""
        hh, g = gpu_P[a_slot], gpu_P[q]
        ea, eb = phy[l, a_slot], phy[l, q]
        dg = (~old_LEG[l, ea, g]).astype(np.int64) - ((~old_LEG[l, eb, g]) & (cnt_LEG[l, eb, g] == 1))
        dh = (~old_LEG[l, eb, hh]).astype(np.int64) - ((~old_LEG[l, ea, hh]) & (cnt_LEG[l, ea, hh] == 1))
        ok = np.ones(l.size, dtype=bool)
        if not fits((g, hh), (dg, dh)):
            # The budget binds: one at a time, best first (callers pass them in that order).
            for k in range(l.size):
                t = state["total"] + dg[k] + dh[k]
                if t > cap_total or in_G[g[k]] + dg[k] > cap_gpu or in_G[hh[k]] + dh[k] > cap_gpu:
                    ok[k] = False
                    continue
                in_G[g[k]] += dg[k]
                in_G[hh[k]] += dh[k]
                state["total"] = int(t)
        else:
            np.add.at(in_G, g, dg)
            np.add.at(in_G, hh, dh)
            state["total"] += int(dg.sum() + dh.sum())
        l, a_slot, q, hh, g, ea, eb = (x[ok] for x in (l, a_slot, q, hh, g, ea, eb))
        phy[l, a_slot], phy[l, q] = eb, ea
        cnt_LEG[l, ea, hh] -= 1
        cnt_LEG[l, eb, hh] += 1
        cnt_LEG[l, eb, g] -= 1
        cnt_LEG[l, ea, g] += 1
        return ok

    def apply_reps(l, a_slot, q):
        """Copy the expert of slot a_slot over donor slot q in layers l (distinct layers)."""
        g = gpu_P[q]
        x, b = phy[l, a_slot], phy[l, q]
        dg = (~old_LEG[l, x, g]).astype(np.int64) - ((~old_LEG[l, b, g]) & (cnt_LEG[l, b, g] == 1))
        ok = np.ones(l.size, dtype=bool)
        if not fits((g,), (dg,)):
            for k in range(l.size):
                t = state["total"] + dg[k]
                if t > cap_total or in_G[g[k]] + dg[k] > cap_gpu:
                    ok[k] = False
                    continue
                in_G[g[k]] += dg[k]
                state["total"] = int(t)
        else:
            np.add.at(in_G, g, dg)
            state["total"] += int(dg.sum())
        l, q, g, x, b = (v[ok] for v in (l, q, g, x, b))
        phy[l, q] = x
        cnt_LEG[l, b, g] -= 1
        cnt_LEG[l, x, g] += 1
        r_LE[l, b] -= 1
        r_LE[l, x] += 1
        return ok

    for _ in range(iters):
        if active.size == 0:
            break
        A = active.size
        ar = np.arange(A)
        ph = phy[active]                                          # [A, P]
        ld = load_LE[active]                                      # [A, E]
        r = r_LE[active]
        w_AP = np.take_along_axis(ld / r, ph, axis=1)             # load of each replica
        # Summed slot by slot (not .sum, whose pairwise order depends on S) so the compiled
        # kernel can reproduce the same float64 loads exactly.
        w_AGS = w_AP.reshape(A, G, S)
        gl_AG = w_AGS[:, :, 0].copy()
        for s in range(1, S):
            gl_AG += w_AGS[:, :, s]
        srt = np.argsort(-gl_AG, axis=1, kind="stable")
        h = srt[:, 0]                                             # busiest GPU
        Lh = gl_AG[ar, h]
        room_G = cap_gpu - in_G
        room_tot = cap_total - state["total"]
        la2 = active[:, None]
        la3 = active[:, None, None]
        h2 = h[:, None]
        need_A = min_gain_L[active]

        # Swap: slot a on the busiest GPU (axis H, one row) <-> slot q on one of the C lightest
        # GPUs (heavier partners seldom help and would cost G / C times the work).
        hr_AH = srt[:, :H]
        Lr_AH = np.take_along_axis(gl_AG, hr_AH, axis=1)
        hs_AHS = hr_AH[:, :, None] * S + s_idx                   # slots of the busy GPUs
        ea_AHS = np.take_along_axis(ph, hs_AHS.reshape(A, H * S), axis=1).reshape(A, H, S)
        wa_AHS = np.take_along_axis(w_AP, hs_AHS.reshape(A, H * S), axis=1).reshape(A, H, S)
        light_AC = srt[:, ::-1][:, :C]
        q_AQ = (light_AC[:, :, None] * S + s_idx).reshape(A, C * S)
        g_AQ = gpu_P[q_AQ]
        eb_AQ = np.take_along_axis(ph, q_AQ, axis=1)
        w_AQ = np.take_along_axis(w_AP, q_AQ, axis=1)
        gl_AQ = np.take_along_axis(gl_AG, g_AQ, axis=1)
        delta = wa_AHS[..., None] - w_AQ[:, None, None, :]       # [A, H, S, Q] load leaving h
        # Gains are local: how far the busy GPU drops while the GPUs the change touches
        # stay below its old load. The global maximum never rises, and a layer with several
        # near-busiest GPUs still sees each step as progress.
        Lr4 = Lr_AH[:, :, None, None]
        swap_gain = Lr4 - np.maximum(Lr4 - delta, gl_AQ[:, None, None, :] + delta)
        # Counts of each busy-GPU expert on every GPU, gathered once: [A, H, S, G].
        cnt_x_AHSG = cnt_LEG[la3, ea_AHS]
        old_x_AHSG = old_LEG[la3, ea_AHS]
        # Per partner GPU, then repeated over its S slots (S times fewer gathers).
        light4 = np.broadcast_to(light_AC[:, None, None, :], (A, H, S, C))
        cn_g_ea = np.repeat(np.take_along_axis(cnt_x_AHSG, light4, axis=3), S, axis=3)
        ol_g_ea = np.repeat(np.take_along_axis(old_x_AHSG, light4, axis=3), S, axis=3)
        hr3 = hr_AH[:, :, None]
        cn_h_eb = cnt_LEG[la3, eb_AQ[:, None, :], hr3]            # [A, H, Q]
        ol_h_eb = old_LEG[la3, eb_AQ[:, None, :], hr3]
        cn_h_ea = np.take_along_axis(cnt_x_AHSG, hr3[..., None], axis=3)[..., 0]    # [A, H, S]
        ol_h_ea = np.take_along_axis(old_x_AHSG, hr3[..., None], axis=3)[..., 0]
        cn_g_eb = cnt_LEG[la2, eb_AQ, g_AQ]                       # [A, Q]
        # Moves against the old placement: an expert landing on a GPU that did not hold it
        # costs 1; one leaving a GPU it was moved onto (its only copy there) refunds 1.
        d_g = (~ol_g_ea).astype(np.int64) - ((~old_LEG[la2, eb_AQ, g_AQ]) & (cn_g_eb == 1))[:, None, None, :]
        d_h = ((~ol_h_eb).astype(np.int64)[:, :, None, :] - ((~ol_h_ea) & (cn_h_ea == 1))[..., None])
        swap_cost = d_g + d_h
        bad = (cn_g_ea > 0) | (cn_h_eb > 0)[:, :, None, :] | (ea_AHS[..., None] == eb_AQ[:, None, None, :])
        bad |= (g_AQ[:, None, None, :] == hr_AH[:, :, None, None])
        bad |= ((d_g > room_G[g_AQ][:, None, None, :]) | (d_h > room_G[hr_AH][:, :, None, None])
                | (swap_cost > room_tot))
        swap_gain[bad] = -np.inf

        # Replicate (busiest GPU only): expert x on h gets one more replica in donor slot q
        # (expert b, r_b >= 2), donors ranked by how little losing them hurts (light GPU,
        # light expert).
        ea_AS = ea_AHS[:, 0]
        rb_AP = np.take_along_axis(r, ph, axis=1)
        Wb_AP = np.take_along_axis(ld, ph, axis=1)
        harm = gl_AG[:, gpu_P] + Wb_AP / np.maximum(rb_AP - 1, 1)
        harm[(rb_AP < 2) | (gpu_P[None, :] == h2)] = np.inf
        # A stable sort, not argpartition: ties then pick the same donors in the same order
        # in the compiled kernel (argpartition's order among ties is unspecified).
        q_AD = np.argsort(harm, axis=1, kind="stable")[:, :D] if D < P else np.tile(np.arange(P), (A, 1))
        q_ok_AD = np.isfinite(np.take_along_axis(harm, q_AD, axis=1))
        b_AD = np.take_along_axis(ph, q_AD, axis=1)
        gq_AD = gpu_P[q_AD]
        rb = np.take_along_axis(rb_AP, q_AD, axis=1).astype(np.float64)
        Wb = np.take_along_axis(Wb_AP, q_AD, axis=1)
        wb_q = np.take_along_axis(w_AP, q_AD, axis=1)
        db = np.where(rb >= 2, Wb / np.maximum(rb - 1, 1) - wb_q, 0.0)           # [A, D] rise per b replica
        rx = np.take_along_axis(r, ea_AS, axis=1).astype(np.float64)              # [A, S]
        Wx = np.take_along_axis(ld, ea_AS, axis=1)
        dx = Wx / rx - Wx / (rx + 1)                                              # fall per x replica
        cnt_x_ASG = cnt_x_AHSG[:, 0]                                              # [A, S, G]
        cnt_b_ADG = cnt_LEG[la2, b_AD]                                            # [A, D, G]
        # New load of GPU g after the change: (gl - cnt_x * dx) + cnt_b * db, for the GPUs
        # the change touches (holding x or b) except g_q, the donor slot's GPU, priced apart.
        # The busiest touched GPU is the larger of two max-plus reductions, over GPUs holding x
        # (any b) and over GPUs holding b (any x): two [A, S, D, G] passes instead of a
        # masked [A, S, D, G] array built, gathered, scattered and reduced (same values).
        gq3 = gq_AD[:, None, :]
        y_ASG = gl_AG[:, None, :] - cnt_x_ASG * dx[:, :, None]
        cbdb_ADG = cnt_b_ADG * db[:, :, None]
        not_gq_ADG = gpu_G[None, None, :] != gq_AD[:, :, None]
        xm_ASG = np.where(cnt_x_ASG > 0, y_ASG, -np.inf)
        bm_ADG = np.where((cnt_b_ADG > 0) & not_gq_ADG, cbdb_ADG, -np.inf)
        # GPUs on axis 1 ([A, G, S, D]): the reduction then runs over whole [S, D] planes,
        # ~30% faster than over a short last axis.
        t = lambda a: np.ascontiguousarray(a.transpose(0, 2, 1))  # noqa: E731
        buf = np.add(t(xm_ASG)[:, :, :, None], t(cbdb_ADG)[:, :, None, :])
        top_ASD = buf.max(axis=1)
        np.add(t(y_ASG)[:, :, :, None], t(bm_ADG)[:, :, None, :], out=buf)
        np.maximum(top_ASD, buf.max(axis=1), out=top_ASD)
        # GPU g_q of the donor slot gains x's new replica and loses b's old one.
        cn_gx = np.take_along_axis(cnt_x_ASG, gq3, axis=2)                        # [A, S, D]
        cb_gq_AD = np.take_along_axis(cnt_b_ADG, gq_AD[:, :, None], axis=2)[:, :, 0]
        gl_gq_AD = np.take_along_axis(gl_AG, gq_AD, axis=1)
        at_g = (((gl_gq_AD[:, None, :] - cn_gx * dx[:, :, None]) + (cb_gq_AD * db)[:, None, :])
                + (Wx / (rx + 1))[:, :, None] - (wb_q + db)[:, None, :])
        rep_gain = Lh[:, None, None] - np.maximum(top_ASD, at_g)
        rep_cost = ((~np.take_along_axis(old_x_AHSG[:, 0], gq3, axis=2)).astype(np.int64)
                    - ((~old_LEG[la2, b_AD, gq_AD]) & (cb_gq_AD == 1))[:, None, :])
        rbad = (~q_ok_AD[:, None, :]) | (cn_gx > 0) | (b_AD[:, None, :] == ea_AS[:, :, None])
        rbad |= (rep_cost > room_G[gq_AD][:, None, :]) | (rep_cost > room_tot)
        rep_gain[rbad] = -np.inf

        # Best change per layer by gain per move; a free change (cost <= 0) counts as a
        # quarter move so it is preferred but still ranked by its gain.
        def pick(gain, cost):
            need = need_A.reshape((-1,) + (1,) * (gain.ndim - 1))
            key = np.where(gain >= need * np.maximum(cost, 1), gain / np.maximum(cost, 0.25), -np.inf)
            i = key.reshape(A, -1).argmax(axis=1)
            return i, key.reshape(A, -1)[ar, i]
        si, skey = pick(swap_gain[:, 0], swap_cost[:, 0])
        ri, rkey = pick(rep_gain, rep_cost)
        use_rep = rkey > skey
        best = np.maximum(skey, rkey)
        order = np.argsort(-best, kind="stable")
        order = order[np.isfinite(best[order])]
        if order.size == 0:
            break
        # Apply, best gain per move first, re-checking budgets (layers share them).
        applied = np.zeros(A, dtype=bool)
        rep_k = order[use_rep[order]]
        sw_k = order[~use_rep[order]]
        s_rp, d_rp = np.divmod(ri, D)
        s_sw, q_sw = np.divmod(si, C * S)
        # Upper bounds (1 per replication, 1 onto each GPU of a swap): if even they fit, the
        # order does not matter and every layer's change is applied at once.
        one_r, one_s = np.ones(rep_k.size, np.int64), np.ones(sw_k.size, np.int64)
        if not fits((gq_AD[rep_k, d_rp[rep_k]], gpu_P[q_AQ[sw_k, q_sw[sw_k]]], h[sw_k]), (one_r, one_s, one_s)):
            # The budget may bind: apply strictly best first over both kinds, one at a time.
            for k in order:
                kk = np.array([k])
                if use_rep[k]:
                    applied[k] = apply_reps(active[kk], h[kk] * S + s_rp[kk], q_AD[kk, d_rp[kk]])[0]
                else:
                    applied[k] = apply_swaps(active[kk], h[kk] * S + s_sw[kk], q_AQ[kk, q_sw[kk]])[0]
        else:
            if rep_k.size:
                applied[rep_k] = apply_reps(active[rep_k], h[rep_k] * S + s_rp[rep_k], q_AD[rep_k, d_rp[rep_k]])
            if sw_k.size:
                applied[sw_k] = apply_swaps(active[sw_k], h[sw_k] * S + s_sw[sw_k], q_AQ[sw_k, q_sw[sw_k]])
        if not applied.any():
            break
        active = active[applied]
    return phy


def restore_missing(load_LE: np.ndarray, phy2log_LP: np.ndarray, num_gpus: int) -> np.ndarray:
    """Give every expert without a replica (-1 slots or experts absent) one, heaviest first.

    Empty slots (-1) are used first; then the slot of a replica whose expert has the most
    replicas and the lowest load per replica, on the least-loaded GPU that does not hold the
    expert. Returns a copy of phy2log_LP with no expert missing.
    """
    load_LE, _, _ = _check_load_and_maps(load_LE, num_gpus, phy2log_LP=phy2log_LP)
    phy = np.array(phy2log_LP, dtype=np.int64, copy=True)
    L, P = phy.shape
    E = load_LE.shape[1]
    G, S = num_gpus, P // num_gpus
    for l in range(L):
        row = phy[l]
        present = np.zeros(E, dtype=np.int64)
        np.add.at(present, row[row >= 0], 1)
        missing = np.flatnonzero(present == 0)
        if missing.size == 0 and (row >= 0).all():
            continue
        for e in missing[np.argsort(-load_LE[l, missing], kind="stable")]:
            r = np.maximum(present, 1)
            w = np.where(row >= 0, load_LE[l, np.maximum(row, 0)] / r[np.maximum(row, 0)], 0.0)
            gl = w.reshape(G, S).sum(axis=1)
            holds = np.zeros(G, bool)
            holds[np.arange(P)[row == e] // S] = True
            empty = row < 0
            donor = (row >= 0) & (present[np.maximum(row, 0)] >= 2)
            ok = (empty | donor) & ~holds[np.arange(P) // S]
            if not ok.any():
                ok = empty | donor
            if not ok.any():
                raise EplbError(f"{P} slots cannot hold all {E} experts in layer index {l}")
            # Prefer empty slots, then light GPUs, then cheap donors.
            score = np.where(empty, -1e300, gl[np.arange(P) // S] + np.where(donor, w, 0))
            q = int(np.argmin(np.where(ok, score, np.inf)))
            if row[q] >= 0:
                present[row[q]] -= 1
            row[q] = e
            present[e] += 1
        # Leftover empty slots take extra replicas of the heaviest experts per replica.
        for q in np.flatnonzero(row < 0):
            held = set(row[(np.arange(P) // S) == q // S].tolist())
            per = load_LE[l] / np.maximum(present, 1)
            per[list(h for h in held if h >= 0)] = -1.0
            e = int(np.argmax(per))
            row[q] = e
            present[e] += 1
    return phy


def migrate(load_LE: np.ndarray, old_LP: np.ndarray, target_LP: np.ndarray, num_gpus: int,
            num_nodes: int = 1, budget: Budget | None = None,
            num_expert_groups: int | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
    """Turn a from-scratch plan into one that fits the old placement and the budget.

    Returns (phy2log_LP, perm_LP, info). perm_LP maps each slot of the result to a slot of
    target_LP (so the planner's dispatch weights can follow), or is None when the budgeted
    search replaced the target. info holds the move counts of each candidate. With num_nodes > 1
    and num_expert_groups the search keeps each layer's group span (see `budgeted_search`).
    """
    load_LE, L, _ = _check_load_and_maps(load_LE, num_gpus, old_LP=old_LP, target_LP=target_LP)
    old_LP = np.asarray(old_LP, dtype=np.int64)
    target_LP = np.asarray(target_LP, dtype=np.int64)
    if (target_LP < 0).any():
        l, p = np.argwhere(target_LP < 0)[0]
        raise EplbError(f"target_LP has an empty slot ({p} of layer index {l}): a plan fills every slot")
    E = load_LE.shape[1]
    budget = budget or Budget()
    perm = relabel(old_LP, target_LP, num_gpus, E, num_nodes)
    relabeled = np.take_along_axis(target_LP, perm, axis=1)
    moves_scratch = int(count_moves(old_LP, target_LP, num_gpus, E).sum())
    moves_rel_LG = count_moves(old_LP, relabeled, num_gpus, E)
    info = {"moves_from_scratch": moves_scratch, "moves_relabeled": int(moves_rel_LG.sum())}
    if not budget.limited:
        info["method"] = "relabel"
        return relabeled, perm, info
    present_LE = np.bincount((np.arange(L)[:, None] * E + old_LP)[old_LP >= 0], minlength=L * E)
    start = restore_missing(load_LE, old_LP, num_gpus) if (old_LP < 0).any() or (present_LE == 0).any() else old_LP
    searched = budgeted_search(load_LE, start, num_gpus, budget, num_nodes=num_nodes,
                               num_expert_groups=num_expert_groups)
    searched = np.take_along_axis(searched, keep_slots(old_LP, searched, num_gpus), axis=1)
    # The relabelled target wins if the budget can pay for it and it costs no more: summed
    # busiest-GPU load plus move_cost x the layer's mean GPU load per move (the search's price,
    # new (group, node) pairs included).
    fits = ((budget.max_moves is None or moves_rel_LG.sum() <= budget.max_moves)
            and (budget.max_moves_per_gpu is None or moves_rel_LG.sum(axis=0).max() <= budget.max_moves_per_gpu))
    price_L = budget.move_cost * load_LE.sum(axis=1) / num_gpus
    span = _span_priced(num_nodes, num_expert_groups, budget)
    if span:
        from eplb.stats import group_span

        pairs0_L = group_span(old_LP, num_gpus, num_nodes, num_expert_groups, E).sum(axis=1)

    def cost(phy):
        moves_L = count_moves(old_LP, phy, num_gpus, E).sum(axis=1).astype(np.float64)
        if span:   # the search's price of spreading groups over nodes, in moves
            moves_L += budget.span_cost * (group_span(phy, num_gpus, num_nodes, num_expert_groups, E).sum(axis=1)
                                           - pairs0_L)
        return float((max_load(load_LE, phy, num_gpus) + price_L * moves_L).sum())

    if fits and cost(relabeled) <= cost(searched):
        info["method"] = "relabel"
        return relabeled, perm, info
    info["method"] = "budgeted_search"
    return searched, None, info


def adapt_solution(request, sol, budget: Budget, bytes_per_expert: int | None = None):
    """The front door's migration step: a planner's Solution made to fit request.previous.

    Relabels the planner's plan onto the previous placement (balance unchanged) or, when the
    budget cannot pay for that, replaces it by the budgeted search from the previous
    placement (status HEURISTIC, message says so). Move counts go to info["migration"].
    """
    import time

    from eplb.planner_api import Solution

    prev, topo = request.previous, request.topology
    if prev.num_gpus != topo.num_gpus or prev.num_nodes != topo.num_nodes:
        raise EplbError(f"previous placement is for {prev.num_gpus} GPUs on {prev.num_nodes} node(s); "
                        f"this plan is for {topo.num_gpus} on {topo.num_nodes}: plan for the same GPUs")
    if bytes_per_expert is not None:
        _check_count("bytes_per_expert", bytes_per_expert)
    t0 = time.perf_counter()
    phy, perm, info = migrate(request.load_LE, prev.phy2log_LP, sol.phy2log_LP, topo.num_gpus, topo.num_nodes, budget,
                              request.num_expert_groups)
    weights = None
    if perm is not None and sol.dispatch_weights_LP is not None:
        weights = np.take_along_axis(np.asarray(sol.dispatch_weights_LP), perm, axis=1)
    moves_LG = count_moves(prev.phy2log_LP, phy, topo.num_gpus, request.num_logical_experts)
    info.update({
        "moves": int(moves_LG.sum()),
        "moves_max_per_gpu": int(moves_LG.sum(axis=0).max()),
        "bytes": None if bytes_per_expert is None else int(moves_LG.sum()) * int(bytes_per_expert),
        "max_moves": budget.max_moves, "max_moves_per_gpu": budget.max_moves_per_gpu,
        "move_cost": budget.move_cost, "seconds": time.perf_counter() - t0,
    })
    if topo.num_nodes > 1 and request.num_expert_groups:
        from eplb.stats import group_span

        info.update(span_cost=budget.span_cost, **{
            f"group_span_{k}": float(group_span(m, topo.num_gpus, topo.num_nodes, request.num_expert_groups,
                                                request.num_logical_experts).mean())
            for k, m in (("before", prev.phy2log_LP), ("after", phy))})
    if info["method"] == "relabel":
        return Solution(phy, weights, sol.status, sol.message, {**sol.info, "migration": info})
    note = (f"move-budgeted search from the previous placement ({info['moves']} moves; the planner's "
            f"own plan needed {info['moves_relabeled']} after relabelling), even dispatch")
    return Solution(phy, None, "HEURISTIC", f"{sol.message}; {note}" if sol.message else note,
                    {**sol.info, "migration": info})


def max_load(load_LE: np.ndarray, phy2log_LP: np.ndarray, num_gpus: int) -> np.ndarray:
    """Busiest GPU's load per layer under even dispatch, [L] (slots < 0 hold nothing)."""
    load_LE = np.asarray(load_LE, dtype=np.float64)
    L, P = phy2log_LP.shape
    E = load_LE.shape[1]
    valid = phy2log_LP >= 0
    # Replica counts by bincount (np.add.at is ~10x slower; same integer counts).
    r = np.bincount((np.arange(L)[:, None] * E + phy2log_LP)[valid], minlength=L * E).reshape(L, E).astype(np.float64)
    e = np.maximum(phy2log_LP, 0)
    w = np.where(valid, np.take_along_axis(load_LE / np.maximum(r, 1), e, axis=1), 0.0)
    return w.reshape(L, num_gpus, P // num_gpus).sum(axis=2).max(axis=1)


# 3. Scheduling ----------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class MigrationPlan:
    """Copies that turn old_LP into new_LP, in rounds that keep every expert served.

    Transfer m copies expert `expert_M[m]` of layer `layer_M[m]` from slot `src_slot_M[m]`
    (on rank `src_rank_M[m]`, or CHECKPOINT = -1: reload from the checkpoint) into slot
    `dst_slot_M[m]` (on rank `dst_rank_M[m]`) during round `round_M[m]`. Within a round every
    rank sends at most one and receives at most one expert over the network; copies inside
    one GPU (src rank = dst rank) use no link and are not limited. A slot being written
    serves nothing during its round (see `serving`). Ranks and slots are indices of the
    placements (0..G-1, 0..P-1); `rank_ids_G` names the engine rank of each.
    """

    old_LP: np.ndarray
    """Expert in each slot before migration, int64 [L, P]; -1 = empty slot."""
    new_LP: np.ndarray
    """Expert in each slot after migration, int64 [L, P]."""
    slots_per_gpu: int
    """S: slot p lives on rank p // S."""
    num_logical_experts: int
    """E: logical experts."""
    round_M: np.ndarray
    """Round of each transfer, non-decreasing, int64 [M]."""
    layer_M: np.ndarray
    """Layer index (0..L-1) of each transfer, int64 [M]."""
    expert_M: np.ndarray
    """Logical expert copied, int64 [M]."""
    src_rank_M: np.ndarray
    """Rank copied from, or CHECKPOINT (-1), int64 [M]."""
    src_slot_M: np.ndarray
    """Slot copied from (-1 with CHECKPOINT), int64 [M]."""
    dst_rank_M: np.ndarray
    """Rank written to, int64 [M]."""
    dst_slot_M: np.ndarray
    """Slot written to, int64 [M]."""
    staging_M: np.ndarray
    """True for copies that only break a cycle (into a slot restored later), bool [M]."""
    chunk_R: np.ndarray
    """Layer chunk each round belongs to, int64 [R]; a round never mixes chunks."""
    rank_ids_G: np.ndarray
    """Engine rank id of each rank index, int64 [G] (0..G-1 unless ranks failed)."""
    bytes_per_expert: int | None = None
    """Size of one expert's weights, for `bytes` (None: unknown)."""

    def __post_init__(self) -> None:
        old, new = np.asarray(self.old_LP), np.asarray(self.new_LP)
        if old.shape != new.shape or old.ndim != 2:
            raise EplbError(f"old and new maps must be [layers, slots] of one shape, got {old.shape} and {new.shape}")
        S = _check_count("slots_per_gpu", self.slots_per_gpu)
        E = _check_count("num_logical_experts", self.num_logical_experts)
        if self.bytes_per_expert is not None:
            _check_count("bytes_per_expert", self.bytes_per_expert)
        G = len(np.atleast_1d(self.rank_ids_G))
        if np.ndim(self.rank_ids_G) != 1 or G * S != old.shape[1]:
            raise EplbError(f"rank_ids_G names {G} ranks of {S} slots each, but the maps have "
                            f"{old.shape[1]} slots: one engine rank per GPU is needed")
        _check_maps(G, E, old_LP=old, new_LP=new)
        M = len(self.round_M)
        for name in ("round_M", "layer_M", "expert_M", "src_rank_M", "src_slot_M", "dst_rank_M", "dst_slot_M",
                     "staging_M", "chunk_R", "rank_ids_G"):
            a = np.asarray(getattr(self, name))
            if a.ndim != 1 or (a.size and a.dtype.kind not in "biu"):
                raise EplbError(f"{name} must be a 1-D array of whole numbers, got {a.dtype} of shape {a.shape}")
            if name.endswith("_M") and len(a) != M:
                raise EplbError(f"{name} has {len(a)} entries, round_M has {M}")
        # Every index in range (serving, check and the engine index slots by them), and each
        # transfer's ranks the ones its slots live on.
        L, P = old.shape
        lay, exp_ = np.asarray(self.layer_M), np.asarray(self.expert_M)
        src, srank = np.asarray(self.src_slot_M), np.asarray(self.src_rank_M)
        dst, drank = np.asarray(self.dst_slot_M), np.asarray(self.dst_rank_M)
        reload = srank == CHECKPOINT
        bad = ((lay < 0) | (lay >= L) | (exp_ < 0) | (exp_ >= E) | (dst < 0) | (dst >= P) | (drank != dst // S)
               | np.where(reload, src != -1, (src < 0) | (src >= P) | (srank != src // S)))
        if bad.any():
            m = int(np.flatnonzero(bad)[0])
            raise EplbError(f"transfer {m} (layer {lay[m]}, expert {exp_[m]}, slot {src[m]} on rank {srank[m]} -> "
                            f"slot {dst[m]} on rank {drank[m]}) is outside the {L} x {P} maps of {E} experts "
                            f"or names a rank its slot is not on")
        rnd = np.asarray(self.round_M, dtype=np.int64)
        if M and (np.any(np.diff(rnd) < 0) or rnd[0] < 0):
            raise EplbError("transfers must be sorted by round, from round 0")
        if len(self.chunk_R) != (int(rnd[-1]) + 1 if M else 0):
            raise EplbError(f"chunk_R has {len(self.chunk_R)} entries for {int(rnd[-1]) + 1 if M else 0} rounds")
        for name in ("round_M", "layer_M", "expert_M", "src_rank_M", "src_slot_M", "dst_rank_M",
                     "dst_slot_M", "chunk_R", "rank_ids_G"):
            object.__setattr__(self, name, _ro(np.asarray(getattr(self, name), dtype=np.int64)))
        object.__setattr__(self, "staging_M", _ro(np.asarray(self.staging_M, dtype=bool)))
        object.__setattr__(self, "old_LP", _ro(old.astype(np.int64)))
        object.__setattr__(self, "new_LP", _ro(new.astype(np.int64)))
        # Link limits: per round, each rank sends <= 1 and receives <= 1 over the network.
        net = self.network_mask
        for ranks in (self.src_rank_M[net], self.dst_rank_M[net]):
            key = rnd[net] * (len(self.rank_ids_G) + 1) + ranks
            if len(np.unique(key)) != len(key):
                raise EplbError("a rank sends or receives more than one expert in one round")

    @property
    def num_rounds(self) -> int:
        return len(self.chunk_R)

    @property
    def num_transfers(self) -> int:
        return len(self.round_M)

    @property
    def network_mask(self) -> np.ndarray:
        """Transfers that cross a link (not local copies, not checkpoint reloads), bool [M]."""
        return (self.src_rank_M >= 0) & (self.src_rank_M != self.dst_rank_M)

    @property
    def reloads(self) -> int:
        """Copies read from the checkpoint (experts that lost every replica)."""
        return int((self.src_rank_M == CHECKPOINT).sum())

    @property
    def moves(self) -> int:
        """Experts copied onto a GPU that did not hold them before (count_moves of old -> new)."""
        G = len(self.rank_ids_G)
        return int(count_moves(self.old_LP, self.new_LP, G, self.num_logical_experts).sum())

    @property
    def bytes(self) -> int | None:
        """Bytes sent over links and read from the checkpoint (None without bytes_per_expert)."""
        if self.bytes_per_expert is None:
            return None
        return int((self.network_mask.sum() + self.reloads) * self.bytes_per_expert)

    def summary(self) -> dict:
        """JSON-ready counts."""
        return {
            "moves": self.moves, "transfers": self.num_transfers,
            "network_transfers": int(self.network_mask.sum()),
            "local_copies": int(((self.src_rank_M == self.dst_rank_M)).sum()),
            "staging_copies": int(self.staging_M.sum()), "reloads": self.reloads,
            "rounds": self.num_rounds, "bytes": self.bytes,
        }

    def chunks(self) -> list[tuple[np.ndarray, range]]:
        """(layers, rounds) of each layer chunk, in the order they run."""
        out = []
        for c in np.unique(self.chunk_R):
            rounds = np.flatnonzero(self.chunk_R == c)
            layers = np.unique(self.layer_M[np.isin(self.round_M, rounds)])
            out.append((layers, range(int(rounds[0]), int(rounds[-1]) + 1)))
        return out

    def state_before(self, k: int) -> np.ndarray:
        """Complete slot contents when round k starts, int64 [L, P] (k = num_rounds: the end)."""
        if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)) or not 0 <= k <= self.num_rounds:
            raise EplbError(f"round {k!r} is outside 0..{self.num_rounds}")
        cur = self.old_LP.copy()
        done = self.round_M < k
        cur[self.layer_M[done], self.dst_slot_M[done]] = self.expert_M[done]
        return cur

    def serving(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """What to serve with during round k: (phy2log_LP, dispatch_weights_LP).

        Slots being written in round k get weight 0 and are labelled with the expert they
        are receiving; each expert's tokens are split evenly over its complete replicas.
        Experts with no complete replica (only possible for experts lost with failed ranks
        before their reload lands) have weight 0 everywhere.
        """
        if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)) or not 0 <= k < self.num_rounds:
            raise EplbError(f"round {k!r} is outside 0..{self.num_rounds - 1}")
        cur = self.state_before(k)
        now = self.round_M == k
        writing = np.zeros(cur.shape, dtype=bool)
        writing[self.layer_M[now], self.dst_slot_M[now]] = True
        cur[self.layer_M[now], self.dst_slot_M[now]] = self.expert_M[now]
        live = (cur >= 0) & ~writing
        L, E = cur.shape[0], self.num_logical_experts
        n_LE = np.zeros((L, E))
        np.add.at(n_LE, (np.nonzero(live)[0], cur[live]), 1.0)
        w = np.where(live, 1.0 / np.maximum(np.take_along_axis(n_LE, np.maximum(cur, 0), axis=1), 1), 0.0)
        return cur, w

    def serving_placement(self, k: int, *, num_nodes: int = 1, layer_ids=None):
        """`serving(k)` as a Placement (raises if an expert has no complete replica)."""
        from eplb.placement import Placement

        phy, w = self.serving(k)
        if (phy < 0).any():
            l, p = np.argwhere(phy < 0)[0]
            raise EplbError(f"slot {p} of layer index {l} is empty in round {k}: no placement to serve")
        sums = np.zeros((phy.shape[0], self.num_logical_experts))
        np.add.at(sums, (np.arange(phy.shape[0])[:, None], phy), w)
        if (sums == 0).any():
            l, e = np.argwhere(sums == 0)[0]
            raise EplbError(f"expert {e} of layer index {l} has no complete replica in round {k} "
                            f"(lost with a failed rank; it is served again once reloaded)")
        return Placement(phy, len(self.rank_ids_G), self.num_logical_experts, num_nodes, layer_ids, w,
                         planner="migration")

    def check(self) -> None:
        """Replay the schedule and raise AssertionError if any round breaks the guarantees:
        an expert present before losing its last complete replica, a source slot that is
        not complete, or a slot written twice in one round."""
        G = len(self.rank_ids_G)
        S = self.slots_per_gpu
        for k in range(self.num_rounds):
            cur = self.state_before(k)
            now = np.flatnonzero(self.round_M == k)
            dst = set()
            for m in now:
                l, p, s = self.layer_M[m], self.dst_slot_M[m], self.src_slot_M[m]
                assert (l, p) not in dst, f"slot {p} of layer {l} written twice in round {k}"
                dst.add((l, p))
                assert p // S == self.dst_rank_M[m] and 0 <= self.dst_rank_M[m] < G
                if self.src_rank_M[m] != CHECKPOINT:
                    assert cur[l, s] == self.expert_M[m], f"round {k}: source slot {s} does not hold expert"
                    assert s // S == self.src_rank_M[m]
            for m in now:
                l, s = self.layer_M[m], self.src_slot_M[m]
                if s >= 0:
                    assert (l, s) not in dst, f"round {k}: slot {s} of layer {l} is both source and destination"
            phy, w = self.serving(k)
            for l in np.unique(self.layer_M[now]):
                before = set(cur[l][cur[l] >= 0].tolist())
                serving = set(phy[l][w[l] > 0].tolist())
                lost = before - serving
                assert not lost, f"round {k}: experts {sorted(lost)} of layer {l} have no serving replica"


_NO_SAFE_MIGRATION = (
    "no safe migration: every pending slot holds the only replica of its expert and no slot holds "
    "a spare replica to stage through (a layer with as many slots as experts); add redundant slots "
    "or migrate with the experts offline")


def _ro(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    a.setflags(write=False)
    return a


def schedule(old_LP: np.ndarray, new_LP: np.ndarray, num_gpus: int, num_logical_experts: int, *,
             layers_per_chunk: int | None = None, rank_ids=None,
             bytes_per_expert: int | None = None, compiled: bool = True) -> MigrationPlan:
    """Order the copies from old_LP to new_LP into safe rounds (see MigrationPlan).

    Greedy per round: ranks with the most copies left go first; each takes its first
    pending slot that may be written now, i.e. whose current expert keeps another complete
    replica that is not being written this round, from a source slot that is complete and
    on a rank with its send link free (a source on the same GPU needs no link). Experts
    absent from old_LP are read from the checkpoint once, then copied from that replica.

    Cycles: when no pending slot may be written (each holds the only replica of its expert,
    e.g. two GPUs exchanging their only copies of A and B), one such expert is first copied
    into a *staging* slot: a slot already in its final state whose expert has another
    complete replica (exists whenever a layer has more slots than experts present). The
    cycle then unwinds, and the staging slot is restored last. With no such slot (P = E
    and a cycle) a safe schedule does not exist and EplbError says so. After failed ranks
    with P = E, the slots of the lost experts are the only room to stage through: a reload
    that would use up a layer's last such room waits until it is the layer's last copy.

    layers_per_chunk: rounds only mix layers of one chunk of that many consecutive layers,
    and chunks run in order, so an engine can migrate (and free buffers) chunk by chunk.
    compiled=True runs `eplb._schedule_kernel` (numba, releases the GIL: ~10x faster, and a
    serving thread is not stalled while a side thread schedules); compiled=False runs the
    Python version below. Both are held to the same checks; their rounds can differ (the
    compiled one gives the link matching to the ranks with the most copies left first).
    """
    L, P = _check_maps(num_gpus, num_logical_experts, old_LP=old_LP, new_LP=new_LP)
    old_LP = np.asarray(old_LP, dtype=np.int64)
    new_LP = np.asarray(new_LP, dtype=np.int64)
    if (new_LP < 0).any():
        raise EplbError(f"the new placement must hold expert ids 0..{num_logical_experts - 1} in every slot")
    S = P // num_gpus
    had = holdings(old_LP, 1, num_logical_experts)[:, 0] > 0
    gone = had & ~(holdings(new_LP, 1, num_logical_experts)[:, 0] > 0)
    if gone.any():
        l, e = np.argwhere(gone)[0]
        raise EplbError(f"expert {e} of layer index {l} is in the old placement but not the new one: "
                        f"every expert needs a replica in the new placement")
    # All layers in one chunk by default (at least 1: a map of no layers has nothing to chunk).
    chunk = max(L, 1) if layers_per_chunk is None else _check_count("layers_per_chunk", layers_per_chunk)
    chunk = min(chunk, max(L, 1))                           # the kernel takes an int64
    ranks = np.arange(num_gpus) if rank_ids is None else np.asarray(rank_ids)
    if ranks.shape != (num_gpus,) or (ranks.size and ranks.dtype.kind not in "iu"):
        raise EplbError(f"rank_ids must be {num_gpus} whole numbers (one engine rank per GPU), got {rank_ids!r}")
    ranks = ranks.astype(np.int64)
    if compiled:
        from eplb import _schedule_kernel

        arr, chunk_R, status, layer = _schedule_kernel.schedule(
            _kernel_ints(old_LP), _kernel_ints(new_LP), num_gpus, num_logical_experts, chunk, 8)
        if status == _schedule_kernel.STATUS_NO_SPARE:
            raise EplbError(f"{_NO_SAFE_MIGRATION} (layer index {layer})")
        assert status == _schedule_kernel.STATUS_OK, "migration schedule does not converge (bug)"
    else:
        cols: list[tuple] = []
        chunk_R = []
        for c, first in enumerate(range(0, L, chunk)):
            layers = range(first, min(L, first + chunk))
            _schedule_chunk(old_LP, new_LP, layers, S, num_gpus, num_logical_experts, c, cols, chunk_R)
        arr = np.asarray(cols, dtype=np.int64).reshape(-1, 8)
    return MigrationPlan(
        old_LP=old_LP, new_LP=new_LP, slots_per_gpu=S, num_logical_experts=num_logical_experts,
        round_M=arr[:, 0], layer_M=arr[:, 1], expert_M=arr[:, 2], src_rank_M=arr[:, 3],
        src_slot_M=arr[:, 4], dst_rank_M=arr[:, 5], dst_slot_M=arr[:, 6],
        staging_M=arr[:, 7].astype(bool), chunk_R=np.asarray(chunk_R, dtype=np.int64),
        rank_ids_G=ranks, bytes_per_expert=bytes_per_expert,
    )


def _schedule_chunk(old_LP, new_LP, layers, S, G, E, chunk_id, cols, chunk_R, per_rank: int = 8) -> None:
    """Append the rounds of one layer chunk to cols / chunk_R (see `schedule`).

    Spare room of a layer: P minus the experts it holds (empty slots and duplicates). Copies
    keep it, reloads of lost experts use it up, and a cycle needs one unit to stage through:
    a reload that would leave none waits until it is its layer's last pending slot (with
    E < P every reload leaves some)."""
    P = G * S
    tight = E >= P
    cur = {l: old_LP[l].tolist() for l in layers}
    tgt = {l: new_LP[l].tolist() for l in layers}
    holders: dict[tuple[int, int], set] = {}
    for l in layers:
        for p, e in enumerate(cur[l]):
            if e >= 0:
                holders.setdefault((l, e), set()).add(p)
    pend: list[list[tuple[int, int]]] = [[] for _ in range(G)]
    for l in layers:
        for p in np.flatnonzero(old_LP[l] != new_LP[l]).tolist():
            pend[p // S].append((l, p))
    left = sum(len(q) for q in pend)
    # Staging slot -> (blocked slot, expert): the staging copy stays until the blocked slot
    # has been overwritten, or restoring it first would just recreate the cycle.
    staged_for: dict[tuple[int, int], tuple[int, int]] = {}
    guard = 4 * (left + len(layers) * len(cur[layers[0]]) if len(layers) else 0) + 8
    while left:
        guard -= 1
        assert guard > 0, "migration schedule does not converge (bug)"
        rnd = len(chunk_R)
        sourcing, done, inflight = set(), [], set()
        if tight:
            npl = {l: 0 for l in layers}
            for q in pend:
                for (l, _p) in q:
                    npl[l] += 1
            ndist = {l: sum(1 for e in range(E) if holders.get((l, e))) for l in layers}

        def commit(l, p, e, src, src_rank, d):
            o = cur[l][p]
            if o >= 0:
                holders[(l, o)].discard(p)
            sourcing.add((l, src))
            inflight.add((l, e))
            done.append((l, p, e, src_rank, src, d, False))

        # Scan: local copies are taken at once (no link); network and checkpoint candidates
        # (at most `per_rank` per destination rank) go to a matching of links.
        cand: list[list[tuple]] = [[] for _ in range(G)]
        rows, cols_ = [], []
        for d in range(G):
            for (l, p) in pend[d]:
                if (l, p) in sourcing:
                    continue
                if (l, p) in staged_for:
                    blocked, a = staged_for[(l, p)]
                    if cur[l][blocked] == a:
                        continue
                    del staged_for[(l, p)]
                o, e = cur[l][p], tgt[l][p]
                if o >= 0 and len(holders[(l, o)]) < 2:
                    continue                      # p holds the last complete replica of o
                hs = holders.get((l, e))
                if hs:
                    local = next((s for s in hs if s // S == d), None)
                    if local is not None:
                        commit(l, p, e, local, d, d)
                        continue
                    by_rank = {}
                    for s in hs:
                        by_rank.setdefault(s // S, s)
                elif (l, e) in inflight:
                    continue                      # e's only copy is still being written
                elif tight and P - ndist[l] < 2 and npl[l] > 1:
                    continue                      # the layer's last spare room: reload last
                else:
                    by_rank = {G + d: -1}         # lost with every replica: checkpoint reload
                if len(cand[d]) < per_rank:
                    cand[d].append((l, p, e, by_rank))
                    for r in by_rank:
                        rows.append(d)
                        cols_.append(r)
        # Each rank receives <= 1 and sends <= 1: a maximum matching of destination ranks to
        # source ranks (columns G + d stand for the checkpoint, one per destination).
        if rows:
            from scipy.sparse import csr_matrix
            from scipy.sparse.csgraph import maximum_bipartite_matching

            graph = csr_matrix((np.ones(len(rows)), (rows, cols_)), shape=(G, 2 * G))
            match = maximum_bipartite_matching(graph, perm_type="column")
            for d in range(G):
                r = int(match[d])
                if r < 0:
                    continue
                for (l, p, e, by_rank) in cand[d]:
                    if r not in by_rank or (l, p) in sourcing:
                        continue
                    o, src = cur[l][p], by_rank[r]
                    if any(t[0] == l and t[1] == p for t in done[-G:]):
                        continue
                    if o >= 0 and len(holders[(l, o)]) < 2:
                        continue                  # an earlier pick this round took o's spare
                    if src >= 0 and src not in holders.get((l, e), ()):
                        continue                  # the source is being written this round
                    if src < 0 and (l, e) in inflight:
                        continue
                    if src < 0 and tight:
                        if P - ndist[l] < 2 and npl[l] > 1:
                            continue              # another reload this round took the room
                        ndist[l] += 1
                    commit(l, p, e, src, CHECKPOINT if src < 0 else r, d)
                    break
        if not done:
            done = _stage_cycles(cur, tgt, holders, pend, S, staged_for)
            for (l, s_, a, _r, src, *_) in done:
                staged_for[(l, s_)] = (src, a)
        for (l, p, e, src_rank, src, d, staged) in done:
            if cur[l][p] >= 0:
                holders[(l, cur[l][p])].discard(p)
            cur[l][p] = e
            holders.setdefault((l, e), set()).add(p)
            cols.append((rnd, l, e, src_rank, src, d, p, staged))
        chunk_R.append(chunk_id)
        for g in range(G):
            pend[g] = [(l, p) for (l, p) in pend[g] if cur[l][p] != tgt[l][p]]
        # A staging copy makes its slot pending again (it must get its own expert back).
        for (l, p, e, *_rest) in done:
            if cur[l][p] != tgt[l][p] and (l, p) not in pend[p // S]:
                pend[p // S].append((l, p))
        left = sum(len(q) for q in pend)


def _stage_cycles(cur, tgt, holders, pend, S, staged_for):
    """Break every cycle of blocked slots at once, one staging copy per cycle.

    Slot p is blocked when it holds the last replica of its expert o; it waits for a
    pending slot whose target is o. Following these waits from any blocked slot ends in a
    cycle (everything is blocked when this runs). Per cycle, one member's expert is copied
    into a spare slot: a finished slot whose own expert has another complete replica,
    on the member's GPU if possible (no link), else over free links. Only when no finished
    slot is spare: a pending one that is empty or holds a duplicate and stages nothing yet
    (a layer with as many slots as experts whose lost experts' reloads wait for the end).
    """
    waiting_for: dict[tuple[int, int], list] = {}
    for q in pend:
        for (l, p) in q:
            waiting_for.setdefault((l, tgt[l][p]), []).append(p)
    state: dict[tuple[int, int], int] = {}                 # 1 = on the current walk, 2 = done
    cycles = []
    for q in pend:
        for start in q:
            path = []
            node = start
            while node is not None and state.get(node) is None:
                state[node] = 1
                path.append(node)
                l, p = node
                nxt = waiting_for.get((l, cur[l][p]), [])
                node = (l, nxt[0]) if nxt else None
            if node is not None and state.get(node) == 1:
                cycles.append(path[path.index(node):])
            for n in path:
                state[n] = 2
    out, used, send_busy, recv_busy = [], set(), set(), set()
    spares_by_layer: dict[int, tuple[list[int], list[int]]] = {}
    spare = lambda l, s: cur[l][s] < 0 or len(holders[(l, cur[l][s])]) >= 2  # noqa: E731
    for cyc in cycles:
        l = cyc[0][0]
        if l not in spares_by_layer:
            P = len(cur[l])
            spares_by_layer[l] = ([s for s in range(P) if cur[l][s] == tgt[l][s] and cur[l][s] >= 0 and spare(l, s)],
                                  [s for s in range(P) if cur[l][s] != tgt[l][s] and (l, s) not in staged_for
                                   and spare(l, s)])
        best = None
        for spares in spares_by_layer[l]:
            for (_, p) in cyc:
                for s in spares:
                    if (l, s) in used or not spare(l, s):
                        continue
                    if s // S == p // S:
                        best = (p, s)
                        break
                    if best is None and p // S not in send_busy and s // S not in recv_busy:
                        best = (p, s)
                if best is not None and best[1] // S == best[0] // S:
                    break
            if best is not None:
                break
        if best is None:
            continue
        p, s = best
        if s // S != p // S:
            send_busy.add(p // S)
            recv_busy.add(s // S)
        used.add((l, s))
        if cur[l][s] >= 0:
            holders[(l, cur[l][s])].discard(s)
        out.append((l, s, cur[l][p], p // S, p, s // S, True))
    if not out:
        raise EplbError(_NO_SAFE_MIGRATION)
    return out
