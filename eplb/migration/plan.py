"""The migration plan: copies from one placement to another, in rounds that keep every expert served.

Legend: L = MoE layers, E = logical experts, G = ranks (GPUs), S = slots per rank,
P = G x S slots, M = transfers, R = rounds. Slot p lives on rank p // S.

`MigrationPlan` checks its indices when it is built (cheap, every plan) and `check` replays
it (every round, for plans that come from elsewhere: the runtime replays a plan before the
first byte moves). `eplb.migration.schedule` builds them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from eplb.core.placement import Placement
from eplb.errors import EplbError, readonly
from eplb.migration.checks import check_count, check_maps
from eplb.migration.moves import count_moves

CHECKPOINT = -1
"""Source rank of a transfer that reloads an expert from the checkpoint (no replica survived)."""

_INT_FIELDS = ("round_M", "layer_M", "expert_M", "src_rank_M", "src_slot_M", "dst_rank_M", "dst_slot_M",
               "chunk_R", "rank_ids_G")


def _round_index(k, num_rounds: int, what: str) -> int:
    """k as a round index in 0..num_rounds - 1 (0..num_rounds when it may name the end)."""
    hi = num_rounds if what == "state" else num_rounds - 1
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)) or not 0 <= k <= hi:
        raise EplbError(f"round {k!r} is outside 0..{hi}")
    return int(k)


@dataclass(frozen=True, eq=False)
class MigrationPlan:
    """Copies that turn old_LP into new_LP, in rounds that keep every expert served.

    Transfer m copies expert `expert_M[m]` of layer `layer_M[m]` from slot `src_slot_M[m]`
    (on rank `src_rank_M[m]`, or CHECKPOINT = -1: reload from the checkpoint) into slot
    `dst_slot_M[m]` (on rank `dst_rank_M[m]`) during round `round_M[m]`. Within a round every
    rank sends at most one and receives at most one expert over the network; copies inside
    one GPU (src rank = dst rank) use no link and are not limited. A slot being written
    serves nothing during its round (see `serving`). Ranks and slots are indices of the
    placements (0..G-1, 0..P-1); `rank_ids_G` names the engine rank of each.
    """

    old_LP: np.ndarray
    """Expert in each slot before migration, int64 [L, P]; -1 = empty slot."""
    new_LP: np.ndarray
    """Expert in each slot after migration, int64 [L, P]."""
    slots_per_gpu: int
    """S: slot p lives on rank p // S."""
    num_logical_experts: int
    """E: logical experts."""
    round_M: np.ndarray
    """Round of each transfer, non-decreasing, int64 [M]."""
    layer_M: np.ndarray
    """Layer index (0..L-1) of each transfer, int64 [M]."""
    expert_M: np.ndarray
    """Logical expert copied, int64 [M]."""
    src_rank_M: np.ndarray
    """Rank copied from, or CHECKPOINT (-1), int64 [M]."""
    src_slot_M: np.ndarray
    """Slot copied from (-1 with CHECKPOINT), int64 [M]."""
    dst_rank_M: np.ndarray
    """Rank written to, int64 [M]."""
    dst_slot_M: np.ndarray
    """Slot written to, int64 [M]."""
    staging_M: np.ndarray
    """True for copies that only break a cycle (into a slot restored later), bool [M]."""
    chunk_R: np.ndarray
    """Layer chunk each round belongs to, int64 [R]; a round never mixes chunks."""
    rank_ids_G: np.ndarray
    """Engine rank id of each rank index, int64 [G] (0..G-1 unless ranks failed)."""
    bytes_per_expert: int | None = None
    """Size of one expert's weights, for `bytes` (None: unknown)."""

    def __post_init__(self) -> None:
        old, new = np.asarray(self.old_LP), np.asarray(self.new_LP)
        if old.shape != new.shape or old.ndim != 2:
            raise EplbError(f"old and new maps must be [layers, slots] of one shape, got {old.shape} and {new.shape}")
        S = check_count("slots_per_gpu", self.slots_per_gpu)
        E = check_count("num_logical_experts", self.num_logical_experts)
        if self.bytes_per_expert is not None:
            check_count("bytes_per_expert", self.bytes_per_expert)
        G = len(np.atleast_1d(self.rank_ids_G))
        if np.ndim(self.rank_ids_G) != 1 or G * S != old.shape[1]:
            raise EplbError(f"rank_ids_G names {G} ranks of {S} slots each, but the maps have "
                            f"{old.shape[1]} slots: one engine rank per GPU is needed")
        check_maps(G, E, old_LP=old, new_LP=new)
        M = len(self.round_M)
        for name in _INT_FIELDS[:7] + ("staging_M",) + _INT_FIELDS[7:]:
            a = np.asarray(getattr(self, name))
            if a.ndim != 1 or (a.size and a.dtype.kind not in "biu"):
                raise EplbError(f"{name} must be a 1-D array of whole numbers, got {a.dtype} of shape {a.shape}")
            if name.endswith("_M") and len(a) != M:
                raise EplbError(f"{name} has {len(a)} entries, round_M has {M}")
        self._check_indices(old.shape, S, E)
        rnd = np.asarray(self.round_M, dtype=np.int64)
        if M and (np.any(np.diff(rnd) < 0) or rnd[0] < 0):
            raise EplbError("transfers must be sorted by round, from round 0")
        if len(self.chunk_R) != (int(rnd[-1]) + 1 if M else 0):
            raise EplbError(f"chunk_R has {len(self.chunk_R)} entries for {int(rnd[-1]) + 1 if M else 0} rounds")
        self._freeze()
        # Link limits: per round, each rank sends <= 1 and receives <= 1 over the network.
        net = self.network_mask
        for ranks in (self.src_rank_M[net], self.dst_rank_M[net]):
            key = rnd[net] * (len(self.rank_ids_G) + 1) + ranks
            if len(np.unique(key)) != len(key):
                raise EplbError("a rank sends or receives more than one expert in one round")

    @classmethod
    def trusted(cls, **fields) -> MigrationPlan:
        """A plan from fields known to be valid (the schedule kernel's rows on checked maps):
        the same value as `MigrationPlan(**fields)`, without its checks (a few ms at 256 GPUs,
        paid on every rebalance). Maps that are read-only int64 already are kept, not copied."""
        plan = object.__new__(cls)
        object.__setattr__(plan, "bytes_per_expert", None)
        for name, value in fields.items():
            object.__setattr__(plan, name, value)
        for name in ("old_LP", "new_LP"):
            a = fields[name]
            if not (a.dtype == np.int64 and a.flags.c_contiguous and not a.flags.writeable):
                object.__setattr__(plan, name, readonly(a.astype(np.int64)))
        plan._freeze(maps=False)
        return plan

    def _freeze(self, maps: bool = True) -> None:
        """Every array field as a C-ordered read-only array of its dtype (int64, bool for
        staging_M); maps: copy old_LP and new_LP too."""
        for name in _INT_FIELDS:
            object.__setattr__(self, name, readonly(np.asarray(getattr(self, name), dtype=np.int64)))
        object.__setattr__(self, "staging_M", readonly(np.asarray(self.staging_M, dtype=bool)))
        if maps:
            object.__setattr__(self, "old_LP", readonly(np.asarray(self.old_LP).astype(np.int64)))
            object.__setattr__(self, "new_LP", readonly(np.asarray(self.new_LP).astype(np.int64)))

    def _check_indices(self, shape: tuple[int, int], S: int, E: int) -> None:
        """Every index in range (serving, check and the engine index slots by them), and each
        transfer's ranks the ones its slots live on."""
        L, P = shape
        lay, exp_ = np.asarray(self.layer_M), np.asarray(self.expert_M)
        src, srank = np.asarray(self.src_slot_M), np.asarray(self.src_rank_M)
        dst, drank = np.asarray(self.dst_slot_M), np.asarray(self.dst_rank_M)
        reload = srank == CHECKPOINT
        bad = ((lay < 0) | (lay >= L) | (exp_ < 0) | (exp_ >= E) | (dst < 0) | (dst >= P) | (drank != dst // S)
               | np.where(reload, src != -1, (src < 0) | (src >= P) | (srank != src // S)))
        if bad.any():
            m = int(np.flatnonzero(bad)[0])
            raise EplbError(f"transfer {m} (layer {lay[m]}, expert {exp_[m]}, slot {src[m]} on rank {srank[m]} -> "
                            f"slot {dst[m]} on rank {drank[m]}) is outside the {L} x {P} maps of {E} experts "
                            f"or names a rank its slot is not on")

    @property
    def num_rounds(self) -> int:
        return len(self.chunk_R)

    @property
    def num_transfers(self) -> int:
        return len(self.round_M)

    @property
    def network_mask(self) -> np.ndarray:
        """Transfers that cross a link (not local copies, not checkpoint reloads), bool [M]."""
        return (self.src_rank_M >= 0) & (self.src_rank_M != self.dst_rank_M)

    @property
    def reloads(self) -> int:
        """Copies read from the checkpoint (experts that lost every replica)."""
        return int((self.src_rank_M == CHECKPOINT).sum())

    @functools.cached_property
    def moves(self) -> int:
        """Experts copied onto a GPU that did not hold them before (count_moves of old -> new;
        counted once, the maps are read-only)."""
        G = len(self.rank_ids_G)
        return int(count_moves(self.old_LP, self.new_LP, G, self.num_logical_experts).sum())

    @property
    def bytes(self) -> int | None:
        """Bytes sent over links and read from the checkpoint (None without bytes_per_expert)."""
        if self.bytes_per_expert is None:
            return None
        return int((self.network_mask.sum() + self.reloads) * self.bytes_per_expert)

    def summary(self) -> dict:
        """JSON-ready counts."""
        return {
            "moves": self.moves, "transfers": self.num_transfers,
            "network_transfers": int(self.network_mask.sum()),
            "local_copies": int(((self.src_rank_M == self.dst_rank_M)).sum()),
            "staging_copies": int(self.staging_M.sum()), "reloads": self.reloads,
            "rounds": self.num_rounds, "bytes": self.bytes,
        }

    def chunks(self) -> list[tuple[np.ndarray, range]]:
        """(layers, rounds) of each layer chunk, in the order they run."""
        out = []
        for c in np.unique(self.chunk_R):
            rounds = np.flatnonzero(self.chunk_R == c)
            layers = np.unique(self.layer_M[np.isin(self.round_M, rounds)])
            out.append((layers, range(int(rounds[0]), int(rounds[-1]) + 1)))
        return out

    def state_before(self, k: int) -> np.ndarray:
        """Complete slot contents when round k starts, int64 [L, P] (k = num_rounds: the end)."""
        k = _round_index(k, self.num_rounds, "state")
        cur = self.old_LP.copy()
        done = self.round_M < k
        cur[self.layer_M[done], self.dst_slot_M[done]] = self.expert_M[done]
        return cur

    def serving(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """What to serve with during round k: (phy2log_LP, dispatch_weights_LP).

        Slots being written in round k get weight 0 and are labelled with the expert they
        are receiving; each expert's tokens are split evenly over its complete replicas.
        Experts with no complete replica (only possible for experts lost with failed ranks
        before their reload lands) have weight 0 everywhere.
        """
        k = _round_index(k, self.num_rounds, "round")
        cur = self.state_before(k)
        now = self.round_M == k
        writing = np.zeros(cur.shape, dtype=bool)
        writing[self.layer_M[now], self.dst_slot_M[now]] = True
        cur[self.layer_M[now], self.dst_slot_M[now]] = self.expert_M[now]
        live = (cur >= 0) & ~writing
        L, E = cur.shape[0], self.num_logical_experts
        n_LE = np.zeros((L, E))
        np.add.at(n_LE, (np.nonzero(live)[0], cur[live]), 1.0)
        w = np.where(live, 1.0 / np.maximum(np.take_along_axis(n_LE, np.maximum(cur, 0), axis=1), 1), 0.0)
        return cur, w

    def serving_placement(self, k: int, *, num_nodes: int = 1, layer_ids=None) -> Placement:
        """`serving(k)` as a Placement (raises if an expert has no complete replica)."""
        phy, w = self.serving(k)
        if (phy < 0).any():
            l, p = np.argwhere(phy < 0)[0]
            raise EplbError(f"slot {p} of layer index {l} is empty in round {k}: no placement to serve")
        sums = np.zeros((phy.shape[0], self.num_logical_experts))
        np.add.at(sums, (np.arange(phy.shape[0])[:, None], phy), w)
        if (sums == 0).any():
            l, e = np.argwhere(sums == 0)[0]
            raise EplbError(f"expert {e} of layer index {l} has no complete replica in round {k} "
                            f"(lost with a failed rank; it is served again once reloaded)")
        return Placement(phy, len(self.rank_ids_G), self.num_logical_experts, num_nodes, layer_ids, w,
                         planner="migration")

    def check(self) -> None:
        """Replay the plan on old_LP and raise EplbError at the first round that breaks its
        guarantees: a slot written twice, a source slot that does not hold the expert copied
        or is itself written in that round, an expert held before the round without a complete
        replica during it; or an end other than new_LP. (Indices, ranks and link limits are
        checked when the plan is built.)"""
        L, P = self.old_LP.shape
        E = self.num_logical_experts
        cur = self.old_LP.copy()
        start_R = np.searchsorted(self.round_M, np.arange(self.num_rounds + 1))
        for k in range(self.num_rounds):
            m = slice(start_R[k], start_R[k + 1])
            lay, exp_, dst = self.layer_M[m], self.expert_M[m], self.dst_slot_M[m]
            src, srank = self.src_slot_M[m], self.src_rank_M[m]
            _check_round_writes(k, cur, lay, exp_, dst, src, srank, P)
            # Every expert a touched layer holds before the round keeps a slot not being written.
            layers = np.unique(lay)
            held = cur[layers]
            live = held.copy()
            live[np.searchsorted(layers, lay), dst] = -1
            row = np.arange(layers.size)[:, None] * E
            n_before = np.bincount((row + held)[held >= 0], minlength=layers.size * E)
            n_live = np.bincount((row + live)[live >= 0], minlength=layers.size * E)
            lost = (n_before > 0) & (n_live == 0)
            if lost.any():
                i = int(np.flatnonzero(lost)[0]) // E
                experts = (np.flatnonzero(lost.reshape(-1, E)[i])).tolist()
                raise EplbError(f"migration round {k}: experts {experts} of layer {layers[i]} have no "
                                f"serving replica")
            cur[lay, dst] = exp_
        if not np.array_equal(cur, self.new_LP):
            l, p = np.argwhere(cur != self.new_LP)[0]
            raise EplbError(f"the migration plan ends with expert {cur[l, p]} in slot {p} of layer {l}, "
                            f"the new placement wants {self.new_LP[l, p]}")


def _check_round_writes(k, cur, lay, exp_, dst, src, srank, P) -> None:
    """The writes of round k (transfers lay, exp_, dst, src, srank) against the slots cur it starts from."""
    key = lay * P + dst
    uniq, first, count = np.unique(key, return_index=True, return_counts=True)
    if (count > 1).any():
        i = first[int(np.flatnonzero(count > 1)[0])]
        raise EplbError(f"migration round {k}: slot {dst[i]} of layer {lay[i]} is written twice")
    copy = srank != CHECKPOINT
    wrong = copy & (cur[lay, np.where(copy, src, 0)] != exp_)
    if wrong.any():
        i = int(np.flatnonzero(wrong)[0])
        raise EplbError(f"migration round {k}: source slot {src[i]} (rank {srank[i]}) does not hold expert "
                        f"{exp_[i]} of layer {lay[i]}")
    both = copy & np.isin(lay * P + src, uniq)
    if both.any():
        i = int(np.flatnonzero(both)[0])
        raise EplbError(f"migration round {k}: slot {src[i]} of layer {lay[i]} is both a source and written")
