"""One generator per class of input issue 35 found mishandled: each draws many members of the
class, not its one reproduction, and checks the outcome every class must have: success that
reads the input as what it is, or one EplbError line (CLI exit 2), in bounded memory.

Classes: layer ids of any size (trace ids, `--layer-ids` ranges) on the SGLang path; YAML
alias chains; torch tensors of every kind; bytes flipped in .pt and .npz files; per-token
expert ids handed over as counts.
"""

from __future__ import annotations

import io
import json
import random
import tracemalloc
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb.cli import main
from eplb.core.trace import Trace, default_meta
from eplb.errors import EplbError
from eplb.formats import load_trace, save_trace
from eplb.formats.export import read_placement
from tests.fuzz.common import check_message, examples

MEMORY_BOUND = 256 * 2**20
"""What any of these small inputs may allocate at its peak (the default input limit is 1 GiB:
an unchecked size born from an id or an alias would take far more)."""


def _cli(argv) -> tuple[int, str]:
    """main(argv)'s exit code and its stderr, which must be one line when it is not 0."""
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as exc:  # argparse's own refusals
            rc = exc.code
    if rc != 0:
        lines = [line for line in err.getvalue().splitlines() if line.startswith("eplb")]
        assert rc == 2 and lines, err.getvalue()
        check_message(lines[-1])
    return rc, err.getvalue()


def _bounded(call):
    """call()'s result and the peak bytes it allocated (numpy's buffers included)."""
    tracemalloc.start()
    try:
        result = call()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def counts():
    return np.random.default_rng(3).integers(0, 40, size=(3, 4, 16))


big_ids = st.one_of(st.integers(0, 200), st.integers(10**5, 10**7), st.integers(10**9, 2**61))


@settings(max_examples=examples(12))
@given(extra=big_ids)
def test_layer_ids_of_any_size_on_the_sglang_path(tmp_path_factory, counts, extra):
    d = tmp_path_factory.mktemp("ids")
    ids = np.array([0, 1, 2, 3 + extra], dtype=np.int64)
    try:
        trace = Trace(counts, ids, default_meta(int(ids[-1]) + 1, 16, source="fuzz"))
    except EplbError as exc:  # refused where the trace is built: fine, if said in one line
        check_message(str(exc))
        return
    path = save_trace(trace, d / "t.npz")
    (rc, err), peak = _bounded(lambda: _cli(["plan", str(path), "--gpus", "4", "-f", "sglang",
                                             "-o", str(d / "p.json")]))
    assert peak < MEMORY_BOUND, f"layer id {ids[-1]}: {peak:,} bytes"


@settings(max_examples=examples(12))
@given(last=st.one_of(big_ids, st.integers(2**61, 10**30)), comma=st.booleans())
def test_layer_id_ranges_are_counted_before_they_are_built(tmp_path_factory, counts, last, comma):
    d = tmp_path_factory.mktemp("ranges")
    path = save_trace(Trace(counts, np.arange(4), default_meta(4, 16, source="fuzz")), d / "t.npz")
    text = f"0-2,{last}" if comma else f"0-{last}"
    (rc, err), peak = _bounded(lambda: _cli(["plan", str(path), "--gpus", "4", "--layer-ids", text,
                                             "-f", "sglang", "-o", str(d / "p.json")]))
    assert peak < MEMORY_BOUND, f"--layer-ids {text}: {peak:,} bytes"


@settings(max_examples=examples(10))
@given(depth=st.integers(1, 12), fan=st.integers(2, 12), where=st.sampled_from(["row", "value", "key"]))
def test_yaml_alias_chains_are_bounded(tmp_path_factory, depth, fan, where):
    d = tmp_path_factory.mktemp("yaml")
    lines = ["a0: &a0 [1, 2, 3]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * fan)}]" for i in range(1, depth + 1)]
    chain = "\n".join(f"  {line}" for line in lines)
    body = {"row": f"num_slots: 16\ninitial_global_assignments:\n  0: *a{depth}\nanchors:\n{chain}\n",
            "value": f"anchors:\n{chain}\nnum_slots: *a{depth}\ninitial_global_assignments: {{0: [0]}}\n",
            "key": f"anchors:\n{chain}\n*a{depth} : 1\n"}[where]
    path = d / "lb.yaml"
    path.write_text(body)

    def read():
        try:
            read_placement(path, "trtllm", num_gpus=4)
        except EplbError as exc:
            msg = str(exc)
            check_message(msg)
            assert len(msg) < 1000, f"{len(msg)} characters"  # the expanded value is not quoted

    _, peak = _bounded(read)
    assert peak < MEMORY_BOUND, f"depth {depth} x fan {fan}: {peak:,} bytes"


def _tensor_kinds():
    torch = pytest.importorskip("torch")
    c = torch.tensor(np.random.default_rng(4).integers(0, 40, size=(3, 4, 16)))
    with warnings.catch_warnings():  # torch warns that CSR is beta and qint8 deprecated: made here on purpose
        warnings.simplefilter("ignore")
        return torch, c, _kinds(torch, c)


def _kinds(torch, c) -> dict:
    return {
        "int64": c, "int32": c.int(), "float32": c.float(), "float64": c.double(), "bfloat16": c.bfloat16(),
        "float16": c.half(), "uint8": c.to(torch.uint8), "bool": c > 20, "complex": c.to(torch.complex64),
        "meta": torch.empty(3, 4, 16, device="meta"), "sparse_coo": c.to_sparse(),
        "sparse_csr": c.to_sparse_csr(dense_dim=1), "strided view": c.expand(2, 3, 4, 16)[0],
        "negative": -c, "transposed": c.transpose(0, 1), "quantized": torch.quantize_per_tensor(
            c.float(), 1.0, 0, torch.qint8),
    }


def test_torch_tensors_of_every_kind(tmp_path):
    torch, c, kinds = _tensor_kinds()
    for name, t in kinds.items():
        path = tmp_path / f"{name.replace(' ', '_')}.pt"
        torch.save({"logical_count": t}, path)
        try:
            trace = load_trace(path)
        except EplbError as exc:
            check_message(str(exc))
            continue
        # Read as what it is: the same counts, exactly (bfloat16 and float16 hold these exactly).
        want = t.to_dense().double().numpy() if t.layout != torch.strided else t.double().numpy()
        got = trace.counts_TLE if want.ndim == 3 else trace.counts_TLE[-1]
        assert np.array_equal(got, want.reshape(got.shape)), name


@pytest.mark.parametrize("kind", ["pt", "npz"])
def test_flipped_bytes_are_refused_or_change_nothing(tmp_path, counts, kind):
    if kind == "pt":
        torch = pytest.importorskip("torch")
        torch.save({"logical_count": torch.tensor(counts)}, tmp_path / "t.pt")
        good = tmp_path / "t.pt"
    else:
        good = save_trace(Trace(counts, np.arange(4), default_meta(4, 16, source="fuzz")), tmp_path / "t.npz")
    want = load_trace(good).counts_TLE
    data = good.read_bytes()
    rnd = random.Random(7)
    for i in range(examples(60)):
        bad = bytearray(data)
        at = rnd.randrange(len(bad))
        bad[at] ^= 1 << rnd.randrange(8)
        path = tmp_path / f"m{i}.{kind}"
        path.write_bytes(bytes(bad))
        try:
            got = load_trace(path).counts_TLE
        except EplbError as exc:
            check_message(str(exc))
            continue
        # Accepted only where the flip hit bytes no value depends on (zip padding, a record id).
        assert np.array_equal(got, want), f"byte {at} flipped: the counts read changed"


@settings(max_examples=examples(15))
@given(tokens=st.integers(20, 300), layers=st.integers(2, 6), top_k=st.integers(2, 8), experts=st.integers(8, 64))
def test_per_token_expert_ids_are_not_read_as_counts(tmp_path_factory, tokens, layers, top_k, experts):
    """[tokens, layers, top_k] ids told from counts by what counts cannot do: a window's counts sum
    alike in every layer. One layer carries no such sign, nor do rows that name every expert (top_k =
    experts: each row sums alike), so neither is drawn."""
    rng = np.random.default_rng(tokens * 7 + layers)
    top_k = min(top_k, experts - 1)
    ids = np.stack([np.stack([rng.choice(experts, top_k, replace=False) for _ in range(layers)])
                    for _ in range(tokens)])
    path = Path(tmp_path_factory.mktemp("topk")) / "ids.npy"
    np.save(path, ids)
    with pytest.raises(EplbError, match="per-token expert ids"):
        load_trace(path)
    # The counts of those tokens, which is what a trace holds, read as they are.
    counts = np.stack([np.bincount(ids[:, l].ravel(), minlength=experts) for l in range(layers)])[None]
    np.save(path, counts)
    assert np.array_equal(load_trace(path).counts_TLE, counts)


# Tables of cases for the classes a generator adds little to -------------------------------------

def _torch():
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("classes")
    counts = np.random.default_rng(0).integers(1, 50, size=(4, 3, 16))
    return save_trace(Trace(counts, np.array([1, 2, 3]), default_meta(3, 16, num_hidden_layers=4, source="classes")),
                      d / "t.npz")


# 6, 11, 12, 13: command lines that must be refused before any work, with a message that helps.
def test_refused_command_lines(trace_path, tmp_path):
    one = save_trace(load_trace(trace_path).windows(0, 1), tmp_path / "one.npz")
    (tmp_path / "dangling.json").symlink_to(tmp_path / "missing" / "x.json")
    cases = {
        ("simulate", "--seed", -1): "seed",
        ("plan", trace_path, "--gpus", 4, "-o", tmp_path / "p.npz"): ".npz",
        ("plan", trace_path, "--gpus", 4, "-o", tmp_path / "p.txt"): ".txt",
        ("plan", trace_path, "--gpus", 4, "-o", tmp_path / "dangling.json"): "missing",
        ("replay", one, "--gpus", 4): "window",
    }
    for argv, named in cases.items():
        rc, err = _cli(argv)
        assert rc == 2 and named in err, (argv, err)
        assert "warmup must be >= 1, got 0" not in err and "Budget(" not in err and "\x1b" not in err
    assert not (tmp_path / "p.npz").exists() and not (tmp_path / "p.txt").exists()


# 8, 10: TensorRT-LLM rows that are empty or not lists, keys that are not ASCII layer numbers.
@pytest.mark.parametrize("row", ["3: []", "3: 012", "3: '012'", "\u0663: [0, 1, 2, 3]"])
def test_tensorrt_llm_rows_are_refused(tmp_path, row):
    path = tmp_path / "p.yaml"
    path.write_text(f"num_slots: 4\ninitial_global_assignments:\n  {row}\n", encoding="utf-8")
    with pytest.raises(EplbError) as exc:
        read_placement(path, "trtllm", num_gpus=2)
    check_message(str(exc.value))


# 10: all-zero traces are refused by every command, not scored as a perfect 1.0000; bool counts
# are refused from every format alike; a UTF-8 BOM is read as JSON.
def test_zero_and_bool_traces_are_refused_alike(tmp_path, trace_path):
    zero = tmp_path / "z.npy"
    np.save(zero, np.zeros((3, 2, 8), dtype=np.int64))
    for argv in (["stats", zero], ["plan", zero, "--gpus", 2], ["replay", zero, "--gpus", 2],
                 ["backtest", zero, "--gpus", 2]):
        rc, err = _cli(argv)
        assert rc == 2 and "1.0000" not in err, (argv, err)
    flags = np.ones((3, 2, 8), dtype=bool)
    _torch().save({"logical_count": _torch().from_numpy(flags)}, tmp_path / "b.pt")
    (tmp_path / "b.json").write_text(json.dumps({"logical_count": flags.tolist()}))
    for name in ("b.pt", "b.json"):
        with pytest.raises(EplbError):
            load_trace(tmp_path / name)
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps({"logical_count": [[[1, 2]]]}).encode())
    assert load_trace(tmp_path / "bom.json").counts_TLE.tolist() == [[[1, 2]]]


def test_a_huge_tensorrt_llm_layer_key_allocates_nothing(tmp_path):
    path = tmp_path / "p.yaml"  # YAML 1.1 reads 0_100000000 as octal 100000000 = 2**24, as the engine does
    path.write_text("num_slots: 4\ninitial_global_assignments:\n  0_100000000: [0, 1, 2, 3]\n")
    try:
        pl = read_placement(path, "trtllm", num_gpus=2)
    except EplbError as exc:
        check_message(str(exc))
    else:  # one row, no map over 2**24 layers
        assert pl.layer_ids.tolist() == [8**8] and pl.phy2log_LP.shape == (1, 4)
