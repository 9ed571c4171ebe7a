# ruff: noqa: B023  (every lambda here is called at once by _called, inside its loop iteration)
"""Every public entry point refuses a bad value with an EplbError, never another exception.

The entry points are the callables `eplb.__all__` names (functions, and the constructors of the
values a caller builds: Topology, Trace, Placement, Budget, Scoring, Rebalancer) plus the
Rebalancer's methods. Each is called once with valid arguments, then with one argument at a
time replaced by each value of BAD (wrong types, non-finite and huge numbers, ragged and
boolean lists, text arrays, torch tensors of kinds with no values or no numpy form). The only
allowed outcomes are success or an EplbError of one line: a TypeError, AttributeError or
numpy's ValueError from deep inside is what issue 35 found (`Rebalancer.adopt("x")`,
`save_placement("x", path)`, `observe(bf16 tensor)`, `load_trace(None)`).

Result values (PlanResult, Solution, ReplayResult, LoadReport, MigrationPlan, RebalanceResult)
are made by eplb, not by callers, and are left out; so are `register` (a planner author's
hook, checked in tests/unit/test_planner_api.py) and calls with a missing argument (Python's
own TypeError names it).
"""

from __future__ import annotations

import numpy as np

import eplb
from eplb.core.trace import default_meta
from eplb.errors import EplbError
from eplb.stats.loads import evaluate  # `eplb.evaluate` is shadowed by the eplb.evaluate package once imported
from tests.fuzz.common import check_message

try:
    import torch
except ImportError:
    torch = None

BAD = [None, "x", "", -1, 0, 2.5, float("nan"), float("inf"), True, 10**30, [], [[1, 2], [3]], [True, False],
       {"a": 1}, object(), b"\xff", np.array(["a", "b"]), np.full((2, 8), np.nan), np.ones((2, 8), dtype=bool),
       np.ones((3, 3, 3, 3))]
if torch is not None:
    BAD += [torch.ones(2, 8, dtype=torch.bfloat16), torch.empty(2, 8, device="meta"), torch.ones(2, 8).to_sparse(),
            torch.ones(2, 8, dtype=torch.complex64)]

_COUNTS = np.random.default_rng(0).integers(1, 50, size=(4, 2, 8))


_META = default_meta(2, 8, num_hidden_layers=4, source="test_api")


def _trace():
    return eplb.Trace(_COUNTS, np.array([1, 3]), _META)


def _placement():
    return eplb.plan(_COUNTS, num_gpus=2, planner="greedy").placement


def _called(name, call, escaped: list) -> bool:
    """Run call(); note it in `escaped` when it raises anything but a one-line EplbError. True if refused."""
    try:
        call()
    except EplbError as exc:
        try:
            check_message(str(exc))
        except AssertionError:
            escaped.append(f"{name}: the message is not one line: {str(exc)[:200]!r}")
        return True
    except Exception as exc:  # noqa: BLE001 - the point: nothing but EplbError may escape
        escaped.append(f"{name} raised {type(exc).__name__}: {str(exc)[:200]}")
        return True
    return False


def _entry_points(tmp):
    """name -> (function, valid positional args, valid keyword args)."""
    trace_path = eplb.save_trace(_trace(), tmp / "t.npz")
    plan_path = eplb.save_placement(_placement(), tmp / "p.json")
    topo = eplb.Topology(2, 5)
    return {
        "load_trace": (eplb.load_trace, [trace_path], {}),
        "load_history": (eplb.load_history, [[trace_path, trace_path]], {}),
        "load_placement": (eplb.load_placement, [plan_path], {}),
        "save_trace": (eplb.save_trace, [_trace(), tmp / "out.npz"], {}),
        "save_placement": (eplb.save_placement, [_placement(), tmp / "out.json"], {}),
        "plan": (eplb.plan, [_COUNTS], {"num_gpus": 2, "planner": "greedy", "num_redundant": 2, "num_nodes": 1,
                                        "aggregate": "sum", "num_expert_groups": None, "settings": None}),
        "plan topology": (eplb.plan, [_COUNTS], {"topology": topo, "planner": "greedy", "previous": _placement(),
                                                 "budget": eplb.Budget(max_moves=2), "dispatch": "even"}),
        "evaluate": (evaluate, [_placement(), _COUNTS.sum(0)], {}),
        "lower_bound": (eplb.lower_bound, [_COUNTS.sum(0), 2, 10], {}),
        "get_planner": (eplb.get_planner, ["greedy"], {}),
        "get_policy": (eplb.get_policy, ["adaptive"], {"settings": None, "objective": "tokens"}),
        "replay": (eplb.replay, [_COUNTS], {"topology": topo, "policy": "static", "warmup": 2, "delay": 1,
                                            "references": ("static",), "tokens_per_window": None}),
        "Topology": (eplb.Topology, [2, 5], {"num_nodes": 1}),
        "Trace": (eplb.Trace, [_COUNTS, np.array([1, 3])], {"meta": _META}),
        "Placement": (eplb.Placement, [np.tile(np.arange(10) % 8, (2, 1)), 2, 8], {"num_nodes": 1,
                                                                                  "layer_ids": np.array([1, 3])}),
        "Budget": (eplb.Budget, [], {"max_moves": 2, "max_moves_per_gpu": 1, "move_cost": 0.0, "span_cost": 1.0,
                                     "bytes_per_expert": None}),
        "Scoring": (eplb.Scoring, [], {"rules": ("even",), "batches_per_window": 8, "seed": 0}),
        "Rebalancer": (eplb.Rebalancer, [_placement()], {"window": 4, "interval": 10, "planner": "greedy",
                                                         "budget": None, "layers_per_chunk": None,
                                                         "policy": "auto", "dispatch": None}),
    }


def test_every_public_entry_point_refuses_bad_values_with_an_eplb_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a bad path such as "x" is a valid file name: it lands here, not in the checkout
    escaped: list[str] = []
    for name, (fn, args, kwargs) in _entry_points(tmp_path).items():
        fn(*args, **kwargs)  # the valid call works, so each refusal below is the bad value's
        for i in range(len(args)):
            for bad in BAD:
                _called(f"{name} argument {i} = {bad!r}", lambda: fn(*args[:i], bad, *args[i + 1:], **kwargs), escaped)
        for key in kwargs:
            for bad in BAD:
                _called(f"{name}({key}={bad!r})", lambda: fn(*args, **{**kwargs, key: bad}), escaped)
    assert not escaped, "\n".join(escaped)


def test_every_rebalancer_method_refuses_bad_values_with_an_eplb_error():
    reb = eplb.Rebalancer(_placement(), window=4, interval=10 ** 6, planner="greedy")
    reb.observe(_COUNTS[0])
    escaped: list[str] = []
    for bad in BAD:
        for name, call in [(f"observe({bad!r})", lambda: reb.observe(bad)),
                           (f"observe(physical={bad!r})", lambda: reb.observe(_COUNTS[0], physical=bad)),
                           (f"rebalance(failed_ranks={bad!r})", lambda: reb.rebalance(failed_ranks=bad, apply=False)),
                           (f"rebalance(apply={bad!r})", lambda: reb.rebalance(apply=bad)),
                           (f"adopt({bad!r})", lambda: reb.adopt(bad))]:
            load_LE, phy_LP = reb.load_LE.copy(), reb.placement.phy2log_LP.copy()
            if _called(name, call, escaped):
                # A refused call leaves the window and the placement exactly as they were (some BAD
                # values are valid here: physical=None, a bfloat16 tensor of counts).
                assert np.array_equal(reb.load_LE, load_LE), name
                assert np.array_equal(reb.placement.phy2log_LP, phy_LP), name
    assert not escaped, "\n".join(escaped)
