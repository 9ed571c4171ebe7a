"""Compiled scoring (numba): the lower bound and an even split's load report, one pass per layer.

Legend: L = MoE layers, E = logical experts, G = GPUs, S = slots per GPU, P = G x S slots.

eplb.stats' numpy scores are the specification: `even_report` gives `stats.load_report` of
`Placement.gpu_loads` and `bound_terms` gives `stats.lower_bound`'s terms, to the bit. Every
sum therefore adds in numpy's own order (`_sum`: numpy's pairwise summation of a contiguous
run, which is what its reductions over the last axis do), and every product and quotient is
the one numpy forms (a replica's tokens are load x (1 / count), as `Placement.replica_weights`
makes them). The kernels trust their input (eplb.stats checks it, the arrays are a
Placement's) and release the GIL. `warm_up` runs each on the argument types the real calls
use: float64 loads and a Placement's read-only int64 maps and counts.
"""

from __future__ import annotations

import numpy as np
from numba import njit

ready = False
"""True once `warm_up` has loaded (or compiled) the kernels in this process (eplb.stats uses
them from then on)."""


@njit(cache=True, nogil=True)
def _block(a, lo, n):
    """a[lo:lo + n], n <= 128, summed as numpy sums a contiguous run that short: a plain loop
    below 8 numbers, else eight strided partial sums, combined pairwise, then the rest."""
    if n < 8:
        res = -0.0  # numpy's start: keeps a sum of -0.0 negative
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    whole = n - n % 8
    while i < whole:
        j = lo + i
        r0 += a[j]
        r1 += a[j + 1]
        r2 += a[j + 2]
        r3 += a[j + 3]
        r4 += a[j + 4]
        r5 += a[j + 5]
        r6 += a[j + 6]
        r7 += a[j + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@njit(cache=True, nogil=True)
def _sum(a, lo, n, stack):
    """a[lo:lo + n] summed in numpy's pairwise order: runs longer than 128 are the sum of their
    two halves (the first cut down to a multiple of 8), each summed the same way. The halving
    walks an explicit stack (`_stack`): numba's cache cannot load a recursive function."""
    if n <= 128:
        return _block(a, lo, n)
    # Tasks in post-order: (start, length) to sum, or length -1 to add the two newest sums.
    task_lo, task_n, sums = stack
    tasks, done = 1, 0
    task_lo[0], task_n[0] = lo, n
    while tasks:
        tasks -= 1
        start, m = task_lo[tasks], task_n[tasks]
        if m < 0:
            done -= 1
            sums[done - 1] += sums[done]
        elif m <= 128:
            sums[done] = _block(a, start, m)
            done += 1
        else:
            half = m // 2
            half -= half % 8
            task_n[tasks] = -1  # then add: first half + second half
            task_lo[tasks + 1], task_n[tasks + 1] = start + half, m - half
            task_lo[tasks + 2], task_n[tasks + 2] = start, half
            tasks += 3
    return sums[0]


@njit(cache=True, nogil=True)
def _stack():
    """Scratch for `_sum`: each halving adds two tasks and one pending sum, and a run of n
    numbers is halved fewer than 63 times."""
    return np.empty(128, dtype=np.int64), np.empty(128, dtype=np.int64), np.empty(64)


@njit(cache=True, nogil=True)
def bound_terms(load_LE, count_LE, num_gpus, num_slots, bound_L):
    """The lower bound of each layer whose counts are min-max optimal into bound_L [L]; returns
    which layers those are, bool [L] (the others are left for the caller to solve).

    bound = max(total / G, top) with top = the largest load per replica under count_LE (sum P
    per layer). top is the optimum when the fewest replicas n_e that put every expert below it
    (load_e / n_e < top, as floats: rounded division is monotone in n) sum to more than P, or
    when top is 0. Divisions are the cost here, so none is made where the answer is known: a
    single replica carries its whole load, an expert below top needs one replica, and the
    search for n_e starts from the expert's count (optimal counts are off by one at most)."""
    L, E = load_LE.shape
    proven_L = np.zeros(L, dtype=np.bool_)
    stack = _stack()
    per_E = np.empty(E)
    for l in range(L):
        row = load_LE[l]
        top = 0.0
        for e in range(E):
            x = row[e]
            c = count_LE[l, e]
            q = x if c == 1 else x / c
            per_E[e] = q
            if q > top:
                top = q
        bound_L[l] = max(_sum(row, 0, E, stack) / num_gpus, top)
        if top <= 0:
            proven_L[l] = True
            continue
        need = 0
        for e in range(E):
            x = row[e]
            if x < top:
                need += 1
            else:
                n = float(count_LE[l, e])
                if per_E[e] >= top:  # x / n itself
                    n += 1.0
                    while x / n >= top:
                        n += 1.0
                else:
                    while n > 1.0 and x / (n - 1.0) < top:
                        n -= 1.0
                need += int(n)
            if need > num_slots:
                proven_L[l] = True
                break
    return proven_L


@njit(cache=True, nogil=True)
def even_report(load_LE, phy2log_LP, count_LE, num_gpus, bound_L):
    """`stats.load_report(placement.gpu_loads(load_LE), bound_L)` for an even split among the
    replicas: (tokens per GPU [L, G], busiest / mean GPU [L], busiest GPU / bound [L],
    balancedness). A replica carries load x (1 / count) (load itself for a single replica:
    x 1.0 is exact), and a GPU's load sums its slots' tokens in slot order."""
    L, E = load_LE.shape
    P = phy2log_LP.shape[1]
    G = num_gpus
    S = P // G
    gpu_LG = np.empty((L, G))
    imbalance_L = np.empty(L)
    ratio_L = np.empty(L)
    max_L = np.empty(L)
    mean_L = np.empty(L)
    per_E = np.empty(E)
    slot_S = np.empty(S)
    stack = _stack()
    for l in range(L):
        for e in range(E):
            c = count_LE[l, e]
            per_E[e] = load_LE[l, e] if c == 1 else load_LE[l, e] * (1.0 / c)
        row_G = gpu_LG[l]
        phy_P = phy2log_LP[l]
        busiest = -np.inf
        for g in range(G):
            o = g * S
            if S < 8:  # numpy's short run: one sum in slot order
                x = -0.0
                for s in range(S):
                    x += per_E[phy_P[o + s]]
            else:
                for s in range(S):
                    slot_S[s] = per_E[phy_P[o + s]]
                x = _sum(slot_S, 0, S, stack)
            row_G[g] = x
            if x > busiest:
                busiest = x
        mean = _sum(row_G, 0, G, stack) / G
        max_L[l] = busiest
        mean_L[l] = mean
        imbalance_L[l] = busiest / mean if mean > 0 else 1.0
        ratio_L[l] = busiest / bound_L[l] if bound_L[l] > 0 else 1.0
    top = _sum(max_L, 0, L, stack)
    balancedness = _sum(mean_L, 0, L, stack) / top if top > 0 else 1.0
    return gpu_LG, imbalance_L, ratio_L, balancedness


@njit(cache=True, nogil=True)
def replica_counts(phy2log_LP, num_experts):
    """(count_LE int64 [L, E], smallest id, largest id) of a map [L, P] in one pass: what
    Placement checks with numpy's min, max and bincount (ids outside 0..E-1 are not counted;
    the caller refuses the map then)."""
    L, P = phy2log_LP.shape
    count_LE = np.zeros((L, num_experts), dtype=np.int64)
    lo = phy2log_LP[0, 0] if L and P else 0
    hi = lo
    for l in range(L):
        for p in range(P):
            e = phy2log_LP[l, p]
            if e < lo:
                lo = e
            if e > hi:
                hi = e
            if 0 <= e < num_experts:
                count_LE[l, e] += 1
    return count_LE, lo, hi


def warm_up() -> None:
    """Load (or, on a fresh install, compile) the kernels on the argument types of the real
    calls (eplb.core.jit runs this in the background; eplb.stats on first use)."""
    global ready
    load_LE = np.array([[3.0, 1.0, 1.0], [1.0, 2.0, 0.0]])
    phy_LP = np.array([[0, 1, 0, 2], [0, 1, 2, 1]])
    count_LE = np.array([[2, 1, 1], [1, 2, 1]])
    for a in (phy_LP, count_LE):
        a.flags.writeable = False  # a Placement's arrays are read-only
    bound_L = np.empty(2)
    bound_terms(load_LE, count_LE, 2, 4, bound_L)
    even_report(load_LE, phy_LP, count_LE, 2, bound_L)
    replica_counts(phy_LP, 3)
    ready = True
