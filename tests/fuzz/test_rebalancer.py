"""Fuzz the serving hook: Rebalancer.observe with random shapes, dtypes and values, from threads.

An observation is accepted (the step advances, the window stays finite and >= 0) or refused
with one EplbError line and no change at all: a NaN, 1e308, a complex or bool array, text,
a ragged list or a wrong shape never reaches the window. Rebalances interleave with the
observations, and several threads observe while another rebalances: the only exceptions are
EplbErrors, and the window holds exactly the sum of the observations that were accepted.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import eplb
from eplb.errors import EplbError
from tests.fuzz.common import check_message, examples, outcome

L, E, G = 3, 8, 4  # 12 slots: logical [3, 8] and physical [3, 12] counts differ in shape
BASE = eplb.plan(np.arange(1.0, 25.0).reshape(L, E), num_gpus=G).placement
P = BASE.num_slots

DTYPES = ["<i8", "<i4", "|i1", "|u1", "<u8", "<f8", "<f4", "<f2", "|b1", "<c16", "<U2", "O"]
EXTREME = [0.0, 1.0, 3.0, -1.0, 1e308, -1e308, np.inf, np.nan, 2.0**62, 1e-320, 0.5]


@st.composite
def observations(draw):
    shape = draw(st.sampled_from([(L, E)] * 4 + [(L, P)] * 2 + [(L, E + 1), (L + 1, E), (E,), (), (L, E, 1),
                                                                    (0, E), (L, 0)]))
    kind = draw(st.sampled_from(["array", "array", "list", "ragged", "tensor"]))
    if kind == "ragged":
        return [[1.0] * E, [1.0] * (E - 1), [None] * E][: shape[0] if shape else 1]
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    if dtype.kind == "O":
        return np.array([[draw(st.sampled_from([1, "a", None, 2.5, [1]])) for _ in range(E)] for _ in range(L)],
                        dtype=object)
    if dtype.kind == "U":
        elements = st.text(alphabet="0123456789.-e", max_size=2)
    elif dtype.kind == "c":
        elements = st.complex_numbers(width=128, max_magnitude=10)
    elif dtype.kind == "f":
        extreme = EXTREME if dtype.itemsize == 8 else [0.0, 1.0, -1.0, np.inf, np.nan]  # 1e308 fits float64 only
        elements = st.sampled_from(extreme) | st.floats(0, 100, width=8 * dtype.itemsize)
    else:
        elements = None
    a = draw(hnp.arrays(dtype, shape, elements=elements))
    if kind == "list":
        return a.tolist()
    if kind == "tensor":
        torch = pytest.importorskip("torch")
        try:
            return torch.from_numpy(np.ascontiguousarray(a))
        except TypeError:  # a dtype torch has no tensor for
            return a
    return a


@settings(max_examples=examples(100))
@given(mode=st.sampled_from([{"window": 3}, {"alpha": 0.5}, {}]), interval=st.integers(1, 3),
       ops=st.lists(st.tuples(st.sampled_from(["observe"] * 6 + ["rebalance", "predict"]), observations(),
                              st.sampled_from([None, None, True, False, "yes", 1])), min_size=1, max_size=8))
def test_observe_accepts_or_refuses_without_a_trace(mode, interval, ops):
    rb = eplb.Rebalancer(BASE, interval=interval, min_improvement=0.0, **mode)
    for op, counts, physical in ops:
        before, step = rb.load_LE, rb.step
        if op == "observe":
            kind, _ = outcome(lambda: rb.observe(counts, physical=physical))  # noqa: B023 (called at once)
            if kind == "refused":
                assert rb.step == step and np.array_equal(rb.load_LE, before, equal_nan=True)
            else:
                assert rb.step == step + 1
            assert np.isfinite(rb.load_LE).all() and (rb.load_LE >= 0).all()
        elif op == "rebalance":
            kind, res = outcome(rb.rebalance)
            if kind == "ok":
                assert (res.placement.replica_count_LE >= 1).all() and np.isfinite(res.after.imbalance_L).all()
        else:
            assert np.isfinite(rb.predicted_improvement())


def test_threads_observe_while_another_rebalances():
    """4 observer threads (valid and invalid counts interleaved) and 1 rebalancing thread."""
    rb = eplb.Rebalancer(BASE, interval=5, min_improvement=0.0)
    rng = np.random.default_rng(0)
    plans = [[rng.integers(0, 50, size=(L, E)).astype(float) for _ in range(40)] for _ in range(4)]
    bad = [np.full((L, E), np.nan), np.full((L, E), 1e308), np.ones((L, E), dtype=bool), np.ones((L + 1, E))]
    unexpected: list[BaseException] = []
    stop = threading.Event()

    def observer(counts_list):
        try:
            for i, c in enumerate(counts_list):
                rb.observe(c, physical=False)
                try:
                    rb.observe(bad[i % len(bad)], physical=False)
                    unexpected.append(AssertionError("a bad observation was accepted"))
                except EplbError as exc:
                    check_message(str(exc))
        except BaseException as exc:  # noqa: BLE001 - any escape is the failure this test looks for
            unexpected.append(exc)

    def rebalancer():
        while not stop.is_set():
            try:
                rb.rebalance()
            except EplbError as exc:  # no load yet, or another placement adopted meanwhile
                check_message(str(exc))
            except BaseException as exc:  # noqa: BLE001
                unexpected.append(exc)
                return

    threads = [threading.Thread(target=observer, args=(p,)) for p in plans]
    side = threading.Thread(target=rebalancer)
    side.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    side.join()
    assert not unexpected, unexpected
    assert rb.step == 4 * 40
    np.testing.assert_array_equal(rb.load_LE, sum(sum(p) for p in plans))  # every accepted count, exactly once
