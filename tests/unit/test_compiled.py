"""eplb.core.jit: kernels load in the background, compile in side processes on a cold cache."""

from __future__ import annotations

import sys
import textwrap
import types

import numpy as np
import pytest

import eplb
from eplb.core.jit import compile_in_side_processes, load_cached, warm_up_in_background


def test_background_warm_up_loads_the_greedy_and_migration_kernels():
    w = warm_up_in_background(("planners.greedy", "eplb.migration.kernels"))
    assert w.wait(900)
    assert w.status == "ready" and w.seconds is not None
    assert warm_up_in_background(("planners.greedy", "eplb.migration.kernels")) is w   # one per process


def test_a_cold_kernel_is_not_compiled_in_process_but_in_a_side_process(tmp_path, monkeypatch):
    """The probe refuses to compile; the side process compiles into numba's cache; the next
    probe loads it from there."""
    (tmp_path / "cold_kernel_mod.py").write_text(textwrap.dedent('''
        import numpy as np
        from numba import njit

        @njit(cache=True)
        def twice(a):
            out = np.empty_like(a)
            for i in range(a.size):
                out[i] = 2 * a[i]
            return out

        def warm_up():
            twice(np.arange(3.0))
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_cached(("cold_kernel_mod",)) is False
    mod = sys.modules["cold_kernel_mod"]
    assert mod.twice.signatures == []                        # the refused compile left nothing behind
    assert compile_in_side_processes(("cold_kernel_mod",)) == []
    assert load_cached(("cold_kernel_mod",)) is True
    assert len(mod.twice.signatures) == 1 and sum(mod.twice.stats.cache_hits.values()) == 1
    np.testing.assert_array_equal(mod.twice(np.arange(3.0)), [0.0, 2.0, 4.0])


def test_processes_compiling_one_module_take_turns(tmp_path, monkeypatch):
    """Workers started together compile a module one at a time (the later ones then only load
    from the cache): their warm-ups never overlap."""
    log = tmp_path / "turns.log"
    (tmp_path / "slow_warm_up_mod.py").write_text(textwrap.dedent(f'''
        import time

        def warm_up():
            with open({str(log)!r}, "a") as f:
                f.write(f"{{time.monotonic()}} ")
            time.sleep(0.3)
            with open({str(log)!r}, "a") as f:
                f.write(f"{{time.monotonic()}}\\n")
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert compile_in_side_processes(("slow_warm_up_mod",) * 3) == []
    spans = sorted(tuple(map(float, line.split())) for line in log.read_text().splitlines())
    assert len(spans) == 3
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def test_a_failing_side_process_is_reported(tmp_path, monkeypatch):
    (tmp_path / "broken_kernel_mod.py").write_text("raise ImportError('no such kernel here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    failed = compile_in_side_processes(("broken_kernel_mod",))
    assert len(failed) == 1 and "no such kernel here" in failed[0]


def test_rebalancer_starts_without_waiting_for_kernels():
    rng = np.random.default_rng(0)
    load = rng.gamma(0.5, 1.0, (2, 16)) * 100
    rb = eplb.Rebalancer(eplb.plan(load, num_gpus=4).placement, min_improvement=0.0)
    from eplb.planning.kernel_sets import WARM_UP_MODULES

    assert rb.warmup.modules == WARM_UP_MODULES and "eplb.migration.kernels" in WARM_UP_MODULES
    rb.observe(load[:, ::-1].copy())
    res = rb.rebalance()
    assert rb.warmup.ready and res.info["kernel_wait_seconds"] >= 0.0


def test_a_kernel_module_still_importing_counts_as_not_loaded(monkeypatch):
    # The background warm-up puts a kernel module in sys.modules as its import starts (numba
    # first, which takes a while after an install); the lookups that never import (scores,
    # Placement's counts, SGLang's draws) must read it as not loaded and go on in numpy, not
    # raise AttributeError from a serving loop's first observe() (seen in bench_speed's start-up
    # part). (An import of it waits for the other thread, by Python's per-module import lock.)
    from eplb import stats
    from eplb.core.jit import loaded_kernel
    from eplb.core.placement import Placement
    from eplb.dispatch import sglang as sglang_dispatch

    for name in ("eplb.stats._score_kernel", "eplb.dispatch._sglang_draws_kernel"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        assert loaded_kernel(name) is None
    monkeypatch.setattr(sglang_dispatch, "_load_tried", True)
    assert stats.score_kernel() is None and sglang_dispatch._draws_kernel() is None
    pl = Placement(np.array([[0, 1, 2, 0], [2, 1, 0, 1]]), num_gpus=2, num_logical_experts=3)
    assert pl.replica_count_LE.tolist() == [[2, 1, 1], [1, 2, 1]]
    done = types.ModuleType("done")
    done.ready = True
    monkeypatch.setitem(sys.modules, "done", done)
    assert loaded_kernel("done") is done


class _Compiling:
    """A warm-up caught compiling (the first process after an install), until `finish()`."""

    def __init__(self):
        self.compiling, self.ready, self.status = True, False, "compiling in side processes"

    def finish(self):
        self.compiling, self.ready, self.status = False, True, "ready"

    def wait_until_known(self, timeout=None):
        return True

    def wait(self, timeout=None):
        return self.ready


@pytest.mark.parametrize("policy", [None, "adaptive"])
def test_a_due_check_waits_for_compiling_kernels_and_a_policy_keeps_its_windows(policy):
    """While the kernels compile, observe holds a due check back (and says why), so a serving
    loop that rebalances on True never waits; the next check after the compile is due, and a
    policy then sees every window closed meanwhile."""
    rng = np.random.default_rng(3)
    load = rng.gamma(0.5, 1.0, (2, 16)) * 100
    rule = {"min_improvement": 0.0} if policy is None else {}
    rb = eplb.Rebalancer(eplb.plan(load, num_gpus=4).placement, interval=2, policy=policy, **rule)
    rb.warmup = _Compiling()
    flips = load[:, ::-1].copy()
    assert [rb.observe(flips) for _ in range(4)] == [False] * 4
    assert rb.last_check["due"] is False and "kernels are compiling" in rb.last_check["reason"]
    rb.warmup.finish()
    assert [rb.observe(flips) for _ in range(2)] == [False, True]
    if policy is not None:
        assert len(rb._closed) == 3        # the two held back and the one just closed
    res = rb.rebalance()
    assert res.info["kernel_wait_seconds"] < 1.0


def test_a_policy_names_the_kernels_its_settings_use():
    from eplb.planning.kernel_sets import kernel_modules
    from eplb.serving.policy import AdaptivePolicy

    assert "eplb.serving.resplit_repair" not in kernel_modules("greedy", AdaptivePolicy())
    assert kernel_modules("greedy", AdaptivePolicy(rule="resplit"))[:3] == (
        "planners.greedy", "eplb.serving.policy", "eplb.serving.resplit_repair")
    # The schedule's relay mode runs (and is compiled) only on clusters of <= 2 slots per GPU.
    assert "eplb.migration.kernels:warm_up_relay" not in kernel_modules("greedy", None, 9)
    assert kernel_modules("greedy", None, 2)[-1] == "eplb.migration.kernels:warm_up_relay"


def test_a_warm_up_may_name_a_function_of_its_module(tmp_path, monkeypatch):
    import importlib

    (tmp_path / "two_warm_ups.py").write_text(
        "ran = []\n\ndef warm_up():\n    ran.append('warm_up')\n\ndef warm_up_other():\n    ran.append('other')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_cached(("two_warm_ups:warm_up_other", "two_warm_ups"))
    mod = importlib.import_module("two_warm_ups")
    monkeypatch.delitem(sys.modules, "two_warm_ups")
    assert mod.ran == ["other", "warm_up"]
    failed = compile_in_side_processes(("two_warm_ups:no_such_warm_up",))
    assert len(failed) == 1 and "no_such_warm_up" in failed[0]


def test_greedy_warm_up_compiles_the_only_kernel_versions_real_calls_use():
    """Read-only traces, float32 and strided loads, hierarchical's node rows: all reach the
    greedy kernels as the types warm_up compiled."""
    from planners import _greedy_kernel as k
    from planners import greedy

    greedy.warm_up()
    before = [len(f.signatures) for f in (k.replicate, k.pack, k.refine)]
    rng = np.random.default_rng(3)
    load = (rng.gamma(0.5, 1.0, (3, 64)) * 100).astype(np.float32)
    load.flags.writeable = False
    eplb.plan(load, num_gpus=8)
    eplb.plan(np.asfortranarray(load.astype(np.float64)), num_gpus=8, num_nodes=2, planner="hierarchical",
              num_expert_groups=8)
    greedy.plan_greedy(load[:, ::2], 4, 9, refine_rounds=3)
    assert [len(f.signatures) for f in (k.replicate, k.pack, k.refine)] == before


@pytest.mark.parametrize("G, S", [(4, 9), (8, 5), (16, 3)])
def test_greedy_refinement_never_raises_the_busiest_gpu(G, S):
    rng = np.random.default_rng(G)
    load = np.floor(rng.gamma(2.0, 100.0, (6, 32))) + 1
    from planners.greedy import plan_greedy

    packed = plan_greedy(load, G, S, refine_rounds=0)
    refined = plan_greedy(load, G, S)
    busiest = lambda phy: eplb.Placement(phy, G, 32).gpu_loads(load).max(axis=1)  # noqa: E731
    assert (busiest(refined) <= busiest(packed) + 1e-9).all()
    assert (busiest(refined) < busiest(packed) - 1e-9).any()
    lb = eplb.stats.lower_bound(load, G, G * S)
    assert (busiest(refined) >= lb - 1e-9).all()


def test_engines_compile_the_planners_kernels_aside(monkeypatch):
    """Before an engine starts (the SGLang launcher, vLLM's top process): one detached process
    per warm-up of the planner's kernels, so that no rebalance inside the engine compiles."""
    import eplb.core.jit
    from eplb.integrations import compile_aside
    from eplb.planning.kernel_sets import kernel_modules

    started = []
    monkeypatch.setattr(eplb.core.jit, "compile_detached", started.append)
    compile_aside("greedy")
    assert started == list(kernel_modules("greedy")) and "planners.greedy" in started


def test_a_detached_compile_is_reaped_when_it_ends(tmp_path, monkeypatch):
    """A server that starts one keeps no zombie: a daemon thread waits for it."""
    import time

    from eplb.core.jit import compile_detached

    (tmp_path / "quick_warm_up_mod.py").write_text("def warm_up():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    proc = compile_detached("quick_warm_up_mod")
    deadline = time.monotonic() + 30
    while proc.returncode is None and time.monotonic() < deadline:   # set by the reaper's wait()
        time.sleep(0.05)
    assert proc.returncode == 0
