"""DeepSeek EPLB's tuple `(phy2log, log2phy, logcnt)`, to and from a Placement (API only).

Legend: L = MoE layers, E = logical experts, P = physical slots, X = replica columns.

`deepseek-ai/EPLB`'s `rebalance_experts` returns, per MoE layer:
- `phy2log` [L, P]: logical expert held by each physical slot;
- `log2phy` [L, E, X]: the physical slots of each logical expert by replica rank (column k
  holds the expert's replica of rank k), padded with -1 to X = the largest replica count
  (DeepSeek's `maxlogcnt`; SGLang's copy does the same; vLLM pads to P - E + 1); any width
  and column order is accepted on input;
- `logcnt` [L, E]: replicas of each logical expert.
The tuple carries no GPU count or layer ids, so `from_deepseek` asks for them.
"""

from __future__ import annotations

import numpy as np

from eplb.core.placement import Placement
from eplb.errors import EplbError, number_array, whole_array, whole_number


def replica_ranks(phy2log, log2phy) -> np.ndarray:
    """Replica rank of every slot, int64 [L, P], read from a DeepSeek-style log2phy [L, E, X]
    (slot log2phy[l, e, k] has rank k): what `to_deepseek` needs to give the columns back in
    the same order."""
    phy2log_LP = _as_numpy(phy2log, "phy2log")
    l2p_LEX = _as_numpy(log2phy, "log2phy")
    L, P = phy2log_LP.shape
    rank_LP = np.full((L, P), -1, dtype=np.int64)
    l_i, e_i, k_i = np.nonzero(l2p_LEX >= 0)
    rank_LP[l_i, l2p_LEX[l_i, e_i, k_i]] = k_i
    if (rank_LP < 0).any():
        l, p = np.argwhere(rank_LP < 0)[0]
        raise EplbError(f"log2phy lists no replica rank for slot {p} of layer index {l}")
    return rank_LP


def to_deepseek(placement: Placement, *, pad_to: int | None = None, replica_rank_LP=None,
                as_torch: bool = False):
    """(phy2log [L, P], log2phy [L, E, X], logcnt [L, E]) as int64 numpy arrays (or torch tensors).

    log2phy's columns are replica ranks, as in DeepSeek's `rebalance_experts`: column k of
    expert e holds the slot of its replica of rank k. replica_rank_LP [L, P] gives the ranks
    (e.g. `replica_ranks(phy2log, log2phy)` of a DeepSeek result, for an exact round trip);
    by default a replica's rank is its order among the expert's slots (lowest slot first),
    the order vLLM's `compute_logical_maps` and SGLang's start-up path build.
    pad_to: replica columns X of log2phy; default the largest replica count (DeepSeek's
    width). Pass `P - E + 1` for vLLM's `logical_to_physical_map` width.
    """
    log2phy_LEX = placement.log2phy_LEX
    if replica_rank_LP is not None:
        rank_LP = _as_numpy(replica_rank_LP, "replica_rank_LP")
        L, P = placement.phy2log_LP.shape
        if rank_LP.shape != (L, P):
            raise EplbError(f"replica_rank_LP must be [{L}, {P}] (one rank per slot), got shape {rank_LP.shape}")
        cnt_LP = np.take_along_axis(placement.replica_count_LE, placement.phy2log_LP, axis=1)
        # Ranks must number each expert's replicas 0..count-1 exactly once.
        key_LP = placement.phy2log_LP * (int(cnt_LP.max()) + 1) + rank_LP
        if (rank_LP < 0).any() or (rank_LP >= cnt_LP).any() or any(
                len(np.unique(row)) != P for row in key_LP):
            raise EplbError("replica_rank_LP must number the replicas of each expert 0..count-1, once each")
        log2phy_LEX = np.full_like(log2phy_LEX, -1)
        rows = np.broadcast_to(np.arange(L)[:, None], (L, P))
        log2phy_LEX[rows, placement.phy2log_LP, rank_LP] = np.broadcast_to(np.arange(P), (L, P))
    if pad_to is not None:
        pad_to = whole_number("pad_to (replica columns)", pad_to, 1)
        X = log2phy_LEX.shape[2]
        if pad_to < X:
            raise EplbError(f"pad_to ({pad_to}) is smaller than the largest replica count ({X})")
        log2phy_LEX = np.pad(log2phy_LEX, ((0, 0), (0, 0), (0, pad_to - X)), constant_values=-1)
    out = (placement.phy2log_LP.copy(), np.ascontiguousarray(log2phy_LEX), placement.replica_count_LE.copy())
    if as_torch:
        import torch  # only when tensors were asked for

        return tuple(torch.from_numpy(np.array(a, dtype=np.int64)) for a in out)
    return out


def _as_numpy(a, name: str) -> np.ndarray:
    a = number_array(name, a)  # tensors too (eplb.errors.tensor_array: no meta, sparse or bool ones)
    if not np.issubdtype(a.dtype, np.integer):
        raise EplbError(f"{name} must hold integers, got dtype {a.dtype}")
    return whole_array(name, a)  # uint64 ids past 2**62 are refused, not wrapped


def from_deepseek(phy2log, log2phy=None, logcnt=None, *, num_gpus: int, num_nodes: int = 1,
                  num_logical_experts: int | None = None, layer_ids=None, planner: str = "deepseek") -> Placement:
    """A Placement from DeepSeek's tuple; log2phy and logcnt, when given, must agree with phy2log."""
    phy2log_LP = _as_numpy(phy2log, "phy2log")
    if phy2log_LP.ndim != 2:
        raise EplbError(f"phy2log must be 2-D [layers, physical slots], got shape {phy2log_LP.shape}")
    if num_logical_experts is None and phy2log_LP.size == 0:
        raise EplbError(f"phy2log has shape {phy2log_LP.shape}, no slots: a placement needs at least one per GPU")
    E = (whole_number("num_logical_experts", num_logical_experts, 1) if num_logical_experts is not None
         else int(phy2log_LP.max()) + 1)
    p = Placement(phy2log_LP, num_gpus, E, num_nodes, layer_ids, planner=planner)
    if logcnt is not None:
        cnt_LE = _as_numpy(logcnt, "logcnt")
        if cnt_LE.shape != p.replica_count_LE.shape or not np.array_equal(cnt_LE, p.replica_count_LE):
            raise EplbError(f"logcnt (shape {cnt_LE.shape}) does not match the replica counts in phy2log")
    if log2phy is not None:
        l2p_LEX = _as_numpy(log2phy, "log2phy")
        L, P = phy2log_LP.shape
        if l2p_LEX.ndim != 3 or l2p_LEX.shape[:2] != (L, E):
            raise EplbError(f"log2phy must be [{L}, {E}, replicas], got shape {l2p_LEX.shape}")
        # The same slots per expert, in any order: compare sorted valid entries.
        mine_LEX = p.log2phy_LEX
        X = max(mine_LEX.shape[2], l2p_LEX.shape[2])
        a = np.sort(np.pad(mine_LEX, ((0, 0), (0, 0), (0, X - mine_LEX.shape[2])), constant_values=-1), axis=2)
        b = np.sort(np.pad(l2p_LEX, ((0, 0), (0, 0), (0, X - l2p_LEX.shape[2])), constant_values=-1), axis=2)
        if not np.array_equal(a, b):
            l, e = np.argwhere(np.any(a != b, axis=2))[0]
            raise EplbError(f"log2phy disagrees with phy2log for expert {e} in layer index {l}")
    return p
