"""The planner table: built-in entries import and match the CLI; run-time and entry-point planners."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import numpy as np
import pytest

import eplb
from eplb.cli import build_parser
from eplb.errors import EplbError
from planners import api as planner_api
from planners.api import PLANNERS, PlanRequest, Solution, get_planner, planner_class, planner_names, register

ROOT = Path(__file__).resolve().parents[2]


def _choices(parser: argparse.ArgumentParser, *path: str) -> list[str]:
    """The --planner choices of the (sub)command named by path, e.g. ("plot", "balance")."""
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    action = next(a for a in parser._actions if "--planner" in a.option_strings)
    return sorted(action.choices)


@pytest.mark.parametrize("command", [("plan",), ("backtest",), ("plot", "balance")])
def test_cli_planner_choices_are_the_table(command):
    assert _choices(build_parser(), *command) == sorted(PLANNERS) == planner_names()


@pytest.mark.parametrize("name", sorted(PLANNERS))
def test_every_table_entry_imports_and_carries_its_name(name):
    cls = planner_class(name)
    assert PLANNERS[name] == f"{cls.__module__}:{cls.__name__}"
    assert cls.name == name
    assert callable(cls.plan)


def test_planners_package_imports_nothing():
    """No registration by import side effect: the table finds each planner module on its own."""
    tree = ast.parse((ROOT / "planners" / "__init__.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


class _Echo:
    """A planner made at run time: the contiguous placement, status FEASIBLE."""

    def __init__(self, tag: str = ""):
        self.tag = tag

    def plan(self, request: PlanRequest) -> Solution:
        from eplb.core.placement import contiguous_map

        return Solution(contiguous_map(request.num_logical_experts, request.topology, request.num_layers),
                        status="FEASIBLE", message=self.tag)


@pytest.fixture
def clean_registry(monkeypatch):
    monkeypatch.setattr(planner_api, "_registered", {})
    monkeypatch.setattr(planner_api, "_entry_points", None)


def test_register_a_class_made_at_run_time(clean_registry):
    cls = type("Echo", (_Echo,), {})
    assert register("echo", cls) is cls and cls.name == "echo"
    register("echo", cls)  # the same class again: a no-op
    assert "echo" in planner_names()
    result = eplb.plan(np.ones((2, 8)), num_gpus=2, planner="echo", settings={"tag": "hi"})
    assert (result.planner, result.status, result.message) == ("echo", "FEASIBLE", "hi")
    with pytest.raises(EplbError, match="'echo' is taken"):
        register("echo", type("Other", (_Echo,), {}))
    with pytest.raises(EplbError, match="'greedy' is taken"):
        register("greedy", type("Greedy2", (_Echo,), {}))
    with pytest.raises(EplbError, match="no plan"):
        register("broken", type("Broken", (), {}))


class _EntryPoint:
    def __init__(self, name: str, value: str, obj):
        self.name, self.value, self._obj = name, value, obj

    def load(self):
        return self._obj


def test_entry_point_planners_are_listed_and_loaded_on_use(clean_registry, monkeypatch):
    loaded = []

    class Lazy(_EntryPoint):
        def load(self):
            loaded.append(self.name)
            return super().load()

    eps = [Lazy("plugin", "pkg.mod:Echo", type("Plugin", (_Echo,), {"name": "plugin"}))]
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: eps if group == "eplb.planners" else [])
    assert "plugin" in planner_names() and loaded == []
    assert get_planner("plugin").plan(PlanRequest(np.ones((1, 4)), eplb.Topology(2, 2))).status == "FEASIBLE"
    assert loaded == ["plugin"]


def test_entry_point_reusing_a_builtin_name_is_refused(clean_registry, monkeypatch):
    eps = [_EntryPoint("greedy", "pkg.mod:Greedy", _Echo)]
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: eps)
    with pytest.raises(EplbError, match="reuse built-in planner name.*greedy"):
        planner_names()


def test_unknown_planner_names_the_choices():
    with pytest.raises(EplbError, match="unknown planner 'nope': choose one of .*greedy"):
        get_planner("nope")
