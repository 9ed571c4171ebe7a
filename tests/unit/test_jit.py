"""eplb.core.jit: a kernel runs as plain Python until its machine code is at hand, compiled in a
side process meanwhile; both ways give the same results."""

from __future__ import annotations

import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import eplb
from eplb.core import _side_compile, jit
from eplb.errors import EplbError

_MODULE = '''
import numpy as np
from eplb.core.jit import kernel


@kernel(inline=True)
def _twice(x):
    return 2 * x


@kernel
def doubled(a):
    out = np.empty_like(a)
    for i in range(a.size):
        out[i] = _twice(a[i])
    return out


@kernel
def broken(a):
    return a.no_such_attribute
'''


@pytest.fixture
def kernel_module(tmp_path, monkeypatch):
    """A fresh module of kernels (its own numba cache beside it), importable by side processes."""
    name = f"jit_probe_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(jit.MODE_ENV, "auto")
    __import__(name)
    yield sys.modules[name]
    monkeypatch.delitem(sys.modules, name)


def test_an_uncached_kernel_runs_as_python_while_a_side_process_compiles_it(kernel_module):
    k = kernel_module.doubled
    a = np.arange(4.0)
    with jit.record() as interpreted:
        np.testing.assert_array_equal(k(a), [0.0, 2.0, 4.0, 6.0])
    assert interpreted == {k.name}
    assert k.dispatcher.signatures == []                # nothing compiled in this process
    assert jit.wait(600)
    assert any(name.startswith(k.name) and state == "compiled" for name, state in jit.status().items())
    with jit.record() as interpreted:
        np.testing.assert_array_equal(k(a), [0.0, 2.0, 4.0, 6.0])
    assert interpreted == set()                         # loaded from the cache the side process filled
    assert len(k.dispatcher.signatures) == 1 and sum(k.dispatcher.stats.cache_hits.values()) == 1


def test_new_argument_types_are_a_first_call_again_never_a_compile_in_place(kernel_module):
    k = kernel_module.doubled
    k(np.arange(3.0))
    assert jit.wait(600)
    k(np.arange(3.0))
    assert len(k.dispatcher.signatures) == 1
    with jit.record() as interpreted:
        np.testing.assert_array_equal(k(np.arange(3)), [0, 2, 4])   # int64: no machine code yet
    assert interpreted == {k.name} and len(k.dispatcher.signatures) == 1
    assert jit.wait(600)


def test_a_kernel_that_cannot_compile_stays_python_and_says_why(kernel_module):
    k = kernel_module.broken
    with pytest.raises(AttributeError):
        k(np.arange(3.0))                               # the Python function's own error
    assert jit.wait(600)
    failed = [state for name, state in jit.status().items() if name.startswith(k.name)]
    assert failed and failed[0].startswith("failed: ")


def test_wait_and_off_modes(kernel_module, monkeypatch):
    k = kernel_module.doubled
    monkeypatch.setenv(jit.MODE_ENV, "off")
    with jit.record() as interpreted:
        k(np.arange(2.0))
    assert interpreted == {k.name} and k.dispatcher.signatures == []
    monkeypatch.setenv(jit.MODE_ENV, "wait")
    with jit.record() as interpreted:
        k(np.arange(2.0))
    assert interpreted == set() and len(k.dispatcher.signatures) == 1
    monkeypatch.setenv(jit.MODE_ENV, "fast")
    with pytest.raises(EplbError, match="EPLB_JIT='fast' is not a jit mode"):
        jit.mode()


def test_an_edited_callee_in_another_kernel_file_invalidates_its_callers_cache(tmp_path):
    """numba stamps a cache entry with its own file only; eplb stamps it with its folder's kernel
    files, so a caller never loads machine code built with an old callee."""
    import os
    import subprocess

    (tmp_path / "probe_callee_kernel.py").write_text(
        "from eplb.core.jit import kernel\n\n\n@kernel\ndef step(x):\n    return x + 1\n")
    (tmp_path / "probe_caller_kernel.py").write_text(
        "from eplb.core.jit import kernel\nfrom probe_callee_kernel import step\n\n\n"
        "@kernel\ndef twice(x):\n    return step(step(x))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]), EPLB_JIT="wait")
    run = ["-c", "import probe_caller_kernel as k; print(k.twice(1), k.twice.dispatcher.stats.cache_hits)"]
    first = subprocess.run([sys.executable, *run], env=env, capture_output=True, text=True, check=True).stdout
    assert first.startswith("3 ")
    callee = tmp_path / "probe_callee_kernel.py"
    callee.write_text(callee.read_text().replace("x + 1", "x + 10"))
    os.utime(callee, (time.time() + 5, time.time() + 5))
    again = subprocess.run([sys.executable, *run], env=env, capture_output=True, text=True, check=True).stdout
    assert again.startswith("21 ")


def test_side_processes_wanting_one_kernel_take_turns(tmp_path):
    spans = []

    def hold():
        with _side_compile._turn(str(tmp_path / "turn.lock")):
            t0 = time.monotonic()
            time.sleep(0.2)
            spans.append((t0, time.monotonic()))

    threads = [threading.Thread(target=hold) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans.sort()
    assert len(spans) == 3 and all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def _decision(G: int, S: int, seed: int):
    rng = np.random.default_rng(seed)
    a = rng.pareto(1.2, (6, G * S * 3 // 4)) * 100 + 1
    b = a * rng.lognormal(0.0, 0.6, a.shape)
    rb = eplb.Rebalancer(eplb.plan(a, num_gpus=G, slots_per_gpu=S).placement, interval=1)
    rb.observe(b)
    return rb.rebalance()


@pytest.mark.parametrize("G, S", [(8, 5), (16, 2)])     # 2 slots per GPU: the schedule's relay mode too
def test_interpreted_kernels_decide_exactly_as_compiled_ones(G, S, monkeypatch):
    """A fresh install's first decisions run the kernels as Python: the same placement and the
    same migration, to the bit, as the machine code gives."""
    monkeypatch.setenv(jit.MODE_ENV, "off")
    slow = _decision(G, S, G)
    assert "planners._greedy_kernel.refine" in slow.info["interpreted_kernels"]
    assert any(".schedule._rounds_kernel." in k for k in slow.info["interpreted_kernels"])
    monkeypatch.setenv(jit.MODE_ENV, "wait")
    fast = _decision(G, S, G)
    assert fast.info["interpreted_kernels"] == []
    np.testing.assert_array_equal(slow.placement.phy2log_LP, fast.placement.phy2log_LP)
    for name in ("round_M", "layer_M", "expert_M", "src_slot_M", "dst_slot_M", "staging_M", "chunk_R"):
        np.testing.assert_array_equal(getattr(slow.migration, name), getattr(fast.migration, name))
    assert slow.moves == fast.moves > 0


def test_real_calls_reach_each_kernel_with_one_argument_type_list():
    """Read-only traces, float32 and strided loads, node rows, relay clusters: every kernel a plan
    and a rebalance run is called with the types of its first call, so it has one cache entry."""
    rng = np.random.default_rng(3)
    load = (rng.gamma(0.5, 1.0, (3, 64)) * 100).astype(np.float32)
    load.flags.writeable = False
    eplb.plan(load, num_gpus=8)
    eplb.plan(np.asfortranarray(load.astype(np.float64)), num_gpus=8, num_nodes=2, planner="hierarchical",
              num_expert_groups=8)
    for G, S in ((8, 9), (16, 5), (32, 2)):
        _decision(G, S, G)
    kernels = [v for m in list(sys.modules.values()) if (m.__name__ or "").startswith(("eplb.", "planners."))
               for v in vars(m).values() if isinstance(v, jit.Kernel) and v._state]
    assert len(kernels) >= 10
    many = {k.name: list(k._state) for k in kernels if len(k._state) > 1}
    assert not many, many


def test_first_calls_from_two_threads_compile_one_at_a_time(kernel_module, monkeypatch):
    """A planner's worker threads may meet two uncompiled kernels at once ("wait" mode). Each
    compile switches compiling off for the loaded kernels when it ends; overlapping, one would
    switch off a callee the other is still linking ("compilation disabled")."""
    monkeypatch.setenv(jit.MODE_ENV, "wait")
    first, second = kernel_module.doubled, kernel_module._twice
    inside, overlapped = threading.Event(), []
    compile_first = first.dispatcher.compile

    def slow_compile(sig):
        inside.set()
        time.sleep(0.3)                        # the other thread's first call starts meanwhile
        overlapped.append(second.dispatcher.signatures != [])
        return compile_first(sig)

    monkeypatch.setattr(first.dispatcher, "compile", slow_compile)
    worker = threading.Thread(target=first, args=(np.arange(3.0),))
    worker.start()
    assert inside.wait(10)
    assert second(np.float64(2.0)) == 4.0      # waits for the first compile, then compiles
    worker.join()
    assert overlapped == [False]
    assert first(np.arange(3.0)).tolist() == [0.0, 2.0, 4.0]
