"""Reference twin of the adaptive policy's repair kernel (eplb/serving/_policy_kernel.py), kept as a test oracle.

Legend: M = windows, L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU, P = G x S slots.

Written the obvious way: loads recomputed from scratch with numpy at every step, replica counts
from `eplb.stats.replica_counts_minmax`, each candidate swap's change of the smooth maximum
summed directly over windows (four exponentials per window, scaled by the current peak), moves
counted with `count_moves` semantics. The kernel keeps loads incrementally, factors the swap
gain and scales by the peak when the swaps start; on continuous loads the two make the same
choices (tests/unit/test_policy.py compares them slot by slot).
"""

from __future__ import annotations

import numpy as np

from eplb.stats.loads import replica_counts_minmax

_TIE = 1e-12  # as the kernel: closer choices are ties, the first in order wins


def _loads(phy_P, share_EM, G):
    cnt_E = np.bincount(phy_P, minlength=share_EM.shape[0])
    return (share_EM[phy_P] / cnt_E[phy_P][:, None]).reshape(G, -1, share_EM.shape[1]).sum(axis=1)  # [G, M]


def _cost(load_GM):
    top_M = load_GM.max(axis=0)
    return 0.5 * top_M.mean() + 0.5 * top_M.max(), top_M.max()


def _moves_G(old_P, phy_P, G, E):
    S = len(phy_P) // G
    held = np.zeros((G, E), dtype=bool)
    now = np.zeros((G, E), dtype=bool)
    held[np.arange(len(old_P)) // S, old_P] = True
    now[np.arange(len(phy_P)) // S, phy_P] = True
    return (now & ~held).sum(axis=1)


def _fits(old_P, phy_P, G, E, cap_total, cap_G):
    m_G = _moves_G(old_P, phy_P, G, E)
    return m_G.sum() <= cap_total and (m_G <= cap_G).all()


def _fill(old_P, phy_P, target_E, share_EM, G, cap_total, cap_G):
    E = share_EM.shape[0]
    S = len(phy_P) // G
    for e in range(E):
        while np.bincount(phy_P, minlength=E)[e] < target_E[e]:
            cnt_E = np.bincount(phy_P, minlength=E)
            peak_G = _loads(phy_P, share_EM, G).max(axis=1)
            best = None
            for p in range(len(phy_P)):
                x, g = phy_P[p], p // S
                if cnt_E[x] <= target_E[x] or cnt_E[x] <= 1 or (phy_P[g * S:(g + 1) * S] == e).any():
                    continue
                trial = phy_P.copy()
                trial[p] = e
                if not _fits(old_P, trial, G, E, cap_total, cap_G):
                    continue
                if best is None or peak_G[g] < peak_G[best // S] - _TIE * peak_G[best // S]:
                    best = p
            if best is None:
                break
            phy_P[best] = e


def _swaps(old_P, phy_P, share_EM, G, rounds, beta, partners, cap_total, cap_G):
    E, M = share_EM.shape
    S = len(phy_P) // G
    w_EM = share_EM / np.bincount(phy_P, minlength=E)[:, None]
    for _ in range(rounds):
        load_GM = _loads(phy_P, share_EM, G)
        top = load_GM.max()
        z = np.exp(beta * (load_GM - top)).sum()
        peak_G = load_GM.max(axis=1)
        order = sorted(range(G), key=lambda g: (-peak_G[g], g))
        light = list(range(G)) if partners >= G else order[::-1][:partners]
        best, pick = -np.inf, None
        for A in order[:min(2, G)]:
            for a in range(A * S, (A + 1) * S):
                ea = phy_P[a]
                for B in light:
                    for b in range(B * S, (B + 1) * S):
                        eb = phy_P[b]
                        if B == A or eb == ea or (phy_P[A * S:(A + 1) * S] == eb).any() \
                                or (phy_P[B * S:(B + 1) * S] == ea).any():
                            continue
                        trial = phy_P.copy()
                        trial[a], trial[b] = eb, ea
                        if not _fits(old_P, trial, G, E, cap_total, cap_G):
                            continue
                        d_M = w_EM[ea] - w_EM[eb]
                        ea_M = np.exp(beta * (load_GM[A] - top))
                        eb_M = np.exp(beta * (load_GM[B] - top))
                        gain = np.sum(ea_M + eb_M - ea_M * np.exp(-beta * d_M) - eb_M * np.exp(beta * d_M))
                        if pick is None or gain > best + _TIE * abs(best):
                            best, pick = gain, (a, b)
        if pick is None or not best > 1e-9 * z:
            break
        a, b = pick
        phy_P[a], phy_P[b] = phy_P[b], phy_P[a]


def repair(phy2log_LP, windows_MLE, num_gpus, *, rounds_L, beta=50.0, blends=(0.0, 1.0), partners=8,
           max_moves=np.inf, max_moves_G=None):
    """`eplb.serving.policy.repair` (one fill swapped, the default), the obvious way: (new_LP, cost_L2)."""
    old_LP = np.asarray(phy2log_LP, dtype=np.int64)
    L, P = old_LP.shape
    G = num_gpus
    cap_G = np.full(G, np.inf) if max_moves_G is None else np.asarray(max_moves_G, dtype=np.float64)
    tot_ML1 = windows_MLE.sum(axis=2, keepdims=True)
    share_MLE = np.where(tot_ML1 > 0, windows_MLE * G / np.where(tot_ML1 > 0, tot_ML1, 1.0), 0.0)
    new_LP = old_LP.copy()
    cost_L2 = np.empty((L, 2))
    for l in range(L):
        share_EM = share_MLE[:, l].T
        old_cost, best_worst = _cost(_loads(old_LP[l], share_EM, G))
        cost_L2[l] = old_cost
        fills = []
        for blend in blends:
            mean_E, max_E = share_EM.mean(axis=1), share_EM.max(axis=1)
            target_E = replica_counts_minmax((mean_E + blend * (max_E - mean_E))[None], P, max_replicas=G)[0]
            if any((target_E == t).all() for t, _, _ in fills):
                continue
            phy_P = old_LP[l].copy()
            _fill(old_LP[l], phy_P, target_E, share_EM, G, max_moves, cap_G)
            fills.append((target_E, phy_P, _cost(_loads(phy_P, share_EM, G))[1]))
        pick = fills[0]
        for f in fills[1:]:                                       # the lightest, first of (near) equals
            if f[2] < pick[2] - _TIE * pick[2]:
                pick = f
        phy_P = pick[1]
        _swaps(old_LP[l], phy_P, share_EM, G, int(rounds_L[l]), beta, partners, max_moves, cap_G)
        cost, worst = _cost(_loads(phy_P, share_EM, G))
        if worst < best_worst - 1e-12:
            new_LP[l], cost_L2[l, 1] = phy_P, cost
    return new_LP, cost_L2
