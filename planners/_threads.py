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
    """Blocks to split R rows of P slots into: one per usable core (at most MAX_THREADS), each
    of at least MIN_BLOCK_WORK cells."""
    return max(1, min(usable_cores(), MAX_THREADS, num_rows * num_slots // MIN_BLOCK_WORK, num_rows))


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
    """fn(start, stop) for consecutive blocks of rows covering 0..num_rows, on `num_blocks`
    threads at once (the calling thread one of them). Each thread takes the next block until
    none is left: rows differ in work, and another process may hold a core, so a fixed share
    per thread would wait for the slowest. fn must write only its own rows; the first error
    any block raises is raised here, after every thread has stopped."""
    n = num_blocks(num_rows, num_slots)
    if n == 1:
        fn(0, num_rows)
        return
    k = min(num_rows, BLOCKS_PER_THREAD * n, max(n, num_rows * num_slots // MIN_BLOCK_WORK))
    cuts = [num_rows * i // k for i in range(k + 1)]
    blocks = iter(list(zip(cuts[:-1], cuts[1:])))  # next() on a list iterator is atomic under the GIL
    failed: list[BaseException] = []

    def work() -> None:
        for a, b in blocks:
            if failed:
                return
            try:
                fn(a, b)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                failed.append(exc)
                return

    pool = _shared_pool()
    futures = [pool.submit(work) for _ in range(n - 1)]
    work()
    for f in futures:  # every thread has stopped before the call returns
        f.result()
    if failed:
        raise failed[0]
