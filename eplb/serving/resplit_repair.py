"""Placements for an engine that re-splits every batch: exact re-split scores and a local search
under them (kernels in eplb/serving/_resplit_kernel.py).

Legend: M = windows (scenarios), L = MoE layers, E = logical experts, G = GPUs, P = physical
slots.

An engine that re-splits each batch among an expert's replicas (`eplb.dispatch.Resplitter`,
rule `resplit`) serves a window as well as the best flow of each expert's tokens onto the GPUs
holding its replicas allows. What matters then is not each GPU's even-split load but which
experts share GPUs and how many GPUs each replicated expert spans: by Hall's theorem the busiest
GPU is max over GPU sets X of (load of the experts held only inside X) / |X|, scored here exactly
over all 2**G sets, hence for at most MAX_GPUS GPUs. `resplit_repair` changes a placement in
force by slot swaps and rewritten spare replicas that lower that score over a set of windows
(half the mean, half the worst), each kept only where it buys more than its price in moves.

Because a few dozen windows can all be balanced perfectly under re-split, a plan fitted to them
stops where they are and hedges nothing more; `scenarios` adds the same windows with their
deviation from the mean widened (`spread`), so the search keeps the flow paths that absorb
larger draws than the ones seen.
"""

from __future__ import annotations

import numpy as np

from eplb.core.jit import kernel_floats, kernel_ints
from eplb.errors import EplbError
from eplb.serving import _resplit_kernel
from planners.robust import normalise_windows

MAX_GPUS = 12
"""Exact scoring enumerates the 2**G GPU sets of a layer: 4,096 at 12 GPUs."""

PLAN_ROUNDS = 8
"""Passes of the search when a plan is made for the rule from scratch (`eplb replay --plan-for
resplit`'s warm-up plan); a decision of the online policy makes `resplit_rounds` (1)."""


def check_gpus(num_gpus: int) -> None:
    if num_gpus > MAX_GPUS:
        raise EplbError(f"planning for the re-split rule scores all 2**G GPU sets of a layer, so it takes at most "
                        f"{MAX_GPUS} GPUs; this placement has {num_gpus}: plan with rule='even' instead")


def scenarios(windows_MLE: np.ndarray, num_gpus: int, weights_M: np.ndarray | None = None,
              spread: tuple[float, ...] = (1.0, 1.5)) -> tuple[np.ndarray, np.ndarray]:
    """The windows normalised (mean GPU load 1) and, for each factor a of `spread`, mean + a x (window -
    mean) (clipped at 0), the mean weighted by weights_M; returns ([M x len(spread), L, E], their weights)."""
    norm = normalise_windows(np.asarray(windows_MLE, dtype=np.float64), num_gpus)
    w_M = np.ones(len(norm)) if weights_M is None else np.asarray(weights_M, dtype=np.float64)
    mean = np.average(norm, axis=0, weights=w_M)[None]
    out = np.concatenate([np.maximum(mean + a * (norm - mean), 0.0) for a in spread])
    return out, np.tile(w_M, len(spread))


def resplit_imbalance(phy2log_LP: np.ndarray, windows_MLE: np.ndarray, num_gpus: int) -> np.ndarray:
    """Busiest / mean GPU of each window and layer under the best re-split, [M, L] (idle layers 1)."""
    check_gpus(num_gpus)
    return _resplit_kernel.resplit_busiest(kernel_ints(phy2log_LP), kernel_floats(windows_MLE), int(num_gpus))


def resplit_repair(old_LP: np.ndarray, windows_MLE: np.ndarray, num_gpus: int, weights_M: np.ndarray | None = None,
                   spread: tuple[float, ...] = (1.0, 1.5), price: float = 0.0,
                   rounds: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """The placement in force, changed for the re-split rule on these windows; (new map [L, P],
    cost [L, 2]: before and after, on the scenarios).

    Each layer is searched on its own: every pair of slots on two GPUs swaps experts (two moves),
    every spare replica (of an expert with two or more) may hold another expert (one move); a change
    is kept when the cost (half the weighted mean, half the worst scenario of re-split busiest /
    mean GPU, `scenarios` of the windows with `spread`) drops by more than `price` per move, for at
    most `rounds` passes. A layer already balanced in every scenario is left as it is.
    """
    check_gpus(num_gpus)
    load_MLE, w_M = scenarios(windows_MLE, num_gpus, weights_M, spread)
    return _resplit_kernel.resplit_search(kernel_ints(old_LP), kernel_floats(load_MLE), kernel_floats(w_M),
                                          int(num_gpus), int(rounds), float(price))


def resplit_decision(old_LP: np.ndarray, windows_MLE: np.ndarray, weights_M: np.ndarray, num_gpus: int,
                     num_logical_experts: int, price: float, spread: tuple[float, ...],
                     rounds: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The adaptive policy's decision for the re-split rule: `resplit_repair` of the placement in
    force on the windows, kept per layer where its gain pays for its moves (gain > price x moves,
    moves counted as `eplb.migration.count_moves` does). Returns (new map [L, P] with unchanged
    rows where nothing pays, the layers that change bool [L], their gain [L])."""
    from eplb.migration import count_moves

    new_LP, cost_L2 = resplit_repair(old_LP, windows_MLE, num_gpus, weights_M, spread, price, rounds)
    moves_L = count_moves(old_LP, new_LP, num_gpus, num_logical_experts).sum(axis=1)
    gain_L = cost_L2[:, 0] - cost_L2[:, 1]
    pays_L = (moves_L > 0) & (gain_L > price * moves_L)
    return np.where(pays_L[:, None], new_LP, old_LP), pays_L, np.where(pays_L, gain_L, 0.0)
