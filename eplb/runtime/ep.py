"""Expert-parallel MoE shim on torch.distributed: one layer's routed experts spread over ranks.

Legend: T = tokens on this rank, K = top-k, D = model dim, F = expert hidden dim,
E = logical experts, P = physical slots, G = ranks in the group, S = slots per rank (P // G),
X = most replicas of an expert, N = T * K (token, expert) rows this rank sends,
R = rows this rank receives and computes.

How a forward goes (attention is data-parallel, so each rank brings its own T tokens):
1. every (token, chosen expert) row picks one physical slot among the expert's replicas
   (`MODES`); slot p lives on rank p // S as local slot p % S;
2. rows are sorted by destination rank; the split sizes are exchanged with one
   `all_to_all_single`, then the rows (and their local slot ids) travel with
   `all_to_all_single` and uneven splits;
3. each rank runs its rows through the SwiGLU expert in their local slot;
4. outputs travel back along the reversed splits and are combined with the router weights.
The same code runs on gloo (CPU tensors) and NCCL (CUDA tensors): the device is taken from
the tensors, the process group is passed in explicitly.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from eplb.core.placement import Placement
from eplb.dispatch.rules import Resplitter
from eplb.errors import EplbError
from eplb.runtime.model import swiglu

MODES = ("even", "weights", "local", "resplit")
"""Replica choice: "even" = round-robin over an expert's replicas; "weights" = the plan's
dispatch_weights (systematic weighted choice per token); "local" = a replica on the token's
own rank when there is one, else round-robin; "resplit" = weights re-split per batch from
the batch's own counts (`eplb.dispatch.resplit`)."""


def ranks_agree(group: dist.ProcessGroup, device: torch.device | str, *arrays: np.ndarray) -> bool:
    """Do all ranks of `group` hold the same arrays? (One tiny all-reduce of a digest.)

    Ranks that disagree on a placement or a migration plan would send rows to the wrong
    experts or wait forever for transfers nobody sends; this turns both into an error.
    """
    d = hashlib.blake2b(digest_size=8)
    for a in arrays:
        a = np.ascontiguousarray(a)
        d.update(f"{a.dtype.str}{a.shape}".encode())
        d.update(a.tobytes())
    v = int.from_bytes(d.digest(), "little", signed=True) >> 1  # >> 1: -v never overflows
    t = torch.tensor([v, -v], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t[0]) == -int(t[1])


# Expert computation -----------------------------------------------------------------------------


def swiglu_experts(x_RD: torch.Tensor, slot_R: torch.Tensor, w_gate_SFD: torch.Tensor,
                   w_up_SFD: torch.Tensor, w_down_SDF: torch.Tensor) -> torch.Tensor:
    """Run each row through the SwiGLU expert in its local slot: y = W_down (silu(W_gate x) * W_up x).

    x_RD rows, slot_R int64 local slot of each row (0..S-1); returns y_RD.
    """
    R, D = x_RD.shape
    S = w_gate_SFD.shape[0]
    if R == 0:
        return x_RD.new_zeros((0, w_down_SDF.shape[1]))
    order_R = torch.argsort(slot_R, stable=True)
    # One host sync for the split sizes: slicing by them is cheaper than masking per slot.
    rows_S = torch.bincount(slot_R, minlength=S).tolist()
    xs_RD = x_RD[order_R]
    out_RD = torch.empty((R, w_down_SDF.shape[1]), dtype=x_RD.dtype, device=x_RD.device)
    start = 0
    for s, n in enumerate(rows_S):
        if n:
            # The reference model's own expert function: same arithmetic, same rounding.
            out_RD[start:start + n] = swiglu(xs_RD[start:start + n], w_gate_SFD[s], w_up_SFD[s], w_down_SDF[s])
            start += n
    y_RD = torch.empty_like(out_RD)
    y_RD[order_R] = out_RD
    return y_RD


# Replica choice ----------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ReplicaTable:
    """One layer's replica maps, as tensors on one device."""

    log2phy_EX: torch.Tensor
    """Global slots of each expert's replicas, int64 [E, X], padded with -1."""
    count_E: torch.Tensor
    """Replicas of each expert, int64 [E]."""
    local_EX: torch.Tensor
    """This rank's slots of each expert first (padded with -1), int64 [E, X]."""
    local_count_E: torch.Tensor
    """Replicas of each expert on this rank, int64 [E]."""
    weights_EX: torch.Tensor | None
    """The plan's dispatch weight of each replica (0 on padding), float64 [E, X], or None."""

    @classmethod
    def build(cls, placement: Placement, layer: int, rank: int, device: torch.device | str = "cpu") -> ReplicaTable:
        S = placement.slots_per_gpu
        log2phy_EX = placement.log2phy_LEX[layer]
        count_E = placement.replica_count_LE[layer]
        is_local_EX = (log2phy_EX >= 0) & (log2phy_EX // S == rank)
        # Stable sort puts the local replicas first, in slot order.
        first_EX = np.argsort(~is_local_EX, axis=1, kind="stable")
        local_EX = np.where(np.take_along_axis(is_local_EX, first_EX, 1),
                            np.take_along_axis(log2phy_EX, first_EX, 1), -1)
        weights_EX = None
        if placement.dispatch_weights_LP is not None:
            w_P = placement.dispatch_weights_LP[layer]
            weights_EX = np.where(log2phy_EX >= 0, w_P[np.maximum(log2phy_EX, 0)], 0.0)
        t = lambda a: torch.tensor(np.asarray(a), device=device)  # noqa: E731  (copies: placements are read-only)
        return cls(t(log2phy_EX), t(count_E), t(local_EX), t(is_local_EX.sum(axis=1)),
                   None if weights_EX is None else t(weights_EX))


def occurrence(expert_N: torch.Tensor, num_logical_experts: int) -> torch.Tensor:
    """occ_N: how many earlier rows chose the same expert (0, 1, 2, ... per expert, in row order)."""
    order_N = torch.argsort(expert_N, stable=True)
    n_E = torch.bincount(expert_N, minlength=num_logical_experts)
    start_E = torch.cumsum(n_E, 0) - n_E
    occ_sorted = torch.arange(expert_N.numel(), device=expert_N.device) - start_E[expert_N[order_N]]
    occ_N = torch.empty_like(occ_sorted)
    occ_N[order_N] = occ_sorted
    return occ_N


def weighted_choice(expert_N: torch.Tensor, weights_EX: torch.Tensor, count_E: torch.Tensor,
                    rank: int, world: int) -> torch.Tensor:
    """Replica index (0..X-1) of each row, splitting each expert's rows by the weights.

    Systematic sampling: the i-th of an expert's n rows on this rank takes the replica whose
    cumulative-weight interval holds (i + phase) / n. Every replica then gets its share of the
    rows to within one (a random draw would add sqrt(n) noise), and a per-rank phase spreads
    the rounding over ranks. Replicas with weight 0 get nothing.
    """
    E = weights_EX.shape[0]
    w_EX = weights_EX.to(torch.float64)
    cum_EX = torch.cumsum(w_EX, 1)
    # Normalise so the last positive replica ends at exactly 1.0 (x / x == 1 in IEEE), so
    # t < 1 can never run past it into padding or a zero-weight replica.
    cum_EX = cum_EX / cum_EX[:, -1:].clamp_min(1e-300)
    occ_N = occurrence(expert_N, E)
    n_N = torch.bincount(expert_N, minlength=E)[expert_N]
    phase = (rank + 0.5) / world
    t_N = (occ_N.to(torch.float64) + phase) / n_N.to(torch.float64)
    rep_N = (t_N[:, None] >= cum_EX[expert_N]).sum(1)
    return torch.minimum(rep_N, count_E[expert_N] - 1)


def choose_slots(expert_N: torch.Tensor, mode: str, table: ReplicaTable, rank: int, world: int,
                 weights_EX: torch.Tensor | None = None) -> torch.Tensor:
    """Global physical slot (0..P-1) serving each (token, expert) row.

    expert_N int64 logical expert ids; `weights_EX` overrides the table's weights ("resplit").
    """
    E = table.count_E.shape[0]
    if expert_N.numel() == 0:
        return expert_N.clone()
    count_N = table.count_E[expert_N]
    if mode == "even":
        # Start each rank at a different replica so that single rows do not all pile onto
        # the first replica of every expert.
        rep_N = (occurrence(expert_N, E) + rank) % count_N
        return table.log2phy_EX[expert_N, rep_N]
    if mode in ("weights", "resplit"):
        w_EX = table.weights_EX if weights_EX is None else weights_EX
        assert w_EX is not None, "caller checks that weights exist"
        rep_N = weighted_choice(expert_N, w_EX, table.count_E, rank, world)
        return table.log2phy_EX[expert_N, rep_N]
    if mode == "local":
        occ_N = occurrence(expert_N, E)
        local_N = table.local_count_E[expert_N]
        even_N = table.log2phy_EX[expert_N, (occ_N + rank) % count_N]
        mine_N = table.local_EX[expert_N, occ_N % local_N.clamp_min(1)]
        return torch.where(local_N > 0, mine_N, even_N)
    raise EplbError(f"unknown dispatch mode {mode!r}: choose one of {', '.join(MODES)}")


# The layer ---------------------------------------------------------------------------------------


@dataclass
class ForwardStats:
    """What the last forward did on this rank (for eplb.runtime.measure)."""

    rows_sent: int = 0
    """(token, expert) rows this rank sent out (T * K)."""
    rows_received: int = 0
    """Rows this rank computed: its expert load."""
    compute_s: float = 0.0
    """Time of the expert computation: CPU time of this thread on CPU tensors (ranks share
    cores, so wall time would count the other ranks' work), wall time after a device sync on
    CUDA when `sync_timing` is set."""
    a2a_s: float = 0.0
    """Wall time of the all-to-all exchanges (split sizes, rows there, outputs back)."""


class ExpertParallelMoE(torch.nn.Module):
    """The routed experts of one MoE layer, spread over the ranks of a process group.

    Each rank holds the S physical slots `placement` gives it in `layer` (slots
    rank * S .. rank * S + S - 1) as stacked SwiGLU weights w_gate_SFD, w_up_SFD [S, F, D] and
    w_down_SDF [S, D, F]. `forward(x_TD, topk_ids_TK, topk_weights_TK)` returns the routed
    part of the MoE output for this rank's own tokens, equal (to float rounding) to running
    the same tokens through the single-device experts. Construction, `set_placement` and
    `forward` are collective over `group` (every rank calls them, in the same order).
    """

    def __init__(self, placement: Placement, layer: int, w_gate_SFD: torch.Tensor, w_up_SFD: torch.Tensor,
                 w_down_SDF: torch.Tensor, *, group: dist.ProcessGroup, mode: str = "even",
                 sync_timing: bool = False):
        super().__init__()
        if group is None:
            raise EplbError("pass the expert-parallel process group explicitly (e.g. group=dist.group.WORLD)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.sync_timing = bool(sync_timing)
        self.last = ForwardStats()
        self.register_buffer("w_gate_SFD", w_gate_SFD, persistent=False)
        self.register_buffer("w_up_SFD", w_up_SFD, persistent=False)
        self.register_buffer("w_down_SDF", w_down_SDF, persistent=False)
        self.set_placement(placement, layer, mode=mode)

    @classmethod
    def from_full(cls, placement: Placement, layer: int, w_gate_EFD: torch.Tensor, w_up_EFD: torch.Tensor,
                  w_down_EDF: torch.Tensor, *, group: dist.ProcessGroup, mode: str = "even",
                  sync_timing: bool = False) -> ExpertParallelMoE:
        """Take this rank's slots out of the full stacked expert weights [E, ...] (copies)."""
        rank = dist.get_rank(group)
        S = placement.slots_per_gpu
        if not 0 <= layer < placement.num_layers:
            raise EplbError(f"layer index {layer} is outside 0..{placement.num_layers - 1} of the placement")
        experts = torch.tensor(placement.phy2log_LP[layer, rank * S:(rank + 1) * S], device=w_gate_EFD.device)
        if w_gate_EFD.shape[0] != placement.num_logical_experts:
            raise EplbError(f"expert weights hold {w_gate_EFD.shape[0]} experts, the placement "
                            f"{placement.num_logical_experts}: pass the model's full stacked weights")
        return cls(placement, layer, w_gate_EFD[experts].clone(), w_up_EFD[experts].clone(),
                   w_down_EDF[experts].clone(), group=group, mode=mode, sync_timing=sync_timing)

    def check_placement(self, placement: Placement, layer: int, *, mode: str | None = None,
                        weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> str:
        """Raise EplbError unless `set_placement` would take these arguments; returns the mode.

        Local (no communication) and changes nothing: `apply_placement` runs it on every layer
        before the first weight moves, so a refused placement never leaves weights half-moved."""
        mode = self.mode if mode is None else mode
        if mode not in MODES:
            raise EplbError(f"unknown dispatch mode {mode!r}: choose one of {', '.join(MODES)}")
        if placement.num_gpus != self.world:
            raise EplbError(f"placement is for {placement.num_gpus} GPUs but the process group has "
                            f"{self.world} ranks: plan for {self.world} GPUs")
        if not 0 <= layer < placement.num_layers:
            raise EplbError(f"layer index {layer} is outside 0..{placement.num_layers - 1} of the placement")
        if mode == "weights" and placement.dispatch_weights_LP is None:
            raise EplbError("dispatch mode 'weights' needs a placement with dispatch_weights: use mode "
                            "'even' or a planner that sets weights")
        w = (self.w_gate_SFD, self.w_up_SFD, self.w_down_SDF) if weights is None else weights
        S = placement.slots_per_gpu
        shapes = tuple(tuple(t.shape) for t in w)
        Fh, D = shapes[0][1:] if len(shapes[0]) == 3 else (-1, -1)
        if shapes != ((S, Fh, D), (S, Fh, D), (S, D, Fh)):
            raise EplbError(f"local expert weights have shapes {shapes}; this placement gives each rank "
                            f"{S} slots: need gate/up [{S}, F, D] and down [{S}, D, F]")
        return mode

    def set_placement(self, placement: Placement, layer: int, *, mode: str | None = None,
                      weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        """Serve `placement` from now on (with the local weights that go with it, if given).

        Collective over the group (a check that every rank got the same placement). Nothing
        changes if it raises."""
        mode = self.check_placement(placement, layer, mode=mode, weights=weights)
        w_LP = placement.dispatch_weights_LP
        device = (self.w_gate_SFD if weights is None else weights[0]).device
        if not ranks_agree(self.group, device, placement.phy2log_LP[layer],
                           np.zeros(0) if w_LP is None else w_LP[layer], np.array([layer, MODES.index(mode)])):
            raise EplbError(f"the ranks were given different placements or modes for layer {layer}: "
                            f"build the placement from the same inputs on every rank")
        if weights is not None:
            self.w_gate_SFD, self.w_up_SFD, self.w_down_SDF = weights
        self.mode = mode
        self.placement = placement
        self.layer = int(layer)
        self._one_layer = Placement(
            placement.phy2log_LP[layer:layer + 1], placement.num_gpus, placement.num_logical_experts,
            placement.num_nodes, placement.layer_ids[layer:layer + 1],
            None if placement.dispatch_weights_LP is None else placement.dispatch_weights_LP[layer:layer + 1],
        )
        self._tables: dict[str, ReplicaTable] = {}
        self._resplitter = None

    @property
    def slots_per_gpu(self) -> int:
        return self.placement.slots_per_gpu

    @property
    def local_experts_S(self) -> np.ndarray:
        """Logical expert held by each of this rank's slots."""
        S = self.slots_per_gpu
        return self.placement.phy2log_LP[self.layer, self.rank * S:(self.rank + 1) * S]

    def _table(self, device: torch.device) -> ReplicaTable:
        key = str(device)
        if key not in self._tables:
            self._tables[key] = ReplicaTable.build(self._one_layer, 0, self.rank, device)
        return self._tables[key]

    def _resplit_weights(self, expert_N: torch.Tensor, table: ReplicaTable,
                         refuse: Callable[[list[list[int]]], None], verdict_2: torch.Tensor) -> torch.Tensor:
        """Replica weights re-split from this batch's counts, summed over all ranks.

        The same all-reduce carries every rank's input verdict (see `forward`), since it is the
        first exchange of a forward in this mode."""
        if self._resplitter is None:
            self._resplitter = Resplitter(self._one_layer)
        E, G, r = self.placement.num_logical_experts, self.world, self.rank
        counts = torch.zeros(E + 2 * G, dtype=torch.int64, device=expert_N.device)
        counts[:E] = torch.bincount(expert_N, minlength=E)
        counts[E + 2 * r:E + 2 * r + 2] = verdict_2
        # The batch is every rank's tokens: re-split on the summed counts, so that the ranks'
        # choices add up to the split that balances the GPUs.
        dist.all_reduce(counts, group=self.group)
        c = counts.cpu().numpy()
        refuse(c[E:].reshape(G, 2).tolist())
        w_LP = np.asarray(self._resplitter(c[None, :E].astype(np.float64)))
        if w_LP.shape != (1, self.placement.num_slots):
            raise AssertionError(f"resplit returned shape {w_LP.shape}, expected {(1, self.placement.num_slots)}")
        w_P = torch.as_tensor(w_LP[0], device=expert_N.device)
        log2phy_EX = table.log2phy_EX
        zero = torch.zeros((), dtype=w_P.dtype, device=w_P.device)
        return torch.where(log2phy_EX >= 0, w_P[log2phy_EX.clamp_min(0)], zero)

    def _input_problem(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor,
                       topk_weights_TK: torch.Tensor) -> str | None:
        """What is wrong with this rank's inputs, or None (shapes, dtypes, devices: no host sync)."""
        w = self.w_gate_SFD
        D = w.shape[2]
        if x_TD.dim() != 2 or x_TD.shape[1] != D:
            return f"x has shape {tuple(x_TD.shape)}: need [T, {D}] (tokens, model dim of the experts)"
        T = x_TD.shape[0]
        if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != T or topk_weights_TK.shape != topk_ids_TK.shape:
            return (f"x has {T} tokens but topk ids/weights have shapes {tuple(topk_ids_TK.shape)}"
                    f"/{tuple(topk_weights_TK.shape)}: need [{T}, K] for both")
        dt = topk_ids_TK.dtype
        if dt.is_floating_point or dt.is_complex or dt == torch.bool:
            return (f"topk ids have dtype {dt}: need integer expert ids (forward takes x, topk_ids, "
                    f"topk_weights in that order)")
        if x_TD.dtype != w.dtype:
            return f"x is {x_TD.dtype} but the expert weights are {w.dtype}: cast one to the other"
        for name, t in (("x", x_TD), ("topk ids", topk_ids_TK), ("topk weights", topk_weights_TK)):
            if t.device != w.device:
                return f"{name} is on {t.device} but the expert weights are on {w.device}"
        return None

    def _refuse(self, verdict_G2: list[list[int]], problem: str | None, ids_N: torch.Tensor) -> None:
        """Raise on every rank if any rank's verdict [ids out of range, malformed inputs] is bad."""
        culprits = [g for g, (n_bad, malformed) in enumerate(verdict_G2) if n_bad or malformed]
        if not culprits:
            return
        E = self.placement.num_logical_experts
        if problem is not None:
            raise EplbError(f"expert-parallel rank {self.rank}: {problem}")
        if verdict_G2[self.rank][0]:
            bad = ids_N[(ids_N < 0) | (ids_N >= E)]
            raise EplbError(f"expert-parallel rank {self.rank}: topk ids hold {bad.numel()} expert id(s) outside "
                            f"0..{E - 1} (first: {int(bad[0])}): drop padding or dropped-token markers before "
                            f"the MoE")
        raise EplbError(f"expert-parallel rank(s) {culprits} got bad inputs (their own error says which): "
                        f"no rank ran this forward")

    def _timer(self, device: torch.device) -> float:
        # CUDA work is asynchronous: without a sync the clock would stop before the kernels do.
        if device.type == "cuda" and self.sync_timing:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def forward(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> torch.Tensor:
        """Routed-expert output y_TD of this rank's tokens (shared experts not included).

        Collective. Bad inputs on any rank (shapes, dtypes, devices, expert ids outside
        0..E-1) raise EplbError on every rank, and the group stays usable."""
        G, S, E = self.world, self.slots_per_gpu, self.placement.num_logical_experts
        D = self.w_gate_SFD.shape[2]
        device = self.w_gate_SFD.device
        on_cpu = device.type == "cpu"
        table = self._table(device)

        # Step 0: this rank's verdict on its inputs, [ids out of range, malformed]. It travels
        # with the forward's first exchange, so that a bad input raises on every rank instead
        # of leaving the others waiting in that exchange; a malformed input joins it with no rows.
        problem = self._input_problem(x_TD, topk_ids_TK, topk_weights_TK)
        if problem is None:
            T, K = topk_ids_TK.shape
            ids_N = topk_ids_TK.reshape(-1).to(torch.int64)
            bad_N = (ids_N < 0) | (ids_N >= E)
            expert_N = ids_N.masked_fill(bad_N, 0)  # keeps the indexing below in bounds until the verdict
            verdict_2 = torch.stack([bad_N.sum(), torch.zeros((), dtype=torch.int64, device=device)])
        else:
            T = K = 0
            ids_N = expert_N = torch.zeros(0, dtype=torch.int64, device=device)
            verdict_2 = torch.tensor([0, 1], dtype=torch.int64, device=device)

        def refuse(verdict_G2: list[list[int]]) -> None:
            self._refuse(verdict_G2, problem, ids_N)

        stats = ForwardStats(rows_sent=T * K)

        # Step 1: choose a replica (global slot) for every (token, expert) row.
        token_N = torch.arange(T, device=device).repeat_interleave(K)
        resplit_EX = self._resplit_weights(expert_N, table, refuse, verdict_2) if self.mode == "resplit" else None
        slot_N = choose_slots(expert_N, self.mode, table, self.rank, G, resplit_EX)

        # Step 2: sort rows by destination rank and exchange them.
        order_N = torch.argsort(slot_N // S, stable=True)
        send_G = torch.bincount(slot_N // S, minlength=G)
        t0 = self._timer(device)
        # Row counts each way, each with the sender's verdict: [rows, ids out of range, malformed].
        send_G3 = torch.cat([send_G[:, None], verdict_2.expand(G, 2)], 1)
        recv_G3 = torch.empty_like(send_G3)
        dist.all_to_all_single(recv_G3, send_G3, group=self.group)
        sent, got = torch.stack([send_G3, recv_G3]).tolist()  # one host sync for both
        refuse([r[1:] for r in got])
        send_split, recv_split = [r[0] for r in sent], [r[0] for r in got]
        R = sum(recv_split)
        x_RD = x_TD.new_empty((R, D))
        dist.all_to_all_single(x_RD, x_TD[token_N[order_N]], recv_split, send_split, group=self.group)
        slot_R = torch.empty(R, dtype=torch.int64, device=device)
        dist.all_to_all_single(slot_R, (slot_N % S)[order_N], recv_split, send_split, group=self.group)
        stats.a2a_s += self._timer(device) - t0

        # Step 3: the local experts.
        c0 = time.thread_time() if on_cpu else self._timer(device)
        y_RD = swiglu_experts(x_RD, slot_R, self.w_gate_SFD, self.w_up_SFD, self.w_down_SDF)
        stats.compute_s = (time.thread_time() if on_cpu else self._timer(device)) - c0

        # Step 4: outputs back along the reversed splits, then the weighted combine.
        t0 = self._timer(device)
        y_ND = x_TD.new_empty((T * K, y_RD.shape[1]))
        dist.all_to_all_single(y_ND, y_RD, send_split, recv_split, group=self.group)
        stats.a2a_s += self._timer(device) - t0
        stats.rows_received = R
        self.last = stats
        w_N = topk_weights_TK.reshape(-1)[order_N].to(y_ND.dtype)
        y_TD = torch.zeros((T, y_ND.shape[1]), dtype=x_TD.dtype, device=device)
        y_TD.index_add_(0, token_N[order_N], y_ND * w_N[:, None])
        return y_TD
