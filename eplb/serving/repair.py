"""The adaptive policy's kernels, called from Python: window scores and the repair of a placement
in force (eplb/serving/_policy_kernel.py), and the renaming of a fresh plan onto it (by
`eplb.migration.rename_gpus`).

Legend: M = windows in memory, L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU,
P = G x S physical slots.

Every function here trusts its input (eplb.serving.policy and the Rebalancer check it at the
boundary). eplb.serving.policy re-exports every public name.
"""

from __future__ import annotations

import numpy as np

from eplb.core.jit import kernel_floats, kernel_ints
from eplb.core.topology import Topology
from eplb.migration import count_moves, relabel
from eplb.migration.moves import rename_gpus
from eplb.serving import _policy_kernel
from eplb.stats.loads import group_span
from planners._threads import run_blocks
from planners.robust import normalise_windows


def normalise(windows_MLE: np.ndarray, num_gpus: int) -> np.ndarray:
    """Scale each window and layer so the mean GPU load is 1 (idle ones stay 0), [M, L, E]."""
    return normalise_windows(windows_MLE, num_gpus)


def window_imbalance(phy2log_LP: np.ndarray, windows_MLE: np.ndarray, num_gpus: int) -> np.ndarray:
    """Busiest / mean GPU of a placement on each window under an even split, [M, L].

    windows_MLE: loads per window (counts, planning loads or `normalise`d shares: each window
    and layer is normalised so its mean GPU load is 1).
    """
    return _policy_kernel.window_busiest(kernel_floats(windows_MLE), kernel_ints(phy2log_LP), int(num_gpus))


def replica_counts(phy2log_LP: np.ndarray, num_logical_experts: int) -> np.ndarray:
    """Replicas of each expert per layer, int64 [L, E]."""
    L = phy2log_LP.shape[0]
    flat = (np.arange(L)[:, None] * num_logical_experts + phy2log_LP).ravel()
    return np.bincount(flat, minlength=L * num_logical_experts).reshape(L, num_logical_experts)


_SOURCES = 2           # GPUs with the heaviest worst window a swap may unload
_SWAP_FLOOR = 1e-9     # a swap must lower the smooth maximum by this share of it


def repair(phy2log_LP: np.ndarray, windows_MLE: np.ndarray, num_gpus: int, *, rounds_L: np.ndarray,
           beta: float = 50.0, blends=(0.0, 1.0), partners: int = 8, swap_fills: int = 1, worst_weight: float = 0.5,
           max_moves: float = np.inf, max_moves_G: np.ndarray | None = None,
           weights_M: np.ndarray | None = None, swap_price: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """The placement in force, changed a little to balance every window (compiled, per layer).

    Step 1: target replica counts, as the `robust` planner sets them (demand blending each
            expert's mean and worst share over the windows; each blend tried).
    Step 2: fill the experts below target from those above it, one move each: the new replica
            overwrites a slot of an expert with replicas to spare, on the GPU (without the
            needy expert) whose worst window is lightest.
    Step 3: from the `swap_fills` fills with the lightest worst window (one by default: the swaps
            cost most, and swapping from both fills bought nothing measurable), at most
            rounds_L[l] replica swaps in layer l between one of the two GPUs with the heaviest
            worst window and one of the `partners` with the lightest, each lowering the smooth
            maximum of GPU loads over all windows (sharpness `beta`) the most, and lowering it by
            at least the price of the two replicas a swap moves (2 x `swap_price`, in units of
            the mean GPU load; 0: any drop): the layer's gain rule prices a bundle of moves, so
            without it swaps that buy less than their moves ride along with a fill that pays.
    Per layer, the result with the lightest worst window is kept (the layer stays as it was
    unless one beats it). Moves stay within `max_moves` per layer and `max_moves_G[g]`
    onto GPU g. windows_MLE: loads per window (normalised inside, see `window_imbalance`);
    weights_M: each window's weight in the means and the smooth maximum (default 1 each:
    weight k is the window counted k times), never in a worst window.
    Returns (phy2log_LP, cost_L2): the new map and the cost of the old and the new placement per
    layer, cost = (1 - worst_weight) x the mean + worst_weight x the worst window of busiest /
    mean GPU (the adaptive policy's decision uses half and half).
    """
    old = kernel_ints(phy2log_LP)
    G = int(num_gpus)
    new_LP = np.empty_like(old)
    cost_L2 = np.empty((old.shape[0], 2))
    cap_G = np.full(G, np.inf) if max_moves_G is None else kernel_floats(max_moves_G)
    w_M = np.ones(np.shape(windows_MLE)[0]) if weights_M is None else kernel_floats(weights_M)
    windows, blends, rounds_L = kernel_floats(windows_MLE), kernel_floats(blends), kernel_ints(rounds_L)
    # The swaps compare drops of Z = sum exp(beta x load): lowering the smooth maximum by d
    # lowers Z by the share 1 - exp(-beta d).
    floor = max(_SWAP_FLOOR, float(-np.expm1(-float(beta) * 2.0 * float(swap_price))))
    how = (float(beta), int(partners), _SOURCES, floor)

    def repair_block(first: int, stop: int) -> None:
        # The caps are per layer: blocks of layers on the planners' threads give the same map.
        _policy_kernel.repair(windows, w_M, old, blends, rounds_L, G, how, int(swap_fills), float(worst_weight),
                              float(max_moves), cap_G, new_LP, cost_L2, first, stop)

    M, L = windows.shape[:2]
    run_blocks(repair_block, L, M * old.shape[1])
    return new_LP, cost_L2


def robust_repair(phy2log_LP: np.ndarray, windows_MLE: np.ndarray, num_gpus: int, *, swaps: int,
                  beta: float = 50.0, blends=(0.0, 1.0), partners: int = 8) -> np.ndarray:
    """`repair` with `swaps` rounds in every layer and no move cap; returns phy2log_LP (new)."""
    rounds_L = np.full(np.shape(phy2log_LP)[0], int(swaps))
    return repair(phy2log_LP, windows_MLE, num_gpus, rounds_L=rounds_L, beta=beta, blends=blends,
                  partners=partners)[0]


def renamed(old_LP: np.ndarray, new_LP: np.ndarray, num_gpus: int, num_logical_experts: int,
            num_nodes: int = 1) -> np.ndarray:
    """new_LP with its GPUs renamed (and slots ordered) to keep the most replicas of old_LP in
    place, [L, P]. One node: a greedy matching of GPUs by shared experts
    (`eplb.migration.rename_gpus`, a few ms at 256 GPUs); more nodes: `eplb.migration.relabel`
    (nodes renamed as wholes)."""
    if num_nodes > 1:
        return np.take_along_axis(new_LP, relabel(old_LP, new_LP, num_gpus, num_logical_experts, num_nodes), axis=1)
    return rename_gpus(old_LP, new_LP, num_gpus, num_logical_experts)


def group_pairs(phy2log_LP: np.ndarray, topology: Topology, num_expert_groups: int,
                num_logical_experts: int) -> np.ndarray:
    """(expert group, node) pairs holding a replica, per layer, int [L] (Budget.span_cost prices them)."""
    return group_span(phy2log_LP, topology, num_expert_groups, num_logical_experts).sum(axis=1)


def within_caps(old_LP: np.ndarray, windows_L: list, num_gpus: int, num_logical_experts: int, budget,
                rounds_L: np.ndarray, pays_L: np.ndarray, new_LP: np.ndarray, gain_L: np.ndarray, moves_LG: np.ndarray,
                price_L, kw: dict):
    """Keep the paying layers (pays_L) of a decision that fit Budget.max_moves / max_moves_per_gpu,
    best gain per move first; a layer that does not fit whole is repaired again within what is
    left, on its own windows and their weights (windows_L[l]: [M, L, E], [M]) with rounds_L[l]
    swaps, and kept if its gain still beats price_L(rows, moves, layers). Returns (keep_L, new_LP,
    gain_L)."""
    G, E = int(num_gpus), int(num_logical_experts)
    left = np.inf if budget.max_moves is None else float(budget.max_moves)
    left_G = np.full(G, np.inf if budget.max_moves_per_gpu is None else float(budget.max_moves_per_gpu))
    moves_L = moves_LG.sum(axis=1)
    keep_L = np.zeros_like(pays_L)
    new_LP, gain_L = new_LP.copy(), gain_L.copy()
    for l in sorted(np.flatnonzero(pays_L), key=lambda l: -gain_L[l] / moves_L[l]):
        if left <= 0 or not (left_G > 0).any():
            break
        if moves_L[l] > left or (moves_LG[l] > left_G).any():
            win_MLE, w_M = windows_L[l]
            rows, cost = repair(old_LP[l:l + 1], win_MLE[:, l:l + 1], G, rounds_L=rounds_L[l:l + 1],
                                max_moves=left, max_moves_G=left_G, weights_M=w_M, **kw)
            m_G = count_moves(old_LP[l:l + 1], rows, G, E)[0]
            gain = cost[0, 0] - cost[0, 1]
            if m_G.sum() == 0 or not gain > price_L(rows, m_G.sum(keepdims=True), [l])[0]:
                continue
            assert m_G.sum() <= left and (m_G <= left_G).all(), "capped repair exceeded its caps"
            new_LP[l], gain_L[l], moves_LG[l] = rows[0], gain, m_G
        keep_L[l] = True
        left -= moves_LG[l].sum()
        left_G -= moves_LG[l]
    return keep_L, new_LP, gain_L
