"""Plots: files are written headless (Agg), in the format of their extension, and are not blank."""

import numpy as np
import pytest

from eplb.core.placement import Placement, contiguous_map
from eplb.core.topology import Topology
from eplb.errors import EplbError
from eplb.evaluate import plot, timeline
from eplb.formats import save_placement, save_trace
from eplb.planning.front_door import plan

L, E, G = 6, 32, 4


@pytest.fixture(scope="module")
def load_LE():
    rng = np.random.default_rng(7)
    # Skewed (log-normal) expert loads so hot experts and imbalance exist to be drawn.
    return np.round(rng.lognormal(3.0, 1.0, size=(L, E)))


@pytest.fixture(scope="module")
def placements(load_LE):
    topo = Topology.for_experts(E, num_gpus=G)
    base = Placement(contiguous_map(E, topo, L), G, E)
    return {"contiguous": base, "greedy": plan(load_LE, num_gpus=G, planner="greedy")}


def _assert_png_has_content(path, min_side=300):
    import matplotlib.image as mpimg

    img = mpimg.imread(path)
    assert img.ndim == 3 and min(img.shape[:2]) >= min_side
    assert path.stat().st_size > 10_000
    grey = img[..., :3].mean(axis=2)
    assert grey.std() > 0.05  # not a blank canvas
    assert (grey < 0.5).mean() > 0.01  # some ink: axes, text, data


def test_heatmap_png(tmp_path, load_LE):
    p = tmp_path / "heat.png"
    fig = plot.expert_heatmap(load_LE, layer_ids=np.arange(3, 3 + L), path=p)
    _assert_png_has_content(p)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "logical expert id" and "layer" in ax.get_ylabel()
    assert "log" in fig.axes[1].get_ylabel()  # colour bar says the scale


def test_heatmap_accepts_a_trace_and_svg(tmp_path):
    from eplb.core.trace import Trace, default_meta

    counts = np.random.default_rng(1).poisson(20, size=(3, L, E))
    counts[:, :, 0] = 0  # an idle expert is drawn, not an error
    trace = Trace(counts, np.arange(1, L + 1), default_meta(L + 1, E))
    p = tmp_path / "heat.svg"
    plot.expert_heatmap(trace, path=p)
    text = p.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text and len(text) > 20_000


def test_gpu_load_comparison(tmp_path, load_LE, placements):
    p = tmp_path / "balance.png"
    fig = plot.gpu_load_comparison(load_LE, placements, path=p)
    _assert_png_has_content(p)
    left = fig.axes[0]
    labels = [t.get_text() for t in left.get_legend().get_texts()]
    assert any(s.startswith("contiguous") for s in labels) and any(s.startswith("greedy") for s in labels)
    assert any(s.startswith("lower bound") for s in labels)
    assert "GPU" in left.get_ylabel()


def test_replica_map_with_and_without_load(tmp_path, load_LE, placements):
    pl = placements["greedy"]
    p1, p2 = tmp_path / "rep1.png", tmp_path / "rep2.png"
    plot.replica_map(pl, load_LE, path=p1)
    plot.replica_map(pl, None, layer=L - 1, path=p2)
    _assert_png_has_content(p1)
    _assert_png_has_content(p2)
    with pytest.raises(EplbError, match="layer index 99 is outside 0..5"):
        plot.replica_map(pl, layer=99)


def test_backtest_timeline(tmp_path):
    rng = np.random.default_rng(3)
    series = [
        timeline.TimelineSeries("static", 1.4 + 0.1 * rng.random(30)),
        timeline.TimelineSeries("greedy every 10", 1.1 + 0.05 * rng.random(30), [0, 10, 20], [96, 20, 18]),
    ]
    p = tmp_path / "bt.png"
    fig = timeline.backtest_timeline(series, window_label="window (4,096 tokens)", path=p)
    _assert_png_has_content(p)
    assert len(fig.axes) == 2 and fig.axes[1].get_xlabel() == "window (4,096 tokens)"


@pytest.fixture(scope="module")
def backtests():
    from eplb.evaluate.backtest import backtest

    rng = np.random.default_rng(5)
    counts = rng.poisson(rng.gamma(0.7, 40.0, size=(9, 2, 16)))
    kw = dict(num_gpus=4, history=3, dispatch=("even", "resplit"), oracle=False, quiet=True)
    return [backtest(counts, planner="greedy", interval=2, **kw),
            backtest(counts, planner="greedy", interval=3, **kw),
            backtest(counts, planner="contiguous", interval=9, **kw)]


def test_timeline_from_backtest_results_and_their_json(backtests):
    import json

    direct = timeline.timeline_from_backtest(backtests, dispatch="resplit")
    # What `eplb backtest --json` prints, through a file, gives the same series.
    data = json.loads(json.dumps({"results": [r.summary() for r in backtests]}))
    for via_json in (timeline.timeline_from_json(data, "resplit"),
                     timeline.timeline_from_backtest(data["results"], "resplit")):
        for a, b in zip(direct, via_json):
            assert a.name == b.name and np.array_equal(a.rebalance_at, b.rebalance_at)
            assert np.array_equal(a.imbalance_T, b.imbalance_T)
            assert (a.moves is None and b.moves is None) or np.array_equal(a.moves, b.moves, equal_nan=True)
    every2, every3, once = direct
    # The same planner twice is told apart by its interval.
    assert [s.name for s in direct] == ["greedy, every 2 windows", "greedy, every 3 windows", "contiguous"]
    r = backtests[0]
    assert np.array_equal(every2.imbalance_T, r.column("imbalance")[:, r.dispatch.index("resplit")])
    # 6 scored windows (3..8): plans start serving at windows 3, 5, 7 = positions 0, 2, 4.
    assert every2.rebalance_at.tolist() == [0, 2, 4] and every3.rebalance_at.tolist() == [0, 3]
    assert np.isnan(every2.moves[0]) and every2.moves[1:].tolist() == [p.moves for p in r.plans[1:]]
    assert once.rebalance_at.tolist() == [0] and once.moves is None  # one plan: nothing was moved
    assert [s.name for s in timeline.as_timeline(backtests[:1])] == ["greedy"]


def test_timeline_from_backtest_errors_name_the_problem(backtests):
    from eplb.evaluate.backtest import backtest

    with pytest.raises(EplbError, match="has no 'optimal' dispatch scores \\(it scored even, resplit\\)"):
        timeline.timeline_from_backtest(backtests, dispatch="optimal")
    other = backtest(np.random.default_rng(1).poisson(30, size=(9, 2, 16)), num_gpus=4, history=5, dispatch=("even",),
                     oracle=False, quiet=True)
    with pytest.raises(EplbError, match="score different windows \\(greedy: windows 3..8, greedy: windows 5..8\\)"):
        timeline.timeline_from_backtest([backtests[0], other])
    with pytest.raises(EplbError, match="lacks 'per_window'"):
        timeline.timeline_from_backtest([{"planner": "greedy"}])
    with pytest.raises(EplbError, match="read it with eplb.evaluate.timeline.timeline_from_json"):
        timeline.as_timeline(backtests[0].summary())
    with pytest.raises(EplbError, match="expected the output of `eplb backtest --json`"):
        timeline.timeline_from_json({"runs": []})


def test_timeline_from_explicit_series_and_mapping():
    data = {"series": [{"name": "a", "imbalance": [1.2, 1.1], "rebalance_at": [0, 1], "moves": [None, 5]}]}
    (a,) = timeline.timeline_from_json(data)
    assert a.name == "a" and np.isnan(a.moves[0]) and a.moves[1] == 5.0
    with pytest.raises(EplbError, match=r"unknown key\(s\) \['imbalance_T'\]"):
        timeline.timeline_from_json({"series": [{"name": "a", "imbalance": [1.0], "imbalance_T": [1.0]}]})
    runs = timeline.as_timeline({"static": [1.3, 1.3, 1.2]})
    assert runs[0].rebalance_at.size == 0 and runs[0].moves is None


def test_backtest_figure_from_results(tmp_path, backtests):
    p = tmp_path / "bt.png"
    fig = timeline.backtest_timeline(timeline.timeline_from_backtest(backtests), path=p)
    _assert_png_has_content(p)
    top, bottom = fig.axes
    labels = [t.get_text() for t in top.get_legend().get_texts()]
    assert labels[0].startswith("greedy, every 2 windows (mean ") and "3 plans, median" in labels[0]
    assert labels[2].startswith("contiguous") and "1 plan)" in labels[2]
    # Bars only for counted rebalances: 2 for every-2, 1 for every-3, none for the first plans.
    assert sum(len(c.patches) for c in bottom.containers) == 3


@pytest.mark.parametrize("kw, msg", [
    (dict(rebalance_at=[5]), r"rebalance_at must be sorted window indices in 0..2"),
    (dict(rebalance_at=[0, 1], moves=[3]), "1 move counts for 2 rebalances"),
])
def test_timeline_errors_name_the_value(kw, msg):
    with pytest.raises(EplbError, match=msg):
        timeline.TimelineSeries("x", [1.0, 1.1, 1.2], **kw)


def test_bad_extension_and_shapes(tmp_path, load_LE, placements):
    with pytest.raises(EplbError, match="use a file name ending in .png, .svg, .pdf"):
        plot.expert_heatmap(load_LE, path=tmp_path / "heat.jpg")
    with pytest.raises(EplbError, match="folder .* does not exist"):
        plot.expert_heatmap(load_LE, path=tmp_path / "nope" / "heat.png")
    with pytest.raises(EplbError, match="loads must be"):
        plot.expert_heatmap(np.zeros(5))
    with pytest.raises(EplbError, match="needs \\(6, 32\\)"):
        plot.replica_map(placements["greedy"], load_LE[:, :8])


def test_plotting_does_not_touch_pyplot_state(tmp_path, load_LE):
    import sys

    plot.expert_heatmap(load_LE, path=tmp_path / "h.png")
    # Figures are built without pyplot: nothing global (backend, open figures) changes.
    assert "matplotlib.pyplot" not in sys.modules or not sys.modules["matplotlib.pyplot"].get_fignums()


def test_cli_refuses_a_placement_for_other_layer_ids(tmp_path, load_LE, capsys):
    from eplb.cli import main
    from eplb.core.trace import Trace, default_meta

    counts = load_LE.astype(np.int64)[None]
    trace = Trace(counts, np.arange(3, 3 + L), default_meta(3 + L, E, source="t"))
    save_trace(trace, tmp_path / "t.npz")
    save_trace(Trace(counts, np.arange(L), default_meta(3 + L, E, source="u")), tmp_path / "shifted.npz")
    save_placement(plan(trace, num_gpus=G, planner="greedy").placement, tmp_path / "p.json")
    assert main(["plot", "balance", str(tmp_path / "t.npz"), "--placement", str(tmp_path / "p.json"),
                 "-o", str(tmp_path / "ok.png"), "-q"]) == 0
    for argv in (["balance", str(tmp_path / "shifted.npz"), "--placement", str(tmp_path / "p.json")],
                 ["replicas", str(tmp_path / "p.json"), "--trace", str(tmp_path / "shifted.npz")]):
        assert main(["plot", *argv, "-o", str(tmp_path / "x.png")]) == 2
        assert "is for MoE layer ids 3..8 but" in capsys.readouterr().err
