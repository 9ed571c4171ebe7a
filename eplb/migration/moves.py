"""Moves and relabelling: how many experts a new placement copies, and renaming it to copy fewer.

Legend: L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU, P = G x S slots,
R = L x G rows of S slots (one per layer and GPU). Slot p lives on GPU p // S.

A *move* is a replica copied onto a GPU that did not hold that expert before (in that layer);
reshuffling slots inside a GPU is free. `relabel` renames the GPUs (and nodes) of a new plan
so that it keeps as many old replicas as possible (an assignment problem per layer), then
`keep_slots` puts every replica that stays on its GPU back in its old slot.

`rename_gpus` renames them by a greedy matching of GPUs by shared experts instead (a few ms at
256 GPUs; the exact assignment keeps a few more replicas for many times the time), and
`fewest_moves` bounds what any renaming can keep before one is made: the adaptive policy's
replan uses both.

The counting and matching are kernels (`_moves_kernel`). Each call is well under a
millisecond compiled and several times that in the fastest numpy / scipy found (sorted-row keys,
a join of holders, scipy's matchings a block at a time: tests/oracles/moves_numpy.py, which the
tests compare them with, beside tests/oracles/migration.py). That is noise on the Rebalancer's
default decision, but the policy=None decision calls count_moves 3-5 times, keep_slots twice and
relabel once, and loses well beyond noise in numpy (docs/results/kernels.md, the `moves` rows).
"""

from __future__ import annotations

import numpy as np

from eplb.core.jit import kernel_ints
from eplb.migration import _moves_kernel
from eplb.migration.checks import check_maps, check_nodes
from planners._threads import run_blocks


def holdings(phy2log_LP: np.ndarray, num_gpus: int, num_logical_experts: int) -> np.ndarray:
    """Replicas of each expert on each GPU, int64 [L, G, E]. Entries < 0 in phy2log_LP (empty) are skipped."""
    phy2log_LP = np.asarray(phy2log_LP)
    L, P = phy2log_LP.shape
    S = P // num_gpus
    gpu_P = np.arange(P) // S
    flat = (np.arange(L)[:, None] * num_gpus + gpu_P[None, :]) * num_logical_experts + phy2log_LP
    flat = flat[phy2log_LP >= 0]
    return np.bincount(flat, minlength=L * num_gpus * num_logical_experts).reshape(L, num_gpus, num_logical_experts)


def count_moves(old_LP: np.ndarray, new_LP: np.ndarray, num_gpus: int, num_logical_experts: int) -> np.ndarray:
    """Moves onto each GPU, int64 [L, G]: experts the GPU holds in new_LP but not in old_LP."""
    check_maps(num_gpus, num_logical_experts, old_LP=old_LP, new_LP=new_LP)
    L, P = np.shape(new_LP)
    R, S = L * num_gpus, P // num_gpus
    return _moves_kernel.count_moves(kernel_ints(old_LP).reshape(R, S),
                                     kernel_ints(new_LP).reshape(R, S)).reshape(L, num_gpus)


def _keep_counts(old_LP: np.ndarray, new_LP: np.ndarray, num_gpus: int, num_logical_experts: int) -> np.ndarray:
    """keep_LGG[l, a, b]: experts new GPU a holds that old GPU b held too, float64 [L, G, G]."""
    check_maps(num_gpus, num_logical_experts, old_LP=old_LP, new_LP=new_LP)
    return _moves_kernel.keep_counts(kernel_ints(old_LP), kernel_ints(new_LP), num_gpus, num_logical_experts)


def _gpu_assignment(keep_LGG: np.ndarray, num_nodes: int) -> np.ndarray:
    """For each layer, which new GPU goes to each old GPU position, int64 [L, G].

    keep_LGG[l, a, b]: experts new GPU a would keep if it became old GPU b. With several
    nodes a node's GPUs move as a whole (node-aware planners packed them together): first
    the best GPU matching for every (new node, old node) pair, then the best node matching.
    A Hungarian method in numba: the same kept totals as scipy's linear_sum_assignment
    (ties may pick other GPUs) without one scipy call per node pair and layer.
    """
    return _moves_kernel.gpu_assignment(np.ascontiguousarray(keep_LGG, dtype=np.float64), int(num_nodes))


SPARSE_FROM_GPUS = 96
"""From this many GPUs (on one node) the GPU matching runs on the sparse overlap graph (scipy's
LAPJVsp): a dense Hungarian costs G^3 per layer, while each GPU shares experts with only a few
others."""


def _gpu_assignment_sparse(old_LP: np.ndarray, new_LP: np.ndarray, num_gpus: int,
                           num_logical_experts: int) -> np.ndarray:
    """`_gpu_assignment` of one node from the overlap pairs alone, int64 [L, G] (optimal too).

    A maximum-weight matching on the pairs (new GPU, old GPU) that share experts, completed
    by pairing the other GPUs in index order (they keep nothing either way). scipy's sparse
    matcher needs a full matching: every new GPU a also gets a dummy old GPU G + a, and all
    weights are raised by 1 (each row is matched once, so the optimum does not change)."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import min_weight_full_bipartite_matching

    G = num_gpus
    start, a_M, b_M, w_M = _moves_kernel.keep_pairs(kernel_ints(old_LP), kernel_ints(new_LP), G,
                                                    num_logical_experts)
    L = len(start) - 1
    out = np.empty((L, G), dtype=np.int64)
    dummy = np.arange(G)
    for l in range(L):
        m = slice(start[l], start[l + 1])
        w = np.concatenate([w_M[m] + 1.0, np.ones(G)])
        graph = csr_matrix((w, (np.concatenate([a_M[m], dummy]), np.concatenate([b_M[m], G + dummy]))),
                           shape=(G, 2 * G))
        rows, cols = min_weight_full_bipartite_matching(graph, maximize=True)
        src_B = np.full(G, -1, dtype=np.int64)
        real = cols < G
        src_B[cols[real]] = rows[real]
        free_rows = np.setdiff1d(np.arange(G), rows[real])
        src_B[src_B < 0] = free_rows               # both in increasing order
        out[l] = src_B
    return out


def relabel(old_LP: np.ndarray, new_LP: np.ndarray, num_gpus: int, num_logical_experts: int,
            num_nodes: int = 1) -> np.ndarray:
    """Slot permutation perm_LP that makes new_LP[l, perm_LP[l]] keep the most old replicas.

    The GPUs of one layer are interchangeable as wholes (and nodes, as wholes of GPUs), so a
    new plan loses nothing by renaming them; the renaming that keeps the most (GPU, expert)
    pairs of old_LP is an assignment problem. Inside a GPU, an expert it already held goes
    back to the slot it occupied, so a kept replica is not even copied locally.
    """
    L, P = check_maps(num_gpus, num_logical_experts, old_LP=old_LP, new_LP=new_LP)
    num_nodes = check_nodes(num_gpus, num_nodes)
    old_LP = np.asarray(old_LP)
    new_LP = np.asarray(new_LP)
    G, S = num_gpus, P // num_gpus
    if num_nodes == 1 and G >= SPARSE_FROM_GPUS:
        gsrc_LG = _gpu_assignment_sparse(old_LP, new_LP, G, num_logical_experts)
    else:
        keep_LGG = _keep_counts(old_LP, new_LP, G, num_logical_experts)
        gsrc_LG = _gpu_assignment(keep_LGG, num_nodes)         # new GPU placed at each old GPU position
    # Slots of new GPU gsrc[l, b] placed on GPU b, still in their own order.
    base_LP = (gsrc_LG[:, :, None] * S + np.arange(S)[None, None, :]).reshape(L, P)
    moved_LP = np.take_along_axis(new_LP, base_LP, axis=1)

    return np.take_along_axis(base_LP, keep_slots(old_LP, moved_LP, G), axis=1)


def keep_slots(old_LP: np.ndarray, new_LP: np.ndarray, num_gpus: int) -> np.ndarray:
    """Within-GPU slot permutation perm_LP: new_LP[l, perm_LP[l]] has each expert that a GPU
    keeps in the slot it held in old_LP (GPUs are not renamed), so kept replicas are not
    even copied locally. The k-th copy of an expert in a GPU's new slots takes the slot of
    its k-th copy in the old ones; the other new slots fill the free slots, both in order."""
    old_LP = np.asarray(old_LP)
    new_LP = np.asarray(new_LP)
    L, P = check_maps(num_gpus, max(int(old_LP.max(initial=0)), int(new_LP.max(initial=0))) + 1,
                      old_LP=old_LP, new_LP=new_LP)
    G, S = num_gpus, P // num_gpus
    src_RS = _moves_kernel.keep_slots(kernel_ints(old_LP).reshape(L * G, S), kernel_ints(new_LP).reshape(L * G, S))
    return src_RS.reshape(L, P) + (np.arange(P) // S * S)[None, :]


def rename_gpus(old_LP: np.ndarray, new_LP: np.ndarray, num_gpus: int, num_logical_experts: int) -> np.ndarray:
    """new_LP with each layer's GPUs renamed by a greedy matching (pairs of new and old GPU
    sharing the most experts first) and each GPU's slots ordered as `keep_slots` does, [L, P]:
    most of what `relabel` keeps, in a few ms at 256 GPUs (blocks of layers on threads)."""
    L, P = check_maps(num_gpus, num_logical_experts, old_LP=old_LP, new_LP=new_LP)
    old_k, new_k = kernel_ints(old_LP), kernel_ints(new_LP)
    out_LP = np.empty_like(new_k)

    def rows(a: int, b: int) -> None:   # rows are independent: blocks of them on threads
        _moves_kernel.rename_gpus(old_k[a:b], new_k[a:b], int(num_gpus), int(num_logical_experts), out_LP[a:b])

    run_blocks(rows, L, P)
    return out_LP


def fewest_moves(old_LP: np.ndarray, new_LP: np.ndarray, num_gpus: int, num_logical_experts: int) -> np.ndarray:
    """A lower bound on the moves (`count_moves`) of new_LP onto old_LP with new_LP's GPUs
    renamed in any way (`rename_gpus`' and `relabel`'s included), per layer, int [L], before a
    renaming is made: each new GPU keeps at most what it shares with the old GPU it shares most
    with (blocks of layers on threads)."""
    L, P = check_maps(num_gpus, num_logical_experts, old_LP=old_LP, new_LP=new_LP)
    old_k, new_k = kernel_ints(old_LP), kernel_ints(new_LP)
    out_L = np.empty(L, dtype=np.int64)

    def rows(a: int, b: int) -> None:
        out_L[a:b] = _moves_kernel.fewest_moves(old_k[a:b], new_k[a:b], int(num_gpus), int(num_logical_experts))

    run_blocks(rows, L, P)
    return out_L
