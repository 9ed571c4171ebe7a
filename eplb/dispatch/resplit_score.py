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
    gpu = np.concatenate([fixed_MBG, np.zeros((M, B, 1))], axis=2)
    flow = flex_MBR[..., None] * lay.even_BRX[None]
    rows = np.arange(B)[:, None]
    for r in range(lay.gpu_BRX.shape[1]):
        np.add.at(gpu, (slice(None), rows, lay.gpu_BRX[:, r]), flow[:, :, r])
    gpu[:, :, G] = 0.0
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


def fill_classes(gpu_BRX: np.ndarray, num_gpus: int, by_span: bool = True) -> list[tuple]:
    """What `water_fill` pours by, for GPUs gpu_BRX [B, R, X] (build once per layout, reuse for
    any loads): per colour class (`colour_classes`), its experts k_BK, its GPU count Xc, the
    flat index of each of their GPUs into the [B, G + 1] GPU loads, and the padding (+inf on
    GPUs an expert lacks, so the level never counts them)."""
    B, R, X = gpu_BRX.shape
    G = int(num_gpus)
    # The padding expert R: no GPUs, no tokens.
    g_all = np.concatenate([gpu_BRX, np.full((B, 1, X), G)], axis=1)
    rows = np.arange(B)[:, None]
    classes = []
    for k_BK in colour_classes(gpu_BRX, G, by_span):
        g_BKX = g_all[rows, k_BK]
        Xc = max(1, int((g_BKX < G).sum(axis=2).max()))
        g_BKX = g_BKX[:, :, :Xc]
        pad = np.where(g_BKX == G, np.inf, 0.0)
        pad[:, :, 0] = 0.0                                         # padding experts: 0 tokens on the dummy GPU
        classes.append((k_BK, Xc, rows[:, :, None] * (G + 1) + g_BKX, pad[None]))
    return classes


def water_fill(gpu_BRX: np.ndarray, flex_MBR: np.ndarray, gpu: np.ndarray, flow: np.ndarray, sweeps: int,
               classes: list[tuple] | None = None) -> None:
    """`sweeps` sweeps of water-filling over the flexible experts, in place on the state
    (gpu [M, B, G + 1], flow [M, B, R, X]) for their GPUs gpu_BRX and loads flex_MBR: each
    expert in turn pours its tokens onto its lowest GPUs, every row and window at once, and
    experts that share no GPU at once (`colour_classes`). `classes`: `fill_classes(gpu_BRX, G)`,
    when the caller keeps it for many calls on one layout."""
    B, R, X = gpu_BRX.shape
    G = gpu.shape[2] - 1
    if not R or sweeps <= 0:
        return
    if classes is None:
        classes = fill_classes(gpu_BRX, G)
    M = flex_MBR.shape[0]
    f_all = np.concatenate([flex_MBR, np.zeros((M, B, 1))], axis=2)
    flow_all = np.concatenate([flow, np.zeros((M, B, 1, X))], axis=2)
    rows = np.arange(B)[:, None]
    gpu_flat = np.ascontiguousarray(gpu).reshape(M, B * (G + 1))
    gpu_1d = gpu_flat.reshape(-1)                                  # a view: flat indices over windows too
    window = (np.arange(M) * (B * (G + 1)))[:, None, None, None]
    state = [(Xc, window + flat[None], pad, f_all[:, rows, k_BK][..., None], flow_all[:, rows, k_BK, :Xc],
              np.arange(1, Xc + 1)) for k_BK, Xc, flat, pad in classes]
    for _ in range(sweeps):
        for Xc, flat, pad, load, flow_c, ks in state:
            base = gpu_1d[flat] - flow_c + pad
            if Xc == 2:
                # Two GPUs: the level meets both, or all tokens go to the lower one.
                first = np.clip(0.5 * (load[..., 0] + base[..., 1] - base[..., 0]), 0.0, load[..., 0])
                new = np.stack([first, load[..., 0] - first], axis=3)
            else:
                # The level over the k lowest GPUs is (load + their sum) / k; the water level is
                # the least of these (+inf entries never count).
                level = ((load + np.cumsum(np.sort(base, axis=3), axis=3)) / ks).min(axis=3, keepdims=True)
                new = np.maximum(level - base, 0.0)
            # The GPUs of one class are distinct (only the dummy repeats, and it only ever gets 0).
            gpu_1d[flat] += new - flow_c
            flow_c[:] = new
    for (k_BK, Xc, _, _), (_, _, _, _, flow_c, _) in zip(classes, state):
        flow_all[:, rows, k_BK, :Xc] = flow_c
    flow[:] = flow_all[:, :, :R]
    gpu[:] = gpu_flat.reshape(gpu.shape)


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
