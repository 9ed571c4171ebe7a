"""Scores of placements for an engine that re-splits every batch, at any GPU count (numpy only).

Legend: M = windows (scenarios), B = rows (layers, or candidate maps of the search), E = logical
experts, G = GPUs, S = slots per GPU, P = G x S physical slots, R = experts of a row spanning two
or more GPUs ("flexible"), X = most distinct GPUs one expert spans.

An engine that splits each expert's tokens in any shares over the GPUs holding its replicas
(SGLang's `--ep-dispatch-algorithm lp`, eplb's `resplit`) serves a window with the busiest GPU
t* of that LP. By Hall's theorem t* = max over GPU sets Y of h(Y) / |Y|, h(Y) the load of the
experts whose every replica lies in Y. Both sides of that are computed here, for all rows and
windows at once:
- an upper bound, from a feasible split: water-filling (the rule `eplb.dispatch.Resplitter`
  runs per batch): each flexible expert in turn pours its tokens onto its lowest GPUs, from
  the engine's even split, for a number of sweeps; it never rises and converges to t*;
- a lower bound, from GPU sets: the prefixes Y_k of the GPUs sorted by that split's load
  (busiest first). An expert lies inside Y_k iff all of its GPUs rank below k, so h(Y_k) is a
  cumulative sum over experts binned by the worst rank of their GPUs, and the bound is
  max_k h(Y_k) / k. At the optimum the busiest GPUs of the lexicographically optimal split
  form such a prefix and receive nothing from outside it, so the bound meets t* there.
`resplit_bounds` gives both after a fixed number of sweeps (what the search ranks candidates
by); `resplit_imbalance` sweeps until they meet (within `TOL`) and raises if they do not.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from scipy.sparse import csr_matrix

from eplb.errors import EplbError

TOL = 1e-6
"""Largest gap between the bounds (busiest / mean GPU) `resplit_imbalance` accepts as exact."""

MAX_SWEEPS = 2000
"""Sweeps `resplit_imbalance` makes at most before it reports bounds that have not met."""


@dataclass(frozen=True, eq=False)
class Layout:
    """Which GPUs each expert of each row spans (one row: a layer's map [P])."""

    rigid_BEG: csr_matrix
    """[B x E, B x G] 0/1: expert e of row b lies on one GPU g only (its tokens stay there)."""
    expert_BR: np.ndarray
    """int [B, R]: the flexible experts of each row (padding: expert 0 with no GPUs)."""
    gpu_BRX: np.ndarray
    """int [B, R, X]: their distinct GPUs, ascending (padding: the dummy GPU G)."""
    even_BRX: np.ndarray
    """[B, R, X]: the engine's even split, the share of each GPU (its replicas / the expert's)."""
    slot_BRX: np.ndarray
    """int [B, R, X]: the first slot of the expert on each of those GPUs (padding: P)."""
    rigid_slot: np.ndarray
    """int [n]: b x P + the first slot of each expert of row b that lies on one GPU only."""
    num_gpus: int


def layout(phy_BP: np.ndarray, num_gpus: int) -> Layout:
    """The `Layout` of maps phy_BP [B, P] (slot p on GPU p // S)."""
    phy_BP = np.asarray(phy_BP, dtype=np.int64)
    B, P = phy_BP.shape
    G = int(num_gpus)
    E = int(phy_BP.max()) + 1 if phy_BP.size else 1
    # Step 1: (row, expert, GPU) triples with their replica counts, sorted.
    key = (np.arange(B)[:, None] * E + phy_BP) * G + np.arange(P)[None, :] // (P // G)
    pair, first_slot, cnt = np.unique(key.ravel(), return_index=True, return_counts=True)
    first_slot %= P
    be, g = pair // G, pair % G
    first = np.r_[True, be[1:] != be[:-1]]
    start = np.flatnonzero(first)
    n_pair = np.diff(np.r_[start, len(be)])                       # distinct GPUs of each (row, expert)
    span = np.repeat(n_pair, n_pair)
    # Step 2: experts on one GPU are fixed loads there.
    one = span == 1
    b_one = be[one] // E
    rigid = csr_matrix((np.ones(int(one.sum())), (be[one], b_one * G + g[one])), shape=(B * E, B * G))
    # Step 3: the flexible experts, R per row at most, X GPUs each at most.
    flex = ~one
    be_f, g_f, c_f = be[flex], g[flex], cnt[flex]
    head = np.r_[True, be_f[1:] != be_f[:-1]] if len(be_f) else np.zeros(0, bool)
    idx_expert = np.cumsum(head) - 1                              # which flexible expert, overall
    row_of = be_f[head] // E
    R_row = np.bincount(row_of, minlength=B)
    R = int(R_row.max()) if len(row_of) else 0
    X = int(np.diff(np.r_[np.flatnonzero(head), len(be_f)]).max()) if len(be_f) else 1
    r_of = np.arange(len(row_of)) - np.r_[0, np.cumsum(R_row)][row_of]
    x_of = np.arange(len(be_f)) - np.flatnonzero(head)[idx_expert]
    expert_BR = np.zeros((B, R), dtype=np.int64)
    expert_BR[row_of, r_of] = be_f[head] % E
    gpu_BRX = np.full((B, R, X), G, dtype=np.int64)
    gpu_BRX[row_of[idx_expert], r_of[idx_expert], x_of] = g_f
    even_BRX = np.zeros((B, R, X))
    tot = np.bincount(idx_expert, weights=c_f)
    even_BRX[row_of[idx_expert], r_of[idx_expert], x_of] = c_f / tot[idx_expert]
    slot_BRX = np.full((B, R, X), P, dtype=np.int64)
    slot_BRX[row_of[idx_expert], r_of[idx_expert], x_of] = first_slot[flex]
    return Layout(rigid, expert_BR, gpu_BRX, even_BRX, slot_BRX, b_one * P + first_slot[one], G)


def fixed_loads(lay: Layout, load_MBE: np.ndarray) -> np.ndarray:
    """Tokens of the experts on one GPU, per GPU, [M, B, G]."""
    M, B, E = load_MBE.shape
    return (lay.rigid_BEG.T @ load_MBE.reshape(M, B * E).T).T.reshape(M, B, lay.num_gpus)


def flexible_loads(lay: Layout, load_MBE: np.ndarray) -> np.ndarray:
    """Tokens of each flexible expert, [M, B, R] (padding 0)."""
    take = np.take_along_axis(load_MBE, np.broadcast_to(lay.expert_BR, (len(load_MBE),) + lay.expert_BR.shape), axis=2)
    return take * (lay.gpu_BRX[None, :, :, 0] < lay.num_gpus)


def even_split(lay: Layout, fixed_MBG: np.ndarray, flex_MBR: np.ndarray):
    """The engine's even split as a water-filling state: (GPU loads [M, B, G + 1], the last the
    dummy GPU; tokens of each flexible expert on each of its GPUs [M, B, R, X])."""
    M, B, G = fixed_MBG.shape
    flow = flex_MBR[..., None] * lay.even_BRX[None]
    # One bincount over the fixed loads, then the flows in expert order: each GPU's sum is added
    # in the same order as expert by expert, so the split is the same to the last bit.
    real_BRX = lay.gpu_BRX < G
    cell_BRX = np.arange(B)[:, None, None] * (G + 1) + lay.gpu_BRX
    cell_MN = np.arange(M)[:, None] * (B * (G + 1)) + cell_BRX[real_BRX][None]
    cell_MBG = (np.arange(M * B)[:, None] * (G + 1) + np.arange(G)).reshape(M, B, G)
    gpu = np.bincount(np.concatenate([cell_MBG.ravel(), cell_MN.ravel()]),
                      weights=np.concatenate([fixed_MBG.ravel(), flow[:, real_BRX].ravel()]),
                      minlength=M * B * (G + 1)).reshape(M, B, G + 1)
    return gpu, flow


def colour_classes(gpu_BRX: np.ndarray, num_gpus: int, by_span: bool = True) -> list[np.ndarray]:
    """The flexible experts of each row in classes that share no GPU and span about as many GPUs
    (1, 2, 3-4, 5-8, ...): a list of int [B, K] (indices into R; padding R, an expert with no
    GPUs), greedy colouring in expert order. The experts of one class can pour at once with the
    same result as one after another, and a class pads its experts to few GPUs. by_span=False:
    one class per colour (fewer, wider steps: faster when there are few rows)."""
    B, R, X = gpu_BRX.shape
    G = int(num_gpus)
    rows = np.arange(B)[:, None]
    used_BG = np.zeros((B, G + 1), dtype=np.uint64)
    colour_BR = np.zeros((B, R), dtype=np.int64)
    for r in range(R):
        g_BX = gpu_BRX[:, r]
        taken = np.bitwise_or.reduce(np.where(g_BX < G, used_BG[rows, g_BX], np.uint64(0)), axis=1)
        free = ~taken & (taken + np.uint64(1))                     # lowest clear bit (0 when all 64 are taken)
        colour = np.where(free > 0, np.log2(np.maximum(free, 1).astype(np.float64)).astype(np.int64), 64 + r)
        colour_BR[:, r] = colour
        bit = np.where(colour < 64, np.left_shift(np.uint64(1), np.minimum(colour, 63).astype(np.uint64)),
                       np.uint64(0))
        np.bitwise_or.at(used_BG, (np.broadcast_to(rows, g_BX.shape), g_BX), bit[:, None])
    span_BR = np.maximum((gpu_BRX < G).sum(axis=2), 1)
    key_BR = colour_BR * 64 + (np.ceil(np.log2(span_BR)).astype(np.int64) if by_span else 0)
    out = []
    for c in np.unique(key_BR) if R else []:
        member_BR = key_BR == c
        K = int(member_BR.sum(axis=1).max())
        order = np.argsort(~member_BR, axis=1, kind="stable")[:, :K]
        out.append(np.where(np.take_along_axis(member_BR, order, axis=1), order, R))
    return out


NETWORK_GPUS = 8
"""Most GPUs of a class that pours through a sorting network of elementwise min / max (one pass
per comparator over every expert of the class at once); wider classes sort with np.sort."""


@functools.cache
def _network(n: int) -> tuple[tuple[int, int], ...]:
    """Comparators (i, j), i < j, of Batcher's odd-even merge sort of n values ascending (the
    comparators of the next power of two that touch no index past n: those would hold +inf)."""
    out, p = [], 1
    while p < n:
        k = p
        while k >= 1:
            for j in range(k % p, n - k, 2 * k):
                for i in range(min(k, n - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        out.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return tuple(out)


def _sorted(base_XNM: np.ndarray) -> list[np.ndarray]:
    """The values of base_XNM sorted along X ascending, as X arrays [N, M]."""
    X = base_XNM.shape[0]
    if X > NETWORK_GPUS:
        return list(np.sort(base_XNM, axis=0))
    v = list(base_XNM)
    for i, j in _network(X):
        v[i], v[j] = np.minimum(v[i], v[j]), np.maximum(v[i], v[j])
    return v


def _pour(base_XNM: np.ndarray, load_NM: np.ndarray) -> np.ndarray:
    """Each expert's tokens load_NM poured onto its GPUs above the levels base_XNM (+inf: no such
    GPU): its new flows [X, N, M]. The level is (load + sum of the k lowest) / k for the most k
    whose lowest lie below it; the sums run in the order np.cumsum adds them, so the flows are the
    same to the last bit as pouring along a sorted axis."""
    X = base_XNM.shape[0]
    if X == 2:
        # Two GPUs: the level meets both, or all tokens go to the lower one.
        new = np.empty_like(base_XNM)
        first = np.add(load_NM, base_XNM[1], out=new[0])
        np.subtract(first, base_XNM[0], out=first)
        np.multiply(first, 0.5, out=first)
        np.clip(first, 0.0, load_NM, out=first)
        np.subtract(load_NM, first, out=new[1])
        return new
    low = _sorted(base_XNM)
    total = low[0]
    level = [load_NM + total]
    k = (low[0] < level[0]).astype(np.int64)
    for x in range(1, X):
        total = total + low[x]
        level.append((load_NM + total) / (x + 1))
        k += low[x] < level[x]
    top = np.choose(np.maximum(k - 1, 0), level)
    return np.maximum(top[None] - base_XNM, 0.0)


def fill_classes(gpu_BRX: np.ndarray, num_gpus: int, by_span: bool = True) -> tuple[np.ndarray, list[tuple]]:
    """What `water_fill` pours by, for GPUs gpu_BRX [B, R, X] (build once per layout, reuse for any
    loads): (cell_U: the flat (row, GPU) cells the flexible experts touch, ascending, and per colour
    class (`colour_classes`) with a real GPU, (real_BK: which of its entries are experts, k_BK:
    those experts (padding clipped to R - 1), at_XN: the index into cell_U of each of its GPUs,
    GPUs first, pad [Xc, N, 1] or None: +inf on GPUs a real expert lacks))."""
    B, R, X = gpu_BRX.shape
    G = int(num_gpus)
    rows = np.arange(B)[:, None]
    classes = []
    for k_BK in colour_classes(gpu_BRX, G, by_span):
        # The padding expert R: no GPUs, no tokens.
        real_BK = k_BK < R
        k_BK = np.minimum(k_BK, R - 1)
        g_BKX = np.where(real_BK[:, :, None], gpu_BRX[rows, k_BK], G)
        Xc = max(1, int((g_BKX < G).sum(axis=2).max()))
        g_XN = np.moveaxis(g_BKX[:, :, :Xc], 2, 0).reshape(Xc, -1)
        pad = np.where(g_XN == G, np.inf, 0.0)
        pad[0] = 0.0                                               # padding experts: 0 tokens on the dummy GPU
        flat = np.repeat(np.arange(B), k_BK.shape[1])[None] * (G + 1) + g_XN
        # Only a real expert on fewer GPUs than its class needs the +inf levels: a padding
        # expert has no tokens and only the dummy GPU (load 0), so it pours 0 without them.
        short = (pad == np.inf) & real_BK.ravel()
        if (g_XN < G).any():
            classes.append((real_BK, k_BK, flat, pad[:, :, None] if short.any() else None))
    cell_U = np.unique(np.concatenate([c[2].ravel() for c in classes])) if classes else np.zeros(0, np.int64)
    return cell_U, [(r, k, np.searchsorted(cell_U, f), pad) for r, k, f, pad in classes]


def water_fill(gpu_BRX: np.ndarray, flex_MBR: np.ndarray, gpu: np.ndarray, flow: np.ndarray, sweeps: int,
               classes: tuple[np.ndarray, list[tuple]] | None = None) -> None:
    """`sweeps` sweeps of water-filling over the flexible experts, in place on the state
    (gpu [M, B, G + 1], flow [M, B, R, X]) for their GPUs gpu_BRX and loads flex_MBR: each
    expert in turn pours its tokens onto its lowest GPUs, every row and window at once, and
    experts that share no GPU at once (`colour_classes`). `classes`: `fill_classes(gpu_BRX, G)`,
    when the caller keeps it for many calls on one layout (the per-batch `Resplitter`)."""
    B, R, X = gpu_BRX.shape
    G = gpu.shape[2] - 1
    if not R or sweeps <= 0:
        return
    M = flex_MBR.shape[0]
    rows = np.arange(B)[:, None]
    cell_U, static = fill_classes(gpu_BRX, G) if classes is None else classes
    state = []
    for real_BK, k_BK, flat, pad in static:
        Xc = flat.shape[0]
        took = np.where(real_BK[None, :, :, None], flow[:, rows, k_BK, :Xc], 0.0)
        flow_c = np.ascontiguousarray(np.moveaxis(took, (3, 0), (0, 3))).reshape(Xc, -1, M)
        load = np.ascontiguousarray(np.moveaxis(flex_MBR[:, rows, k_BK] * real_BK, 0, 2)).reshape(-1, M)
        state.append([real_BK, k_BK, flat, pad, load, flow_c])
    classes = state
    # Windows last, for the (row, GPU) cells the experts touch only (a local score's few): a class
    # gathers and scatters whole rows of M loads, and each of its GPUs' slices (GPUs first, then
    # row and expert) is one contiguous array.
    gpu_MQ = gpu.reshape(M, B * (G + 1))
    gpu_UM = np.ascontiguousarray(gpu_MQ[:, cell_U].T)
    for _ in range(sweeps):
        for c in classes:
            _, _, flat, pad, load, flow_c = c
            # g + (pad - flow) is (g - flow) + pad to the bit: pad is 0 or +inf.
            g = gpu_UM[flat]
            new = _pour(g - flow_c if pad is None else g + (pad - flow_c), load)
            # The GPUs of one class are distinct (only the dummy repeats, and it only ever gets 0).
            delta = np.subtract(new, flow_c, out=flow_c)            # the old flows are done with
            gpu_UM[flat] = np.add(g, delta, out=g)
            c[5] = new
    for real_BK, k_BK, _, _, _, flow_c in classes:
        b, k = np.nonzero(real_BK)
        Xc = flow_c.shape[0]
        flow[:, b, k_BK[b, k], :Xc] = np.moveaxis(flow_c.reshape(Xc, B, -1, M)[:, b, k], (0, 2), (2, 0))
    gpu_MQ[:, cell_U] = gpu_UM.T
    if not np.shares_memory(gpu_MQ, gpu):
        gpu[:] = gpu_MQ.reshape(gpu.shape)


def bounds(gpu_BRX: np.ndarray, fixed_MBG: np.ndarray, flex_MBR: np.ndarray, gpu: np.ndarray):
    """(lower, upper) bounds on the busiest GPU, [M, B] each, in tokens, from the split in `gpu`
    (module docstring)."""
    M, B, G = fixed_MBG.shape
    gpu_MBG = gpu[:, :, :G]
    upper = gpu_MBG.max(axis=2)
    order = np.argsort(-gpu_MBG, axis=2)
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(G), order.shape), axis=2)
    h = np.take_along_axis(fixed_MBG, order, axis=2)               # fixed load binned by its GPU's rank
    R = gpu_BRX.shape[1]
    if R:
        rank_pad = np.concatenate([rank, np.full((M, B, 1), -1)], axis=2)
        worst_MBR = np.take_along_axis(rank_pad, np.broadcast_to(gpu_BRX.reshape(1, B, -1), (M, B, gpu_BRX[0].size)),
                                       axis=2).reshape(M, B, R, -1).max(axis=3)
        cell = (np.arange(M * B).reshape(M, B, 1) * G + np.maximum(worst_MBR, 0)).ravel()
        h = h + np.bincount(cell, weights=flex_MBR.ravel(), minlength=M * B * G).reshape(M, B, G)
    lower = (np.cumsum(h, axis=2) / np.arange(1, G + 1)).max(axis=2)
    return lower, upper


def _check(phy_BP, load_MBE, num_gpus: int):
    phy_BP = np.asarray(phy_BP, dtype=np.int64)
    load = np.asarray(load_MBE, dtype=np.float64)
    if phy_BP.ndim != 2 or load.ndim != 3 or load.shape[1] != phy_BP.shape[0]:
        raise EplbError(f"loads have shape {load.shape} for a map of shape {phy_BP.shape}: give [windows, layers, "
                        f"experts] for a map [layers, slots]")
    if num_gpus < 1 or phy_BP.shape[1] % num_gpus:
        raise EplbError(f"{phy_BP.shape[1]} slots do not split over {num_gpus} GPUs: give the map's GPU count")
    if phy_BP.size and (phy_BP.min() < 0 or phy_BP.max() >= load.shape[2]):
        raise EplbError(f"the map holds expert ids outside 0..{load.shape[2] - 1} (the loads' experts)")
    B, E = phy_BP.shape[0], load.shape[2]
    held_BE = np.bincount((np.arange(B)[:, None] * E + phy_BP).ravel(), minlength=B * E).reshape(B, E) > 0
    lost = np.argwhere(~held_BE & (load > 0).any(axis=0))
    if len(lost):
        raise EplbError(f"row {lost[0, 0]} of the map holds no replica of expert {lost[0, 1]}, which has tokens: "
                        f"give a map that holds every expert with tokens")
    return phy_BP, load


def resplit_bounds(phy_BP: np.ndarray, load_MBE: np.ndarray, num_gpus: int, sweeps: int = 8,
                   lay: Layout | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) bounds on busiest / mean GPU under the best re-split of each window and
    row, [M, B] each (idle rows 1), after `sweeps` sweeps of water-filling. phy_BP: maps [B, P];
    load_MBE: tokens [M, B, E]."""
    phy_BP, load = _check(phy_BP, load_MBE, num_gpus)
    lay = layout(phy_BP, num_gpus) if lay is None else lay
    fixed, flex = fixed_loads(lay, load), flexible_loads(lay, load)
    gpu, flow = even_split(lay, fixed, flex)
    water_fill(lay.gpu_BRX, flex, gpu, flow, int(sweeps))
    lo, hi = bounds(lay.gpu_BRX, fixed, flex, gpu)
    mean = load.sum(axis=2) / num_gpus
    ok = mean > 0
    safe = np.where(ok, mean, 1.0)
    return np.where(ok, lo / safe, 1.0), np.where(ok, hi / safe, 1.0)


def resplit_imbalance(phy2log_LP: np.ndarray, windows_MLE: np.ndarray, num_gpus: int) -> np.ndarray:
    """Busiest / mean GPU of each window and layer under the best re-split, [M, L] (idle layers 1),
    exact to within TOL: the (window, layer) cells whose bounds have not met are swept again, with
    twice the sweeps each time, until they do (MAX_SWEEPS at most)."""
    phy_LP, load = _check(phy2log_LP, windows_MLE, num_gpus)
    M, L, E = load.shape
    lo, hi = resplit_bounds(phy_LP, load, num_gpus, 16)
    m_C, l_C = np.nonzero(hi - lo > TOL)
    sweeps = 32
    while len(m_C):
        # Step 1: the open cells as rows of their own (one window each), swept longer.
        lo_C, hi_C = resplit_bounds(phy_LP[l_C], load[m_C, l_C][None], num_gpus, sweeps)
        lo[m_C, l_C], hi[m_C, l_C] = lo_C[0], hi_C[0]
        # Step 2: keep the cells still open.
        open_C = hi_C[0] - lo_C[0] > TOL
        if open_C.any() and sweeps >= MAX_SWEEPS:
            raise EplbError(f"the re-split bounds are still {float((hi_C - lo_C).max()):.2e} apart after {sweeps} "
                            f"sweeps: score these windows with eplb.dispatch.optimal_weights (the exact LP)")
        m_C, l_C, sweeps = m_C[open_C], l_C[open_C], 2 * sweeps
    return hi
