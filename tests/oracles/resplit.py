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


def water_fill_reference(gpu_BRX: np.ndarray, flex_MBR: np.ndarray, gpu: np.ndarray, flow: np.ndarray,
                         sweeps: int, classes: list[np.ndarray]) -> None:
    """eplb.dispatch.resplit_score.water_fill one expert at a time, in plain Python, in place on
    (gpu [M, B, G + 1], flow [M, B, R, X]): the experts in the order of `classes` (each int
    [B, K], padding R), each pouring onto its lowest GPUs with the sums taken in np.cumsum's order."""
    B, R, X = gpu_BRX.shape
    M = flex_MBR.shape[0]
    G = gpu.shape[2] - 1
    for _ in range(sweeps):
        for k_BK in classes:
            for m in range(M):
                for b in range(B):
                    for r in k_BK[b]:
                        if r >= R or gpu_BRX[b, r, 0] >= G:
                            continue
                        xs = [x for x in range(X) if gpu_BRX[b, r, x] < G]
                        base = [float(gpu[m, b, gpu_BRX[b, r, x]] - flow[m, b, r, x]) for x in xs]
                        load = float(flex_MBR[m, b, r])
                        if len(xs) == 2:
                            first = min(max(0.5 * (load + base[1] - base[0]), 0.0), load)
                            new = [first, load - first]
                        else:
                            low, total, level, k = sorted(base), 0.0, [], 0
                            for i, v in enumerate(low):
                                total = v if i == 0 else total + v
                                level.append((load + total) / (i + 1))
                                k += v < level[i]
                            new = [max(level[max(k - 1, 0)] - v, 0.0) for v in base]
                        for x, v in zip(xs, new):
                            g = gpu_BRX[b, r, x]
                            gpu[m, b, g] = gpu[m, b, g] + (v - flow[m, b, r, x])
                            flow[m, b, r, x] = v
