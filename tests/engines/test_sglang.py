"""SGLang 0.5.23's own code against eplb: its start-up path on eplb's export, its static and
dynamic dispatch maps against eplb's model of them, its plug-in loader with eplb's algorithm,
and the launcher's checks.

SGLang's process-wide configuration (`get_exec`, `get_parallel`) is replaced by the few values
its EPLB code reads: 32 EP ranks on 4 nodes, an all-to-all backend, static dispatch; the model
config by DeepSeek-V3's shape (61 hidden layers, 256 experts, 8 groups). Loads: the shipped
synthetic trace (traces/deepseek.npz), so no test depends on ../shared.
"""

import json
import os
import types
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sglang.srt.eplb.expert_location", reason="SGLang is not installed")
torch = pytest.importorskip("torch")

import sglang.srt.eplb.eplb_algorithms as algorithms  # noqa: E402
import sglang.srt.eplb.expert_location as el  # noqa: E402

from eplb.dispatch.sglang import SglangStatic, _candidates, hidden_rows, static_dispatch_maps  # noqa: E402
from eplb.errors import EplbError  # noqa: E402
from eplb.formats import load_trace  # noqa: E402
from eplb.formats.sglang import write_sglang  # noqa: E402
from eplb.integrations import sglang as launcher  # noqa: E402
from eplb.planning.front_door import plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
G, N, H, E, R = 32, 4, 61, 256, 32
RANKS = (0, 17, 31)


@pytest.fixture(scope="module")
def trace():
    return load_trace(ROOT / "traces" / "deepseek.npz")


@pytest.fixture
def server(monkeypatch):
    """SGLang's configuration as its EPLB code reads it; `moe.init_expert_location` is settable."""
    import sglang.srt.elastic_ep.elastic_ep as elastic
    import sglang.srt.runtime_context as rc

    moe = types.SimpleNamespace(ep_join_mode="none", moe_a2a_backend="deepep", ep_dispatch_algorithm="static",
                                ep_num_redundant_experts=R, init_expert_location="trivial", eplb_algorithm="auto")
    exec_ = types.SimpleNamespace(moe=moe)
    par = types.SimpleNamespace(ep_size=G, nnodes=N, elastic_ep_initial_size=None)
    for mod in (el, rc):
        monkeypatch.setattr(mod, "get_exec", lambda: exec_)
        monkeypatch.setattr(mod, "get_parallel", lambda: par)
        monkeypatch.setattr(mod, "get_device", lambda: types.SimpleNamespace(device="cpu"))
    monkeypatch.setattr(elastic, "elastic_expanded_world_enabled", lambda: False)
    monkeypatch.setattr(el.ModelConfigForExpertLocation, "from_model_config",
                        staticmethod(lambda mc: el.ModelConfigForExpertLocation(H, E, 8)))
    return moe


def test_startup_takes_eplb_export_and_dispatches_as_modelled(trace, server, tmp_path):
    rule = SglangStatic()
    p = plan(trace, num_gpus=G, num_nodes=N, num_redundant=R, dispatch=rule).placement
    path = tmp_path / "plan.json"
    write_sglang(p, path, H)
    server.init_expert_location = str(path)
    mine_GLE = static_dispatch_maps(p)
    for rank in RANKS:
        meta = el.compute_initial_expert_location_metadata(None, rank)
        phy_HP = meta.physical_to_logical_map.numpy()
        assert np.array_equal(phy_HP[p.layer_ids], p.phy2log_LP)
        theirs_HE = meta.logical_to_rank_dispatch_physical_map.numpy()
        assert np.array_equal(theirs_HE[p.layer_ids], mine_GLE[rank])
        # No token goes to a slot that holds another expert.
        assert (np.take_along_axis(phy_HP, theirs_HE, axis=1) == np.arange(E)).all()


@pytest.mark.parametrize("path", ["startup", "rebalance"])
def test_static_model_matches_sglang_on_a_draw_heavy_plan(trace, server, path):
    # greedy puts replicas anywhere, so many ranks draw: the case where the rng streams matter.
    p = plan(trace, num_gpus=G, num_nodes=N, num_redundant=R, planner="greedy").placement
    phy_HP, moe = hidden_rows(p, H)
    mine_GLE = static_dispatch_maps(p, path=path)
    for rank in RANKS:
        l2a = el._compute_logical_to_all_physical_map(torch.tensor(phy_HP), E, G, rank if path == "startup" else None)
        theirs = el.compute_logical_to_rank_dispatch_physical_map(l2a, G, G * 9, rank).numpy()
        assert np.array_equal(theirs[moe], mine_GLE[rank])


def test_dynamic_model_matches_sglang_candidate_lists(trace, server):
    p = plan(trace, num_gpus=G, num_nodes=N, num_redundant=R, planner="greedy").placement
    phy_HP, _ = hidden_rows(p, H)
    c = _candidates(phy_HP, G, N, prefer_same_node=True)
    for rank in RANKS:
        l2a = el._compute_logical_to_all_physical_map(torch.tensor(phy_HP), E, G, rank).numpy()
        nearest = c.nearest_HEG[:, :, rank]
        collapsed = nearest >= 0
        assert (l2a[collapsed][:, 0] == nearest[collapsed]).all() and (l2a[collapsed][:, 1:] == -1).all()
        full = c.slots_HEX[~collapsed]
        width = min(full.shape[1], l2a.shape[2])
        assert np.array_equal(l2a[~collapsed][:, :width], full[:, :width])


@pytest.fixture
def hooks():
    """Undo the plug-in's patches after a test (SGLang's registry only applies them)."""
    from sglang.srt.plugins import hook_registry

    saved = algorithms.rebalance_experts, el.compute_initial_expert_location_metadata
    yield hook_registry.HookRegistry
    algorithms.rebalance_experts, el.compute_initial_expert_location_metadata = saved
    hook_registry.HookRegistry.reset()


def test_sglang_loader_installs_eplb_algorithm(trace, server, hooks, monkeypatch, world_of_one):
    from importlib.metadata import entry_points

    import sglang.srt.plugins as plugins

    if "eplb" not in {ep.name for ep in entry_points(group="sglang.srt.plugins")}:
        pytest.skip("eplb is not installed as a package (pip install -e .): no entry point to load")
    original = algorithms.rebalance_experts
    monkeypatch.delenv(launcher.ENV_PLANNER, raising=False)
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    plugins.load_plugins()
    assert algorithms.rebalance_experts is original  # installed, but not enabled: nothing changes
    monkeypatch.setenv(launcher.ENV_PLANNER, "rule-aware,refine_rounds=50")
    monkeypatch.setenv(launcher.ENV_DISPATCH, "static")
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    plugins.load_plugins()
    assert algorithms.rebalance_experts is not original
    # SGLang's own start-up-from-statistics / periodic-rebalance path, with eplb's algorithm.
    counts_THE = np.zeros((4, H, E), dtype=np.int64)
    counts_THE[:, trace.layer_ids] = trace.counts_TLE[:4]
    meta = el.ExpertLocationMetadata.init_by_eplb(None, torch.from_numpy(counts_THE))
    phy_HP = meta.physical_to_logical_map.numpy()
    mine = launcher.rebalance_experts(torch.from_numpy(counts_THE), G * 9, 9, 8, N)
    assert np.array_equal(phy_HP, mine[0].numpy())
    assert np.array_equal(meta.logical_to_all_physical_map.numpy()[:, :, :mine[1].shape[2]], mine[1].numpy())
    # The dispatch SGLang built there is the rebalance-path model eplb planned for (rank 0 here).
    from eplb.core.placement import Placement

    moe = trace.layer_ids
    p = Placement(phy_HP[moe], G, E, N, moe)
    mine_GLE = static_dispatch_maps(p, path="rebalance")
    assert np.array_equal(meta.logical_to_rank_dispatch_physical_map.numpy()[moe], mine_GLE[0])
    served = SglangStatic(path="rebalance").bind(p)(None)
    load = trace.counts_TLE[:4].sum(axis=0)
    gpu = p.gpu_loads(load, served)
    assert gpu.max(axis=1).max() / gpu.mean(axis=1).min() < 1.1


def test_periodic_rebalance_plans_from_the_served_map(trace, server, hooks, monkeypatch, world_of_one):
    """SGLang's periodic rebalance (`init_by_eplb` while a map is served) keeps the served
    replicas and the balance a plan from scratch gets under the rule it applies then."""
    from eplb.core.placement import Placement
    from eplb.migration import count_moves

    monkeypatch.setenv(launcher.ENV_PLANNER, "rule-aware,refine_rounds=50")
    monkeypatch.setenv(launcher.ENV_DISPATCH, "static")
    launcher.register()
    hooks.apply_hooks()
    moe = trace.layer_ids

    def counts(lo):
        c = np.zeros((4, H, E), dtype=np.int64)
        c[:, moe] = trace.counts_TLE[lo:lo + 4]
        return torch.from_numpy(c)

    monkeypatch.setattr(el, "get_global_expert_location_metadata", lambda: None)
    served = el.ExpertLocationMetadata.init_by_eplb(None, counts(0))
    scratch = el.ExpertLocationMetadata.init_by_eplb(None, counts(8))
    monkeypatch.setattr(el, "get_global_expert_location_metadata", lambda: served)
    again = el.ExpertLocationMetadata.init_by_eplb(None, counts(8))
    old, new, fresh = (m.physical_to_logical_map.numpy()[moe] for m in (served, again, scratch))
    assert count_moves(old, new, G, E).sum() < count_moves(old, fresh, G, E).sum()
    rule = SglangStatic(path="rebalance")
    load = trace.counts_TLE[8:12].sum(axis=0)

    def busiest(phy):
        p = Placement(phy, G, E, N, moe)
        return p.gpu_loads(load, rule.bind(p)(None)).max(axis=1)

    assert busiest(new).max() <= busiest(fresh).max() * 1.01
    assert np.median(busiest(new)) <= np.median(busiest(fresh)) * 1.01
    # The dispatch SGLang built for the new map is the one eplb judged it by (rank 0 here).
    mine_GLE = static_dispatch_maps(Placement(new, G, E, N, moe), path="rebalance")
    assert np.array_equal(again.logical_to_rank_dispatch_physical_map.numpy()[moe], mine_GLE[0])


def test_startup_file_is_checked_inside_sglang(server, hooks, monkeypatch, tmp_path):
    import eplb.integrations as integrations

    primed = []
    real_prime = integrations.prime
    monkeypatch.setattr(launcher, "prime", lambda *a: primed.append(real_prime(*a)))
    monkeypatch.setenv(launcher.ENV_PLANNER, "rule-aware")
    launcher.register()
    hooks.apply_hooks()
    path = tmp_path / "short.json"
    path.write_text(json.dumps({"physical_to_logical_map": [[p % E for p in range(E + R)]] * 58}))
    server.init_expert_location = str(path)
    with pytest.raises(EplbError, match="the map has 58 rows, the model has 61 hidden layers"):
        el.compute_initial_expert_location_metadata(None, 0)
    # A scheduler process (it computes expert locations) primes the planner's kernels.
    assert primed, "computing expert locations did not prime the planner's kernels"
    primed[0].join(600)
    assert not primed[0].is_alive()
    path.write_text(json.dumps({"physical_to_logical_map": [[p % E for p in range(288)]] * H}))
    server.ep_num_redundant_experts = 64
    with pytest.raises(EplbError, match=r"the map has 288 slots, the server has 320 \(256 experts \+ 64"):
        el.compute_initial_expert_location_metadata(None, 0)


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": H, "n_routed_experts": E}))
    return d


def test_launcher_checks_then_starts_sglang(model_dir, tmp_path, monkeypatch, capsys):
    launched = []
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    for var in (launcher.ENV_PLANNER, launcher.ENV_DISPATCH):
        monkeypatch.delenv(var, raising=False)
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"physical_to_logical_map": [list(range(E + R))] * 58}))
    base = ["--", "--model-path", str(model_dir), "--ep-num-redundant-experts", str(R), "--moe-a2a-backend", "deepep"]
    assert launcher.main(base + ["--init-expert-location", str(short)], launch=launched.append) == 2
    assert "the map has 58 rows, the model has 61 hidden layers" in capsys.readouterr().err
    assert launched == [] and launcher.ENV_PLANNER not in os.environ
    assert launcher.main(["--planner", "greedy", "--max-moves", "64"] + base, launch=launched.append) == 0
    assert launched == [base[1:]]
    assert os.environ[launcher.ENV_PLANNER] == "greedy,max_moves=64"
    assert os.environ[launcher.ENV_DISPATCH] == "static"


@pytest.mark.parametrize("argv, message", [
    (["--model-path", "x"], "separate eplb's options from SGLang's with --"),
    (["--planner", "nope", "--", "--model-path", "x"], "unknown planner 'nope'"),
    (["--set", "quantile=0.9", "--", "--model-path", "x"], "--set quantile=0.9: planner 'rule-aware' takes"),
])
def test_launcher_errors(argv, message, capsys):
    assert launcher.main(argv, launch=lambda a: None) == 2
    assert message in capsys.readouterr().err


def test_launcher_refuses_other_sglang_versions(monkeypatch, capsys):
    import sglang

    monkeypatch.setattr(sglang, "__version__", "0.5.24")
    assert launcher.main(["--", "--model-path", "x"], launch=lambda a: None) == 2
    assert "SGLang 0.5.24 is not a version eplb's integration was written for (supported: 0.5.23)" in \
        capsys.readouterr().err
