"""Placement and Topology values: invariants, error messages, derived maps, JSON round trip.

Legend: L = MoE layers, E = logical experts, G = GPUs, N = nodes, P = physical slots, X = most replicas.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from eplb.core.placement import Placement
from eplb.core.topology import Topology
from eplb.errors import EplbError
from eplb.formats import load_placement, save_placement

PHY = np.array([[0, 1, 2, 0, 3, 0],
                [3, 2, 1, 0, 1, 2]])  # 2 layers, 4 experts, 6 slots


def test_derived_maps():
    p = Placement(PHY, num_gpus=3, num_logical_experts=4, layer_ids=np.array([3, 4]))
    assert p.num_layers == 2 and p.num_slots == 6 and p.slots_per_gpu == 2
    assert p.replica_count_LE.tolist() == [[3, 1, 1, 1], [1, 2, 2, 1]]
    assert p.gpu_of_slot().tolist() == [0, 0, 1, 1, 2, 2]
    l2p = p.log2phy_LEX
    assert l2p.shape == (2, 4, 3)
    # Padded with -1 ("no replica"), slots listed in slot order.
    assert l2p[0].tolist() == [[0, 3, 5], [1, -1, -1], [2, -1, -1], [4, -1, -1]]
    assert l2p[1].tolist() == [[3, -1, -1], [2, 4, -1], [1, 5, -1], [0, -1, -1]]
    assert p.replica_weights()[0].tolist() == pytest.approx([1 / 3, 1, 1, 1 / 3, 1, 1 / 3])


def test_gpu_loads_even_and_weighted():
    p = Placement(PHY[:1], 3, 4)
    load = np.array([[30.0, 1, 2, 4]])
    assert p.gpu_loads(load).tolist() == [[11.0, 12.0, 14.0]]
    w = np.array([[0.5, 1, 1, 0.25, 1, 0.25]])
    assert p.with_weights(w).gpu_loads(load).tolist() == [[16.0, 9.5, 11.5]]
    with pytest.raises(EplbError, match="loads have shape"):
        p.gpu_loads(np.ones((2, 4)))
    assert p.gpu_loads(load, w).tolist() == [[16.0, 9.5, 11.5]]  # weights given per call
    with pytest.raises(EplbError, match=r"dispatch weights have shape \(6,\)"):
        p.gpu_loads(load, w[0])  # a [P] row used to broadcast over layers


@pytest.mark.parametrize("phy, kwargs, message", [
    (np.array([0, 1]), {}, "must be 2-D"),
    (np.array([[0.0, 1.0]]), {}, "must hold integers"),
    (np.array([[0, 1, 2]]), {"num_gpus": 2}, "do not split evenly over 2 GPUs"),
    (np.array([[0, 1, 2, 3]]), {"num_gpus": 4, "num_nodes": 3}, "divisible by num_nodes"),
    (np.array([[0, 1, 4, 2]]), {}, "expert id 4, outside 0..3"),
    (np.array([[0, 1, -1, 2]]), {}, "expert id -1"),
    (np.array([[0, 1, 1, 2]]), {}, "logical expert 3 has no replica in layer index 0"),
    (np.array([[0, 1, 2, 3]]), {"layer_ids": np.array([1, 2])}, "layer_ids must be 1 integers"),
    (np.array([[0, 1, 2, 3], [0, 1, 2, 3]]), {"layer_ids": np.array([5, 5])}, "distinct"),
    (np.array([[0, 1, 2, 3]]), {"num_gpus": 0}, "num_gpus must be a whole number >= 1, got 0"),
])
def test_invariant_errors_name_the_problem(phy, kwargs, message):
    args = {"num_gpus": 2, "num_logical_experts": 4, **kwargs}
    with pytest.raises(EplbError, match=message):
        Placement(phy, **args)


def test_dispatch_weight_errors():
    phy = np.array([[0, 0, 1, 2]])
    with pytest.raises(EplbError, match=r"shape \(1, 4\)"):
        Placement(phy, 2, 3, dispatch_weights_LP=np.ones((1, 3)))
    with pytest.raises(EplbError, match="finite and non-negative"):
        Placement(phy, 2, 3, dispatch_weights_LP=np.array([[1.5, -0.5, 1, 1]]))
    with pytest.raises(EplbError, match="expert 0 in layer index 0 sum to 0.800000, not 1"):
        Placement(phy, 2, 3, dispatch_weights_LP=np.array([[0.4, 0.4, 1, 1]]))
    ok = Placement(phy, 2, 3, dispatch_weights_LP=np.array([[0.75, 0.25, 1, 1]]))
    assert ok.replica_weights().tolist() == [[0.75, 0.25, 1, 1]]


def test_placement_is_read_only():
    p = Placement(PHY, 3, 4)
    with pytest.raises(ValueError):
        p.phy2log_LP[0, 0] = 1
    with pytest.raises(AttributeError):
        p.num_gpus = 2  # type: ignore[misc]


def test_json_round_trip(tmp_path):
    w = np.tile(np.array([[1 / 3, 1, 1, 1 / 3, 1, 1 / 3]]), (1, 1))
    p = Placement(PHY[:1], 3, 4, num_nodes=3, layer_ids=np.array([7]), dispatch_weights_LP=w,
                  planner="greedy", metrics={"imbalance_max": 1.25})
    path = tmp_path / "plan.json"
    save_placement(p, path)
    d = json.loads(path.read_text())
    assert d["physical_to_logical_map"] == PHY[:1].tolist() and d["layer_ids"] == [7]
    assert d["num_gpus"] == 3 and d["num_nodes"] == 3 and d["num_logical_experts"] == 4
    q = load_placement(path)
    assert q == p and q.planner == "greedy" and q.metrics == {"imbalance_max": 1.25}
    assert Placement.from_dict(Placement(PHY, 3, 4).to_dict()) == Placement(PHY, 3, 4)
    assert Placement(PHY, 3, 4) != Placement(PHY, 3, 4, num_nodes=3)


def test_the_file_format_name_outlives_package_moves():
    """Files say "eplb.placement" as every version before the 2026-12-06 package move wrote; the
    two days that wrote "eplb.core.placement" (the module's new path) are read too."""
    d = Placement(PHY, 3, 4).to_dict()
    assert d["format"] == "eplb.placement"
    for name in ("eplb.placement", "eplb.core.placement"):
        assert Placement.from_dict({**d, "format": name}) == Placement(PHY, 3, 4)
    for bad in ("eplb.core.trace", ["eplb.placement"]):
        with pytest.raises(EplbError, match="not an eplb placement file"):
            Placement.from_dict({**d, "format": bad})


def test_load_errors(tmp_path):
    with pytest.raises(EplbError, match="does not exist"):
        load_placement(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(EplbError, match="not valid JSON"):
        load_placement(bad)
    bad.write_text(json.dumps({"num_gpus": 2}))
    with pytest.raises(EplbError, match="missing key"):
        load_placement(bad)
    bad.write_text(json.dumps({"physical_to_logical_map": [[0, 1], [0]], "num_gpus": 1, "num_logical_experts": 2}))
    with pytest.raises(EplbError, match="rectangular"):
        load_placement(bad)
    bad.write_text(json.dumps({"physical_to_logical_map": [[0, 5]], "num_gpus": 1, "num_logical_experts": 2}))
    with pytest.raises(EplbError, match=str(bad).replace("\\", "\\\\") + ".*outside"):
        load_placement(bad)
    with pytest.raises(EplbError, match="expected a JSON object"):
        Placement.from_dict([1, 2])  # type: ignore[arg-type]
    # A fractional GPU count was truncated (4.7 -> 4) and the file read as valid.
    d = {"physical_to_logical_map": [[0, 1, 2, 3]], "num_gpus": 4.7, "num_logical_experts": 4}
    with pytest.raises(EplbError, match="num_gpus must be a whole number, got 4.7"):
        Placement.from_dict(d)
    assert Placement.from_dict({**d, "num_gpus": 4.0}).num_gpus == 4


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_gpus=2.5), r"num_gpus must be a whole number >= 1, got 2.5"),  # was a 2-GPU placement
    (dict(num_gpus="2"), r"num_gpus must be a whole number >= 1, got '2'"),
    (dict(num_logical_experts=4.7), r"num_logical_experts must be a whole number >= 1, got 4.7"),
    (dict(num_nodes=1.5), r"num_nodes must be a whole number >= 1, got 1.5"),
    (dict(num_gpus=True), r"num_gpus must be a whole number >= 1, got True"),
])
def test_constructor_refuses_fractional_counts(kwargs, message):
    args = dict(phy2log_LP=np.array([[0, 1, 2, 3, 0, 1]]), num_gpus=2, num_logical_experts=4)
    with pytest.raises(EplbError, match=message):
        Placement(**{**args, **kwargs})
    assert Placement(**{**args, "num_gpus": 2.0, "num_nodes": np.int64(2)}).num_gpus == 2


def test_constructor_refuses_zero_slots():
    with pytest.raises(EplbError, match="at least one slot"):  # was numpy's "zero-size array" ValueError
        Placement(np.zeros((1, 0), dtype=np.int64), 2, 4)


# Topology ---------------------------------------------------------------------------------------

def test_topology_sizing():
    t = Topology.for_experts(256, num_gpus=32)
    assert (t.slots_per_gpu, t.num_slots, t.num_nodes) == (9, 288, 1)  # one redundant slot per GPU
    assert Topology.for_experts(256, num_gpus=32, num_redundant=0).slots_per_gpu == 8
    assert Topology.for_experts(256, num_gpus=32, num_nodes=4, slots_per_gpu=10).gpus_per_node == 8
    assert Topology.for_experts(10, num_gpus=4).slots_per_gpu == 4  # ceil(10 / 4) + 1
    # One GPU already holds every expert: the default adds no redundant slot (was E + 1).
    assert Topology.for_experts(16, num_gpus=1).slots_per_gpu == 16
    assert Topology.for_experts(1, num_gpus=1).slots_per_gpu == 1
    t = Topology(num_gpus=8, slots_per_gpu=2, num_nodes=2)
    assert t.gpu_of_slot().tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]
    assert t.node_of_gpu().tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize("kwargs, message", [
    ({"num_gpus": 0}, "num_gpus must be a positive integer"),
    ({"num_gpus": 32, "num_redundant": 32, "slots_per_gpu": 9}, "either num_redundant"),
    ({"num_gpus": 32, "slots_per_gpu": 7}, "use at least 8 slots per GPU"),
    ({"num_gpus": 32, "num_redundant": -1}, "num_redundant must be >= 0"),
    ({"num_gpus": 32, "num_redundant": 30}, "use num_redundant = 0 or 32"),
    ({"num_gpus": 32, "num_nodes": 3}, r"num_gpus \(32\) must be divisible by num_nodes \(3\)"),
])
def test_topology_for_experts_errors(kwargs, message):
    with pytest.raises(EplbError, match=message):
        Topology.for_experts(256, **kwargs)


def test_topology_value_errors():
    with pytest.raises(EplbError, match="slots_per_gpu must be a positive integer"):
        Topology(num_gpus=4, slots_per_gpu=0)
    with pytest.raises(EplbError, match="num_nodes must be a positive integer"):
        Topology(num_gpus=4, slots_per_gpu=1, num_nodes=True)


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "trtllm"])
def test_load_of_an_engine_file_names_the_reader(tmp_path, fmt):
    """`eplb inspect out.yaml` said only "not valid JSON"; now it names the format and the way to read it."""
    pytest.importorskip("torch")
    from eplb.formats.export import write_placement

    path = tmp_path / f"plan.{fmt}"
    write_placement(Placement(np.array([[0, 1, 2, 3, 0, 1]]), 2, 4), path, fmt)
    with pytest.raises(EplbError, match=rf"{fmt}.*read_placement\(path, '{fmt}'"):
        load_placement(path)


def test_from_dict_layer_ids_must_be_whole():
    d = {"physical_to_logical_map": [[0, 1], [1, 0]], "num_gpus": 2, "num_logical_experts": 2}
    with pytest.raises(EplbError, match="layer_ids must be"):  # [3.5, 4] was read as [3, 4]
        Placement.from_dict({**d, "layer_ids": [3.5, 4]})
    with pytest.raises(EplbError, match="layer_ids must be"):
        Placement.from_dict({**d, "layer_ids": ["a", 4]})
    assert Placement.from_dict({**d, "layer_ids": [3.0, 4]}).layer_ids.tolist() == [3, 4]


def test_with_metrics_shares_the_checked_map():
    p = Placement(PHY, 3, 4, layer_ids=np.array([3, 4]), planner="greedy", metrics={"a": 1.0})
    q = p.with_metrics({"imbalance_max": 1.25})
    assert q == p and q.metrics == {"imbalance_max": 1.25} and p.metrics == {"a": 1.0}
    assert q.phy2log_LP is p.phy2log_LP and not q.phy2log_LP.flags.writeable
    assert q.replica_count_LE.tolist() == p.replica_count_LE.tolist() and q.planner == "greedy"
    with pytest.raises(EplbError, match="layer_ids must be distinct"):
        Placement(PHY, 3, 4, layer_ids=np.array([3, 3]))
