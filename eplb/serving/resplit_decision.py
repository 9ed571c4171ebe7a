"""The adaptive policy's decision for an engine that re-splits every batch: the placement in force
searched under the re-split score (`eplb.planning.resplit_repair`), kept per layer where its gain
pays for its moves.

Legend: M = windows, L = MoE layers, E = logical experts, G = GPUs, P = G x S physical slots.
"""

from __future__ import annotations

import numpy as np

from eplb.migration import count_moves
from eplb.planning.resplit_repair import resplit_repair
from eplb.serving.repair import renamed
from planners.greedy import plan_greedy
from planners.robust import normalise_windows


def resplit_decision(old_LP: np.ndarray, windows_MLE: np.ndarray, weights_M: np.ndarray, num_gpus: int,
                     num_logical_experts: int, price: float, spread: tuple[float, ...],
                     rounds: int, fresh: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The adaptive policy's decision for the re-split rule: `resplit_repair` of the placement in
    force on the windows, kept per layer where its gain pays for its moves (gain > price x moves,
    moves counted as `eplb.migration.count_moves` does). With `fresh` (layers the change detector
    flagged: a shift a few swaps may not follow), a greedy plan of the windows' weighted sum,
    renamed to keep the most replicas in place and searched the same way, replaces the repair
    where its net gain is higher. Returns (new map [L, P] with unchanged rows where nothing pays,
    the layers that change bool [L], their gain [L])."""
    G, E = num_gpus, num_logical_experts
    new_LP, cost_L2 = resplit_repair(old_LP, windows_MLE, G, weights_M, spread, price, rounds)
    moves_L = count_moves(old_LP, new_LP, G, E).sum(axis=1)
    gain_L = cost_L2[:, 0] - cost_L2[:, 1]
    if fresh and len(old_LP):
        # Step 1: the fresh plan, renamed onto the placement in force, then searched.
        w_M = np.ones(len(windows_MLE)) if weights_M is None else np.asarray(weights_M, dtype=np.float64)
        total_LE = np.tensordot(w_M, normalise_windows(windows_MLE, G), axes=1)
        start_LP = renamed(old_LP, plan_greedy(total_LE, G, old_LP.shape[1] // G), G, E)
        alt_LP, alt_L2 = resplit_repair(start_LP, windows_MLE, G, weights_M, spread, price, rounds)
        alt_moves_L = count_moves(old_LP, alt_LP, G, E).sum(axis=1)
        # Step 2: per layer, the start whose gain net of its moves is higher.
        alt_gain_L = cost_L2[:, 0] - alt_L2[:, 1]
        better = alt_gain_L - price * alt_moves_L > gain_L - price * moves_L
        new_LP = np.where(better[:, None], alt_LP, new_LP)
        moves_L, gain_L = np.where(better, alt_moves_L, moves_L), np.where(better, alt_gain_L, gain_L)
    pays_L = (moves_L > 0) & (gain_L > price * moves_L)
    return np.where(pays_L[:, None], new_LP, old_LP), pays_L, np.where(pays_L, gain_L, 0.0)
