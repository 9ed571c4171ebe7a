"""Placement exports (SGLang, vLLM, TensorRT-LLM, DeepSeek) and trace importers, round trips."""

import json

import numpy as np
import pytest

from eplb.core.placement import Placement
from eplb.errors import EplbError
from eplb.formats import load_trace
from eplb.formats.deepseek import from_deepseek, to_deepseek
from eplb.formats.export import FORMATS, read_placement, write_placement
from eplb.formats.sglang import sglang_map
from eplb.formats.trtllm import read_safetensors, write_safetensors


def _torch():
    """torch, for the tests of the .pt formats only (the others run without it)."""
    return pytest.importorskip("torch")


def random_placement(rng, layers=4, experts=12, num_gpus=4, slots_per_gpu=4, num_nodes=2, first_layer=3):
    """A valid random placement: every expert once, then random extra replicas, shuffled."""
    P = num_gpus * slots_per_gpu
    rows = []
    for _ in range(layers):
        row = np.concatenate([np.arange(experts), rng.integers(0, experts, P - experts)])
        rows.append(rng.permutation(row))
    return Placement(np.array(rows), num_gpus, experts, num_nodes, np.arange(first_layer, first_layer + layers))


@pytest.fixture
def placement(rng):
    return random_placement(rng)


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_every_format(tmp_path, placement, fmt):
    if fmt == "vllm":
        _torch()
    path = tmp_path / f"plan.{fmt}"
    write_placement(placement, path, fmt, num_hidden_layers=9)
    back = read_placement(path, fmt, num_gpus=4, num_nodes=2, layer_ids=placement.layer_ids)
    assert back == placement
    assert back.layer_ids.tolist() == [3, 4, 5, 6]


@pytest.mark.parametrize("fmt", FORMATS)
def test_unwritable_path_is_a_named_error_in_every_format(tmp_path, placement, fmt):
    """One error for every writer (eplb.core.outputs.atomic_output); torch.save alone raised RuntimeError."""
    if fmt == "vllm":
        _torch()
    for bad, why in ((tmp_path / "no" / "plan.out", "does not exist"), (tmp_path, "it is a folder")):
        with pytest.raises(EplbError, match=why) as info:
            write_placement(placement, bad, fmt)
        assert str(bad) in str(info.value)


def test_sglang_file_is_what_sglang_loads(tmp_path, placement):
    path = write_placement(placement, tmp_path / "loc.json", "sglang", num_hidden_layers=9)
    d = json.loads(path.read_text())
    # SGLang passes every key to init_by_mapping(**d): the map must be the only key.
    assert list(d) == ["physical_to_logical_map"]
    phy2log_HP = np.array(d["physical_to_logical_map"])
    assert phy2log_HP.shape == (9, 16)
    # dense layers 0..2 and 7..8 hold SGLang's trivial map p % E
    for h in (0, 1, 2, 7, 8):
        assert phy2log_HP[h].tolist() == [p % 12 for p in range(16)]
    np.testing.assert_array_equal(phy2log_HP[3:7], placement.phy2log_LP)


def test_sglang_default_rows_and_too_few_layers(placement):
    assert sglang_map(placement).shape == (7, 16)  # largest layer id 6 -> 7 rows
    with pytest.raises(EplbError, match="num_hidden_layers"):
        sglang_map(placement, num_hidden_layers=5)


def test_vllm_file_holds_vllm_shapes(tmp_path, placement):
    torch = _torch()
    path = write_placement(placement, tmp_path / "plan.pt", "vllm")
    state = torch.load(path, weights_only=True)
    L, P, E = 4, 16, 12
    assert state["physical_to_logical_map"].shape == (L, P)
    assert state["logical_to_physical_map"].shape == (L, E, P - E + 1)  # num_redundant + 1
    assert state["logical_replica_count"].shape == (L, E)
    l2p = state["logical_to_physical_map"].numpy()
    assert ((l2p >= 0).sum(axis=2) == state["logical_replica_count"].numpy()).all()
    # each listed slot holds its expert
    phy = state["physical_to_logical_map"].numpy()
    l, e, x = np.nonzero(l2p >= 0)
    assert (phy[l, l2p[l, e, x]] == e).all()


def test_trtllm_yaml_keys_and_layer_ids(tmp_path, placement):
    yaml = pytest.importorskip("yaml")
    path = write_placement(placement, tmp_path / "lb.yaml", "trtllm")
    d = yaml.safe_load(path.read_text())
    assert d["num_slots"] == 16 and d["layer_updates_per_iter"] == 0
    assert sorted(d["initial_global_assignments"]) == [3, 4, 5, 6]
    assert d["initial_global_assignments"][5] == placement.phy2log_LP[2].tolist()


def test_deepseek_tuple_round_trip(placement):
    phy, l2p, cnt = to_deepseek(placement)
    assert l2p.shape == (4, 12, int(cnt.max()))
    back = from_deepseek(phy, l2p, cnt, num_gpus=4, num_nodes=2, layer_ids=placement.layer_ids)
    assert back == placement


def test_deepseek_tuple_as_torch_tensors(placement):
    torch = _torch()
    # DeepSeek's own padding (P - E + 1 columns), and torch tensors, are accepted too
    t = to_deepseek(placement, pad_to=16 - 12 + 1, as_torch=True)
    assert isinstance(t[0], torch.Tensor) and t[1].shape == (4, 12, 5)
    assert from_deepseek(*t, num_gpus=4, num_nodes=2, layer_ids=placement.layer_ids) == placement


def test_deepseek_inconsistent_tuple_rejected(placement):
    phy, l2p, cnt = to_deepseek(placement)
    bad_cnt = cnt.copy()
    bad_cnt[0, 0] += 1
    with pytest.raises(EplbError, match="logcnt"):
        from_deepseek(phy, l2p, bad_cnt, num_gpus=4)
    bad_l2p = l2p.copy()
    e = int(np.argmax(cnt[1] >= 2))
    bad_l2p[1, e, 0], bad_l2p[1, e, 1] = bad_l2p[1, e, 1], -1
    with pytest.raises(EplbError, match="log2phy disagrees"):
        from_deepseek(phy, bad_l2p, None, num_gpus=4)
    with pytest.raises(EplbError, match="pad_to"):
        to_deepseek(placement, pad_to=1)


def test_unknown_format_and_missing_gpus(tmp_path, placement):
    with pytest.raises(EplbError, match="unknown placement format"):
        write_placement(placement, tmp_path / "x", "onnx")
    write_placement(placement, tmp_path / "x.json", "sglang")
    with pytest.raises(EplbError, match="num_gpus"):
        read_placement(tmp_path / "x.json", "sglang")


def test_bad_engine_files_name_the_problem(tmp_path):
    (tmp_path / "a.json").write_text('{"logical_count": [[1, 2]]}')
    with pytest.raises(EplbError, match="physical_to_logical_map"):
        read_placement(tmp_path / "a.json", "sglang", num_gpus=1)
    (tmp_path / "b.yaml").write_text("num_slots: 4\ninitial_global_assignments:\n  3: [0, 1, 2]\n")
    with pytest.raises(EplbError, match="num_slots is 4"):
        read_placement(tmp_path / "b.yaml", "trtllm", num_gpus=1)
    (tmp_path / "c.yaml").write_text("num_slots: 4\nlayer_updates_per_iter: 2\n")
    with pytest.raises(EplbError, match="initial_global_assignments"):
        read_placement(tmp_path / "c.yaml", "trtllm", num_gpus=1)
    (tmp_path / "e.yaml").write_text("num_slots: 4\ninitial_global_assignments:\n  3: [0, 1, 1, 1]\n")
    with pytest.raises(EplbError, match="no replica"):  # expert 2 of 3 missing
        read_placement(tmp_path / "e.yaml", "trtllm", num_gpus=2, num_logical_experts=3)


def test_vllm_file_without_the_maps_is_named(tmp_path):
    torch = _torch()
    torch.save({"physical_to_logical_map": torch.zeros(2, 4, dtype=torch.int64)}, tmp_path / "d.pt")
    with pytest.raises(EplbError, match="logical_to_physical_map"):
        read_placement(tmp_path / "d.pt", "vllm")


# Trace importers ------------------------------------------------------------------------------

def sglang_counts(rng, steps=None, hidden=6, dense=2, experts=16):
    shape = (hidden, experts) if steps is None else (steps, hidden, experts)
    c = rng.integers(0, 100, shape).astype(np.int64)
    c[..., :dense, :] = 0
    return c


@pytest.mark.parametrize("steps", [None, 3])
def test_sglang_pt_import(tmp_path, rng, steps):
    torch = _torch()
    c = sglang_counts(rng, steps)
    # the dict SGLang's recorder writes in stat mode
    torch.save({"rank": 0, "logical_count": torch.from_numpy(c), "average_utilization_rate_over_window": None},
               tmp_path / "expert_distribution_recorder_1.pt")
    t = load_trace(tmp_path / "expert_distribution_recorder_1.pt")
    c3 = c if steps else c[None]
    assert t.counts_TLE.shape == (c3.shape[0], 4, 16)
    np.testing.assert_array_equal(t.counts_TLE, c3[:, 2:])
    assert t.layer_ids.tolist() == [2, 3, 4, 5]
    assert t.meta["num_hidden_layers"] == 6 and t.meta["synthetic"] is False


def test_sglang_json_import(tmp_path, rng):
    c = sglang_counts(rng)
    (tmp_path / "s.json").write_text(json.dumps({"logical_count": c.tolist()}))
    t = load_trace(tmp_path / "s.json")
    np.testing.assert_array_equal(t.total(), c[2:])


class NotATensor:
    """An arbitrary class: a weights-only load must refuse to unpickle it."""


def test_sglang_pt_rejects_pickled_objects_and_wrong_content(tmp_path):
    torch = _torch()
    torch.save({"logical_count": NotATensor()}, tmp_path / "evil.pt")
    with pytest.raises(EplbError, match="weights-only"):
        load_trace(tmp_path / "evil.pt")
    torch.save({"counts": torch.zeros(2, 2)}, tmp_path / "other.pt")
    with pytest.raises(EplbError, match="logical_count"):
        load_trace(tmp_path / "other.pt")
    torch.save({"logical_count": torch.full((3, 4), -1.0)}, tmp_path / "neg.pt")
    with pytest.raises(EplbError, match="negative"):
        load_trace(tmp_path / "neg.pt")


def test_sglang_counts_of_other_dtypes_and_bad_values(tmp_path, rng):
    torch = _torch()
    c = sglang_counts(rng)
    # bfloat16 has no numpy dtype; it must still load (its small integers are exact).
    torch.save({"logical_count": torch.from_numpy(c).to(torch.bfloat16)}, tmp_path / "bf16.pt")
    np.testing.assert_array_equal(load_trace(tmp_path / "bf16.pt").total(), c[2:])
    torch.save({"logical_count": torch.ones(3, 4, dtype=torch.complex64)}, tmp_path / "c.pt")
    with pytest.raises(EplbError, match="complex64"):
        load_trace(tmp_path / "c.pt")


def test_sglang_json_counts_must_be_whole_and_fit_int64(tmp_path):
    # Fractions are not rounded away and huge values do not wrap to negative int64.
    (tmp_path / "frac.json").write_text(json.dumps({"logical_count": [[1.5, 2.0]]}))
    with pytest.raises(EplbError, match=r"whole token counts, got 1.5 at .* \[0, 0, 0\]"):
        load_trace(tmp_path / "frac.json")
    (tmp_path / "huge.json").write_text(json.dumps({"logical_count": [[1e300, 2.0]]}))
    with pytest.raises(EplbError, match="1e\\+300, too large"):
        load_trace(tmp_path / "huge.json")


def write_trtllm_dump(path, counts_RILE, layer_ids, iter_start=100, top_k=2):
    """A directory as TensorRT-LLM's ExpertStatistic writes it: meta + one file per rank."""
    path.mkdir()
    R, I, L, E = counts_RILE.shape
    (path / "meta_info.json").write_text(json.dumps({"num_experts": E, "num_experts_per_token": top_k}))
    for r in range(R):
        write_safetensors({f"{iter_start + i}_{layer_ids[l]}": counts_RILE[r, i, l]
                           for i in range(I) for l in range(L)}, path / f"rank{r}.safetensors")
    return path


def test_trtllm_expert_statistic_import(tmp_path, rng):
    counts = rng.integers(0, 50, (3, 4, 2, 8)).astype(np.int64)  # ranks, iterations, layers, experts
    d = write_trtllm_dump(tmp_path / "expert_statistic", counts, [3, 7])
    write_safetensors({"100_3": np.zeros((5, 2), dtype=np.int32)}, d / "rank0_raw.safetensors")  # skipped
    t = load_trace(d)
    assert t.counts_TLE.shape == (4, 2, 8)
    np.testing.assert_array_equal(t.counts_TLE, counts.sum(axis=0))
    assert t.layer_ids.tolist() == [3, 7]
    assert t.meta["top_k"] == 2 and t.meta["iterations"] == [100, 101, 102, 103]
    with pytest.raises(EplbError, match="pass the TensorRT-LLM expert statistic directory"):
        load_trace(d / "rank0.safetensors")


def test_trtllm_expert_statistic_errors(tmp_path, rng):
    counts = rng.integers(0, 50, (1, 2, 2, 8)).astype(np.int64)
    d = write_trtllm_dump(tmp_path / "a", counts, [3, 4])
    write_safetensors({"100_3": counts[0, 0, 0], "101_3": counts[0, 1, 0], "100_4": counts[0, 0, 1]},
                      d / "rank0.safetensors")
    with pytest.raises(EplbError, match="missing, e.g. iteration 101 layer 4"):
        load_trace(d)
    write_safetensors({"100_3": np.zeros(5, dtype=np.int64)}, d / "rank0.safetensors")
    with pytest.raises(EplbError, match=r"expected \(8,\)"):
        load_trace(d)
    (d / "rank0.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(EplbError, match="safetensors"):
        load_trace(d)
    (tmp_path / "empty").mkdir()
    with pytest.raises(EplbError, match="not a TensorRT-LLM expert statistic"):
        load_trace(tmp_path / "empty")


@pytest.mark.parametrize("num_experts, message", [
    ("eight", r"num_experts must be a whole number >= 1, got 'eight'"),  # was a ValueError traceback
    (8.5, r"num_experts must be a whole number >= 1, got 8.5"),  # was read as 8
    (0, r"num_experts must be a whole number >= 1, got 0"),
])
def test_trtllm_meta_info_num_experts_is_checked(tmp_path, rng, num_experts, message):
    d = write_trtllm_dump(tmp_path / "a", rng.integers(0, 50, (1, 1, 1, 8)), [3])
    (d / "meta_info.json").write_text(json.dumps({"num_experts": num_experts}))
    with pytest.raises(EplbError, match=message):
        load_trace(d)


def test_trtllm_fractional_counts_are_refused(tmp_path):
    """float tensors were cast to int64: 0.5 tokens per expert became 0 without a word."""
    d = write_trtllm_dump(tmp_path / "a", np.full((1, 1, 1, 8), 0.5, dtype=np.float32), [3])
    with pytest.raises(EplbError, match=r"tensor '100_3' holds 0.5.*whole token counts"):
        load_trace(d)
    write_safetensors({"100_3": np.full(8, 3.0, dtype=np.float32)}, d / "rank0.safetensors")
    assert load_trace(d).counts_TLE.sum() == 24  # whole numbers in a float tensor are fine


@pytest.mark.parametrize("yaml_text, message", [
    ("initial_global_assignments:\n  3: [0, 1, 2.5, 3]\n", "whole numbers"),  # 2.5 was read as expert 2
    ("initial_global_assignments:\n  3.7: [0, 1, 2, 3]\n", "whole numbers"),  # layer 3.7 was layer 3
    ("initial_global_assignments:\n  3: [0, 1, true, 3]\n", "whole numbers"),
    ("num_slots: abc\ninitial_global_assignments:\n  3: [0, 1, 2, 3]\n", "num_slots"),  # was a ValueError
])
def test_trtllm_yaml_numbers_are_whole(tmp_path, yaml_text, message):
    pytest.importorskip("yaml")
    path = tmp_path / "lb.yaml"
    path.write_text(yaml_text)
    with pytest.raises(EplbError, match=message):
        read_placement(path, "trtllm", num_gpus=2)


def test_sglang_location_file_ids_must_be_whole(tmp_path):
    path = tmp_path / "loc.json"
    path.write_text(json.dumps({"physical_to_logical_map": [[0, 1, 2.7, 3]]}))  # 2.7 was read as expert 2
    with pytest.raises(EplbError, match="integer"):
        read_placement(path, "sglang", num_gpus=2)
    path.write_text(json.dumps({"physical_to_logical_map": [[0, 1, 2.0, 3]]}))
    assert read_placement(path, "sglang", num_gpus=2).phy2log_LP.tolist() == [[0, 1, 2, 3]]


def test_safetensors_reader_matches_the_library_when_installed(tmp_path, rng):
    a = rng.integers(0, 1000, 16).astype(np.int64)
    write_safetensors({"5_3": a}, tmp_path / "x.safetensors")
    np.testing.assert_array_equal(read_safetensors(tmp_path / "x.safetensors")["5_3"], a)
    st = pytest.importorskip("safetensors.numpy")
    st.save_file({"5_3": a, "6_3": a[::-1].copy()}, str(tmp_path / "lib.safetensors"))
    got = read_safetensors(tmp_path / "lib.safetensors")
    np.testing.assert_array_equal(got["6_3"], a[::-1])
    np.testing.assert_array_equal(st.load_file(str(tmp_path / "x.safetensors"))["5_3"], a)
