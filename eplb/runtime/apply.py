"""Apply a new placement: move expert weights between ranks with point-to-point transfers, in rounds.

Legend: L = MoE layers, E = logical experts, G = ranks, S = slots per rank, P = G x S
physical slots, M = transfers of a migration plan. Local weights are given per tensor name,
each indexable as [layer][local slot] (a stacked [L, S, ...] tensor or a list of per-layer
[S, ...] tensors), e.g. {"w_gate": ..., "w_up": ..., "w_down": ...}.

The schedule is an `eplb.migration.MigrationPlan`: slot-to-slot copies in rounds, built so
that every logical expert keeps a complete replica at every moment (`MigrationPlan.serving(k)`
is the placement to serve with during round k). The weights are moved in place, round by
round, exactly as the plan says:
1. every rank snapshots the slots it sends (and the sources of its copies inside the rank),
2. all sends and receives of the round are posted at once (`batch_isend_irecv`) and waited on,
3. then the received weights, local copies and checkpoint reloads are written into their slots.
Snapshots are taken before any write, so a round may read a slot another transfer of the same
round overwrites. Before the first byte moves, every rank replays the whole plan on the slot
maps and the ranks compare digests of their plans, so a plan that does not fit the
placements, or ranks that disagree, raise `EplbError` instead of hanging some ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from eplb.core.placement import Placement
from eplb.errors import EplbError
from eplb.migration import CHECKPOINT, MigrationPlan, schedule
from eplb.runtime.ep import ranks_agree

Reload = Callable[[int, int], Mapping[str, torch.Tensor]]
"""reload(layer, expert) -> {name: weights of one expert}: reads an expert from the checkpoint."""


def plan_migration(old: Placement, new: Placement, *, layers_per_chunk: int | None = None,
                   bytes_per_expert: int | None = None) -> MigrationPlan:
    """The safe schedule from `old` to `new` (eplb.migration.schedule on their slot maps)."""
    _check_pair(old, new)
    return schedule(old.phy2log_LP, new.phy2log_LP, old.num_gpus, old.num_logical_experts,
                    layers_per_chunk=layers_per_chunk, bytes_per_expert=bytes_per_expert)


def _check_pair(old: Placement, new: Placement) -> None:
    if old.phy2log_LP.shape != new.phy2log_LP.shape or old.num_gpus != new.num_gpus \
            or old.num_logical_experts != new.num_logical_experts:
        raise EplbError(
            f"old placement ({old.num_layers} layers x {old.num_slots} slots, {old.num_logical_experts} experts, "
            f"{old.num_gpus} GPUs) and new ({new.num_layers} x {new.num_slots}, {new.num_logical_experts}, "
            f"{new.num_gpus}) must have the same layers, slots, experts and GPUs to migrate in place"
        )


def check_plan(old: Placement, new: Placement, plan: MigrationPlan) -> None:
    """Raise EplbError unless `plan` was made for these placements and its replay
    (`MigrationPlan.check`) reads only slots that hold the expert being copied, keeps every
    expert served and ends exactly at new's slot map."""
    _check_pair(old, new)
    if not (np.array_equal(plan.old_LP, old.phy2log_LP) and np.array_equal(plan.new_LP, new.phy2log_LP)):
        raise EplbError("the migration plan was made for other placements: build it with "
                        "plan_migration(old, new)")
    G, S = old.num_gpus, old.slots_per_gpu
    if plan.slots_per_gpu != S or len(plan.rank_ids_G) != G:
        raise EplbError(f"the migration plan is for {len(plan.rank_ids_G)} ranks x {plan.slots_per_gpu} slots, "
                        f"the placements for {G} x {S}")
    plan.check()


def migrate_weights(old: Placement, new: Placement, local: Mapping[str, Any], *, group: dist.ProcessGroup,
                    plan: MigrationPlan | None = None, reload: Reload | None = None,
                    on_round: Callable[[int], None] | None = None) -> MigrationPlan:
    """Turn this rank's weights for `old` into its weights for `new`, in place; returns the plan run.

    Collective over `group`: every rank calls it with the same placements and plan.
    plan: None means `plan_migration(old, new)`. reload: needed only if the plan reloads experts
    from the checkpoint. on_round(k) runs on every rank after round k's writes (tests use it to
    check that every expert stays served).
    """
    if group is None:
        raise EplbError("pass the expert-parallel process group explicitly (e.g. group=dist.group.WORLD)")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if old.num_gpus != world:
        raise EplbError(f"placement is for {old.num_gpus} GPUs but the process group has {world} ranks")
    plan = plan_migration(old, new) if plan is None else plan
    check_plan(old, new, plan)
    if plan.reloads and reload is None:
        raise EplbError(f"the migration plan reloads {plan.reloads} expert(s) from the checkpoint: pass reload=")
    S = old.slots_per_gpu
    names = sorted(local)
    for n in names:
        if len(local[n]) != old.num_layers or len(local[n][0]) != S:
            raise EplbError(f"local weights {n!r} must be [{old.num_layers} layers][{S} slots of this rank]")
    if not ranks_agree(group, local[names[0]][0].device, plan.round_M, plan.layer_M, plan.src_slot_M,
                       plan.dst_slot_M, plan.old_LP, plan.new_LP):
        raise EplbError("the ranks were given different migration plans or placements: build them from the "
                        "same inputs on every rank (a mismatch would leave transfers waiting forever)")

    def slot(n: str, layer: int, p: int) -> torch.Tensor:
        return local[n][layer][p - rank * S]

    # Moving weights is not an autograd op: engines' expert weights are often nn.Parameters
    # (requires_grad=True), and in-place copies into views of those raise outside no_grad.
    with torch.no_grad():
        for k in range(plan.num_rounds):
            ms = np.flatnonzero(plan.round_M == k)
            src_G, dst_G = plan.src_rank_M[ms], plan.dst_rank_M[ms]
            ops: list[dist.P2POp] = []
            writes: list[tuple[int, int, dict[str, torch.Tensor]]] = []  # (layer, dst slot, weights)
            # Step 1: snapshots and receive buffers. Both ends walk the round in the same order
            # (peer, then tensor name, then transfer order) so messages match without tags.
            for peer in range(world):
                peer_global = dist.get_global_rank(group, peer)
                if peer != rank:
                    out_m = ms[(src_G == rank) & (dst_G == peer)]
                    in_m = ms[(src_G == peer) & (dst_G == rank)]
                    for n in names:
                        if len(out_m):
                            buf = torch.stack([slot(n, plan.layer_M[m], plan.src_slot_M[m]) for m in out_m])
                            ops.append(dist.P2POp(dist.isend, buf, peer_global, group))
                    bufs = {}
                    for n in names:
                        if len(in_m):
                            ref = local[n][0][0]
                            bufs[n] = torch.empty((len(in_m), *ref.shape), dtype=ref.dtype, device=ref.device)
                            ops.append(dist.P2POp(dist.irecv, bufs[n], peer_global, group))
                    writes += [(int(plan.layer_M[m]), int(plan.dst_slot_M[m]), {n: bufs[n][i] for n in names})
                               for i, m in enumerate(in_m)]
            for m in ms[(src_G == rank) & (dst_G == rank)]:
                l = int(plan.layer_M[m])
                writes.append((l, int(plan.dst_slot_M[m]), {n: slot(n, l, plan.src_slot_M[m]).clone() for n in names}))
            # Step 2: the round's traffic.
            if ops:
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
            # Step 3: writes (and checkpoint reloads) into their slots.
            for m in ms[(src_G == CHECKPOINT) & (dst_G == rank)]:
                l, e = int(plan.layer_M[m]), int(plan.expert_M[m])
                w = reload(l, e)  # type: ignore[misc]
                writes.append((l, int(plan.dst_slot_M[m]), {n: w[n] for n in names}))
            for l, p, w in writes:
                for n in names:
                    slot(n, l, p).copy_(w[n])
            if on_round is not None:
                on_round(k)
    return plan


def apply_placement(moes: Sequence, new: Placement, *, plan: MigrationPlan | None = None,
                    reload: Reload | None = None, mode: str | None = None) -> MigrationPlan:
    """Move the weights of a stack of `ExpertParallelMoE` layers (moes[l] serves layer l) to `new`,
    in place, then serve `new`. All layers must serve the same old placement. Collective."""
    if len(moes) != new.num_layers:
        raise EplbError(f"{len(moes)} MoE layers given but the new placement has {new.num_layers}")
    old = moes[0].placement
    if any(m.placement is not old for m in moes) or [m.layer for m in moes] != list(range(len(moes))):
        raise EplbError("apply_placement needs moes[l] to serve layer l of one shared placement")
    # Every layer must accept `new` (and the mode) before a single weight moves: a refusal
    # after the move would leave layers serving the old placement with the new weights.
    for l, m in enumerate(moes):
        m.check_placement(new, l, mode=mode)
    local = {"w_gate": [m.w_gate_SFD for m in moes], "w_up": [m.w_up_SFD for m in moes],
             "w_down": [m.w_down_SDF for m in moes]}
    done = migrate_weights(old, new, local, group=moes[0].group, plan=plan, reload=reload)
    for l, m in enumerate(moes):
        m.set_placement(new, l, mode=mode)
    return done
