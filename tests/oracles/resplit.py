"""Reference for the re-split scores (eplb/dispatch/resplit_score.py), kept as a test oracle: Hall's
bound over all 2**G GPU sets, which the serving path enumerated (a compiled kernel) while it
planned for at most 12 GPUs.

Legend: M = windows, L = MoE layers, E = logical experts, G = GPUs, P = physical slots, N = 2**G
GPU sets.

Under per-batch re-split the busiest GPU of a window is max over non-empty GPU sets X of (the
load of the experts whose every replica lies in X) / |X| (max-flow / min-cut).
"""

from __future__ import annotations

import numpy as np


def hall_busiest(phy_LP: np.ndarray, load_MLE: np.ndarray, G: int) -> np.ndarray:
    """Busiest / mean GPU under the best re-split of each window and layer, [M, L] (idle layers 1),
    by enumerating every GPU set (G <= 12)."""
    assert G <= 12, "the enumeration is for small cases only"
    L, P = phy_LP.shape
    M, _, E = load_MLE.shape
    S = P // G
    sets_N = np.arange(1, 1 << G)
    size_N = np.array([bin(s).count("1") for s in sets_N])
    out = np.ones((M, L))
    for l in range(L):
        mask_E = np.zeros(E, dtype=np.int64)
        for p in range(P):
            mask_E[phy_LP[l, p]] |= 1 << (p // S)
        inside_NE = (mask_E[None, :] & ~sets_N[:, None]) == 0
        for m in range(M):
            tot = load_MLE[m, l].sum()
            if tot > 0:
                out[m, l] = (inside_NE @ load_MLE[m, l] / size_N).max() / (tot / G)
    return out
