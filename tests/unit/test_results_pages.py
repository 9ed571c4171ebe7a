"""The benchmarks' results pages name paths a reader's checkout has, not this machine's."""

import importlib
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _report(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("_report", None)
    return importlib.import_module("_report")


def test_machine_paths_become_checkout_paths(monkeypatch):
    r = _report(monkeypatch)
    shared, root = r.ROOT.parent / "shared", r.ROOT
    text = (f"data {shared}/traces/v3 (and {shared}/traces/v2.npz); reference: "
            f"/opt/venv/lib/python3.11/site-packages/sglang/srt/eplb/deepseek.py; trace {root}/traces/deepseek.npz")
    assert r.portable(text) == ("data ../shared/traces/v3 (and ../shared/traces/v2.npz); reference: "
                                "sglang/srt/eplb/deepseek.py; trace traces/deepseek.npz")
    assert r.portable("no paths here: 1.5 s / 2 cores") == "no paths here: 1.5 s / 2 cores"


def test_write_results_writes_the_portable_page(monkeypatch, tmp_path):
    r = _report(monkeypatch)
    monkeypatch.setattr(r, "RESULTS", tmp_path / "results")
    out = r.write_results("speed", f"from {r.ROOT.parent / 'shared'}/traces\n")
    assert out == tmp_path / "results" / "speed.md"
    assert out.read_text() == "from ../shared/traces\n"
    assert [p.name for p in out.parent.iterdir()] == ["speed.md"]  # no temporary left behind
