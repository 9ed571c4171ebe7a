"""Whole-array numpy / scipy twins of eplb/migration/_moves_kernel.py, argument for argument.

Legend: L = MoE layers, E = logical experts, G = GPUs, N = nodes, S = slots per GPU,
P = G x S slots, R = rows of S slots (one per layer and GPU), M = (layer, new GPU, old GPU)
pairs sharing an expert.

The fastest numpy versions found of every kernel (issue 34), with the kernels' signatures so that
benchmarks/bench_kernels.py patches them into the serving calls: they lost there (each call is
sub-millisecond compiled and several times that in numpy, docs/results/kernels.md), so they live
here as the tests' references. The tests assert equal outputs, except `gpu_assignment`: the same
kept totals (ties may pick other GPUs).

Every step works on all layers at once: rows are sorted, experts of one row are told apart by
keys row x span + expert (sorted rows give sorted keys, so a membership test is one
searchsorted), and GPUs sharing experts are found by joining new and old holders on (layer,
expert). The matchings are scipy's, a block at a time; the greedy GPU matching is found in rounds
of pairs that come first for both their GPUs.
"""

from __future__ import annotations

import numpy as np


def _span(*maps) -> int:
    """One more than the largest key offset an entry (>= -1) of maps takes."""
    return int(max((int(m.max(initial=0)) for m in maps), default=0)) + 2


def _sorted_keys(x_RS: np.ndarray, span: int):
    """(keys, first): each row sorted, as keys r x span + x + 1 (ascending over the whole array),
    and whether an entry is a row's first copy of a held expert (x >= 0), [R, S] each."""
    xs_RS = np.sort(x_RS, axis=1)
    first_RS = xs_RS >= 0
    first_RS[:, 1:] &= xs_RS[:, 1:] != xs_RS[:, :-1]
    return xs_RS + 1 + np.arange(len(xs_RS))[:, None] * span, first_RS


def _member(sorted_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Is each of keys in sorted_keys (ascending)?"""
    if not sorted_keys.size:
        return np.zeros(keys.shape, dtype=bool)
    at = np.minimum(np.searchsorted(sorted_keys, keys), sorted_keys.size - 1)
    return sorted_keys[at] == keys


def count_moves(old_RS: np.ndarray, new_RS: np.ndarray) -> np.ndarray:
    """Experts (>= 0) a row of new_RS holds that its row of old_RS does not, each counted
    once, int64 [R]."""
    span = _span(old_RS, new_RS)
    kn_RS, first_RS = _sorted_keys(new_RS, span)
    ko_RS, _ = _sorted_keys(old_RS, span)
    return (first_RS & ~_member(ko_RS.ravel(), kn_RS)).sum(axis=1)


def _occurrence_keys(x_RS: np.ndarray, span: int) -> np.ndarray:
    """Keys unique over the whole array: (r x span + x + 1) x S + (copies of x before it in its
    row), [R, S]; an empty slot (x < 0) gets -1 - its flat index, matching nothing."""
    R, S = x_RS.shape
    key = (x_RS + 1 + np.arange(R)[:, None] * span).ravel()
    order = np.argsort(key, kind="stable")
    ks = key[order]
    start = np.ones(ks.size, dtype=bool)
    start[1:] = ks[1:] != ks[:-1]
    idx = np.arange(ks.size)
    occ = np.empty_like(idx)
    occ[order] = idx - np.maximum.accumulate(np.where(start, idx, 0))
    out = key * S + occ
    empty = x_RS.ravel() < 0
    out[empty] = -1 - np.flatnonzero(empty)
    return out.reshape(R, S)


def keep_slots(old_RS: np.ndarray, new_RS: np.ndarray) -> np.ndarray:
    """The within-row source slot of each old position, int64 [R, S]: the k-th copy of an expert
    in a row's new slots takes the position of its k-th copy in the old ones; the other new
    slots fill the free positions, both in increasing order."""
    R, S = new_RS.shape
    span = _span(old_RS, new_RS)
    kn = _occurrence_keys(new_RS, span).ravel()
    ko = _occurrence_keys(old_RS, span).ravel()
    order = np.argsort(ko)
    out = np.empty(R * S, dtype=np.int64)
    matched = np.zeros(R * S, dtype=bool)
    taken = np.zeros(R * S, dtype=bool)
    if ko.size:
        at = order[np.minimum(np.searchsorted(ko[order], kn), ko.size - 1)]
        matched = ko[at] == kn                   # keys are unique: at most one old position
        taken[at[matched]] = True
        out[at[matched]] = np.flatnonzero(matched) % S
    # Free positions and unmatched slots, each in row-major order: a row has as many of one
    # as of the other, so the k-th of each pair up inside their row.
    out[~taken] = np.flatnonzero(~matched) % S
    return out.reshape(R, S)


def _holder_join(old_LP: np.ndarray, new_LP: np.ndarray, G: int, E: int, distinct: bool):
    """Every (layer, new slot, old slot) holding one expert, as (l, a, b): the layer, the new
    slot's GPU and the old slot's, in the order (l, new slot, old slot). distinct: a GPU's
    second copy of an expert is left out on both sides."""
    L, P = new_LP.shape
    S = P // G
    gpu_LP = np.broadcast_to(np.arange(P) // S, (L, P))
    layer_LP = np.broadcast_to(np.arange(L)[:, None], (L, P))
    keep_o, keep_n = old_LP >= 0, new_LP >= 0
    if distinct:
        keep_o = keep_o & _first_copies(old_LP, G)
        keep_n = keep_n & _first_copies(new_LP, G)
    # Old holders sorted by (layer, expert), in slot order among equals; (layer, expert) k's
    # are bo[start[k]:start[k + 1]].
    ko = (layer_LP * E + old_LP)[keep_o]
    bo = gpu_LP[keep_o][np.argsort(ko, kind="stable")]
    count = np.bincount(ko, minlength=L * E)
    start = np.cumsum(count) - count
    kn = (layer_LP * E + new_LP)[keep_n]
    lo, reps = start[kn], count[kn]
    # The ragged ranges lo:lo + reps, concatenated.
    at = np.repeat(lo - np.cumsum(reps) + reps, reps) + np.arange(reps.sum())
    return np.repeat(layer_LP[keep_n], reps), np.repeat(gpu_LP[keep_n], reps), bo[at]


def _first_copies(x_LP: np.ndarray, G: int) -> np.ndarray:
    """Is each slot its GPU's first copy of its expert? bool [L, P]."""
    L, P = x_LP.shape
    S = P // G
    x_RSS = x_LP.reshape(L * G, S)
    dup = (x_RSS[:, :, None] == x_RSS[:, None, :]) & np.tri(S, k=-1, dtype=bool)[None]
    return ~dup.any(axis=2).reshape(L, P)


def _pairs(old_LP: np.ndarray, new_LP: np.ndarray, G: int, E: int):
    """(l_M, a_M, b_M, w_M): the nonzero entries of keep_LGG (experts new GPU a holds that old
    GPU b held too, each once), sorted by (l, a, b), int64 each."""
    l, a, b = _holder_join(old_LP, new_LP, G, E, distinct=True)
    key, w_M = np.unique((l * G + a) * G + b, return_counts=True)
    return key // (G * G), key // G % G, key % G, w_M


def keep_pairs(old_LP: np.ndarray, new_LP: np.ndarray, G: int, E: int):
    """The nonzero entries of keep_counts, layer by layer: (start_L1, a_M, b_M, w_M), layer l's at
    start_L1[l]:start_L1[l + 1] (sorted by (a, b) inside a layer, where the kernel keeps its own
    order)."""
    l_M, a_M, b_M, w_M = _pairs(old_LP, new_LP, G, E)
    return np.searchsorted(l_M, np.arange(len(new_LP) + 1)), a_M, b_M, w_M


def keep_counts(old_LP: np.ndarray, new_LP: np.ndarray, G: int, E: int) -> np.ndarray:
    """keep_LGG[l, a, b]: experts new GPU a holds that old GPU b held too (each counted once),
    float64 [L, G, G]."""
    L = len(new_LP)
    l, a, b = _holder_join(old_LP, new_LP, G, E, distinct=True)
    return np.bincount((l * G + a) * G + b, minlength=L * G * G).reshape(L, G, G).astype(np.float64)


def _max_matching(block_M, row_M, col_M, w_M):
    """A maximum-weight matching of the blocks given (scipy's LAPJVsp on their block-diagonal
    graph: best for a few small blocks, its work grows with the square of the graph): pairs
    (row, col) of weight w > 0 in block block_M; returns whether each pair is matched. Each
    row also gets a dummy column of its own and every weight is raised by 1, so a full matching
    exists and its optimum is the same (every row is matched once)."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import min_weight_full_bipartite_matching

    if not block_M.size:
        return np.zeros(0, dtype=bool)
    rkeys, r_M = np.unique(block_M * (row_M.max() + 1) + row_M, return_inverse=True)
    ckeys, c_M = np.unique(block_M * (col_M.max() + 1) + col_M, return_inverse=True)
    n, m = rkeys.size, ckeys.size
    dummy = np.arange(n)
    graph = csr_matrix((np.concatenate([w_M + 1.0, np.ones(n)]),
                        (np.concatenate([r_M, dummy]), np.concatenate([c_M, m + dummy]))), shape=(n, m + n))
    rows, cols = min_weight_full_bipartite_matching(graph, maximize=True)
    col_of = np.full(n, -1, dtype=np.int64)
    col_of[rows] = cols
    return col_of[r_M] == c_M


SPARSE_FROM_GPUS = 96
"""From this many GPUs in a block the matching runs on the sparse overlap graph (scipy's LAPJVsp,
a block at a time): a dense assignment costs n^3 per block, while each GPU shares experts with only
a few others. Smaller blocks each get scipy's dense linear_sum_assignment."""


def _block_matchings(block_M, row_M, col_M, w_M, n: int) -> np.ndarray:
    """`_max_matching` of each block of n x n, a block per scipy call (LAPJVsp, or the dense
    assignment below SPARSE_FROM_GPUS): one call on all blocks at once is slower, its work growing
    with the square of the whole graph."""
    from scipy.optimize import linear_sum_assignment

    keys, k_M = np.unique(block_M, return_inverse=True)
    if n >= SPARSE_FROM_GPUS:
        order = np.argsort(k_M, kind="stable")
        out = np.zeros(k_M.size, dtype=bool)
        ks = k_M[order]
        bounds = np.searchsorted(ks, np.arange(keys.size + 1))
        for k in range(keys.size):
            m = order[bounds[k]:bounds[k + 1]]
            out[m] = _max_matching(np.zeros(m.size, dtype=np.int64), row_M[m], col_M[m], w_M[m])
        return out
    w_Knn = np.zeros((keys.size, n, n))
    w_Knn[k_M, row_M, col_M] = w_M
    hit_Knn = np.zeros(w_Knn.shape, dtype=bool)
    for k in range(keys.size):
        rows, cols = linear_sum_assignment(w_Knn[k], maximize=True)
        hit_Knn[k, rows, cols] = True
    return hit_Knn[k_M, row_M, col_M]


def _complete(out_LG: np.ndarray, used_LG: np.ndarray, rank_LG: np.ndarray) -> np.ndarray:
    """out_LG (new GPU at each old position) with its -1 entries filled by the unused new GPUs
    (not used_LG), both in increasing order within a layer; the new GPUs sorted by rank_LG
    first (the position of the old node they go to), so they fill that node's positions."""
    free_l, free_b = np.nonzero(out_LG < 0)
    new_l, new_a = np.nonzero(~used_LG)
    order = np.lexsort((new_a, rank_LG[new_l, new_a], new_l))
    out_LG[free_l, free_b] = new_a[order]
    return out_LG


def gpu_assignment_pairs(l_M, a_M, b_M, w_M, L: int, G: int, num_nodes: int) -> np.ndarray:
    """out[l, b] = new GPU placed at old GPU b, int64 [L, G], from the overlap pairs: the best GPU
    matching inside every (new node, old node) pair, then the best node matching (one node: one
    matching of all GPUs). Optimal; ties may pick other GPUs than another matcher."""
    n = G // num_nodes
    A_M, B_M = a_M // n, b_M // n
    # Step 1: the best GPU matching inside each (layer, new node, old node) block sharing experts.
    block_M = (l_M * num_nodes + A_M) * num_nodes + B_M
    inner_M = _block_matchings(block_M, a_M % n, b_M % n, w_M, n)
    # Step 2: the best node matching per layer, on what each block's matching keeps.
    node_w = np.bincount(block_M[inner_M], weights=w_M[inner_M], minlength=L * num_nodes * num_nodes)
    node_key = np.flatnonzero(node_w)
    nl, nA, nB = node_key // (num_nodes * num_nodes), node_key // num_nodes % num_nodes, node_key % num_nodes
    node_of_LN = np.full((L, num_nodes), -1, dtype=np.int64)     # new node placed at old node B
    hit = _max_matching(nl, nA, nB, node_w[node_key])
    node_of_LN[nl[hit], nB[hit]] = nA[hit]
    used_LN = np.zeros((L, num_nodes), dtype=bool)
    used_LN[nl[hit], nA[hit]] = True
    node_of_LN = _complete(node_of_LN, used_LN, np.zeros((L, num_nodes), dtype=np.int64))
    # Step 3: the chosen blocks' GPU pairs, the rest of each old node filled in index order.
    out_LG = np.full((L, G), -1, dtype=np.int64)
    chosen = inner_M & (node_of_LN[l_M, B_M] == A_M)
    out_LG[l_M[chosen], b_M[chosen]] = a_M[chosen]
    used_LG = np.zeros((L, G), dtype=bool)
    used_LG[l_M[chosen], a_M[chosen]] = True
    place_LN = np.empty_like(node_of_LN)                       # old node each new node goes to
    np.put_along_axis(place_LN, node_of_LN, np.broadcast_to(np.arange(num_nodes), (L, num_nodes)), axis=1)
    return _complete(out_LG, used_LG, np.repeat(place_LN, n, axis=1))


def gpu_assignment(keep_LGG: np.ndarray, num_nodes: int) -> np.ndarray:
    """`gpu_assignment_pairs` from a dense overlap matrix keep_LGG [L, G, G]."""
    L, G, _ = keep_LGG.shape
    l, a, b = np.nonzero(keep_LGG)
    return gpu_assignment_pairs(l, a, b, keep_LGG[l, a, b], L, G, num_nodes)


def match_gpus(old_LP: np.ndarray, new_LP: np.ndarray, num_gpus: int, num_logical_experts: int) -> np.ndarray:
    """For each layer, the GPU of new_LP to put at each old GPU's position, int64 [L, G]: pairs of
    (new GPU, old GPU) sharing the most replicas first (among equals, the pair met first going
    through new slots, then old holders, in order), each GPU used once; the other positions get
    the other new GPUs, both in increasing order.

    The sequential greedy matching is found in rounds: a pair that comes first (in that order)
    among the open pairs of its new GPU and of its old GPU is one the greedy takes, so every such
    pair is taken at once and the pairs of the GPUs it uses are dropped."""
    L, P = old_LP.shape
    G = num_gpus
    l, h, g = _holder_join(old_LP, new_LP, G, num_logical_experts, distinct=False)
    key = (l * G + h) * G + g
    pair, first, w = np.unique(key, return_index=True, return_counts=True)
    # Rank of each pair in the greedy's order, per layer: most shared first, then first met.
    rank = np.empty(pair.size, dtype=np.int64)
    rank[np.lexsort((first, -w, pair // (G * G)))] = np.arange(pair.size)
    pl, ph, pg = pair // (G * G), pair // G % G, pair % G
    out_LG = np.full((L, G), -1, dtype=np.int64)
    used_LG = np.zeros((L, G), dtype=bool)
    kh, kg = pl * G + ph, pl * G + pg
    while rank.size:
        best_h = np.full(L * G, np.iinfo(np.int64).max)
        best_g = best_h.copy()
        np.minimum.at(best_h, kh, rank)
        np.minimum.at(best_g, kg, rank)
        take = (best_h[kh] == rank) & (best_g[kg] == rank)
        out_LG.flat[kg[take]] = ph[take]
        used_LG.flat[kh[take]] = True
        open_ = ~used_LG.flat[kh] & (out_LG.flat[kg] < 0)
        rank, pl, ph, pg, kh, kg = rank[open_], pl[open_], ph[open_], pg[open_], kh[open_], kg[open_]
    return _complete(out_LG, used_LG, np.zeros((L, G), dtype=np.int64))


def fewest_moves(old_LP: np.ndarray, new_LP: np.ndarray, num_gpus: int, num_logical_experts: int) -> np.ndarray:
    """For each layer, a lower bound on the moves of new_LP with its GPUs renamed in any way,
    int64 [L]: each new GPU keeps at most what it shares with the old GPU it shares most with,
    and moves the rest of its own (each expert counted once)."""
    L, P = old_LP.shape
    G = num_gpus
    own_L = (_first_copies(new_LP, G) & (new_LP >= 0)).sum(axis=1)
    l_M, a_M, _, w_M = _pairs(old_LP, new_LP, G, num_logical_experts)
    best_LG = np.zeros(L * G, dtype=np.int64)
    np.maximum.at(best_LG, l_M * G + a_M, w_M)
    return own_L - best_LG.reshape(L, G).sum(axis=1)


def rename_gpus(old_LP: np.ndarray, new_LP: np.ndarray, num_gpus: int, num_logical_experts: int,
                out_LP: np.ndarray) -> None:
    """new_LP with each layer's GPUs renamed by `match_gpus` and each GPU's slots ordered by
    `keep_slots`, into out_LP [L, P]."""
    L, P = old_LP.shape
    G = num_gpus
    S = P // G
    src_LG = match_gpus(old_LP, new_LP, G, num_logical_experts)
    moved_RS = np.take_along_axis(new_LP.reshape(L, G, S), src_LG[:, :, None], axis=1).reshape(L * G, S)
    keep_RS = keep_slots(old_LP.reshape(L * G, S), moved_RS)
    out_LP[:] = np.take_along_axis(moved_RS, keep_RS, axis=1).reshape(L, P)
