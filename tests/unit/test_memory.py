"""The input limit is true of the memory a read uses (issue 35: a JSON inside the 1 GiB bound
once peaked at 19x its size).

Every reader charges an input what it will allocate (JSON: per number, string and container
counted from the text; .npy / .npz: the declared elements; .pt: per tensor element) and refuses
it when the charge tops EPLB_MAX_INPUT_BYTES. For each input kind this test finds the charge
(the limit is raised to each refusal's own figure until the read passes: a file meets several
checks in turn), then reads the file in a fresh process and checks that the peak resident
memory the read added stays within that charge. Files are a few MiB, so each run takes about
a second.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eplb.core.files import parse_size
from eplb.core.trace import Trace, default_meta
from eplb.formats import save_trace

ROOT = Path(__file__).resolve().parents[2]

# The read in a fresh process: modules imported first, so that only the read's own allocations
# raise the peak above the resident size measured just before it.
PROBE = """
import sys
import eplb, eplb.formats.detect
if sys.argv[1].endswith(".pt"):
    import torch
def kib(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the resident size now: imports no longer count
before = kib("VmRSS:")
try:
    eplb.load_trace(sys.argv[1])
except eplb.EplbError as exc:
    print("refused", exc)
    sys.exit(0)
print("peak", (kib("VmHWM:") - before) * 1024)
"""
_CHARGE = re.compile(r"would take ([0-9.,]+ (?:bytes|KiB|MiB|GiB)) in memory")


def _read(path: Path, limit: int) -> str:
    env = {**os.environ, "EPLB_MAX_INPUT_BYTES": str(limit), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, env=env,
                          timeout=120, check=True)
    return done.stdout.strip()


def _charge_and_peak(path: Path) -> tuple[int, int]:
    limit = 1
    for _ in range(6):  # each check the file meets in turn names its own charge
        out = _read(path, limit)
        if out.startswith("peak"):
            return limit, int(out.split()[1])
        m = _CHARGE.search(out)
        assert m, out
        # format_size rounds to 0.1 of its unit: step up by that much so the same check passes.
        charge = parse_size(m.group(1).replace(",", "").replace(" ", "")) + 2**20 // 10 * ("iB" in m.group(1))
        assert charge > limit, out
        limit = charge + 1
    raise AssertionError(f"{path}: still refused at {limit} bytes")


def _counts() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 10, size=(120, 58, 64))


def _json(d: Path) -> Path:
    p = d / "t.json"
    p.write_text(json.dumps({"logical_count": _counts().tolist()}))
    return p


def _npz(d: Path) -> Path:
    c = _counts()
    return save_trace(Trace(c, np.arange(58), default_meta(58, 64, source="memory test")), d / "t.npz")


def _npy(d: Path) -> Path:
    np.save(d / "t.npy", _counts())
    return d / "t.npy"


def _pt(d: Path) -> Path:
    torch = pytest.importorskip("torch")
    torch.save({"logical_count": torch.tensor(_counts())}, d / "t.pt")
    return d / "t.pt"


@pytest.mark.parametrize("make", [_json, _npz, _npy, _pt], ids=["json", "npz", "npy", "pt"])
def test_a_read_stays_within_the_memory_it_is_charged(tmp_path, make):
    path = make(tmp_path)
    charge, peak = _charge_and_peak(path)
    assert peak <= charge, f"{path.name}: the read added {peak:,} bytes at its peak, charged {charge:,}"
    # The charge is a bound, not a guess far above it: within 8x of what was used.
    assert charge <= 8 * max(peak, 2**20), f"{path.name}: charged {charge:,} bytes for a peak of {peak:,}"
