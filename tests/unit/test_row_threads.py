"""planners/_threads.py: per-row kernels on blocks of rows give the plan of one thread, to the bit."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from planners import _threads
from planners.greedy import pack, plan_greedy, refine, replicate


@pytest.fixture(autouse=True)
def idle_machine(monkeypatch):
    """The tests' own machine may be busy: they say how idle it is."""
    monkeypatch.setattr(_threads.os, "getloadavg", lambda: (0.0, 0.0, 0.0), raising=False)


@pytest.fixture
def many_blocks(monkeypatch):
    """Every call split into as many blocks as it has rows (up to MAX_THREADS), whatever the cores."""
    monkeypatch.setattr(_threads, "usable_cores", lambda: _threads.MAX_THREADS)
    monkeypatch.setattr(_threads, "MIN_BLOCK_WORK", 1)


def _one_block(monkeypatch):
    monkeypatch.setattr(_threads, "usable_cores", lambda: 1)


@pytest.mark.parametrize("G, S, L", [(8, 5, 11), (16, 3, 7), (4, 12, 3)])
def test_blocks_on_threads_give_the_single_thread_plan(G, S, L, many_blocks, monkeypatch):
    rng = np.random.default_rng(G * L)
    load = np.floor(rng.pareto(1.2, (L, 40)) * 100) + 1
    assert _threads.num_blocks(L, G * S) == min(L, _threads.MAX_THREADS)
    threaded = plan_greedy(load, G, S)
    count = replicate(load, G * S, G)
    packed = pack(load, count, G, S)
    threaded_refine = refine(packed.copy(), load, count, G)
    _one_block(monkeypatch)
    assert _threads.num_blocks(L, G * S) == 1
    np.testing.assert_array_equal(threaded, plan_greedy(load, G, S))
    np.testing.assert_array_equal(threaded_refine, refine(packed.copy(), load, count, G))
    np.testing.assert_array_equal(threaded, threaded_refine)


def test_small_inputs_stay_on_the_calling_thread(monkeypatch):
    monkeypatch.setattr(_threads, "usable_cores", lambda: 4)
    assert _threads.num_blocks(2, 16) == 1                      # 32 cells: not worth a handoff
    assert _threads.num_blocks(58, 288) == 4
    assert _threads.num_blocks(3, 100_000) == 3                 # never more blocks than rows
    seen = set()
    _threads.run_blocks(lambda a, b: seen.add(threading.get_ident()), 2, 16)
    assert seen == {threading.get_ident()}


def test_busy_cores_are_left_alone(monkeypatch):
    monkeypatch.setattr(_threads, "usable_cores", lambda: 4)
    for load, threads in ((0.0, 4), (1.0, 4), (1.4, 4), (2.5, 3), (3.2, 2), (4.6, 1), (9.0, 1)):
        monkeypatch.setattr(_threads.os, "getloadavg", lambda load=load: (load, load, load), raising=False)
        assert _threads.num_blocks(58, 288) == threads, load


def test_blocks_cover_every_row_once_and_errors_reach_the_caller(many_blocks):
    hits = np.zeros(13, dtype=int)

    def mark(a, b):
        hits[a:b] += 1

    _threads.run_blocks(mark, 13, 1)
    assert (hits == 1).all()

    def fail(a, b):
        if a > 0:
            raise ValueError(f"rows {a}..{b}")

    with pytest.raises(ValueError, match="rows"):
        _threads.run_blocks(fail, 13, 1)


def test_a_plan_from_a_side_thread_matches_one_from_the_main_thread(many_blocks):
    """The Rebalancer's adaptive replan may call plan_greedy off the main thread."""
    load = np.floor(np.random.default_rng(5).pareto(1.2, (9, 32)) * 100) + 1
    out = {}
    side = threading.Thread(target=lambda: out.setdefault("phy", plan_greedy(load, 8, 5)))
    side.start()
    side.join()
    np.testing.assert_array_equal(out["phy"], plan_greedy(load, 8, 5))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_its_own_threads(many_blocks):
    """A child inherits the pool object but not its threads: work handed to them would hang."""
    load = np.floor(np.random.default_rng(6).pareto(1.2, (9, 32)) * 100) + 1
    expected = plan_greedy(load, 8, 5)  # the parent's pool now exists
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: plan and report, exit without running the parent's cleanup
        ok = np.array_equal(plan_greedy(load, 8, 5), expected)
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.waitpid(pid, 0)


def test_the_environment_caps_the_threads(monkeypatch):
    monkeypatch.setattr(_threads.os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    monkeypatch.delenv(_threads.THREADS_ENV, raising=False)
    assert _threads.usable_cores() == 6
    monkeypatch.setenv(_threads.THREADS_ENV, "2")
    assert _threads.usable_cores() == 2 and _threads.num_blocks(58, 288) == 2
    monkeypatch.setenv(_threads.THREADS_ENV, "64")
    assert _threads.usable_cores() == 6
    from eplb.errors import EplbError

    for bad in ("0", "two", "-1", "1.5"):
        monkeypatch.setenv(_threads.THREADS_ENV, bad)
        with pytest.raises(EplbError, match=f"EPLB_NUM_THREADS='{bad}'"):
            _threads.num_blocks(58, 288)
