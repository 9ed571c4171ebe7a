"""Atomic outputs and bounded inputs (eplb.core.files, issue 11): nothing lost, nothing leaked.

- every writer leaves the previous file byte-for-byte intact and no temporary file behind when
  the write fails: on a real full file system (a small tmpfs this test mounts when it runs as
  root; skipped otherwise), when the writer's own code raises, and when the writing process is
  killed with SIGKILL in the middle of a write;
- inputs are measured before they are loaded: declared .npy / .npz shapes and uncompressed
  sizes against EPLB_MAX_INPUT_BYTES, JSON nesting depth, torch views that claim more than
  they store.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest

from eplb.cli import main
from eplb.core.files import MAX_INPUT_ENV, TENSOR_BYTES, format_size, json_depth, max_input_bytes, parse_size, read_json
from eplb.core.hardware import PROFILES
from eplb.core.outputs import TEMP_SUFFIX, atomic_output, write_bytes, write_text
from eplb.core.placement import Placement
from eplb.core.topology import Topology
from eplb.core.trace import Trace, default_meta
from eplb.dispatch.calibration import ShimMeasurements
from eplb.errors import EplbError
from eplb.evaluate.replay import replay
from eplb.formats import load_placement, load_trace, save_placement, save_trace, write_replay
from eplb.formats.export import write_placement

ROOT = Path(__file__).resolve().parents[2]


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def one_line_error(rc: int, err: str, command: str) -> str:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"eplb {command}: error: "), err
    return lines[0]


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(TEMP_SUFFIX))


def small_trace(L: int = 4, E: int = 16, T: int = 3, seed: int = 0) -> Trace:
    counts = np.random.default_rng(seed).poisson(30, size=(T, L, E))
    return Trace(counts, np.arange(1, L + 1), default_meta(L + 1, E, source="test"))


def big_placement(L: int = 64, G: int = 16, E: int = 256) -> Placement:
    rng = np.random.default_rng(1)
    phy = np.stack([np.concatenate([rng.permutation(E), rng.integers(0, E, G)]) for _ in range(L)])
    phy = phy.reshape(L, G, -1)
    return Placement(phy.reshape(L, -1), G, E, layer_ids=np.arange(L))


# Writes ---------------------------------------------------------------------------------------

def test_write_replaces_whole_and_keeps_permissions(tmp_path):
    p = tmp_path / "plan.json"
    p.write_text("old")
    p.chmod(0o640)
    write_text(p, "new contents")
    assert p.read_text() == "new contents" and oct(p.stat().st_mode & 0o777) == "0o640"
    assert leftovers(tmp_path) == []


def test_write_follows_a_symlink_and_writes_devices_in_place(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_text(link, "new")
    assert link.is_symlink() and real.read_text() == "new"
    write_text("/dev/null", "into the void")  # not replaced by a regular file
    assert Path("/dev/null").is_char_device()


def test_a_name_at_the_length_limit_still_gets_a_temporary_file(tmp_path):
    p = tmp_path / ("p" * 250 + ".json")
    write_text(p, "{}")
    assert p.read_text() == "{}" and leftovers(tmp_path) == []


def test_a_failure_in_the_writer_keeps_the_old_file(tmp_path):
    p = tmp_path / "plan.json"
    p.write_bytes(b"good plan")
    with pytest.raises(RuntimeError, match="serialiser broke"):
        with atomic_output(p) as f:
            f.write(b"half a pl")
            raise RuntimeError("serialiser broke")
    assert p.read_bytes() == b"good plan" and leftovers(tmp_path) == []


@pytest.mark.parametrize("make, why", [
    (lambda d: d / "missing" / "x.json", "does not exist"),
    (lambda d: d, "it is a folder"),
])
def test_unwritable_targets_are_named(tmp_path, make, why):
    target = make(tmp_path)
    with pytest.raises(EplbError, match=why) as info:
        write_bytes(target, b"x", what="the placement")
    assert str(target) in str(info.value) and "the placement" in str(info.value)


def test_a_read_only_file_is_not_replaced(tmp_path):
    p = tmp_path / "keep.json"
    p.write_text("precious")
    p.chmod(0o444)
    if os.access(p, os.W_OK):  # root bypasses permissions
        pytest.skip("running as root: a read-only file is writable")
    with pytest.raises(EplbError, match="read-only"):
        write_text(p, "new")
    assert p.read_text() == "precious"


def test_an_immutable_file_or_folder_is_not_replaced_even_as_root(tmp_path):
    """chattr +i holds against root too: the plan is refused in one line and nothing changes."""
    target, folder = tmp_path / "plan.json", tmp_path / "locked"
    target.write_text("precious")
    folder.mkdir()
    (folder / "p.json").write_text("kept")
    if subprocess.run(["chattr", "+i", str(target), str(folder)], capture_output=True).returncode:
        pytest.skip("chattr +i needs root and a file system that supports it")
    try:
        for out, message in ((target, "read-only or immutable"), (folder / "p.json", "is not writable")):
            err = io.StringIO()
            with redirect_stderr(err), redirect_stdout(io.StringIO()):
                code = main(["plan", str(Path(__file__).parents[2] / "traces" / "deepseek.npz"), "--gpus", "4",
                             "-p", "greedy", "-o", str(out)])
            assert code == 2 and message in err.getvalue() and err.getvalue().count("\n") == 1
        assert target.read_text() == "precious" and (folder / "p.json").read_text() == "kept"
        assert sorted(q.name for q in tmp_path.rglob("*")) == ["locked", "p.json", "plan.json"]
    finally:
        subprocess.run(["chattr", "-i", str(target), str(folder)], capture_output=True)


KILLED_WRITER = """
import sys, time
from eplb.core.outputs import atomic_output
with atomic_output(sys.argv[1]) as f:
    f.write(b"new data " * 100000)
    f.flush()
    print("writing", flush=True)
    time.sleep(120)
"""


def test_a_writer_killed_mid_write_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "plan.json"
    target.write_bytes(b'{"previous": "plan"}')
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(target)], stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout.readline() == b"writing\n"
        during = sorted(p.name for p in tmp_path.iterdir())
        child.kill()  # SIGKILL: no cleanup code of the writer runs
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
        child.stdout.close()
    assert target.read_bytes() == b'{"previous": "plan"}'
    if during != ["plan.json"]:
        pytest.skip("no O_TMPFILE on this file system: the data went to a named temporary file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


# A real full file system ----------------------------------------------------------------------

@pytest.fixture
def full_disk(tmp_path):
    """A 512 KiB tmpfs mounted for this test (root only), with `fill(keep)` leaving `keep` bytes free."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")

    def fill(keep: int = 8192) -> None:
        st = os.statvfs(mnt)
        free = st.f_bavail * st.f_frsize
        with open(mnt / "filler", "ab") as f:
            f.write(b"\0" * max(free - keep, 0))

    try:
        yield mnt, fill
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _results_page(path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _report
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    saved = _report.RESULTS
    _report.RESULTS = path.parent  # the page goes to RESULTS / "<name>.md"
    try:
        _report.write_page(path.stem, "A results page", "table\n" * 20000, ["--write-docs"])
    finally:
        _report.RESULTS = saved


def _writers(torch_ok: bool):
    pl = big_placement()
    trace = Trace(np.random.default_rng(2).integers(0, 2**40, size=(8, 16, 256)), np.arange(16),
                  default_meta(16, 256, source="test"))
    served = replay(small_trace(L=8, E=64, T=6), topology=Topology(8, 10), warmup=2)
    C, B, L, G, S = 8, 4, 4, 8, 10
    rows = np.random.default_rng(3).random((C, B, L, G, S))
    measured = ShimMeasurements(tuple(f"case {i}" for i in range(C)), np.arange(C), rows,
                                *[np.random.default_rng(4).random((C, B, L, G))] * 4, hidden=32, expert_hidden=48,
                                num_logical_experts=64, top_k=2)
    out = {
        "eplb JSON": ("plan.json", lambda p: save_placement(pl, p)),
        "sglang": ("loc.json", lambda p: write_placement(pl, p, "sglang")),
        "trtllm": ("lb.yaml", lambda p: write_placement(pl, p, "trtllm")),
        "trace npz": ("trace.npz", lambda p: save_trace(trace, p)),
        "replay npz": ("replay.npz", lambda p: write_replay(served, p)),
        "hardware profile": ("gpu.json", lambda p: PROFILES["h200"].save(p)),
        "shim measurements": ("m.npz", lambda p: measured.save(p)),
        "results page": ("page.md", _results_page),
    }
    if torch_ok:
        out["vllm"] = ("plan.pt", lambda p: write_placement(pl, p, "vllm"))
    return out


SMALL_WRITERS = {"hardware profile"}
"""Writers whose whole output fits in the 8 KiB the other writers are left: they get a full disk."""


@pytest.mark.parametrize("name", ["eplb JSON", "sglang", "trtllm", "trace npz", "vllm", "replay npz",
                                  "hardware profile", "shim measurements", "results page"])
def test_disk_full_keeps_every_writers_previous_file(full_disk, name):
    mnt, fill = full_disk
    try:
        import torch  # noqa: F401
        torch_ok = True
    except ImportError:
        torch_ok = False
    writers = _writers(torch_ok)
    if name not in writers:
        pytest.skip("torch is not installed")
    filename, write = writers[name]
    target = mnt / filename
    target.write_bytes(b"previous good file")
    fill(keep=0 if name in SMALL_WRITERS else 8192)
    with pytest.raises(EplbError, match="No space left on device") as info:
        write(target)
    assert str(target) in str(info.value) and "previous" in str(info.value)
    assert target.read_bytes() == b"previous good file"
    assert sorted(p.name for p in mnt.iterdir()) == sorted(["filler", filename])
    # A new file that does not fit is not left behind half-written either.
    (mnt / filename).unlink()
    fill(keep=0 if name in SMALL_WRITERS else 8192)  # the space the previous file held is taken again
    with pytest.raises(EplbError, match="nothing was written"):
        write(target)
    assert sorted(p.name for p in mnt.iterdir()) == ["filler"]


def test_disk_full_through_the_cli(full_disk, tmp_path):
    """plan -o, synth -o, backtest -o, replay -o and plot -o: exit 2, one line naming the file,
    old file intact."""
    mnt, fill = full_disk
    src = tmp_path / "t.npz"
    save_trace(small_trace(L=16, E=64, T=4), src)
    outputs = {"plan": mnt / "plan.json", "synth": mnt / "s.npz", "backtest": mnt / "bt.json",
               "replay": mnt / "r.npz", "plot": mnt / "heat.png"}
    for path in outputs.values():
        path.write_bytes(b"previous")
    fill(keep=2048)
    argvs = {
        "plan": ["plan", str(src), "--gpus", "8", "-p", "greedy", "-o", str(outputs["plan"]), "-q"],
        "synth": ["synth", "-o", str(outputs["synth"]), "--windows", "2", "--tokens", "256", "-q"],
        "backtest": ["backtest", str(src), "--gpus", "8", "--no-oracle", "-q", "-o", str(outputs["backtest"])],
        "replay": ["replay", str(src), "--gpus", "8", "--warmup", "2", "-q", "-o", str(outputs["replay"])],
        "plot": ["plot", "heatmap", str(src), "-o", str(outputs["plot"]), "-q"],
    }
    for command, argv in argvs.items():
        line = one_line_error(*run_cli(argv)[::2], command)
        assert "No space left on device" in line and str(outputs[command]) in line
        assert outputs[command].read_bytes() == b"previous"
    assert leftovers(mnt) == []


# Outputs never overwrite inputs ----------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["plan", "{t}", "--gpus", "4", "-o", "{t}"],
    ["plan", "{t}", "--gpus", "4", "--previous", "{p}", "-o", "{p}"],
    ["synth", "-o", "{t}", "--compare", "{t}"],
    ["backtest", "{t}", "--gpus", "4", "-o", "{t}"],
    ["plot", "heatmap", "{t}", "-o", "{t}"],
    ["plot", "replicas", "{p}", "-o", "{p}"],
    ["plot", "replay", "{t}", "-o", "{t}"],
    ["replay", "{t}", "--gpus", "4", "-o", "{t}"],
    ["replay", "{t}", "--gpus", "4", "--hardware", "{p}", "-o", "{p}"],
    ["plan", "{t}", "--gpus", "4", "--model", "deepseek-v3", "--hardware", "{p}", "-o", "{p}"],
    ["backtest", "{t}", "--gpus", "4", "--hardware", "{p}", "-o", "{p}"],
])
def test_output_naming_an_input_is_refused_before_any_work(tmp_path, argv):
    t, p = tmp_path / "in.npz", tmp_path / "old.json"
    save_trace(small_trace(), t)
    assert main(["plan", str(t), "--gpus", "4", "-p", "greedy", "-o", str(p), "-q"]) == 0
    before = {t: t.read_bytes(), p: p.read_bytes()}
    argv = [a.format(t=t, p=p) for a in argv]
    line = one_line_error(*run_cli(argv)[::2], argv[0])
    assert "names the input" in line
    assert {t: t.read_bytes(), p: p.read_bytes()} == before
    # Another spelling of the same file is the same file.
    alias = tmp_path / "sub" / ".." / "in.npz"
    (tmp_path / "sub").mkdir()
    assert run_cli(["plan", str(t), "--gpus", "4", "-o", str(alias)])[0] == 2


# Bounded inputs --------------------------------------------------------------------------------

def npy_header_only(path: Path, shape, dtype="<i8") -> Path:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": shape})
    path.write_bytes(buf.getvalue())
    return path


def test_a_huge_declared_npy_shape_is_refused_before_loading(tmp_path, monkeypatch):
    path = npy_header_only(tmp_path / "huge.npy", (100000, 100000, 256))
    assert path.stat().st_size < 200
    with pytest.raises(EplbError, match=rf"would take 57,220\.5 GiB in memory, more than the input limit of "
                                        rf"1\.0 GiB.*{MAX_INPUT_ENV}=57221GiB"):
        load_trace(path)
    one_line_error(*run_cli(["stats", str(path)])[::2], "stats")
    # Raised limit: then the file is too short for what its header declares (not "pickle").
    monkeypatch.setenv(MAX_INPUT_ENV, "100000TiB")
    with pytest.raises(EplbError, match="truncated"):
        load_trace(path)


def test_a_truncated_npy_says_truncated_not_pickle(tmp_path):
    path = tmp_path / "t.npy"
    np.save(path, np.ones((4, 8), dtype=np.int64))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(EplbError, match=r"truncated: the array \(shape \(4, 8\), int64\) needs 256 bytes") as info:
        load_trace(path)
    assert "pickle" not in str(info.value)


def test_a_compressed_npz_is_measured_uncompressed(tmp_path, monkeypatch):
    """The issue's 0.97 MB .npz that decompresses to 2 GB, at a small limit: zeros compress ~1000x."""
    path = tmp_path / "bomb.npz"
    counts = np.zeros((64, 64, 256), dtype=np.int64)  # 8 MiB of zeros (and one token: a trace holds some)
    counts[0, :, 0] = 1
    np.savez_compressed(path, counts=counts, layer_ids=np.arange(64), meta=np.array(json.dumps(default_meta(64, 256))))
    assert path.stat().st_size < 100_000
    monkeypatch.setenv(MAX_INPUT_ENV, "1MiB")
    with pytest.raises(EplbError, match=r"8\.0 MiB uncompressed\) would take 8\.0 MiB in memory, more than the input "
                                        r"limit of 1\.0 MiB"):
        load_trace(path)
    monkeypatch.setenv(MAX_INPUT_ENV, "32MiB")
    assert load_trace(path).counts_TLE.shape == (64, 64, 256)


def test_an_npz_member_whose_header_lies_about_its_size(tmp_path):
    """A member's header may declare far more than the zip's own size: both are checked."""
    path = tmp_path / "lie.npz"
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<i8", "fortran_order": False, "shape": (10**6, 64, 256)})
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("counts.npy", header.getvalue() + b"\0" * 64)
        z.writestr("layer_ids.npy", header.getvalue())
        z.writestr("meta.npy", header.getvalue())
    with pytest.raises(EplbError, match="array 'counts' .* would take 366.2 GiB"):
        load_trace(path)


@pytest.mark.parametrize("text, limit", [("2000000000", 2_000_000_000), ("2e9", 2_000_000_000),
                                         ("4GiB", 4 * 2**30), ("500 MB", 500_000_000)])
def test_the_limit_can_be_raised(monkeypatch, text, limit):
    assert parse_size(text) == limit
    monkeypatch.setenv(MAX_INPUT_ENV, text)
    assert max_input_bytes() == limit


@pytest.mark.parametrize("text", ["lots", "1e400", "-5GB", "0"])
def test_a_bad_limit_is_named(monkeypatch, tmp_path, text):
    monkeypatch.setenv(MAX_INPUT_ENV, text)
    save_trace(small_trace(), tmp_path / "t.npz")
    with pytest.raises(EplbError, match=f"{MAX_INPUT_ENV}='{text}' is not a size"):
        load_trace(tmp_path / "t.npz")


def test_text_counts_more_than_its_size(tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"logical_count": [[1] * 100] * 10}))
    monkeypatch.setenv(MAX_INPUT_ENV, "8KiB")  # the file is ~3 KB: parsed, 1,000 numbers cost ~128 KB
    with pytest.raises(EplbError, match="parsing .* of JSON would take"):
        load_trace(path)


def test_deeply_nested_json_is_refused_everywhere(tmp_path):
    """100,000 nested '[' ended in RecursionError as a trace, a placement and --previous."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert json_depth(deep.read_bytes()) == 100_000
    for read in (load_trace, load_placement, lambda p: read_json(p, "file")):
        with pytest.raises(EplbError, match="nested 100000 levels deep"):
            read(deep)
    save_trace(small_trace(), tmp_path / "t.npz")
    for argv in (["inspect", str(deep)], ["stats", str(deep)],
                 ["plan", str(tmp_path / "t.npz"), "--gpus", "4", "--previous", str(deep)],
                 ["plot", "backtest", str(deep), "-o", str(tmp_path / "b.png")]):
        assert "nested" in one_line_error(*run_cli(argv)[::2], argv[0])
    # Brackets inside strings are text, not nesting.
    assert json_depth(b'{"a": "[[[[[[", "b": [1, "]]]"]}') == 2


def test_a_torch_view_claiming_a_huge_shape_is_sized_before_it_is_copied(tmp_path):
    torch = pytest.importorskip("torch")
    huge = torch.zeros(1, dtype=torch.int64).expand(100000, 61, 256)  # stride 0: 8 bytes stored
    path = tmp_path / "dump.pt"
    torch.save({"logical_count": huge}, path)
    assert path.stat().st_size < 10_000
    with pytest.raises(EplbError, match=f"logical_count .* would take {format_size(100000 * 61 * 256 * TENSOR_BYTES)}"):
        load_trace(path)
    from eplb.formats.export import read_placement

    torch.save({"physical_to_logical_map": huge[0], "logical_to_physical_map": huge,
                "logical_replica_count": huge[0]}, tmp_path / "plan.pt")
    with pytest.raises(EplbError, match="would take"):
        read_placement(tmp_path / "plan.pt", "vllm", num_gpus=4)


def test_a_run_that_fails_after_its_work_leaves_the_output_alone(tmp_path):
    """`eplb synth -o out.npz --compare bad.json` wrote the trace, then failed on the bad file."""
    out = tmp_path / "out.npz"
    out.write_bytes(b"previous trace")
    (tmp_path / "bad.json").write_text('{"not": "a trace"}')
    argv = ["synth", "-o", str(out), "--windows", "1", "--tokens", "16", "--compare", str(tmp_path / "bad.json")]
    assert "no 'logical_count' key" in one_line_error(*run_cli(argv)[::2], "synth")
    assert out.read_bytes() == b"previous trace" and leftovers(tmp_path) == []


@pytest.mark.parametrize("argv, want", [
    (["replay", "{t}", "--gpus", "4", "-o", "{d}/r.json"], "ends in .json, but this writes a replay (.npz)"),
    (["calibrate", "-o", "{d}/cpu.npz"], "ends in .npz, but this writes a hardware profile (JSON)"),
    (["calibrate", "-o", "{d}/no/cpu.json"], "does not exist"),
    (["calibrate", "--experts", "99999999999"], "more than the input limit"),
    (["calibrate", "--tokens", "1,99999999999"], "up to 99999999999 tokens per rank"),
])
def test_new_commands_check_the_output_name_before_any_work(tmp_path, argv, want):
    """replay and calibrate refuse an -o that names another kind of file, or no folder, first."""
    t = tmp_path / "in.npz"
    save_trace(small_trace(), t)
    argv = [a.format(t=t, d=tmp_path) for a in argv]
    assert want in one_line_error(*run_cli(argv)[::2], argv[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.npz"]
