"""`eplb calibrate` end to end on 2 gloo ranks (one start, small shapes): measure, fit, write."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.distributed


def test_calibrate_cli_measures_fits_and_writes_a_profile(tmp_path, capsys):
    from eplb.cli import main
    from eplb.core.hardware import get_hardware

    out = tmp_path / "cpu.json"
    rc = main(["calibrate", "--ranks", "2", "--experts", "8", "--layers", "1", "--hidden", "32",
               "--expert-hidden", "48", "--top-k", "2", "--tokens", "1,6", "--steps", "2", "-o", str(out), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    fit = report["fit"]
    # 4 placements x 2 batch sizes; every rank of every case measured (the workers also check
    # that each rank computed exactly the rows its replica choice says).
    assert fit["cases"] == 8 and np.array(fit["measured_ms_CG"]).shape == (8, 2)
    assert (np.array(fit["measured_ms_CG"]) > 0).all() and np.isfinite(fit["r2_compute"])
    hw = get_hardware(str(out))
    assert hw.extra["fit"]["cases"] == 8 and hw.flops("fp32") > 0 and "gloo" in hw.source
