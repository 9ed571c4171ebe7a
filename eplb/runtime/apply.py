"""Apply a new placement: move expert weights between ranks with point-to-point transfers, in rounds.

Legend: L = MoE layers, E = logical experts, G = ranks, S = slots per rank (old and new may
differ), P = physical slots; local weights are stacked `[L, S, ...]` per tensor name
(e.g. {"w_gate": [L, S, F, D], "w_up": [L, S, F, D], "w_down": [L, S, D, F]}).

A schedule is a list of rounds; each round is a list of `Transfer`s (layer, expert, source
rank, destination rank, destination slot). Round k's sends and receives are all posted at once
(`batch_isend_irecv`) and finish before round k + 1 starts, so rounds bound the traffic and
buffer memory in flight. Sources are always read from the old weights, which stay untouched
until the last round is done: no expert is ever lost, whatever the order, and the old
placement can keep serving while the move runs. Replicas that are already on their rank
(same-rank slot moves, extra replicas on one rank) are local copies, not transfers.
Every rank checks the whole schedule before the first byte moves, so a bad schedule raises
the same `EplbError` on all ranks instead of hanging some of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from eplb.errors import EplbError
from eplb.placement import Placement


@dataclass(frozen=True)
class Transfer:
    """One expert's weights copied from one rank to another."""

    layer: int
    """MoE layer index in the placement (0..L-1), not the hidden-layer id."""
    expert: int
    """Logical expert whose weights move."""
    src: int
    """Rank (in the process group) that holds the expert in the old placement."""
    dst: int
    """Rank that needs it in the new placement."""
    dst_slot: int
    """Global physical slot (0..P-1) of the new placement that the copy fills (on rank dst)."""


def as_rounds(schedule: Any) -> list[list[Transfer]]:
    """Normalise a schedule: rounds of Transfers, of 5-tuples, or an object with `.rounds`."""
    rounds = getattr(schedule, "rounds", schedule)
    out: list[list[Transfer]] = []
    for r in rounds:
        batch = []
        for t in r:
            if isinstance(t, Transfer):
                batch.append(t)
            elif isinstance(t, (tuple, list)) and len(t) == 5:
                batch.append(Transfer(*(int(v) for v in t)))
            else:
                batch.append(Transfer(int(t.layer), int(t.expert), int(getattr(t, "src", getattr(t, "src_rank", -1))),
                                      int(getattr(t, "dst", getattr(t, "dst_rank", -1))),
                                      int(getattr(t, "dst_slot", getattr(t, "slot", -1)))))
        out.append(batch)
    return out


def _check_pair(old: Placement, new: Placement) -> None:
    if old.num_gpus != new.num_gpus or old.num_logical_experts != new.num_logical_experts \
            or old.num_layers != new.num_layers:
        raise EplbError(
            f"old placement ({old.num_layers} layers, {old.num_logical_experts} experts, {old.num_gpus} GPUs) "
            f"and new ({new.num_layers}, {new.num_logical_experts}, {new.num_gpus}) must have the same "
            f"layers, experts and GPUs"
        )


def _holds(placement: Placement) -> np.ndarray:
    """held_LGE: does rank g hold expert e in layer l."""
    L, E, G = placement.num_layers, placement.num_logical_experts, placement.num_gpus
    held = np.zeros((L, G, E), dtype=bool)
    rows = np.arange(L)[:, None]
    held[rows, placement.gpu_of_slot()[None, :], placement.phy2log_LP] = True
    return held


def needed_copies(old: Placement, new: Placement) -> list[tuple[int, int, int, int]]:
    """(layer, expert, dst rank, first new slot) for every expert a rank lacks in the new placement."""
    _check_pair(old, new)
    had_LGE, need_LGE = _holds(old), _holds(new)
    S = new.slots_per_gpu
    out = []
    for l, g, e in zip(*np.nonzero(need_LGE & ~had_LGE)):
        slots = np.flatnonzero(new.phy2log_LP[l, g * S:(g + 1) * S] == e)
        out.append((int(l), int(e), int(g), int(g * S + slots[0])))
    return out


def default_schedule(old: Placement, new: Placement, per_round: int = 8) -> list[list[Transfer]]:
    """A simple schedule: each missing replica comes from the old holder with the fewest sends
    so far; rounds are filled first-fit so that no rank sends or receives more than `per_round`
    experts in one round."""
    if per_round < 1:
        raise EplbError(f"per_round must be >= 1, got {per_round}")
    had_LGE = _holds(old)
    G = old.num_gpus
    sends_G = np.zeros(G, dtype=np.int64)
    used_send: list[np.ndarray] = []  # per round: experts sent by each rank
    used_recv: list[np.ndarray] = []
    rounds: list[list[Transfer]] = []
    low_send = np.zeros(G, dtype=np.int64)  # first round where each rank may still send
    low_recv = np.zeros(G, dtype=np.int64)
    for l, e, d, slot in needed_copies(old, new):
        holders = np.flatnonzero(had_LGE[l, :, e])
        src = int(holders[np.argmin(sends_G[holders])])
        sends_G[src] += 1
        k = int(max(low_send[src], low_recv[d]))
        while True:
            if k == len(rounds):
                rounds.append([])
                used_send.append(np.zeros(G, dtype=np.int64))
                used_recv.append(np.zeros(G, dtype=np.int64))
            if used_send[k][src] < per_round and used_recv[k][d] < per_round:
                break
            k += 1
        rounds[k].append(Transfer(l, e, src, d, slot))
        used_send[k][src] += 1
        used_recv[k][d] += 1
        while low_send[src] < len(rounds) and used_send[low_send[src]][src] >= per_round:
            low_send[src] += 1
        while low_recv[d] < len(rounds) and used_recv[low_recv[d]][d] >= per_round:
            low_recv[d] += 1
    return rounds


def check_schedule(old: Placement, new: Placement, rounds: Sequence[Sequence[Transfer]]) -> None:
    """Raise EplbError unless the schedule brings every missing replica from a rank that had it."""
    _check_pair(old, new)
    had_LGE = _holds(old)
    L, G, P = new.num_layers, new.num_gpus, new.num_slots
    S = new.slots_per_gpu
    seen: set[tuple[int, int, int]] = set()
    for k, r in enumerate(rounds):
        for t in r:
            where = f"round {k}, transfer {t}"
            if not (0 <= t.layer < L and 0 <= t.src < G and 0 <= t.dst < G and 0 <= t.dst_slot < P):
                raise EplbError(f"{where}: layer, ranks or slot out of range ({L} layers, {G} ranks, {P} slots)")
            if not 0 <= t.expert < new.num_logical_experts or not had_LGE[t.layer, t.src, t.expert]:
                raise EplbError(f"{where}: source rank {t.src} does not hold expert {t.expert} in layer "
                                f"{t.layer} of the old placement")
            if t.dst_slot // S != t.dst or new.phy2log_LP[t.layer, t.dst_slot] != t.expert:
                raise EplbError(f"{where}: new slot {t.dst_slot} is not expert {t.expert} on rank {t.dst}")
            if t.src == t.dst:
                raise EplbError(f"{where}: source and destination are the same rank (that is a local copy, "
                                f"leave it out of the schedule)")
            key = (t.layer, t.expert, t.dst)
            if key in seen:
                raise EplbError(f"{where}: expert {t.expert} of layer {t.layer} is sent to rank {t.dst} twice")
            seen.add(key)
    missing = [c for c in needed_copies(old, new) if c[:3] not in seen]
    if missing:
        l, e, d, _ = missing[0]
        raise EplbError(f"schedule misses {len(missing)} transfer(s), e.g. expert {e} of layer {l} to rank {d}; "
                        f"use default_schedule(old, new) or the migration plan of these two placements")


def migrate_weights(old: Placement, new: Placement, local: Mapping[str, torch.Tensor], *,
                    group: dist.ProcessGroup, rounds: Any = None) -> dict[str, torch.Tensor]:
    """This rank's weights for `new`, {name: [L, S_new, ...]}, from its weights for `old` ({name: [L, S_old, ...]}).

    Collective over `group`: every rank calls it with the same placements and schedule.
    `rounds`: a schedule (see `as_rounds`); None means `default_schedule(old, new)`.
    """
    if group is None:
        raise EplbError("pass the expert-parallel process group explicitly (e.g. group=dist.group.WORLD)")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if old.num_gpus != world:
        raise EplbError(f"placement is for {old.num_gpus} GPUs but the process group has {world} ranks")
    schedule = default_schedule(old, new) if rounds is None else as_rounds(rounds)
    check_schedule(old, new, schedule)
    So, Sn = old.slots_per_gpu, new.slots_per_gpu
    names = sorted(local)
    L = old.num_layers
    for n in names:
        if local[n].shape[:2] != (L, So):
            raise EplbError(f"local weights {n!r} have shape {tuple(local[n].shape)}; need [{L}, {So}, ...] "
                            f"(layers, this rank's old slots)")
    old_LS = old.phy2log_LP[:, rank * So:(rank + 1) * So]
    new_LS = new.phy2log_LP[:, rank * Sn:(rank + 1) * Sn]

    def old_slot(layer: int, expert: int) -> int:
        return int(np.flatnonzero(old_LS[layer] == expert)[0])

    received: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for r in schedule:
        ops: list[dist.P2POp] = []
        incoming: list[tuple[list[Transfer], dict[str, torch.Tensor]]] = []
        # Both ends walk the round in the same order (peer, then tensor name, then list
        # order), so each pair's messages match without tags (NCCL ignores tags).
        for peer in range(world):
            out_t = [t for t in r if t.src == rank and t.dst == peer]
            in_t = [t for t in r if t.dst == rank and t.src == peer]
            peer_global = dist.get_global_rank(group, peer)
            if out_t:
                idx = [(t.layer, old_slot(t.layer, t.expert)) for t in out_t]
                li = torch.as_tensor([i for i, _ in idx])
                si = torch.as_tensor([s for _, s in idx])
                for n in names:
                    buf = local[n][li.to(local[n].device), si.to(local[n].device)].contiguous()
                    ops.append(dist.P2POp(dist.isend, buf, peer_global, group))
            if in_t:
                bufs = {}
                for n in names:
                    ref = local[n]
                    bufs[n] = torch.empty((len(in_t), *ref.shape[2:]), dtype=ref.dtype, device=ref.device)
                    ops.append(dist.P2POp(dist.irecv, bufs[n], peer_global, group))
                incoming.append((in_t, bufs))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        for in_t, bufs in incoming:
            for i, t in enumerate(in_t):
                received[(t.layer, t.expert)] = {n: bufs[n][i] for n in names}

    out = {n: torch.empty((L, Sn, *local[n].shape[2:]), dtype=local[n].dtype, device=local[n].device) for n in names}
    for l in range(L):
        for s in range(Sn):
            e = int(new_LS[l, s])
            hit = np.flatnonzero(old_LS[l] == e)
            for n in names:
                out[n][l, s] = local[n][l, int(hit[0])] if hit.size else received[(l, e)][n]
    return out


def apply_placement(moes: Sequence, new: Placement, *, rounds: Any = None, mode: str | None = None) -> None:
    """Move the weights of a stack of `ExpertParallelMoE` layers (moes[l] serves layer l) to `new`.

    All layers must serve the same old placement. Collective over their process group.
    """
    if len(moes) != new.num_layers:
        raise EplbError(f"{len(moes)} MoE layers given but the new placement has {new.num_layers}")
    old = moes[0].placement
    if any(m.placement is not old for m in moes) or [m.layer for m in moes] != list(range(len(moes))):
        raise EplbError("apply_placement needs moes[l] to serve layer l of one shared placement")
    local = {
        "w_gate": torch.stack([m.w_gate_SFD for m in moes]),
        "w_up": torch.stack([m.w_up_SFD for m in moes]),
        "w_down": torch.stack([m.w_down_SDF for m in moes]),
    }
    moved = migrate_weights(old, new, local, group=moes[0].group, rounds=rounds)
    for l, m in enumerate(moes):
        m.set_placement(new, l, mode=mode, weights=(moved["w_gate"][l], moved["w_up"][l], moved["w_down"][l]))


def transfers_per_rank(rounds: Iterable[Iterable[Transfer]], world: int) -> dict[str, list[int]]:
    """Experts each rank sends and receives over the whole schedule (for reports)."""
    sent, got = [0] * world, [0] * world
    for r in rounds:
        for t in r:
            sent[t.src] += 1
            got[t.dst] += 1
    return {"sent": sent, "received": got}
