"""Trace validation: every bad .npz / .npy is refused through load_trace with a message naming the problem."""

import io
import json
import zipfile

import numpy as np
import pytest

from eplb.core.trace import REQUIRED_META, Trace, default_meta
from eplb.errors import EplbError
from eplb.formats import load_history, load_trace, save_trace


def meta(**kw):
    m = default_meta(6, 8, model="toy", top_k=2, num_expert_groups=1, tokens_per_window=10,
                     source="test", synthetic=True)
    m.update(kw)
    return m


def write_npz(path, counts=None, layer_ids=None, meta_obj=None, **extra):
    arrays = {
        "counts": np.ones((2, 3, 8), dtype=np.int64) if counts is None else counts,
        "layer_ids": np.array([1, 3, 5]) if layer_ids is None else layer_ids,
        "meta": np.array(json.dumps(meta() if meta_obj is None else meta_obj)),
    }
    arrays.update(extra)
    arrays = {k: v for k, v in arrays.items() if v is not None or k in extra}
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    return path


def test_good_file_round_trips(tmp_path, rng):
    c = rng.integers(0, 9, (2, 3, 8))
    topk = rng.integers(0, 8, (5, 3, 2)).astype(np.int16)
    t = Trace(c, np.array([1, 3, 5]), meta(), topk, np.array([0, 0, 1, 1, 1], dtype=np.int32))
    save_trace(t, tmp_path / "t.npz")
    back = load_trace(tmp_path / "t.npz")
    np.testing.assert_array_equal(back.counts_TLE, c)
    assert back.counts_TLE.dtype == np.int64 and back.layer_ids.tolist() == [1, 3, 5]
    np.testing.assert_array_equal(back.topk_ids_NLK, topk)
    assert back.meta == t.meta


@pytest.mark.parametrize("counts, message", [
    (np.ones((3, 8), dtype=np.int64), "3-D"),
    (np.ones((2, 3, 8), dtype=np.float64) * np.nan, "NaN"),
    (np.full((2, 3, 8), 0.5), "whole token counts"),
    (-np.ones((2, 3, 8), dtype=np.int64), ">= 0"),
    (np.ones((2, 3, 8), dtype=bool), "numbers, not true/false"),
    (np.ones((0, 3, 8), dtype=np.int64), "at least one window"),
])
def test_bad_counts(tmp_path, counts, message):
    with pytest.raises(EplbError, match=message):
        load_trace(write_npz(tmp_path / "bad.npz", counts=counts))


@pytest.mark.parametrize("layer_ids, message", [
    (np.array([1, 3]), "3 integers"),
    (np.array([3, 1, 5]), "strictly increasing"),
    (np.array([-1, 3, 5]), "non-negative"),
    (np.array([1.0, 3.0, 5.0]), "integers"),
    (np.array([1, 3, 6]), "num_hidden_layers"),  # meta says 6 hidden layers: ids must be < 6
])
def test_bad_layer_ids(tmp_path, layer_ids, message):
    with pytest.raises(EplbError, match=message):
        load_trace(write_npz(tmp_path / "bad.npz", layer_ids=layer_ids))


@pytest.mark.parametrize("key", REQUIRED_META)
def test_missing_meta_key(tmp_path, key):
    m = meta()
    del m[key]
    with pytest.raises(EplbError, match=f"missing key.*{key}"):
        load_trace(write_npz(tmp_path / "bad.npz", meta_obj=m))


def test_bad_meta_values(tmp_path):
    with pytest.raises(EplbError, match="num_experts"):
        load_trace(write_npz(tmp_path / "a.npz", meta_obj=meta(num_experts=9)))
    with pytest.raises(EplbError, match="synthetic must be true or false"):
        load_trace(write_npz(tmp_path / "b.npz", meta_obj=meta(synthetic="yes")))
    np.savez(tmp_path / "c.npz", counts=np.ones((1, 3, 8), dtype=np.int64), layer_ids=np.arange(3),
             meta=np.array("{not json"))
    with pytest.raises(EplbError, match="meta: not valid JSON"):
        load_trace(tmp_path / "c.npz")
    np.savez(tmp_path / "d.npz", counts=np.ones((1, 3, 8), dtype=np.int64), layer_ids=np.arange(3),
             meta=np.array("[1, 2]"))
    with pytest.raises(EplbError, match="JSON object"):
        load_trace(tmp_path / "d.npz")


@pytest.mark.parametrize("key, value, message", [
    ("num_hidden_layers", "abc", "num_hidden_layers must be a whole number >= 1 or null, got 'abc'"),  # was a traceback
    ("num_experts", 8.5, "num_experts must be a whole number >= 1 or null, got 8.5"),  # was read as 8
    ("num_expert_groups", 2.5, "num_expert_groups must be a whole number"),  # was planned with 2 groups
    ("num_expert_groups", [4], "num_expert_groups must be a whole number"),
    ("num_expert_groups", 0, "num_expert_groups must be a whole number >= 1"),
    ("num_expert_groups", 3, r"num_expert_groups \(3\) must divide the 8 experts"),
    ("top_k", True, "top_k must be a whole number"),
    ("tokens_per_window", "2048", "tokens_per_window must be a whole number"),
])
def test_meta_numbers_are_checked(tmp_path, key, value, message):
    with pytest.raises(EplbError, match=message):
        load_trace(write_npz(tmp_path / "bad.npz", meta_obj=meta(**{key: value})))
    good = load_trace(write_npz(tmp_path / "good.npz", meta_obj=meta(num_expert_groups=4.0, top_k=None)))
    assert good.meta["num_expert_groups"] == 4 and isinstance(good.meta["num_expert_groups"], int)


@pytest.mark.parametrize("counts", [
    np.full((1, 3, 8), 2**63 + 5, dtype=np.uint64),  # wrapped to negative int64 counts
    np.full((1, 3, 8), 1e30),
])
def test_counts_too_large_for_int64_are_refused(tmp_path, counts):
    with pytest.raises(EplbError, match="too large for a token count"):
        load_trace(write_npz(tmp_path / "big.npz", counts=counts))


def test_missing_arrays(tmp_path):
    np.savez(tmp_path / "m.npz", counts=np.ones((1, 3, 8), dtype=np.int64))
    with pytest.raises(EplbError, match="missing array.*layer_ids.*meta"):
        load_trace(tmp_path / "m.npz")


def test_pickled_object_arrays_rejected(tmp_path):
    obj = np.empty((1, 3, 8), dtype=object)
    obj[...] = 1
    np.savez(tmp_path / "p.npz", counts=obj, layer_ids=np.arange(3), meta=np.array(json.dumps(meta())))
    with pytest.raises(EplbError, match="without pickle"):
        load_trace(tmp_path / "p.npz")
    np.save(tmp_path / "p.npy", obj, allow_pickle=True)
    with pytest.raises(EplbError, match="without pickle"):
        load_trace(tmp_path / "p.npy")


def test_bad_per_token_data(tmp_path):
    c = np.ones((2, 3, 8), dtype=np.int64)
    w = np.array([0, 1], dtype=np.int32)
    with pytest.raises(EplbError, match="given together"):
        load_trace(write_npz(tmp_path / "a.npz", topk_ids=np.zeros((2, 3, 2), dtype=np.int16)))
    with pytest.raises(EplbError, match="expert ids outside"):
        load_trace(write_npz(tmp_path / "b.npz", counts=c, topk_ids=np.full((2, 3, 2), 8, dtype=np.int16),
                             token_window=w))
    with pytest.raises(EplbError, match="non-decreasing"):
        load_trace(write_npz(tmp_path / "c.npz", counts=c, topk_ids=np.zeros((2, 3, 2), dtype=np.int16),
                             token_window=np.array([1, 0], dtype=np.int32)))
    with pytest.raises(EplbError, match=r"topk_ids must be integers \[tokens, 3"):
        load_trace(write_npz(tmp_path / "d.npz", counts=c, topk_ids=np.zeros((2, 4, 2), dtype=np.int16),
                             token_window=w))


def test_npy_plain_arrays(tmp_path, rng):
    a = rng.integers(0, 5, (4, 8))
    np.save(tmp_path / "a.npy", a)
    t = load_trace(tmp_path / "a.npy")
    assert t.counts_TLE.shape == (1, 4, 8) and t.layer_ids.tolist() == [0, 1, 2, 3]
    np.save(tmp_path / "b.npy", np.ones(5))
    with pytest.raises(EplbError, match=r"\[layers, experts\]"):
        load_trace(tmp_path / "b.npy")


def test_unreadable_files(tmp_path):
    with pytest.raises(EplbError, match="does not exist"):
        load_trace(tmp_path / "nope.npz")
    (tmp_path / "x.bin").write_bytes(b"\x00\x01garbage")
    with pytest.raises(EplbError, match="unknown trace format"):
        load_trace(tmp_path / "x.bin")
    (tmp_path / "bad.json").write_text("{oops")
    with pytest.raises(EplbError, match="not valid JSON"):
        load_trace(tmp_path / "bad.json")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("hello.txt", "hi")
    (tmp_path / "z.npz").write_bytes(buf.getvalue())
    with pytest.raises(EplbError, match="neither an eplb .npz"):
        load_trace(tmp_path / "z.npz")
    (tmp_path / "cut.npz").write_bytes(b"PK\x03\x04" + b"\x00" * 20)
    with pytest.raises(EplbError, match="corrupt"):
        load_trace(tmp_path / "cut.npz")


def test_history_must_match(tmp_path, rng):
    a = Trace(rng.integers(0, 5, (1, 3, 8)), np.array([1, 3, 5]), meta())
    b = Trace(rng.integers(0, 5, (2, 3, 8)), np.array([1, 3, 5]), meta())
    c = Trace(rng.integers(0, 5, (1, 3, 8)), np.array([1, 2, 5]), meta())
    real = Trace(rng.integers(0, 5, (2, 3, 8)), np.array([1, 3, 5]), meta(synthetic=False))
    for name, t in (("a", a), ("b", b), ("c", c), ("real", real)):
        save_trace(t, tmp_path / f"{name}.npz")
    h = load_history([tmp_path / "a.npz", tmp_path / "b.npz"])
    assert h.num_windows == 3 and h.meta["synthetic"] is True
    # Same shape, other layers: the message names both files' layer ids, not a shape that agrees.
    with pytest.raises(EplbError, match=r"c\.npz: MoE layer ids \[1, 2, 5\] \(3 layers\) but .*a\.npz has \[1, 3, 5\]"):
        load_history([tmp_path / "a.npz", tmp_path / "c.npz"])
    save_trace(Trace(rng.integers(0, 5, (1, 3, 16)), np.array([1, 3, 5]), meta(num_experts=16)),
               tmp_path / "wide.npz")
    with pytest.raises(EplbError, match=r"wide\.npz: 16 logical experts but .*a\.npz has 8"):
        load_history([tmp_path / "a.npz", tmp_path / "wide.npz"])
    # Any iterable of paths, not only a list; none at all is named before any file is read.
    assert load_history(iter([tmp_path / "a.npz", tmp_path / "b.npz"])).num_windows == 3
    with pytest.raises(EplbError, match="no trace files given"):
        load_history([])
    # A synthetic and a recorded trace are not one history: `synthetic` could describe neither.
    with pytest.raises(EplbError, match=r"synthetic trace\(s\) .*a.npz and recorded trace\(s\) .*real.npz"):
        load_history([tmp_path / "a.npz", tmp_path / "real.npz"])


def test_history_of_traces_that_disagree_on_the_router_is_refused(tmp_path):
    """Groups and top-k are facts of the model: files that disagree are not one model's history;
    a file that does not say (None) takes the others' value."""
    counts = np.ones((1, 2, 8), dtype=np.int64)
    paths = []
    for name, groups in (("a", 4), ("b", 2), ("c", None)):
        path = tmp_path / f"{name}.npz"
        save_trace(Trace(counts, np.array([1, 2]), default_meta(3, 8, num_expert_groups=groups)), path)
        paths.append(path)
    with pytest.raises(EplbError, match="num_expert_groups = 2"):
        load_history([paths[0], paths[1]])
    assert load_history([paths[2], paths[0]]).meta["num_expert_groups"] == 4


def test_small_api_inputs_are_named_errors(tmp_path):
    from eplb import plan
    from eplb.dispatch.rules import Resplitter
    from eplb.formats.deepseek import to_deepseek
    from eplb.formats.sglang import read_sglang

    pl = plan(np.random.default_rng(0).random((2, 8)), num_gpus=2).placement
    with pytest.raises(EplbError, match="needs a Placement"):
        Resplitter("x")
    with pytest.raises(EplbError, match="pad_to"):
        to_deepseek(pl, pad_to=2.5)
    path = tmp_path / "loc.json"
    path.write_text(json.dumps({"physical_to_logical_map": [list(range(8))] * 3}))
    with pytest.raises(EplbError, match="layer_ids"):
        read_sglang(path, num_gpus=2, layer_ids=["a"])
    assert read_sglang(path, num_gpus=2, layer_ids=[1, 2]).num_layers == 2
