"""DeepSeek EPLB's tuple `(phy2log, log2phy, logcnt)`, to and from a Placement (API only).

Legend: L = MoE layers, E = logical experts, P = physical slots, X = replica columns.

`deepseek-ai/EPLB`'s `rebalance_experts` returns, per MoE layer:
- `phy2log` [L, P]: logical expert held by each physical slot;
- `log2phy` [L, E, X]: the physical slots of each logical expert, padded with -1; DeepSeek's
  file uses X = P - E + 1 (the most replicas one expert can have), SGLang's copy uses
  X = max replica count; both are accepted on input;
- `logcnt` [L, E]: replicas of each logical expert.
The tuple carries no GPU count or layer ids, so `from_deepseek` asks for them.
"""

from __future__ import annotations

import numpy as np

from eplb.errors import EplbError, whole_number
from eplb.placement import Placement


def to_deepseek(placement: Placement, *, pad_to: int | None = None, as_torch: bool = False):
    """(phy2log [L, P], log2phy [L, E, X], logcnt [L, E]) as int64 numpy arrays (or torch tensors).

    pad_to: replica columns X of log2phy; default the largest replica count. Pass
    `P - E + 1` for the exact shape of DeepSeek's reference code.
    """
    log2phy_LEX = placement.log2phy_LEX
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
    if hasattr(a, "detach"):  # a torch tensor; no torch import needed to convert it
        a = a.detach().cpu().numpy()
    a = np.asarray(a)
    if not np.issubdtype(a.dtype, np.integer):
        raise EplbError(f"{name} must hold integers, got dtype {a.dtype}")
    return a.astype(np.int64)


def from_deepseek(phy2log, log2phy=None, logcnt=None, *, num_gpus: int, num_nodes: int = 1,
                  num_logical_experts: int | None = None, layer_ids=None, planner: str = "deepseek") -> Placement:
    """A Placement from DeepSeek's tuple; log2phy and logcnt, when given, must agree with phy2log."""
    phy2log_LP = _as_numpy(phy2log, "phy2log")
    if phy2log_LP.ndim != 2:
        raise EplbError(f"phy2log must be 2-D [layers, physical slots], got shape {phy2log_LP.shape}")
    E = int(num_logical_experts) if num_logical_experts is not None else int(phy2log_LP.max()) + 1
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
