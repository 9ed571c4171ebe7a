"""Fuzz every reader: damaged and hostile files give a value or one EplbError line naming the file.

Readers: load_trace (eplb .npz, .npy, SGLang JSON and .pt, TensorRT-LLM dump directories),
load_history, load_placement, read_placement for each engine export, read_replay (what
`eplb replay -o` writes) and load_hardware (JSON / YAML profiles). Inputs: valid seed
files with their bytes mutated (truncated, overwritten, spliced), archives re-zipped around a
mutated member (so the damage reaches numpy's and torch's own parsers, past the zip checks),
and files built from random parts: JSON trees with values swapped for extremes (NaN, 2**63,
true, text, nesting), .npy/.npz arrays of random dtypes and shapes, torch files of random
tensors (stride-0 views included), safetensors headers with random offsets, and YAML.
Every written export is also read back (the round trip must be exact).
"""

from __future__ import annotations

import copy
import io
import json
import math
import shutil
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from eplb.core.hardware import PROFILES, load_hardware
from eplb.core.placement import Placement
from eplb.core.topology import Topology
from eplb.core.trace import Trace, default_meta
from eplb.evaluate.replay import replay
from eplb.formats import load_history, load_placement, load_trace, read_replay, save_placement, save_trace, write_replay
from eplb.formats.export import FORMATS, read_placement, write_placement
from eplb.formats.trtllm import write_safetensors
from tests.fuzz.common import examples, outcome

try:
    import torch
except ImportError:  # the .pt readers and writers need torch; their cases are skipped without it
    torch = None

G = 4
READERS = {
    "load_trace": load_trace,
    "load_history": lambda p: load_history([p, p]),
    "load_placement": load_placement,
    "read sglang": lambda p: read_placement(p, "sglang", num_gpus=G),
    "read trtllm": lambda p: read_placement(p, "trtllm", num_gpus=G),
    "read eplb": lambda p: read_placement(p, "eplb"),
    "read_replay": read_replay,
    "load_hardware": load_hardware,
}
if torch is not None:
    READERS["read vllm"] = lambda p: read_placement(p, "vllm")


def _seed_placement() -> Placement:
    phy = np.array([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3], [7, 6, 5, 4, 3, 2, 1, 0, 7, 6, 5, 4],
                    [0, 2, 4, 6, 1, 3, 5, 7, 0, 1, 0, 1]])
    w = np.where(np.isin(np.arange(12), [0, 8]), 0.5, 1.0)[None].repeat(3, 0)
    w[0, [1, 9]] = 0.5, 0.5
    w[0, [2, 10]] = 0.5, 0.5
    w[0, [3, 11]] = 0.5, 0.5
    w[1] = 1 / np.take_along_axis(np.bincount(phy[1], minlength=8)[None], phy[1][None], 1)[0]
    w[2] = 1 / np.take_along_axis(np.bincount(phy[2], minlength=8)[None], phy[2][None], 1)[0]
    return Placement(phy, G, 8, num_nodes=2, layer_ids=np.array([1, 3, 4]), dispatch_weights_LP=w,
                     planner="greedy", metrics={"imbalance_max": 1.1})


def _build_seeds(d: Path) -> dict[str, Path]:
    rng = np.random.default_rng(0)
    seeds: dict[str, Path] = {}
    counts = rng.poisson(20, size=(2, 3, 8))
    topk = rng.integers(0, 8, size=(4, 3, 2)).astype(np.int16)
    trace = Trace(counts, np.array([1, 3, 4]), default_meta(5, 8, top_k=2, source="seed"), topk,
                  np.array([0, 0, 1, 1], dtype=np.int32))
    seeds["trace.npz"] = save_trace(trace, d / "trace.npz")
    np.save(d / "trace.npy", counts)
    seeds["trace.npy"] = d / "trace.npy"
    lc = np.zeros((5, 8), dtype=np.int64)
    lc[[1, 3, 4]] = counts.sum(0)
    (d / "sglang.json").write_text(json.dumps({"logical_count": lc.tolist(), "rank": 0}))
    seeds["sglang.json"] = d / "sglang.json"
    tdir = d / "trtllm"
    tdir.mkdir()
    (tdir / "meta_info.json").write_text(json.dumps({"num_experts": 8, "num_experts_per_token": 2}))
    for r in range(2):
        write_safetensors({f"{i}_{l}": counts[i, j] // 2 for i in range(2) for j, l in enumerate([1, 3, 4])},
                          tdir / f"rank{r}.safetensors")
    seeds["trtllm"] = tdir
    pl = _seed_placement()
    seeds["plan.json"] = save_placement(pl, d / "plan.json")
    seeds["loc.json"] = write_placement(pl, d / "loc.json", "sglang", num_hidden_layers=6)
    seeds["lb.yaml"] = write_placement(pl, d / "lb.yaml", "trtllm")
    if torch is not None:
        torch.save({"rank": 0, "logical_count": torch.from_numpy(lc)}, d / "sglang.pt")
        seeds["sglang.pt"] = d / "sglang.pt"
        seeds["plan.pt"] = write_placement(pl, d / "plan.pt", "vllm")
    served = Trace(rng.poisson(20, size=(4, 3, 8)), np.array([1, 3, 4]), default_meta(5, 8, top_k=2, source="seed"))
    seeds["replay.npz"] = write_replay(replay(served, topology=Topology(G, 3), warmup=2), d / "replay.npz")
    PROFILES["h200"].save(d / "gpu.json")
    seeds["gpu.json"] = d / "gpu.json"
    (d / "gpu.yaml").write_text("base: h100\nhbm_bytes_per_s: 4.8e12\nflops_per_s: {fp8: 2.0e15}\n")
    seeds["gpu.yaml"] = d / "gpu.yaml"
    return seeds


SEED_DIR = Path(tempfile.mkdtemp(prefix="eplb-fuzz-seeds-"))
SEEDS = _build_seeds(SEED_DIR)
FILE_SEEDS = sorted(k for k, p in SEEDS.items() if p.is_file())


@pytest.fixture(scope="module", autouse=True)
def _remove_seed_dir():
    yield
    shutil.rmtree(SEED_DIR, ignore_errors=True)


def check_reader(reader: str, path: Path, names=()) -> None:
    outcome(lambda: READERS[reader](path), names=names or (path.name,))


# Byte-level mutations -------------------------------------------------------------------------

@st.composite
def mutated_bytes(draw, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, max(len(b) - 1, 0)))
        op = draw(st.sampled_from(["truncate", "overwrite", "insert", "delete", "duplicate", "zeros"]))
        if op == "truncate":
            b = b[:i]
        elif op == "overwrite":
            chunk = draw(st.binary(min_size=1, max_size=8))
            b[i:i + len(chunk)] = chunk
        elif op == "insert":
            b[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del b[i:i + draw(st.integers(1, 64))]
        elif op == "duplicate":
            j = draw(st.integers(0, max(len(b) - 1, 0)))
            b[i:i] = b[j:j + draw(st.integers(1, 64))]
        else:
            n = draw(st.integers(1, 32))
            b[i:i + n] = b"\0" * min(n, len(b) - i)
    return bytes(b)


@st.composite
def rezipped(draw, data: bytes) -> bytes:
    """The archive with one member's bytes mutated and valid CRCs, so the zip layer accepts it."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        members = [(i, z.read(i)) for i in z.infolist()]
    k = draw(st.integers(0, len(members) - 1))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for j, (info, body) in enumerate(members):
            z.writestr(info, draw(mutated_bytes(body)) if j == k else body)
    return out.getvalue()


@settings(max_examples=examples(80))
@given(seed=st.sampled_from(FILE_SEEDS), reader=st.sampled_from(sorted(READERS)), data=st.data())
def test_mutated_files(seed, reader, data):
    raw = SEEDS[seed].read_bytes()
    is_zip = raw.startswith(b"PK\x03\x04")
    body = data.draw(rezipped(raw) if is_zip and data.draw(st.booleans()) else mutated_bytes(raw))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / seed
        path.write_bytes(body)
        check_reader(reader, path)


@settings(max_examples=examples(25))
@given(member=st.sampled_from(["meta_info.json", "rank0.safetensors"]), data=st.data())
def test_mutated_tensorrt_llm_dumps(member, data):
    with tempfile.TemporaryDirectory() as d:
        dump = Path(d) / "dump"
        shutil.copytree(SEEDS["trtllm"], dump)
        (dump / member).write_bytes(data.draw(mutated_bytes((dump / member).read_bytes())))
        check_reader("load_trace", dump, names=("dump", member))


# Structural mutations: JSON and YAML ---------------------------------------------------------

EXTREMES = [None, True, False, -1, 0, 1, 2.5, 2**63, -(2**63) - 1, 10**30, 1e308, -1e308, math.nan, math.inf,
            "1", "", "abc", [], {}, [[]], [1, [2]], [[0.5, -0.5]], {"a": 1}]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=4),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=12)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:6]):  # the first few entries of a long list are enough
            yield from _paths(v, prefix + (i,))


@st.composite
def mutated_tree(draw, obj):
    obj = copy.deepcopy(obj)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(_paths(obj))))
        op = draw(st.sampled_from(["extreme", "random", "delete", "wrap", "grow"]))
        # A copy: EXTREMES holds lists that later operations would otherwise grow in place.
        new = (copy.deepcopy(draw(st.sampled_from(EXTREMES))) if op == "extreme" else
               draw(json_values) if op == "random" else None)
        if not path:
            obj = new if op in ("extreme", "random") else [obj]
            continue
        parent = obj
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        if op in ("extreme", "random"):
            parent[key] = new
        elif op == "delete":
            del parent[key]
        elif op == "wrap":
            parent[key] = [parent[key]]
        elif isinstance(parent, list):
            parent.append(copy.deepcopy(parent[key]))
        else:
            parent[f"{key}_"] = copy.deepcopy(parent[key])
    return obj


JSON_SEEDS = ["sglang.json", "plan.json", "loc.json", "gpu.json"]


@settings(max_examples=examples(80))
@given(seed=st.sampled_from(JSON_SEEDS), reader=st.sampled_from(sorted(READERS)), data=st.data())
def test_structurally_mutated_json(seed, reader, data):
    tree = data.draw(mutated_tree(json.loads(SEEDS[seed].read_text())))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / seed
        path.write_text(json.dumps(tree))
        check_reader(reader, path)


@settings(max_examples=examples(25))
@given(data=st.data())
def test_structurally_mutated_tensorrt_llm_meta(data):
    tree = data.draw(mutated_tree(json.loads((SEEDS["trtllm"] / "meta_info.json").read_text())))
    with tempfile.TemporaryDirectory() as d:
        dump = Path(d) / "dump"
        shutil.copytree(SEEDS["trtllm"], dump)
        (dump / "meta_info.json").write_text(json.dumps(tree))
        check_reader("load_trace", dump, names=("dump", "meta_info.json"))


HOSTILE_YAML = ["!!python/object/apply:os.system ['echo pwned']", "a: &a [*a]", "num_slots: [" * 5000,
                "initial_global_assignments: {3: !!binary aGVsbG8=}", "- " * 3000 + "x",
                "initial_global_assignments: {1e400: [0]}", "initial_global_assignments:\n  3: [0, 1, .nan]"]


@settings(max_examples=examples(40))
@given(data=st.data())
def test_structurally_mutated_yaml(data):
    import yaml

    if data.draw(st.booleans()):
        text = data.draw(st.sampled_from(HOSTILE_YAML))
    else:
        tree = data.draw(mutated_tree(yaml.safe_load(SEEDS["lb.yaml"].read_text())))
        text = yaml.safe_dump(tree) if data.draw(st.booleans()) else json.dumps(tree)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "lb.yaml"
        path.write_text(text)
        check_reader(data.draw(st.sampled_from(["read trtllm", "load_trace", "load_placement", "load_hardware"])),
                     path)


@settings(max_examples=examples(30))
@given(data=st.data())
def test_structurally_mutated_hardware_profiles(data):
    import yaml

    text = SEEDS["gpu.yaml" if data.draw(st.booleans()) else "gpu.json"].read_text()
    tree = data.draw(mutated_tree(yaml.safe_load(text)))
    name = data.draw(st.sampled_from(["gpu.json", "gpu.yaml"]))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / name
        path.write_text(yaml.safe_dump(tree) if name.endswith(".yaml") and data.draw(st.booleans())
                        else json.dumps(tree))
        check_reader("load_hardware", path)


# Structural mutations: arrays, archives, tensors ---------------------------------------------

DTYPES = ["<i8", "<i4", "<i2", "|i1", "|u1", "<u8", ">i8", "<f8", "<f4", "<f2", "|b1", "<c16", "<U3"]


@st.composite
def random_arrays(draw):
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=4)))
    if dtype.kind == "U":
        elements = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=3)  # numpy drops NULs
    elif dtype.kind == "c":
        elements = st.complex_numbers(width=128)
    elif dtype.kind == "f":
        elements = st.floats(width=8 * dtype.itemsize)
    else:
        elements = None
    return draw(hnp.arrays(dtype, shape, elements=elements))


@st.composite
def random_npz(draw):
    seed = dict(np.load(SEEDS["trace.npz"], allow_pickle=False))
    out = {}
    for key in ("counts", "layer_ids", "meta", "topk_ids", "token_window", "extra"):
        choice = draw(st.sampled_from(["seed", "random", "drop", "meta-tree"] if key == "meta" else
                                      ["seed", "random", "drop"]))
        if choice == "seed" and key in seed:
            out[key] = seed[key]
        elif choice == "random":
            out[key] = draw(random_arrays())
        elif choice == "meta-tree":
            out[key] = np.array(json.dumps(draw(mutated_tree(json.loads(str(seed["meta"]))))))
    if draw(st.booleans()) and out:  # an object array: must be refused, never unpickled
        key = draw(st.sampled_from(sorted(out)))
        obj = np.empty(2, dtype=object)
        obj[:] = [1, "x"]
        out[key] = obj
    return out


@settings(max_examples=examples(60))
@given(arrays=random_npz(), reader=st.sampled_from(["load_trace", "load_history", "load_placement"]))
def test_npz_of_random_arrays(arrays, reader):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.npz"
        np.savez(path, **arrays) if arrays else path.write_bytes(b"PK\x05\x06" + b"\0" * 18)
        check_reader(reader, path)


@settings(max_examples=examples(40))
@given(data=st.data())
def test_replay_files_of_random_arrays(data):
    seed = dict(np.load(SEEDS["replay.npz"], allow_pickle=False))
    arrays = dict(seed)
    for key in data.draw(st.lists(st.sampled_from(sorted(seed) + ["extra"]), max_size=3)):
        choice = data.draw(st.sampled_from(["random", "drop", "meta-tree"] if key == "meta" else ["random", "drop"]))
        if choice == "random":
            arrays[key] = data.draw(random_arrays())
        elif choice == "meta-tree":
            arrays[key] = np.array(json.dumps(data.draw(mutated_tree(json.loads(str(seed["meta"]))))))
        else:
            arrays.pop(key, None)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "replay.npz"
        np.savez(path, **arrays)
        check_reader(data.draw(st.sampled_from(["read_replay", "load_trace"])), path)


@settings(max_examples=examples(40))
@given(array=random_arrays(), lie=st.none() | st.lists(st.integers(0, 2**40), min_size=1, max_size=3))
def test_npy_of_random_arrays_and_lying_headers(array, lie):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.npy"
        np.save(path, array)
        if lie is not None:  # the header declares another shape than the data has
            raw = path.read_bytes()
            header = io.BytesIO()
            np.lib.format.write_array_header_1_0(
                header, {"descr": np.lib.format.dtype_to_descr(array.dtype), "fortran_order": False,
                         "shape": tuple(lie)})
            path.write_bytes(header.getvalue() + raw[128:])
        check_reader("load_trace", path)


@st.composite
def random_tensors(draw):
    dtype = draw(st.sampled_from(["int64", "int32", "uint8", "float32", "float16", "bool", "complex64", "bfloat16"]))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    kind = draw(st.sampled_from(["zeros", "random", "expanded", "python"]))
    if kind == "python":
        return draw(st.sampled_from([3, 2.5, "x", [1, 2], None, True]))
    if kind == "expanded":  # a stride-0 view claiming a big shape over one stored number
        return torch.zeros(1, dtype=getattr(torch, dtype)).expand(*[draw(st.integers(1, 10**6)) for _ in range(3)])
    t = torch.from_numpy(np.random.default_rng(draw(st.integers(0, 99))).integers(-3, 20, size=shape))
    return t.to(getattr(torch, dtype)) if kind == "random" else torch.zeros(shape, dtype=getattr(torch, dtype))


@pytest.mark.skipif(torch is None, reason="torch is not installed")
@settings(max_examples=examples(50))
@given(data=st.data())
def test_torch_files_of_random_tensors(data):
    seed = SEEDS["plan.pt" if data.draw(st.booleans()) else "sglang.pt"]
    obj = torch.load(seed, weights_only=True)
    for key in data.draw(st.lists(st.sampled_from(sorted(obj) + ["logical_count"]), max_size=3)):
        if data.draw(st.booleans()):
            obj[key] = data.draw(random_tensors())
        else:
            obj.pop(key, None)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "f.pt"
        torch.save(obj if data.draw(st.integers(0, 9)) else list(obj.values()), path)
        check_reader(data.draw(st.sampled_from(["load_trace", "read vllm", "load_placement"])), path)


@settings(max_examples=examples(40))
@given(data=st.data())
def test_safetensors_headers_with_random_entries(data):
    entry = st.fixed_dictionaries({
        "dtype": st.sampled_from(["I64", "I32", "F32", "F64", "BOOL", "X", 3]),
        "shape": st.lists(st.integers(-2, 2**33), max_size=3) | st.sampled_from(["8", None, [8.5]]),
        "data_offsets": st.lists(st.integers(-8, 2**33), max_size=3) | st.sampled_from([None, "0", [0, 64]]),
    })
    header = data.draw(st.dictionaries(st.sampled_from(["0_1", "0_3", "1_4", "x", "__metadata__", "9_99999"]),
                                       entry | json_values, max_size=3))
    h = json.dumps(header).encode()
    body = data.draw(st.binary(max_size=128))
    with tempfile.TemporaryDirectory() as d:
        dump = Path(d) / "dump"
        shutil.copytree(SEEDS["trtllm"], dump)
        (dump / "rank1.safetensors").write_bytes(len(h).to_bytes(8, "little") + h + body)
        check_reader("load_trace", dump, names=("dump", "rank1.safetensors"))


# Every export, read back -----------------------------------------------------------------------

@st.composite
def placements(draw):
    N = draw(st.sampled_from([1, 2]))
    G = N * draw(st.integers(1, 4))
    E = draw(st.integers(1, 12))
    lo = -(-E // G)
    S = draw(st.integers(lo, max(lo, min(E, lo + 2))))
    L = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    rows = [rng.permutation(np.concatenate([np.arange(E), rng.integers(0, E, G * S - E)])) for _ in range(L)]
    ids = np.sort(rng.choice(np.arange(10), size=L, replace=False))
    return Placement(np.array(rows), G, E, N, ids, planner="fuzz")


@settings(max_examples=examples(30))
@given(pl=placements(), fmt=st.sampled_from([f for f in FORMATS if f != "vllm" or torch is not None]))
def test_every_export_reads_back_exactly(pl, fmt):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / {"eplb": "p.json", "sglang": "loc.json", "vllm": "p.pt", "trtllm": "lb.yaml"}[fmt]
        write_placement(pl, path, fmt, num_hidden_layers=12 if fmt == "sglang" else None)
        back = read_placement(path, fmt, num_gpus=pl.num_gpus, num_nodes=pl.num_nodes,
                              num_logical_experts=None if fmt in ("eplb", "vllm") else pl.num_logical_experts,
                              layer_ids=pl.layer_ids if fmt in ("sglang", "vllm") else None)
        assert back == pl
