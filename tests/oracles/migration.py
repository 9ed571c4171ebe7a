"""Reference twins of the migration kernels: numpy, scipy and plain Python, kept as test oracles.

Legend: L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU, P = G x S slots,
R = L x G rows of S slots.

Each function computes what a numba kernel of `eplb.migration` computes, written the obvious
way (whole-array numpy, scipy's matchings, dicts and sets), and the tests compare them:
- `count_moves`, `keep_counts`, `keep_slots`: equal outputs;
- `gpu_assignment` (scipy's linear_sum_assignment): the same kept totals (ties may differ);
- `budgeted_search` (tests/oracles/search.py, re-exported here): the search in whole-array
  numpy, identical placements (same float64 arithmetic in the same order, same first-maximum
  tie-breaking), from the same `SearchState`, group span priced alike;
- `schedule`: both schedules pass the same replay (their rounds can differ: the kernel gives
  the link matching to the ranks with the most copies left first, this one takes scipy's).
Benchmarks import `schedule` to time the compiled schedule against it (it lives in
migration_schedule.py and is re-exported here). The fastest whole-array twins of the move
kernels, argument for argument (the renaming and its bound included), are moves_numpy.py.
"""

from __future__ import annotations

import numpy as np

from eplb.migration import holdings
from eplb.migration.checks import check_maps
from tests.oracles.migration_schedule import schedule
from tests.oracles.search import budgeted_search

__all__ = ["budgeted_search", "count_moves", "gpu_assignment", "keep_counts", "keep_slots", "schedule"]

# Moves and relabelling ---------------------------------------------------------------------------

def count_moves(old_LP, new_LP, num_gpus: int, num_logical_experts: int) -> np.ndarray:
    """`eplb.migration.count_moves` from [L, G, E] holdings."""
    check_maps(num_gpus, num_logical_experts, old_LP=old_LP, new_LP=new_LP)
    old = holdings(old_LP, num_gpus, num_logical_experts) > 0
    new = holdings(new_LP, num_gpus, num_logical_experts) > 0
    return (new & ~old).sum(axis=2)


def keep_counts(old_LP, new_LP, num_gpus: int, num_logical_experts: int) -> np.ndarray:
    """`eplb.migration.moves._keep_counts` as a batched matmul of holdings."""
    check_maps(num_gpus, num_logical_experts, old_LP=old_LP, new_LP=new_LP)
    old_h = (holdings(old_LP, num_gpus, num_logical_experts) > 0).astype(np.float64)
    new_h = (holdings(new_LP, num_gpus, num_logical_experts) > 0).astype(np.float64)
    return new_h @ old_h.transpose(0, 2, 1)


def gpu_assignment(keep_LGG: np.ndarray, num_nodes: int) -> np.ndarray:
    """`eplb.migration.moves._gpu_assignment` with scipy's linear_sum_assignment."""
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


def keep_slots(old_LP, new_LP, num_gpus: int) -> np.ndarray:
    """`eplb.migration.keep_slots` with sorts and broadcast comparisons."""
    old_LP = np.asarray(old_LP)
    new_LP = np.asarray(new_LP)
    L, P = check_maps(num_gpus, max(int(old_LP.max(initial=0)), int(new_LP.max(initial=0))) + 1,
                      old_LP=old_LP, new_LP=new_LP)
    G, S = num_gpus, P // num_gpus
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
