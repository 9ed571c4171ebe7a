"""Safe migration schedules: the copies from one placement to another, ordered into rounds.

Legend: L = MoE layers, E = logical experts, G = ranks (GPUs), S = slots per rank,
P = G x S slots. Slot p lives on rank p // S.

In every round each rank sends at most one and receives at most one expert, and every
logical expert keeps at least one complete replica serving tokens at every moment (see
`MigrationPlan`). The rounds come from a numba kernel (`_rounds_kernel`); its Python
reference, held to the same replay in the tests, is in tests/oracles/migration_schedule.py.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from eplb.core.jit import kernel_ints, record
from eplb.errors import EplbError
from eplb.migration.checks import check_count, check_maps
from eplb.migration.moves import count_moves, holdings
from eplb.migration.plan import MigrationPlan
from eplb.migration.schedule import _rounds_kernel

NO_SAFE_MIGRATION = (
    "no safe migration: every pending slot holds the only replica of its expert and no slot holds "
    "a spare replica to stage through (a layer with as many slots as experts); add redundant slots "
    "or migrate with the experts offline")

CANDIDATES_PER_RANK = 8
"""Pending slots per destination rank offered to a round's link matching (the first ones in
its queue): enough that a rank whose first candidates' sources are busy still gets a link."""

RELAY_GATE = 1.10
"""Rounds / round bound above which the schedule is run again in relay mode (a levelled source
plan with relays, `_senders_kernel`) and the shorter of the two kept, on clusters of at most
RELAY_SLOTS_PER_GPU slots per GPU (docs/migration-internals.md, "Rounds against the round bound")."""

RELAY_SLOTS_PER_GPU = 2
"""The relay mode's clusters: with two slots per GPU (256 GPUs for 256 experts and as many
redundant slots) nearly every GPU sends and receives in every round and the senders set the
rounds. With more slots per GPU the excess rounds come mostly from chains and staging: there
the relay mode gains a round or two on some decision pairs (32 GPUs) but the decision pays
for the second run (1.7x its time), so only these clusters run it."""

RELAY_CANDIDATES_PER_RANK = 48
"""Candidates per destination rank in relay mode: its matching needs more choice of sources."""


def check_schedule_input(old_LP, new_LP, num_gpus: int, num_logical_experts: int, layers_per_chunk, rank_ids):
    """schedule's input checked: (old_LP, new_LP as int64, layers per chunk, rank ids int64 [G])."""
    L, P = check_maps(num_gpus, num_logical_experts, old_LP=old_LP, new_LP=new_LP)
    old_LP = np.asarray(old_LP, dtype=np.int64)
    new_LP = np.asarray(new_LP, dtype=np.int64)
    if (new_LP < 0).any():
        raise EplbError(f"the new placement must hold expert ids 0..{num_logical_experts - 1} in every slot")
    had = holdings(old_LP, 1, num_logical_experts)[:, 0] > 0
    gone = had & ~(holdings(new_LP, 1, num_logical_experts)[:, 0] > 0)
    if gone.any():
        l, e = np.argwhere(gone)[0]
        raise EplbError(f"expert {e} of layer index {l} is in the old placement but not the new one: "
                        f"every expert needs a replica in the new placement")
    # All layers in one chunk by default (at least 1: a map of no layers has nothing to chunk).
    chunk = max(L, 1) if layers_per_chunk is None else check_count("layers_per_chunk", layers_per_chunk)
    chunk = min(chunk, max(L, 1))                           # the kernel takes an int64
    ranks = np.arange(num_gpus) if rank_ids is None else np.asarray(rank_ids)
    if ranks.shape != (num_gpus,) or (ranks.size and ranks.dtype.kind not in "iu"):
        raise EplbError(f"rank_ids must be {num_gpus} whole numbers (one engine rank per GPU), got {rank_ids!r}")
    return old_LP, new_LP, chunk, ranks.astype(np.int64)


def plan_from_rows(old_LP, new_LP, num_gpus: int, num_logical_experts: int, rows_M8: np.ndarray, chunk_R,
                   rank_ids_G: np.ndarray, bytes_per_expert: int | None, *, trusted: bool = False) -> MigrationPlan:
    """The MigrationPlan of transfer rows int64 [M, 8] (round, layer, expert, src rank, src slot,
    dst rank, dst slot, staging) and the layer chunk of each round, chunk_R [R]. trusted: the
    rows are the kernel's on checked maps (MigrationPlan.trusted: no checks)."""
    fields = dict(
        old_LP=old_LP, new_LP=new_LP, slots_per_gpu=old_LP.shape[1] // num_gpus,
        num_logical_experts=num_logical_experts,
        round_M=rows_M8[:, 0], layer_M=rows_M8[:, 1], expert_M=rows_M8[:, 2], src_rank_M=rows_M8[:, 3],
        src_slot_M=rows_M8[:, 4], dst_rank_M=rows_M8[:, 5], dst_slot_M=rows_M8[:, 6],
        staging_M=rows_M8[:, 7].astype(bool), chunk_R=np.asarray(chunk_R, dtype=np.int64),
        rank_ids_G=rank_ids_G, bytes_per_expert=bytes_per_expert,
    )
    return MigrationPlan.trusted(**fields) if trusted else MigrationPlan(**fields)


def schedule(old_LP: np.ndarray, new_LP: np.ndarray, num_gpus: int, num_logical_experts: int, *,
             layers_per_chunk: int | None = None, rank_ids=None,
             bytes_per_expert: int | None = None) -> MigrationPlan:
    """Order the copies from old_LP to new_LP into safe rounds (see MigrationPlan).

    Greedy per round: ranks with the most copies left go first; each takes its first
    pending slot that may be written now, i.e. whose current expert keeps another complete
    replica that is not being written this round, from a source slot that is complete and
    on a rank with its send link free (a source on the same GPU needs no link). The links of
    a round are a maximum matching of destination ranks to source ranks, the ranks with the
    most copies left tried first. Experts absent from old_LP are read from the checkpoint
    once, then copied from that replica.

    Cycles: when no pending slot may be written (each holds the only replica of its expert,
    e.g. two GPUs exchanging their only copies of A and B), one such expert is first copied
    into a *staging* slot: a slot already in its final state whose expert has another
    complete replica (exists whenever a layer has more slots than experts present). The
    cycle then unwinds, and the staging slot is restored last. With no such slot (P = E
    and a cycle) a safe schedule does not exist and EplbError says so. After failed ranks
    with P = E, the slots of the lost experts are the only room to stage through: a reload
    that would use up a layer's last such room waits until it is the layer's last copy.

    layers_per_chunk: rounds only mix layers of one chunk of that many consecutive layers,
    and chunks run in order, so an engine can migrate (and free buffers) chunk by chunk.
    rank_ids: the engine rank of each GPU index (default 0..G-1). The kernel releases the
    GIL: a serving thread is not stalled while a side thread schedules.
    """
    old_LP, new_LP, chunk, ranks = check_schedule_input(old_LP, new_LP, num_gpus, num_logical_experts,
                                                        layers_per_chunk, rank_ids)
    return _scheduled(old_LP, new_LP, num_gpus, num_logical_experts, chunk, ranks, bytes_per_expert, False)


def schedule_trusted(old_LP: np.ndarray, new_LP: np.ndarray, num_gpus: int, num_logical_experts: int,
                     layers_per_chunk: int | None, rank_ids_G: np.ndarray,
                     bytes_per_expert: int | None, stop: np.ndarray | None = None) -> MigrationPlan | None:
    """`schedule` for callers that hold checked values: the maps of two Placements of one
    topology (int64 [L, P], every expert of old_LP present in new_LP), layers_per_chunk a whole
    number >= 1 or None, rank_ids_G int64 [G]. The same plan, without the input checks and
    MigrationPlan's (the Rebalancer's path: its maps are validated when they are built).
    stop: int64 [1] another thread may set nonzero to end the schedule within a round (then
    None is returned)."""
    L = old_LP.shape[0]
    chunk = max(L, 1) if layers_per_chunk is None else min(int(layers_per_chunk), max(L, 1))
    ranks = np.array(rank_ids_G, dtype=np.int64)    # the plan's own (it freezes it)
    return _scheduled(old_LP, new_LP, num_gpus, num_logical_experts, chunk, ranks, bytes_per_expert, True,
                      stop=stop)


class ScheduleThread:
    """`schedule_trusted(*args)` on a side thread, started at once. Its kernel releases the GIL,
    so the caller's own work (the Rebalancer scores the placements meanwhile) runs beside it on
    another core. `result()` waits for the MigrationPlan, or raises what the schedule raised;
    `seconds` is the schedule's own run time. `stop()` drops a schedule no longer wanted: its
    kernel ends within a round, and result() is then not to be asked for."""

    def __init__(self, *args):
        self.seconds = 0.0
        self.interpreted: set[str] = set()
        """Kernels that ran as plain Python (eplb.core.jit: no machine code yet)."""
        self._out: tuple = (None, None)
        self._stop = np.zeros(1, dtype=np.int64)
        self._thread = threading.Thread(target=self._run, args=args, name="eplb-schedule", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop[0] = 1

    def _run(self, *args) -> None:
        t0 = time.perf_counter()
        try:
            with record() as self.interpreted:
                plan = schedule_trusted(*args, stop=self._stop)
            if plan is not None:
                _ = plan.moves          # counted here, off the caller's thread (cached)
            self._out = (plan, None)
        except BaseException as exc:  # handed to the caller's thread by result()
            self._out = (None, exc)
        self.seconds = time.perf_counter() - t0

    def result(self) -> MigrationPlan:
        self._thread.join()
        plan, exc = self._out
        if exc is not None:
            raise exc
        return plan


def _scheduled(old_LP, new_LP, G: int, E: int, chunk: int, ranks_G, bytes_per_expert, trusted: bool,
               relay: bool | None = None, stop: np.ndarray | None = None) -> MigrationPlan | None:
    """The kernel's plan for checked input; identical maps need no kernel (no rows, no rounds).
    relay None: the plain rounds, and where they exceed RELAY_GATE x the round bound (on clusters
    of at most RELAY_SLOTS_PER_GPU slots per GPU) the relay mode's too, the shorter kept; True /
    False: that mode alone (the tests hold each to the replay). stop: see `schedule_trusted`
    (None: never stopped); a stopped schedule returns None."""
    if np.array_equal(old_LP, new_LP):
        return plan_from_rows(old_LP, new_LP, G, E, np.zeros((0, 8), dtype=np.int64), np.zeros(0, dtype=np.int64),
                              ranks_G, bytes_per_expert, trusted=trusted)
    old_k, new_k = kernel_ints(old_LP), kernel_ints(new_LP)
    stop = np.zeros(1, dtype=np.int64) if stop is None else stop
    rows, chunk_R, layer = _kernel_rounds(old_k, new_k, G, E, chunk, bool(relay), stop)
    if layer == _STOPPED:
        return None
    if layer is not None:
        raise EplbError(f"{NO_SAFE_MIGRATION} (layer index {layer})")
    if (relay is None and old_k.shape[1] <= RELAY_SLOTS_PER_GPU * G
            and chunk_R.size > RELAY_GATE * _round_bound(old_k, new_k, G)):
        rows2, chunk2, failed = _kernel_rounds(old_k, new_k, G, E, chunk, True, stop)
        if failed == _STOPPED:
            return None
        if failed is None and chunk2.size < chunk_R.size:
            rows, chunk_R = rows2, chunk2
    return plan_from_rows(old_LP, new_LP, G, E, rows, chunk_R, ranks_G, bytes_per_expert, trusted=trusted)


_STOPPED = "stopped"
"""`_kernel_rounds`' third item for a schedule its caller stopped."""


def _kernel_rounds(old_k, new_k, G: int, E: int, chunk: int, relay: bool, stop: np.ndarray):
    """The kernel's (rows, chunk of each round, None), or (..., the layer that cannot stage), or
    (..., _STOPPED) once stop[0] is set, in plain or relay mode."""
    if old_k.size >= 2**31:  # the kernel's slot codes are int32 (`_state_kernel._new_state`)
        raise EplbError(f"a migration of {old_k.shape[0]} layers x {old_k.shape[1]} slots has {old_k.size} slot "
                        f"codes, more than the schedule's 2^31 - 1: schedule the layers in parts")
    per_rank = RELAY_CANDIDATES_PER_RANK if relay else CANDIDATES_PER_RANK
    kernel = _rounds_kernel.schedule_relay if relay else _rounds_kernel.schedule
    rows, chunk_R, status, layer = kernel(old_k, new_k, G, E, chunk, per_rank, False, stop)
    if status == _rounds_kernel.STATUS_NO_SPARE:
        return rows, chunk_R, layer
    if status == _rounds_kernel.STATUS_STOPPED:
        return rows, chunk_R, _STOPPED
    assert status == _rounds_kernel.STATUS_OK, "migration schedule does not converge (bug)"
    return rows, chunk_R, None


def _round_bound(old_k, new_k, G: int) -> int:
    """The round bound: the most network copies into one GPU (`count_moves(old, new).sum(axis=0).max()`)."""
    return int(count_moves(old_k, new_k, G, int(max(old_k.max(), new_k.max())) + 1).sum(axis=0).max())
