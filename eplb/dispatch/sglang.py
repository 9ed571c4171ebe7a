"""SGLang's dispatch rules (`--ep-dispatch-algorithm static | dynamic`), modelled for scoring.

Legend: H = hidden layers SGLang holds a map for (dense ones included), L = MoE layers,
E = logical experts, G = GPUs (EP ranks), N = nodes, S = slots per GPU, P = G x S slots.

What SGLang 0.5.23 does (`sglang/srt/eplb/expert_location.py`), as implemented here:
- Nearest replica of expert e for rank q: its only replica if it has one; else the first
  (lowest slot) replica on GPU q; else, when q's node holds some but not all replicas, the
  first replica on q's node; else none ("no nearest": q draws).
- `static`: every rank q sends all its tokens of e to one slot. Ranks with a nearest replica
  use it. The others (R, in rank order) get `fair_choices(candidates, len(R), rng)`:
  each candidate quotient = len(R) // len(candidates) times, plus `rng.sample(candidates,
  remainder)`, the whole list then `rng.shuffle`d; rank R[i] takes entry i. The rng is
  `random.Random(42)`, run over (hidden layer, expert) in order.
- Where the map comes from matters (`path`):
  * "startup" (`--init-expert-location FILE`, `init_by_mapping` with the rank's moe_ep_rank,
    and an all-to-all backend): each rank first collapses *its own copy* of every candidate
    list to its nearest replica, then builds the map from those lists, keeping only its own
    row. A rank therefore draws (consumes the rng) only for the experts it has no nearest
    replica of, so the ranks' rng streams drift apart: the draws are not coordinated and a
    replica's share is (ranks mapped to it) / G, not 1 / replicas.
  * "rebalance" (`init_by_eplb`, SGLang's periodic rebalance): full candidate lists in
    the algorithm's order and one rng stream that every rank replays identically, so the
    draws are coordinated (each candidate gets len(R) // len(candidates) ranks, +1 for a
    random `remainder` of them).
- `dynamic`: every (token, expert) picks uniformly among the rank's candidate list. At
  "startup" that list is collapsed to the nearest replica as above (so a rank holding the
  expert keeps all its tokens local); after a "rebalance" it is the full list (even split).
Rows of hidden layers that are not MoE layers hold SGLang's trivial map `p % E`, as eplb's
`--init-expert-location` export writes them; they take part in the rng stream.

Shares assume every rank holds the same share of each expert's tokens (data-parallel
attention, balanced requests): slot p of expert e takes (ranks mapped to p) / G of them.
The draws are SGLang's own: Python's `random.Random(seed)`, `sample` then `shuffle` per list
(`_fair_choices`, SGLang's `fair_choices`), so every pick is the one SGLang makes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from eplb.core.files import check_input_size
from eplb.core.placement import Placement
from eplb.errors import EplbError, whole_number

PATHS = ("startup", "rebalance")
SEED = 42
"""SGLang's seed for the fair draw (`compute_logical_to_rank_dispatch_physical_map`)."""


def _check_path(path: str) -> str:
    if path not in PATHS:
        raise EplbError(f"unknown SGLang map path {path!r}: choose one of {', '.join(PATHS)} "
                        f"(startup: --init-expert-location; rebalance: after SGLang's periodic rebalance)")
    return path


MAX_HIDDEN_LAYERS = 4096
"""Most hidden layers an SGLang map is built for (DeepSeek-V3 has 61; a larger count is a bad id)."""


def hidden_rows(placement: Placement, num_hidden_layers: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(phy2log_HP, moe_rows_L): SGLang's map over every hidden layer, and the MoE rows in it.

    Rows that are not MoE layers get SGLang's trivial row `p % E` (what eplb's export writes).
    """
    ids = placement.layer_ids
    H = int(ids.max()) + 1 if num_hidden_layers is None else whole_number("num_hidden_layers", num_hidden_layers, 1)
    if H <= int(ids.max()):
        raise EplbError(f"num_hidden_layers ({H}) must exceed the largest MoE layer id ({int(ids.max())})")
    if H > MAX_HIDDEN_LAYERS:
        # Memory alone would allow millions of rows, but SGLang's draws walk every row in Python
        # (the stream runs through filler rows too), minutes per million: refused by count first.
        where = f"num_hidden_layers {H}" if num_hidden_layers is not None else \
            f"the largest MoE layer id, {int(ids.max())},"
        raise EplbError(f"{where} asks for an SGLang dispatch map of {H:,} hidden layers, more than the "
                        f"{MAX_HIDDEN_LAYERS:,} eplb builds (models have at most a few hundred): check the layer ids "
                        f"(plan --layer-ids) or --num-hidden-layers")
    P, E = placement.num_slots, placement.num_logical_experts
    # Sized before anything is built: H comes from a layer id, and one id of 10**8 (a typo, a
    # damaged file) asks for that many rows. Per row: _candidates' [E, G] and [E, X] int64
    # maps (four of them at once) and [P] orders, and the [G, S, S] repeat test.
    G, S = placement.num_gpus, placement.slots_per_gpu
    X = int(placement.replica_count_LE.max())
    row_bytes = 8 * (4 * E * G + E * X + 6 * P) + G * S * S
    where = f"num_hidden_layers {H}" if num_hidden_layers is not None else f"largest MoE layer id {int(ids.max())}"
    check_input_size(where, H * row_bytes, f"SGLang's dispatch map over {H:,} hidden layers (one row per layer "
                                          f"up to the largest MoE layer id; check the layer ids)")
    phy2log_HP = np.tile(np.arange(P, dtype=np.int64) % E, (H, 1))
    phy2log_HP[ids] = placement.phy2log_LP
    return phy2log_HP, ids


@dataclass(frozen=True, eq=False)
class _Candidates:
    """Per (row, expert): slots in slot order, and every rank's nearest replica."""

    slots_HEX: np.ndarray
    """Slots of each expert in slot order, padded with -1, int64 [H, E, X]."""
    count_HE: np.ndarray
    """Replicas of each expert, int64 [H, E]."""
    nearest_HEG: np.ndarray
    """Nearest slot of expert e for rank g, or -1 when g draws, int64 [H, E, G]."""


def _candidates(phy2log_HP: np.ndarray, num_gpus: int, num_nodes: int, prefer_same_node: bool) -> _Candidates:
    H, P = phy2log_HP.shape
    G, N = num_gpus, num_nodes
    S, Q = P // G, G // N
    E = int(phy2log_HP.max()) + 1
    row_HP = np.arange(H)[:, None] * E + phy2log_HP  # flat (row, expert) of each slot
    count_HE = np.bincount(row_HP.ravel(), minlength=H * E).reshape(H, E)
    X = int(count_HE.max())
    order_HP = np.argsort(phy2log_HP, axis=1, kind="stable")  # slots grouped by expert, slot order inside
    sorted_HP = np.take_along_axis(phy2log_HP, order_HP, axis=1)
    first_HE = np.cumsum(count_HE, axis=1) - count_HE
    rank_HP = np.arange(P)[None, :] - np.take_along_axis(first_HE, sorted_HP, axis=1)
    slots_HEX = np.full((H, E, X), -1, dtype=np.int64)
    slots_HEX[np.arange(H)[:, None], sorted_HP, rank_HP] = order_HP
    # First slot of each expert on each GPU (the lowest: later copies on the same GPU are left
    # out, so every index below is written once) and on each node (the lowest of its GPUs').
    big = P  # larger than any slot
    phy_HGS = phy2log_HP.reshape(H, G, S)
    again_HGS = np.tril(phy_HGS[:, :, :, None] == phy_HGS[:, :, None, :], -1).any(axis=3)
    h_i, p_i = np.nonzero(~again_HGS.reshape(H, P))
    first_gpu_HEG = np.full((H, E, G), big, dtype=np.int64)
    first_gpu_HEG[h_i, phy2log_HP[h_i, p_i], p_i // S] = p_i
    first_node_HEN = first_gpu_HEG.reshape(H, E, N, Q).min(axis=3)
    node_G = np.arange(G) // Q
    nearest_HEG = np.where(first_gpu_HEG < big, first_gpu_HEG, -1)
    if prefer_same_node:
        node_HP = np.broadcast_to(np.arange(P) // (S * Q), (H, P))
        on_node_HEN = np.bincount((row_HP * N + node_HP).ravel(), minlength=H * E * N).reshape(H, E, N)
        narrows_HEG = (on_node_HEN[:, :, node_G] > 0) & (on_node_HEN[:, :, node_G] < count_HE[:, :, None])
        nearest_HEG = np.where((nearest_HEG < 0) & narrows_HEG, first_node_HEN[:, :, node_G], nearest_HEG)
    nearest_HEG = np.where((count_HE == 1)[:, :, None], slots_HEX[:, :, :1], nearest_HEG)
    return _Candidates(slots_HEX, count_HE, nearest_HEG)


def _fair_choices(arr: list, k: int, rng: random.Random) -> list:
    """k picks from arr, each entry k // len(arr) times plus a random remainder, shuffled."""
    quotient, remainder = divmod(k, len(arr))
    ans = arr * quotient + rng.sample(arr, k=remainder)
    rng.shuffle(ans)
    return ans


def _draws(seed: int, slots_JX: np.ndarray, count_J: np.ndarray, k_J: np.ndarray) -> np.ndarray:
    """`_fair_choices(slots_JX[j, :count_J[j]], k_J[j], rng)` for every list j in turn, from one
    `random.Random(seed)`: the picks one list after another, int64 [sum k_J]."""
    rng = random.Random(seed)
    picks: list[int] = []
    for arr, n, k in zip(slots_JX.tolist(), count_J.tolist(), k_J.tolist()):
        picks += _fair_choices(arr[:n], k, rng)
    return np.array(picks, dtype=np.int64)


def static_dispatch_maps(placement: Placement, *, path: str = "startup", seed: int = SEED,
                         prefer_same_node: bool = True, num_hidden_layers: int | None = None) -> np.ndarray:
    """The slot every rank sends each expert's tokens to under SGLang `static`, int64 [G, L, E].

    Row g is what SGLang's `compute_logical_to_rank_dispatch_physical_map` leaves on rank g
    (its `logical_to_rank_dispatch_physical_map`, MoE rows only).
    """
    _check_path(path)
    phy2log_HP, moe_L = hidden_rows(placement, num_hidden_layers)
    G = placement.num_gpus
    c = _candidates(phy2log_HP, G, placement.num_nodes, prefer_same_node)
    out_GHE = np.transpose(c.nearest_HEG, (2, 0, 1)).copy()
    draws_HEG = c.nearest_HEG < 0  # only experts with >= 2 replicas ever draw
    k_HE = draws_HEG.sum(axis=2)
    if path == "rebalance":
        # One stream over every (row, expert) some rank draws for, in order; its drawing ranks
        # take the picks in rank order (np.nonzero's order: row, expert, rank).
        h_i, e_i = np.nonzero(k_HE)
        picks = _draws(seed, c.slots_HEX[h_i, e_i], c.count_HE[h_i, e_i], k_HE[h_i, e_i])
        h_k, e_k, g_k = np.nonzero(draws_HEG)
        out_GHE[g_k, h_k, e_k] = picks
    else:
        # Position of each drawing rank among the drawing ranks of its (row, expert).
        pos_HEG = np.cumsum(draws_HEG, axis=2) - 1
        # A rank's stream depends only on which (row, expert) it draws for: ranks that draw for
        # the same ones (typically a node's) replay one stream, so it is drawn once per group.
        groups: dict[bytes, list[int]] = {}
        for g in range(G):
            groups.setdefault(np.packbits(draws_HEG[:, :, g]).tobytes(), []).append(g)
        for members in groups.values():
            h_i, e_i = np.nonzero(draws_HEG[:, :, members[0]])
            k_J = k_HE[h_i, e_i]
            picks = _draws(seed, c.slots_HEX[h_i, e_i], c.count_HE[h_i, e_i], k_J)
            start_J = np.cumsum(k_J) - k_J
            for g in members:
                out_GHE[g, h_i, e_i] = picks[start_J + pos_HEG[h_i, e_i, g]]
    assert (out_GHE >= 0).all()
    return out_GHE[:, moe_L]


def _shares_from_maps(placement: Placement, map_GLE: np.ndarray) -> np.ndarray:
    L, P = placement.phy2log_LP.shape
    G = placement.num_gpus
    # Ranks mapped to each slot, counted over the flat (layer, slot) index.
    count_LP = np.bincount((np.arange(L)[None, :, None] * P + map_GLE).ravel(), minlength=L * P).reshape(L, P)
    return count_LP.astype(np.float64) / G


@dataclass(frozen=True)
class SglangStatic:
    """SGLang `--ep-dispatch-algorithm static`: one slot per (rank, expert), see the module text.

    path: "startup" (the map from `--init-expert-location`, what an eplb export gets) or
    "rebalance" (after SGLang's periodic rebalance). SGLang's default with
    `--init-expert-location` or `--enable-eplb` and an all-to-all MoE backend.
    """

    path: str = "startup"
    seed: int = SEED
    prefer_same_node: bool = True
    """False under elastic-EP scale-up (`ep_join_mode=scale`), where SGLang skips the node step."""
    num_hidden_layers: int | None = None
    """Rows of SGLang's map (default the largest MoE layer id + 1); rows that are not MoE layers are trivial."""
    name = "sglang-static"
    per_batch = False

    def __post_init__(self) -> None:
        _check_path(self.path)

    def bind(self, placement: Placement):
        maps = static_dispatch_maps(placement, path=self.path, seed=self.seed,
                                    prefer_same_node=self.prefer_same_node,
                                    num_hidden_layers=self.num_hidden_layers)
        w_LP = _shares_from_maps(placement, maps)
        return lambda counts_LE=None: w_LP


@dataclass(frozen=True)
class SglangDynamic:
    """SGLang `--ep-dispatch-algorithm dynamic`: a uniform pick among the rank's candidate list.

    path "startup": lists collapsed to each rank's nearest replica (a holder keeps its tokens);
    "rebalance": full lists, an even split (also what SGLang does without an all-to-all backend).
    """

    path: str = "startup"
    prefer_same_node: bool = True
    num_hidden_layers: int | None = None
    name = "sglang-dynamic"
    per_batch = False

    def __post_init__(self) -> None:
        _check_path(self.path)

    def bind(self, placement: Placement):
        L, P = placement.phy2log_LP.shape
        cnt_LP = np.take_along_axis(placement.replica_count_LE, placement.phy2log_LP, axis=1)
        if self.path == "rebalance":
            w_LP = 1.0 / cnt_LP
            return lambda counts_LE=None: w_LP
        phy2log_HP, moe_L = hidden_rows(placement, self.num_hidden_layers)
        G = placement.num_gpus
        c = _candidates(phy2log_HP[moe_L], G, placement.num_nodes, self.prefer_same_node)
        w_LP = np.zeros((L, P))
        l_i, e_i, g_i = np.nonzero(c.nearest_HEG >= 0)
        np.add.at(w_LP, (l_i, c.nearest_HEG[l_i, e_i, g_i]), 1.0 / G)
        # Ranks without a nearest replica spread over all of the expert's slots.
        k_LE = (c.nearest_HEG < 0).sum(axis=2)
        k_LP = np.take_along_axis(k_LE, placement.phy2log_LP, axis=1)
        w_LP += k_LP / (G * cnt_LP)
        return lambda counts_LE=None: w_LP
