"""The robust planners' packing and swap search written the obvious way, kept as test oracles.

Legend: T = history windows, L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU,
P = G x S slots, I = replicas of a packing round (= G), A = layers still searching,
K = source GPUs a round unloads, Q = K x S source slots.

- `pack_one_window`: `planners.robust.pack_vector`'s one-window rounds, one layer and one item
  at a time (planners.robust packs every layer in lock-step);
- `pack_windows`: `pack_vector`'s many-window rounds, one layer and one round at a time, each
  an assignment (scipy's linear_sum_assignment) on costs built for that layer alone
  (planners.robust builds every layer's costs of a round at once);
- `smooth_max_swaps`: the swap search with every quantity recomputed each round from the slot
  loads ([A, Q, P] gains, per-slot exponentials, the holds table rebuilt, forbidden swaps
  masked afterwards); planners.robust keeps loads, exponentials and holds up to date, starts
  forbidden swaps at -inf and scores a few layers at a time. Both make the same float64
  operations on the same values, so the swaps are the same.
"""

from __future__ import annotations

import numpy as np

from planners.robust import kept_windows


def pack_one_window(rep_LP: np.ndarray, order_LSG: np.ndarray, num_gpus: int, slots_per_gpu: int) -> np.ndarray:
    """phy2log_LP: round k gives item i of rep_LP[l, kG:(k + 1)G] the first GPU of
    order_LSG[l, k] still free in the round that does not hold its expert."""
    L, P = rep_LP.shape
    G, S = num_gpus, slots_per_gpu
    E = int(rep_LP.max()) + 1
    phy2log_LGS = np.empty((L, G, S), dtype=np.int64)
    for l in range(L):
        holds_GE = np.zeros((G, E), dtype=bool)
        for k in range(S):
            free_G = np.ones(G, dtype=bool)
            for e in rep_LP[l, k * G:(k + 1) * G]:
                order_G = order_LSG[l, k]
                fits = order_G[free_G[order_G] & ~holds_GE[order_G, e]]
                assert fits.size, "packing round had no feasible pairing"
                free_G[fits[0]] = False
                holds_GE[fits[0], e] = True
                phy2log_LGS[l, fits[0], k] = e
    return phy2log_LGS.reshape(L, P)


def pack_windows(share_TLE: np.ndarray, count_LE: np.ndarray, rep_LP: np.ndarray, num_gpus: int,
                 slots_per_gpu: int) -> np.ndarray:
    """phy2log_LP: round k pairs the items rep_LP[l, kG:(k + 1)G] with the GPUs so as to minimise
    the sum of the GPUs' worst-window loads after the round, never two replicas of one expert on
    one GPU (1e9 stands for forbidden)."""
    from scipy.optimize import linear_sum_assignment

    T, L, E = share_TLE.shape
    G, S = num_gpus, slots_per_gpu
    w_LET = np.moveaxis(share_TLE / count_LE[None], 0, 2)
    phy2log_LGS = np.empty((L, G, S), dtype=np.int64)
    for l in range(L):
        load_GT = np.zeros((G, T))
        holds_GE = np.zeros((G, E), dtype=bool)
        for k in range(S):
            items_I = rep_LP[l, k * G:(k + 1) * G]
            w_IT = w_LET[l, items_I]
            cost_IG = (load_GT[None, :, :] + w_IT[:, None, :]).max(axis=2)
            cost_IG = np.where(holds_GE[:, items_I].T, 1e9, cost_IG)
            rows_I, gpu_I = linear_sum_assignment(cost_IG)
            assert cost_IG[rows_I, gpu_I].max() < 1e9, "packing round had no feasible pairing"
            phy2log_LGS[l, gpu_I, k] = items_I[rows_I]
            load_GT[gpu_I] += w_IT[rows_I]
            holds_GE[gpu_I, items_I[rows_I]] = True
    return phy2log_LGS.reshape(L, G * S)


def smooth_max_swaps(phy2log_LP, slot_load_LPT, num_gpus: int, *, beta: float, max_rounds: int,
                     quantile: float = 1.0, top_gpus: int = 2, num_units: int = 1, bound_LP=None) -> None:
    """planners.robust.smooth_max_swaps, in place on the same arrays (its docstring specifies it)."""
    L, P, T = slot_load_LPT.shape
    G = num_gpus
    S = P // G
    E = int(phy2log_LP.max()) + 1
    gpu_of_P = np.arange(P) // S
    unit_of_P = gpu_of_P // (G // num_units)
    active = np.arange(L)
    for _ in range(max_rounds):
        if active.size == 0:
            break
        A = active.size
        ar = np.arange(A)
        phy2log_AP = phy2log_LP[active]
        w_APT = slot_load_LPT[active]
        load_AGT = w_APT.reshape(A, G, S, T).sum(axis=2)
        keep_AT = kept_windows(load_AGT, quantile)
        peak_A = np.where(keep_AT[:, None, :], load_AGT, -np.inf).max(axis=(1, 2))
        gpu_peak_AG = np.where(keep_AT[:, None, :], load_AGT, -np.inf).max(axis=2)
        src_AK = np.argsort(-gpu_peak_AG, axis=1, kind="stable")[:, :top_gpus]
        K = src_AK.shape[1]
        a_slot_AQ = (src_AK[:, :, None] * S + np.arange(S)).reshape(A, K * S)
        wa_AQT = np.take_along_axis(w_APT, a_slot_AQ[:, :, None], axis=1)
        ea_AQ = np.take_along_axis(phy2log_AP, a_slot_AQ, axis=1)
        gpu_a_AQ = a_slot_AQ // S
        la_AQT = np.take_along_axis(load_AGT, gpu_a_AQ[:, :, None], axis=1)
        lb_APT = load_AGT[:, gpu_of_P]
        m_A11 = peak_A[:, None, None]
        keep_A1T = keep_AT[:, None, :]
        ea_AQT = np.where(keep_A1T, np.exp(beta * (la_AQT - m_A11)), 0.0)
        eb_APT = np.where(keep_A1T, np.exp(beta * (lb_APT - m_A11)), 0.0)
        ua_AQT = np.exp(np.minimum(beta * wa_AQT, 600.0))
        vb_APT = np.exp(np.minimum(beta * w_APT, 600.0))
        gain_AQP = (ea_AQT.sum(axis=2)[:, :, None] + eb_APT.sum(axis=2)[:, None, :]
                    - np.matmul(ea_AQT / ua_AQT, np.swapaxes(vb_APT, 1, 2))
                    - np.matmul(ua_AQT, np.swapaxes(eb_APT / vb_APT, 1, 2)))
        holds_AGE = np.zeros((A, G, E), dtype=bool)
        holds_AGE[ar[:, None], gpu_of_P[None, :], phy2log_AP] = True
        eb_on_a_AQP = holds_AGE[ar[:, None, None], gpu_a_AQ[:, :, None], phy2log_AP[:, None, :]]
        ea_on_b_AQP = holds_AGE[ar[:, None, None], gpu_of_P[None, None, :], ea_AQ[:, :, None]]
        bad = (gpu_of_P[None, None, :] == gpu_a_AQ[:, :, None]) | eb_on_a_AQP | ea_on_b_AQP
        if bound_LP is not None:
            bnd_AP = bound_LP[active]
            ba_AQ = np.take_along_axis(bnd_AP, a_slot_AQ, axis=1)
            same_unit = unit_of_P[None, None, :] == unit_of_P[a_slot_AQ][:, :, None]
            bad |= ~((~ba_AQ[:, :, None] & ~bnd_AP[:, None, :]) | same_unit)
        gain_AQP = np.where(bad, -np.inf, gain_AQP)
        flat = gain_AQP.reshape(A, -1).argmax(axis=1)
        best = gain_AQP.reshape(A, -1)[ar, flat]
        z_A = np.where(keep_AT[:, None, :], np.exp(beta * (load_AGT - peak_A[:, None, None])), 0.0).sum(axis=(1, 2))
        improve = best > 1e-9 * z_A
        if not improve.any():
            break
        q, b = np.divmod(flat[improve], P)
        layers = active[improve]
        a = a_slot_AQ[ar[improve], q]
        for arr in (phy2log_LP, slot_load_LPT) if bound_LP is None else (phy2log_LP, slot_load_LPT, bound_LP):
            tmp = arr[layers, a].copy()
            arr[layers, a] = arr[layers, b]
            arr[layers, b] = tmp
        active = layers
