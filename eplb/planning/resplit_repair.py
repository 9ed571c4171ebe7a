"""Placements for an engine that re-splits every batch: re-split scores and a local search under
them, at any GPU count (numpy; the scores are eplb.dispatch.resplit_score's).

Legend: M = windows (scenarios), L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU,
P = G x S physical slots, C = candidate maps of one search step.

An engine that re-splits each batch among an expert's replicas (`eplb.dispatch.Resplitter`,
rule `resplit`; SGLang's `--ep-dispatch-algorithm lp`) serves a window as well as the best flow
of each expert's tokens onto the GPUs holding its replicas allows. What matters then is not each
GPU's even-split load but which experts share GPUs and how many GPUs each replicated expert
spans: by Hall's theorem the busiest GPU is max over GPU sets Y of (load of the experts held only
inside Y) / |Y|. `resplit_repair` changes a placement in force by slot swaps and rewritten spare
replicas that lower that score over a set of windows (half the mean, half the worst), each kept
only where it buys more than its price in moves.

Each step builds, for every layer at once, a few dozen candidates aimed at the layer's busiest
GPUs in its worst scenario (`_candidates`), ranks them by local scores (each starts from the
placement's own split and re-pours only the experts on the two GPUs it changes:
`eplb.planning.resplit_local`), and keeps each layer's best one if the layer's full score (SWEEPS
sweeps of water-filling from the even split, the upper bound of `eplb.dispatch.resplit_score`)
confirms that it pays.

Because a few dozen windows can all be balanced perfectly under re-split, a plan fitted to them
stops where they are and hedges nothing more; `scenarios` adds the same windows with their
deviation from the mean widened (`spread`), so the search keeps the flow paths that absorb
larger draws than the ones seen.
"""

from __future__ import annotations

import numpy as np

from eplb.dispatch.resplit_score import (
    even_split,
    fixed_loads,
    flexible_loads,
    layout,
    resplit_imbalance,
    water_fill,
)
from eplb.errors import EplbError
from eplb.planning.resplit_local import score_local, slot_flows
from planners.robust import normalise_windows

__all__ = ["PLAN_ROUNDS", "resplit_imbalance", "resplit_repair", "scenarios"]

PLAN_ROUNDS = 8
"""Passes of the search when a plan is made for the rule from scratch (`eplb replay --plan-for
resplit`'s warm-up plan); a decision of the online policy makes `resplit_rounds` (1)."""

STEPS = 4
"""Search steps per pass: each keeps at most one change per layer."""

SWEEPS = 9
"""Water-filling sweeps from the even split that score a layer's map in full."""

LOCAL = ((96, (32, 2, 8, 4)), (320, (24, 1, 6, 4)), (None, (8, 0, 4, 1)))
"""(most slots per layer or None, (SCREEN, HOPS, SWEEPS, VERIFY)): the search's settings for a
layer, from the first tier its slots fit (the work of a step grows with the slots). The SCREEN
best candidates per layer and step by a quick screen are scored locally, the experts HOPS steps
of shared GPUs from the changed GPUs pouring SWEEPS times (around a hot expert on many GPUs a
wide layer's neighbourhood covers most of it), and the VERIFY best of those in full."""

SCREEN_SWEEPS = 2
"""Sweeps of the quick screen (over the experts on the two changed GPUs only)."""

SCREEN_SCENARIOS = 8
"""Scenarios of the quick screen: each layer's busiest under the placement in force."""


WIDTHS = ((3, 4, 16, 4, 3), (8, 32, 64, 8, 4), (1 << 30, 0, 256, 16, 8))
"""Candidates of a step, per layer, (HOT, COLD, SWAPS, SPARES, TARGETS): swaps between the HOT
busiest GPUs of the worst scenario and the COLD least loaded GPUs (the SWAPS most promising), and the
SPARES least needed spare replicas rewritten to each of the TARGETS heaviest experts of the
busiest GPUs (HOT >= G: swaps between any two GPUs, the more loaded one's expert the heavier,
and any spare replica to any of the TARGETS heaviest experts). A layer starts with the first
width; one that finds nothing there tries the next and stops after the last (after the second
where a layer has more than EVERY_SLOTS slots: the widest search grows as P**2)."""

EVERY_SLOTS = 96
"""Most slots per layer for which the widest search runs."""


def scenarios(windows_MLE: np.ndarray, num_gpus: int, weights_M: np.ndarray | None = None,
              spread: tuple[float, ...] = (1.0, 1.5)) -> tuple[np.ndarray, np.ndarray]:
    """The windows normalised (mean GPU load 1) and, for each factor a of `spread`, mean + a x (window -
    mean) (clipped at 0), the mean weighted by weights_M; returns ([M x len(spread), L, E], their weights)."""
    norm = normalise_windows(np.asarray(windows_MLE, dtype=np.float64), num_gpus)
    w_M = np.ones(len(norm)) if weights_M is None else np.asarray(weights_M, dtype=np.float64)
    mean = np.average(norm, axis=0, weights=w_M)[None]
    out = np.concatenate([np.maximum(mean + a * (norm - mean), 0.0) for a in spread])
    return out, np.tile(w_M, len(spread))


def _cost(hi_MC: np.ndarray, w_M: np.ndarray) -> np.ndarray:
    """Half the weighted mean, half the worst scenario, [C]."""
    return 0.5 * (w_M @ hi_MC) / w_M.sum() + 0.5 * hi_MC.max(axis=0)


def _ratio(busiest_MC, load_MCE, G):
    """Busiest / mean GPU, 1 for idle rows."""
    mean = load_MCE.sum(axis=2) / G
    return np.where(mean > 0, busiest_MC / np.where(mean > 0, mean, 1.0), 1.0)


def _candidates(cur_LP, layers, width_L, gpu_MLG, hi_ML, load_MLE, w_M, G):
    """Candidate changes of the active layers: (layer [C], slot a [C], slot b [C], -1 for a
    rewrite of slot a to expert x [C], x [C]). None puts an expert twice on one GPU (a wasted slot
    under re-split)."""
    L, P = cur_LP.shape
    S = P // G
    E = load_MLE.shape[2]
    gpu_P = np.arange(P) // S
    out = []
    for l in layers:
        HOT, COLD, SWAPS, SPARES, TARGETS = WIDTHS[width_L[l]]
        phy = cur_LP[l]
        r_E = np.bincount(phy, minlength=E)
        on_EG = np.zeros((E, G), dtype=bool)
        on_EG[phy, gpu_P] = True
        worst = int(np.argmax(hi_ML[:, l]))
        mean_E = (w_M @ load_MLE[:, l]) / w_M.sum()
        press_G = 0.5 * (w_M @ gpu_MLG[:, l]) / w_M.sum() + 0.5 * gpu_MLG[worst, l]
        hot = np.argsort(-gpu_MLG[worst, l], kind="stable")[:min(HOT, G // 2)]
        cold = np.argsort(press_G, kind="stable")
        cold = cold[~np.isin(cold, hot)][:COLD]
        x_P = mean_E[phy] / r_E[phy]
        # Swaps: a replica of a hot GPU for a lighter one of a cold GPU (moves the difference).
        every = HOT >= G                                            # the widest search: any two GPUs
        a = np.arange(P) if every else np.flatnonzero(np.isin(gpu_P, hot))
        b = np.arange(P) if every else np.flatnonzero(np.isin(gpu_P, cold))
        A, Bq = np.meshgrid(a, b, indexing="ij")
        A, Bq = A.ravel(), Bq.ravel()
        d = x_P[A] - x_P[Bq]
        gain = np.minimum(d, press_G[gpu_P[A]] - press_G[gpu_P[Bq]] - d)
        ok = (gain > 0) | (width_L[l] > 0) & (d > 0)
        if every:
            ok = press_G[gpu_P[A]] > press_G[gpu_P[Bq]]
        ok &= (phy[A] != phy[Bq]) & ~on_EG[phy[A], gpu_P[Bq]] & ~on_EG[phy[Bq], gpu_P[A]]
        A, Bq, gain = A[ok], Bq[ok], gain[ok]
        top = np.argsort(-gain, kind="stable")[:SWAPS]
        A, Bq = A[top], Bq[top]
        out.append(np.stack([np.full(len(A), l), A, Bq, np.full(len(A), -1)], axis=1))
        # Rewrites: a spare replica (its expert has another) of a cold-ish GPU to a heavy hot expert.
        spare = np.flatnonzero((r_E[phy] >= 2) & (every | ~np.isin(gpu_P, hot)))
        spare = spare[np.argsort(x_P[spare], kind="stable")[:SPARES]]
        on_hot = np.arange(P) if every else np.flatnonzero(np.isin(gpu_P, hot))
        heavy = phy[on_hot[np.argsort(-x_P[on_hot], kind="stable")]]
        heavy = heavy[np.sort(np.unique(heavy, return_index=True)[1])][:TARGETS]
        Q, T = np.meshgrid(spare, heavy, indexing="ij")
        Q, T = Q.ravel(), T.ravel()
        ok = ~on_EG[T, gpu_P[Q]]
        out.append(np.stack([np.full(ok.sum(), l), Q[ok], np.full(ok.sum(), -1), T[ok]], axis=1))
    return np.concatenate(out).astype(np.int64) if out else np.zeros((0, 4), np.int64)


def _score(cur_LP, load_MLE, G, w_M):
    """The placement's split after SWEEPS sweeps from the even split: (split per slot [M, L, P + S],
    GPU loads [M, L, G + 1], busiest / mean GPU [M, L], cost [L])."""
    lay = layout(cur_LP, G)
    fixed, flex = fixed_loads(lay, load_MLE), flexible_loads(lay, load_MLE)
    gpu, flow = even_split(lay, fixed, flex)
    water_fill(lay.gpu_BRX, flex, gpu, flow, SWEEPS)
    hi_ML = _ratio(gpu[:, :, :G].max(axis=2), load_MLE, G)
    return [slot_flows(lay, flow, load_MLE, cur_LP), gpu, hi_ML, _cost(hi_ML, w_M)]


def _screen(cand, cur_LP, state, load_MLE, G) -> np.ndarray:
    """A quick cost of each candidate [C], to rank them: on each layer's SCREEN_SCENARIOS busiest
    scenarios, the experts on the two changed GPUs pour SCREEN_SWEEPS times."""
    k = min(SCREEN_SCENARIOS, len(load_MLE))
    pick_KL = np.argsort(-state[2], axis=0, kind="stable")[:k]
    take = [np.take_along_axis(x, pick_KL[:, :, None], axis=0) for x in (state[0], state[1], load_MLE)]
    busiest_KC = score_local(cand, cur_LP, take[0], take[1], take[2], G, 0, SCREEN_SWEEPS)
    ratio_KC = _ratio(busiest_KC, take[2][:, cand[:, 0]], G)
    return 0.5 * ratio_KC.mean(axis=0) + 0.5 * ratio_KC.max(axis=0)


def _best_per_layer(layer_C, gain_C, k):
    """Indices of the k highest gains of each layer, [n]."""
    order = np.lexsort((-gain_C, layer_C))
    start = np.r_[True, layer_C[order[1:]] != layer_C[order[:-1]]] if len(order) else np.zeros(0, bool)
    rank = np.arange(len(order)) - np.maximum.accumulate(np.where(start, np.arange(len(order)), 0))
    return order[rank < k]


def _apply(cur_LP, cand_C4):
    """The candidates' changes made on cur_LP, in place (one per layer)."""
    for l, a, b, x in cand_C4:
        if b >= 0:
            cur_LP[l, a], cur_LP[l, b] = cur_LP[l, b], cur_LP[l, a]
        else:
            cur_LP[l, a] = x


def resplit_repair(old_LP: np.ndarray, windows_MLE: np.ndarray, num_gpus: int, weights_M: np.ndarray | None = None,
                   spread: tuple[float, ...] = (1.0, 1.5), price: float = 0.0,
                   rounds: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """The placement in force, changed for the re-split rule on these windows; (new map [L, P],
    cost [L, 2]: before and after, on the scenarios).

    The cost of a layer is half the weighted mean, half the worst scenario of busiest / mean GPU
    under re-split (`scenarios` of the windows with `spread`), each scenario scored by a feasible
    split (SWEEPS sweeps of water-filling from the even split: an upper bound within a few 1e-3 of
    the optimum, `eplb.dispatch.resplit_score`). `rounds` passes of STEPS steps; each step ranks
    the candidates (module docstring) by local scores (`eplb.planning.resplit_local`) and keeps, per
    layer, the best one where its full score lowers the cost by more than `price` per move (a swap
    moves two replicas, a rewrite one). A layer balanced in every scenario is left.
    """
    old_LP = np.asarray(old_LP, dtype=np.int64)
    L, P = old_LP.shape
    G = int(num_gpus)
    if G < 1 or P % G:
        raise EplbError(f"{P} slots do not split over {num_gpus} GPUs: give the placement's GPU count")
    load_MLE, w_M = scenarios(windows_MLE, G, weights_M, spread)
    cur = old_LP.copy()
    state = _score(cur, load_MLE, G, w_M)
    before = state[3].copy()
    active = before > 1.0 + 1e-9
    width_L = np.zeros(L, dtype=np.int64)
    widths = len(WIDTHS) if P <= EVERY_SLOTS else len(WIDTHS) - 1
    screen, hops, sweeps, verify = next(t for most, t in LOCAL if most is None or P <= most)
    for _ in range(int(rounds) * STEPS):
        layers = np.flatnonzero(active)
        if not layers.size:
            break
        cost = state[3]
        cand = _candidates(cur, layers, width_L, state[1][:, :, :G], state[2], load_MLE, w_M, G)
        # Step 1: every candidate screened by the experts on its two GPUs, a few sweeps; the
        # SCREEN best of each layer scored locally, the VERIFY best of those where they pay.
        pick = _best_per_layer(cand[:, 0], -_screen(cand, cur, state, load_MLE, G), screen)
        cand, load_C = cand[pick], load_MLE[:, cand[pick, 0]]
        c_C = _cost(_ratio(score_local(cand, cur, state[0], state[1], load_MLE, G, hops, sweeps), load_C, G), w_M)
        moves_C = np.where(cand[:, 2] >= 0, 2, 1)
        gain_C = cost[cand[:, 0]] - c_C - price * moves_C
        top = _best_per_layer(cand[:, 0], gain_C, verify)
        top = top[gain_C[top] > 1e-12]
        # Step 2: those scored in full; each layer keeps its best that pays there.
        rows = np.zeros(0, dtype=np.int64)
        if top.size:
            new_NP = cur[cand[top, 0]].copy()
            _apply(new_NP, np.c_[np.arange(len(top)), cand[top, 1:]])
            full = _score(new_NP, load_MLE[:, cand[top, 0]], G, w_M)
            gain_N = cost[cand[top, 0]] - full[3] - price * moves_C[top]
            best = _best_per_layer(cand[top, 0], gain_N, 1)
            best = best[gain_N[best] > 1e-12]
            rows = cand[top[best], 0]
            cur[rows] = new_NP[best]
            for whole, new in zip(state[:3], full[:3]):
                whole[:, rows] = new[:, best]
            state[3][rows] = full[3][best]
        # Step 3: layers that found nothing widen their search, or stop at the widest.
        found = np.zeros(L, dtype=bool)
        found[rows] = True
        width_L[active & ~found] += 1
        active &= found | (width_L < widths)
        width_L = np.minimum(width_L, widths - 1)
        active &= state[3] > 1.0 + 1e-9
    return cur, np.stack([before, state[3]], axis=1)
