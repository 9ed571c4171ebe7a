"""The numba kernels of the migration package: what compiles, and loading it ahead of time.

Four kernel modules, each imported on first use (numba takes about half a second to import,
and `eplb plan` without a previous placement must start fast):
- `_moves_kernel`: count_moves, keep_slots, keep_counts, gpu_assignment, keep_pairs (for `moves`);
- `_search_kernel`: holdings_LEG and the budgeted search loop (for `search`);
- `_schedule_kernel`: the rounds of a migration schedule (for `schedule`), with its stages
  (`_chain_kernel`, `_links_kernel`, `_sources_kernel`, `_cycles_kernel`, `_stage_kernel`),
  compiled with it;
  `schedule_relay` is the relay mode's entry point (`warm_up` runs both);
- `_repair_kernel`: the search step of the share-keeping repair under SGLang's rules (for `rule`).
Every kernel trusts its input (the package's entry points check it: `checks`), releases the
GIL, and is compiled with `cache=True`: the machine code is stored beside the module (or under
NUMBA_CACHE_DIR), so only the first process after an install compiles. Arrays reach the
kernels as writable C-ordered int64 (`checks.kernel_ints`) or float64, one type per argument,
so each kernel has one compiled version; `warm_up` makes it exist before the first decision.
The stages a kernel is written in (`_scan`, `_price_swaps`, ...) are `inline="always"`: numba
then compiles each entry point as one function. A separately compiled helper is optimised on
its own and again inside its caller, which makes the first compile markedly longer; helpers
with several callers (`_apply`, `price_layer`, `stage`) stay separate so that their code is
compiled once. The schedule's per-copy helper `commit` is inlined all the same: a call of a
separate helper passes the schedule state's twenty-odd arrays each time, which cost about 6% of
the schedule's run time at 32 and 128 GPUs (the first compile takes a few seconds longer).
Inlining does not make array arguments free: numba reference-counts the array and tuple
arguments of an inlined helper at every call (LLVM's pruning leaves the pairs once the helper
branches). A helper called once per slot (`_spare`) therefore takes scalars and its caller
reads the arrays; measured on the 32-GPU decision, this removed 80% of the schedule's reference
counting and about a third of its run time.
"""

from __future__ import annotations

import time

import numpy as np

from eplb.migration.checks import kernel_ints
from eplb.migration.moves import count_moves, keep_slots, relabel
from eplb.migration.schedule.rounds import schedule
from eplb.migration.search import Budget, budgeted_search


def warm_up() -> float:
    """Load (or, on a fresh install, compile) the numba kernels of the migration package now,
    so that the first rebalance decision does not pay for it; returns the seconds it took.
    Fast after the first call in a process."""
    from eplb.migration import _moves_kernel, _repair_kernel

    t0 = time.perf_counter()
    # Two layers, 3 experts, 2 GPUs x 2 slots: runs every kernel on the argument types the
    # real calls use (all sizes share one compiled version).
    old = np.array([[0, 1, 2, 0], [0, 1, 2, 2]])
    new = np.array([[1, 0, 2, 1], [2, 1, 0, 0]])
    load = np.array([[3.0, 1.0, 1.0], [1.0, 1.0, 3.0]])
    count_moves(old, new, 2, 3)
    relabel(old, new, 2, 3)
    _moves_kernel.keep_pairs(kernel_ints(old), kernel_ints(new), 2, 3)     # relabel's path from 96 GPUs
    keep_slots(old, new, 2)
    budgeted_search(load, old, 2, Budget(move_cost=0.001))
    budgeted_search(load, old, 2, Budget(max_moves=1))
    # Three slots per GPU: past RELAY_SLOTS_PER_GPU, so the relay mode stays cold (warm_up_relay).
    old3 = np.array([[0, 1, 2, 0, 1, 2], [0, 1, 2, 2, 1, 0]])
    schedule(old3, old3[:, ::-1].copy(), 2, 3)
    _repair_kernel.warm_up()
    return time.perf_counter() - t0


def warm_up_relay() -> float:
    """`warm_up` for the schedule's relay mode, which only clusters of at most
    RELAY_SLOTS_PER_GPU slots per GPU run (`schedule`'s gate): a Rebalancer warms it for those
    alone, as its compile costs as much as the plain schedule's. Returns the seconds it took."""
    from eplb.migration.schedule import _rounds_kernel as _schedule_kernel

    t0 = time.perf_counter()
    old = kernel_ints(np.array([[0, 1, 2, 0], [0, 1, 2, 2]]))
    new = kernel_ints(np.array([[1, 0, 2, 1], [2, 1, 0, 0]]))
    _schedule_kernel.schedule_relay(old, new, 2, 3, 2, 4, False, np.zeros(1, dtype=np.int64))
    return time.perf_counter() - t0
