"""Run a per-row kernel over blocks of rows on threads (the kernels release the GIL).

Legend: R = rows (layers, or layers x nodes), P = physical slots of a row.

Planning kernels work one row at a time and never look at another row, so splitting the rows
into blocks and running the blocks at once gives the same answer to the bit. A call here lasts
milliseconds, so the threads are kept between calls (starting one costs ~0.1 ms) and small
inputs stay on the calling thread, which always works on blocks itself.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from eplb.errors import EplbError

THREADS_ENV = "EPLB_NUM_THREADS"
"""Environment variable capping the threads a plan uses (1: the calling thread only, e.g. in a
serving process whose cores belong to the engine)."""

MAX_THREADS = 8
"""Most threads one call uses (the blocks of a 58-layer plan stop paying beyond a few)."""

MIN_BLOCK_WORK = 2048
"""Fewest row x slot cells a block is given: below it a handoff costs more than it saves."""

BLOCKS_PER_THREAD = 2
"""Blocks a call is cut into per thread, at most (each of MIN_BLOCK_WORK cells at least)."""

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_pid = -1


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one), at most
    EPLB_NUM_THREADS when that is set."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    text = os.environ.get(THREADS_ENV, "").strip()
    if not text:
        return cores
    if not text.isdigit() or int(text) < 1:
        raise EplbError(f"{THREADS_ENV}={text!r}: give a whole number of threads >= 1 (1: no extra threads), "
                        f"or unset it to use every usable core")
    return min(cores, int(text))


def num_blocks(num_rows: int, num_slots: int) -> int:
    """Threads to run R rows of P slots on: the calling thread plus one per core idle on
    average (`usable_cores` less the 1-minute load average, rounded: on a machine whose cores
    are busy a second thread only waits for one), at most MAX_THREADS, each with MIN_BLOCK_WORK
    cells. The load average counts the caller itself while it runs (a process that plans
    continuously holds it near 1 on its own), so a core less than half busy counts as idle."""
    cores = usable_cores()
    if cores > 1:
        try:
            cores = max(1, min(cores, int(cores - os.getloadavg()[0] + 1.5)))
        except (AttributeError, OSError):  # no load average here (Windows): every usable core
            pass
    return max(1, min(cores, MAX_THREADS, num_rows * num_slots // MIN_BLOCK_WORK, num_rows))


def _shared_pool() -> ThreadPoolExecutor:
    """The process's worker threads, made on first use; again in a forked child, which inherits
    the pool object but none of its threads (work handed to it would never run)."""
    global _pool, _pool_pid
    with _lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(MAX_THREADS - 1, thread_name_prefix="eplb-rows")
            _pool_pid = os.getpid()
        return _pool


def run_blocks(fn: Callable[[int, int], None], num_rows: int, num_slots: int) -> None:
    """fn(start, stop) for consecutive blocks of rows covering 0..num_rows, on up to
    `num_blocks` threads at once, the calling thread one of them. Each thread takes the next
    block until none is left, and the call waits only for blocks some thread has taken: rows
    differ in work, and on a busy machine a worker may wake late (or not before the caller has
    done every block itself), so neither a fixed share nor the worker is waited for. fn must
    write only its own rows; the first error any block raises is raised here, after every
    block taken has ended (none is started after an error)."""
    n = num_blocks(num_rows, num_slots)
    if n == 1:
        fn(0, num_rows)
        return
    k = min(num_rows, BLOCKS_PER_THREAD * n, max(n, num_rows * num_slots // MIN_BLOCK_WORK))
    cuts = [num_rows * i // k for i in range(k + 1)]
    cond = threading.Condition()
    taken = done = 0
    failed: list[BaseException] = []

    def work() -> None:
        nonlocal taken, done
        while True:
            with cond:
                if failed or taken == k:
                    return
                i = taken
                taken += 1
            try:
                fn(cuts[i], cuts[i + 1])
            except BaseException as exc:  # handed to the caller below
                with cond:
                    failed.append(exc)
            with cond:
                done += 1
                cond.notify_all()

    pool = _shared_pool()
    for _ in range(n - 1):
        pool.submit(work)
    work()
    with cond:  # the caller's loop ended: every block is taken (or one failed); wait for those taken
        cond.wait_for(lambda: done == taken)
    if failed:
        raise failed[0]
