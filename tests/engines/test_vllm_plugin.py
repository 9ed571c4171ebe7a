"""The vLLM plug-in against vLLM 0.33.0's own code: its plug-in loader, its policy table,
`EplbState.update_mapping` and the initial map."""

import types

import numpy as np
import pytest

pytest.importorskip("vllm.distributed.eplb.policy", reason="vLLM is not installed")
torch = pytest.importorskip("torch")

from vllm.distributed.eplb import policy as policies  # noqa: E402
from vllm.distributed.eplb.policy.default import DefaultEplbPolicy  # noqa: E402

from eplb.errors import EplbError  # noqa: E402
from eplb.formats import save_placement  # noqa: E402
from eplb.integrations import vllm as plugin  # noqa: E402
from eplb.planning.front_door import plan  # noqa: E402


@pytest.fixture
def restore_policies():
    saved = dict(policies.EPLB_POLICIES)
    yield
    policies.EPLB_POLICIES.clear()
    policies.EPLB_POLICIES.update(saved)


def test_plugin_does_nothing_unless_enabled(monkeypatch, restore_policies):
    monkeypatch.delenv(plugin.ENV_POLICY, raising=False)
    plugin.register()
    assert policies.EPLB_POLICIES["default"] is DefaultEplbPolicy


def test_vllm_loader_installs_the_policy(monkeypatch, restore_policies):
    from importlib.metadata import entry_points

    import vllm.plugins
    from vllm.distributed.eplb.eplb_state import EPLB_POLICIES as state_table

    if "eplb" not in {ep.name for ep in entry_points(group="vllm.general_plugins")}:
        pytest.skip("eplb is not installed as a package (pip install -e .): no entry point to load")
    monkeypatch.setenv(plugin.ENV_POLICY, "greedy,refine_rounds=8")
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False, raising=False)
    vllm.plugins.load_general_plugins()
    cls = policies.EPLB_POLICIES["default"]
    assert cls is plugin.policy_class() and state_table["default"] is cls  # the table EplbState reads
    assert issubclass(cls, policies.AbstractEplbPolicy)
    assert cls.planner == "greedy" and cls.settings == {"refine_rounds": 8}


def test_version_and_spec_are_checked(monkeypatch, restore_policies):
    import vllm

    monkeypatch.setenv(plugin.ENV_POLICY, "greedy")
    monkeypatch.setattr(vllm, "__version__", "0.34.1")
    with pytest.raises(EplbError, match=r"vLLM 0.34.1 is not a version .*supported: 0.33.0"):
        plugin.register()
    cls = plugin.policy_class()
    with pytest.raises(EplbError, match="unknown planner 'gredy'"):
        plugin.configure(cls, "gredy")
    with pytest.raises(EplbError, match="has no setting"):
        plugin.configure(cls, "greedy,quantile=0.9")
    with pytest.raises(EplbError, match="static serves the initial map"):
        plugin.configure(cls, "static")
    plugin.configure(cls, "greedy")


def _eplb_state(num_layers, num_logical, num_physical):
    from vllm.distributed.eplb.eplb_state import EplbModelState, EplbState

    state = EplbState(types.SimpleNamespace(), torch.device("cpu"))
    phy = torch.arange(num_physical).remainder(num_logical).repeat(num_layers, 1)
    max_slots = num_physical - num_logical + 1
    model = types.SimpleNamespace(num_logical_experts=num_logical)
    ms = EplbModelState(
        physical_to_logical_map=phy, physical_to_logical_map_buffer=phy,
        logical_to_physical_map=torch.full((num_layers, num_logical, max_slots), -1),
        logical_replica_count=torch.zeros(num_layers, num_logical, dtype=torch.long),
        expert_load_pass=torch.zeros(num_layers, num_physical, dtype=torch.int32),
        expert_load_pass_buffer=torch.zeros(num_layers, num_physical, dtype=torch.int32),
        expert_load_window=torch.zeros(1, num_layers, num_physical, dtype=torch.int32),
        last_expert_load=torch.ones(num_layers, num_logical, dtype=torch.int64), model_name="m", model=model,
        expert_buffer=[], rebalanced=False, eplb_stats=None, device_index=None, communicator=None)
    state.model_states["m"] = ms
    return state, ms, types.SimpleNamespace(compute_hash=lambda: "m")


def test_update_mapping_takes_an_eplb_map():
    from eplb.formats.vllm import vllm_maps

    rng = np.random.default_rng(1)
    load = rng.integers(1, 1000, size=(4, 32)).astype(float)
    p = plan(load, num_gpus=8, num_nodes=2, num_redundant=8, dispatch="even").placement
    state, ms, cfg = _eplb_state(4, 32, 40)
    state.update_mapping(cfg, torch.from_numpy(p.phy2log_LP.copy()))
    mine = vllm_maps(p)
    assert torch.equal(ms.physical_to_logical_map, torch.from_numpy(mine["physical_to_logical_map"]))
    assert torch.equal(ms.logical_to_physical_map, torch.from_numpy(mine["logical_to_physical_map"]))
    assert torch.equal(ms.logical_replica_count, torch.from_numpy(mine["logical_replica_count"]))


def test_initial_map_is_served_first(tmp_path):
    rng = np.random.default_rng(2)
    load = rng.integers(1, 1000, size=(3, 16))
    fixed = plan(load.astype(float), num_gpus=4, num_redundant=4, planner="contiguous").placement
    path = tmp_path / "initial.json"
    save_placement(fixed, path)
    cls = plugin.policy_class()
    plugin.configure(cls, "greedy", str(path))
    trivial = torch.arange(20).remainder(16).repeat(3, 1)
    w = torch.from_numpy(load)
    first = cls.rebalance_experts(w, 20, 1, 1, 4, trivial)           # e.g. vLLM's profile run
    again = cls.rebalance_experts(w, 20, 1, 1, 4, trivial)           # the first real rearrangement
    assert np.array_equal(first.numpy(), fixed.phy2log_LP) and np.array_equal(again.numpy(), fixed.phy2log_LP)
    planned = cls.rebalance_experts(w, 20, 1, 1, 4, again)           # in place: plan from now on
    assert cls.initial_served and not np.array_equal(planned.numpy(), fixed.phy2log_LP)
    plugin.configure(cls, "static", str(path))
    assert np.array_equal(cls.rebalance_experts(w, 20, 1, 1, 4, again).numpy(), fixed.phy2log_LP)
    with pytest.raises(EplbError, match="the map has 20 slots, vLLM has 24 physical experts"):
        cls.rebalance_experts(w, 24, 1, 1, 4, None)
    with pytest.raises(EplbError, match="the map has 3 MoE layers, the model has 2"):
        cls.rebalance_experts(w[:2], 20, 1, 1, 4, None)
    plugin.configure(cls, "greedy")
