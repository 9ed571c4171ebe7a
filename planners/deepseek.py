"""DeepSeek's EPLB algorithm (deepseek-ai/EPLB `eplb.py`), re-implemented in numpy as a baseline.

Legend: L = MoE layers, E = logical experts, G = GPUs, N = nodes, S = slots per GPU,
P = G x S physical slots, X = rows of a batched step (layers, or layers x nodes).

Same steps, same arithmetic (float32 loads, the same tie-breaking) as the reference, so it
reproduces the reference's maps exactly; the per-layer Python loops of the reference are
replaced by numpy steps over all rows at once.

Hierarchical policy (used when groups divide over nodes, as DeepSeek's entry point decides):
Step 1: pack expert groups to nodes, groups_per_node each, balancing group loads.
Step 2: replicate within each node: each node's P / N slots go to its own experts, each
        redundant slot to the expert with the highest load per replica.
Step 3: pack each node's replicas onto its GPUs, S each, balancing GPU loads.
Global policy: the same with one group and one node.

Known weaknesses, kept on purpose (this is the baseline): a node's redundant slots cannot
serve another node's hot expert, whole groups are packed to nodes, and two replicas of one
expert may share a GPU.
"""

from __future__ import annotations

import numpy as np

from eplb.errors import EplbError
from planners.api import PlanRequest, Solution

POLICIES = ("auto", "hierarchical", "global")


def balanced_packing(weight_XI: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack I items into `num_packs` packs of I / num_packs items each, per row.

    Items go heaviest first to the lightest pack that still has room (lowest pack index on
    ties). Returns (pack_XI, rank_XI): each item's pack and its position inside the pack.
    """
    X, I = weight_XI.shape
    assert I % num_packs == 0, (I, num_packs)
    per_pack = I // num_packs
    if per_pack == 1:
        return np.broadcast_to(np.arange(I), (X, I)).copy(), np.zeros((X, I), dtype=np.int64)
    # The reference sorts float32 weights descending; a stable sort keeps equal items in id order.
    order_XI = np.argsort(-weight_XI.astype(np.float32), axis=1, kind="stable")
    w64_XI = weight_XI.astype(np.float64)  # the reference accumulates pack loads as Python floats
    rows = np.arange(X)
    pack_XI = np.full((X, I), -1, dtype=np.int64)
    rank_XI = np.full((X, I), -1, dtype=np.int64)
    pack_load_XK = np.zeros((X, num_packs))
    pack_items_XK = np.zeros((X, num_packs), dtype=np.int64)
    for j in range(I):
        item_X = order_XI[:, j]
        k_X = np.argmin(np.where(pack_items_XK < per_pack, pack_load_XK, np.inf), axis=1)
        pack_XI[rows, item_X] = k_X
        rank_XI[rows, item_X] = pack_items_XK[rows, k_X]
        pack_load_XK[rows, k_X] += w64_XI[rows, item_X]
        pack_items_XK[rows, k_X] += 1
    return pack_XI, rank_XI


def replicate_experts(weight_XM: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replicate M experts into `num_phy` replicas, minimising the heaviest replica, per row.

    Returns (phy2log_XQ, rank_XQ, count_XM) with Q = num_phy: slot q < M holds expert q, each
    later slot the expert with the highest float32 load per replica at that moment.
    """
    X, M = weight_XM.shape
    assert num_phy >= M, (num_phy, M)
    rows = np.arange(X)
    phy2log_XQ = np.tile(np.arange(num_phy, dtype=np.int64), (X, 1))
    rank_XQ = np.zeros((X, num_phy), dtype=np.int64)
    count_XM = np.ones((X, M), dtype=np.int64)
    w32 = weight_XM.astype(np.float32)
    per_XM = w32.copy()
    for q in range(M, num_phy):
        e_X = np.argmax(per_XM, axis=1)
        phy2log_XQ[:, q] = e_X
        rank_XQ[:, q] = count_XM[rows, e_X]
        count_XM[rows, e_X] += 1
        per_XM[rows, e_X] = w32[rows, e_X] / count_XM[rows, e_X].astype(np.float32)
    return phy2log_XQ, rank_XQ, count_XM


def _inverse(perm_XI: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm_XI)
    np.put_along_axis(inv, perm_XI, np.broadcast_to(np.arange(perm_XI.shape[1]), perm_XI.shape), axis=1)
    return inv


def rebalance_hierarchical(weight_LE: np.ndarray, num_slots: int, num_expert_groups: int, num_nodes: int,
                           num_gpus: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepSeek's hierarchical policy. Returns (phy2log_LP, rank_LP, count_LE)."""
    L, E = weight_LE.shape
    N, G, P = num_nodes, num_gpus, num_slots
    group_size = E // num_expert_groups
    groups_per_node = num_expert_groups // N
    S = P // G
    w = weight_LE.astype(np.float32)

    # Step 1: pack groups to nodes; "mlog" numbers experts node by node.
    group_load_LK = w.reshape(L, num_expert_groups, group_size).sum(axis=2, dtype=np.float32)
    gpack_LK, grank_LK = balanced_packing(group_load_LK, N)
    log2mlog_LE = (((gpack_LK * groups_per_node + grank_LK) * group_size)[:, :, None]
                   + np.arange(group_size)).reshape(L, E)
    mlog2log_LE = _inverse(log2mlog_LE)

    # Step 2: replicate within nodes; rows are (layer, node), columns the node's E / N experts.
    mload_XM = np.take_along_axis(w, mlog2log_LE, axis=1).reshape(L * N, E // N)
    phy2mlog_XQ, phyrank_XQ, mcount_XM = replicate_experts(mload_XM, P // N)

    # Step 3: pack each node's replicas onto its G / N GPUs.
    per_replica_XM = mload_XM / mcount_XM.astype(np.float32)
    phy_load_XQ = np.take_along_axis(per_replica_XM, phy2mlog_XQ, axis=1)
    pack_XQ, rank_XQ = balanced_packing(phy_load_XQ, G // N)
    pphy2phy_XQ = _inverse(pack_XQ * S + rank_XQ)

    pphy2mlog_LP = (np.take_along_axis(phy2mlog_XQ, pphy2phy_XQ, axis=1).reshape(L, N, -1)
                    + np.arange(0, E, E // N)[None, :, None]).reshape(L, P)
    phy2log_LP = np.take_along_axis(mlog2log_LE, pphy2mlog_LP, axis=1)
    rank_LP = np.take_along_axis(phyrank_XQ, pphy2phy_XQ, axis=1).reshape(L, P)
    count_LE = np.take_along_axis(mcount_XM.reshape(L, E), log2mlog_LE, axis=1)
    return phy2log_LP, rank_LP, count_LE


def check_config(num_logical_experts: int, num_slots: int, num_expert_groups: int, num_nodes: int,
                 num_gpus: int) -> None:
    """Refuse, with the fix, what DeepSeek's hierarchical policy asserts on."""
    if num_logical_experts % num_expert_groups:
        raise EplbError(f"deepseek hierarchical policy: {num_logical_experts} experts do not split into "
                        f"{num_expert_groups} equal groups; use a group count that divides {num_logical_experts}, "
                        f"or policy='global'")
    if num_expert_groups % num_nodes:
        raise EplbError(f"deepseek hierarchical policy: {num_expert_groups} expert groups do not split "
                        f"evenly over {num_nodes} nodes; use policy='global' or planner 'hierarchical'")
    if num_gpus % num_nodes:
        raise EplbError(f"num_gpus ({num_gpus}) must be divisible by num_nodes ({num_nodes})")
    if num_slots % num_gpus:
        raise EplbError(f"{num_slots} physical slots do not split evenly over {num_gpus} GPUs")


def rebalance_experts(weight_LE, num_replicas: int, num_expert_groups: int | None, num_nodes: int,
                      num_gpus: int, policy: str = "auto") -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """DeepSeek's entry point: (phy2log_LP, log2phy_LEX padded with -1, count_LE, policy used).

    policy "auto" decides as DeepSeek's `rebalance_experts` does: hierarchical when the groups
    split evenly over the nodes, else global. Without groups (None) auto means global.
    """
    if policy not in POLICIES:
        raise EplbError(f"unknown deepseek policy {policy!r}: choose one of {', '.join(POLICIES)}")
    weight_LE = np.asarray(weight_LE, dtype=np.float64)
    L, E = weight_LE.shape
    if num_replicas < E:
        raise EplbError(f"{num_replicas} physical slots cannot hold {E} logical experts")
    if policy == "auto":
        policy = "hierarchical" if num_expert_groups is not None and num_expert_groups % num_nodes == 0 else "global"
    if policy == "hierarchical":
        if num_expert_groups is None:
            raise EplbError("deepseek hierarchical policy needs num_expert_groups (DeepSeek-V3: 8)")
        check_config(E, num_replicas, num_expert_groups, num_nodes, num_gpus)
        phy2log_LP, rank_LP, count_LE = rebalance_hierarchical(weight_LE, num_replicas, num_expert_groups, num_nodes,
                                                               num_gpus)
    else:
        check_config(E, num_replicas, 1, 1, num_gpus)
        phy2log_LP, rank_LP, count_LE = rebalance_hierarchical(weight_LE, num_replicas, 1, 1, num_gpus)
    X = int(count_LE.max())
    log2phy_LEX = np.full((L, E, X), -1, dtype=np.int64)
    log2phy_LEX.reshape(L, -1)[np.arange(L)[:, None], phy2log_LP * X + rank_LP] = np.arange(num_replicas)
    return phy2log_LP, log2phy_LEX, count_LE, policy


class DeepSeekPlanner:
    """DeepSeek's EPLB (hierarchical when groups divide over nodes, else global): a baseline.

    policy: "auto" (DeepSeek's own rule), "hierarchical" or "global". Groups come from the
    request (`num_expert_groups`, from the trace's meta or the caller); with none, auto is global.
    """

    name = "deepseek"

    one_replica_per_gpu = False
    """DeepSeek's packing may put two replicas of one expert on one GPU."""

    def __init__(self, policy: str = "auto"):
        if policy not in POLICIES:
            raise EplbError(f"unknown deepseek policy {policy!r}: choose one of {', '.join(POLICIES)}")
        self.policy = policy

    def plan(self, request: PlanRequest) -> Solution:
        t = request.topology
        phy2log_LP, _, _, used = rebalance_experts(request.load_LE, t.num_slots, request.num_expert_groups,
                                                   t.num_nodes, t.num_gpus, self.policy)
        return Solution(phy2log_LP, message=f"DeepSeek EPLB, {used} policy", info={"policy": used})
