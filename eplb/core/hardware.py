"""Hardware profiles: the few numbers of a GPU (or CPU) that the cost model needs, as data.

Every figure is per GPU and per direction. FLOP/s are dense (the spec sheets' "with sparsity"
figures are twice these). Bandwidths are the peaks the spec sheets give; real kernels reach
a fraction of them (DeepEP measures ~150 GB/s of H800's 160 GB/s NVLink and 43-58 GB/s of a
50 GB/s RDMA NIC), which is what `eplb calibrate` is for on hardware at hand. A profile is
a `Hardware` value: a preset by name (`get_hardware("h200")`), or a JSON/YAML file of the
same fields (`get_hardware("my-gpu.yaml")`), optionally starting from a preset (`base: h200`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from eplb.core.files import as_path, parse_json, parse_yaml, read_bytes
from eplb.core.outputs import write_text
from eplb.errors import EplbError

FLOP_DTYPES = ("fp32", "bf16", "fp16", "fp8", "fp4")
"""dtypes a profile may give a FLOP/s figure for (the expert GEMM's input dtype)."""

NUMBER_FIELDS = ("hbm_bytes_per_s", "nvlink_bytes_per_s", "internode_bytes_per_s")
"""Bandwidths: must be > 0."""
OVERHEAD_FIELDS = ("expert_overhead_s", "a2a_latency_s")
"""Fixed costs: must be >= 0 (0 = none)."""


@dataclass(frozen=True)
class Hardware:
    """One accelerator's peak numbers (per GPU, per direction)."""

    name: str
    """Display name."""
    flops_per_s: Mapping[str, float]
    """Dense matrix FLOP/s by input dtype, e.g. {"bf16": 9.89e14, "fp8": 1.979e15}."""
    hbm_bytes_per_s: float
    """Device-memory bandwidth: what streaming an expert's weights runs at."""
    nvlink_bytes_per_s: float
    """Intra-node bandwidth of one GPU, one direction (NVLink; on CPU: the local transport)."""
    internode_bytes_per_s: float
    """Inter-node bandwidth of one GPU, one direction (its RDMA NIC)."""
    expert_overhead_s: float = 0.0
    """Fixed cost of each active expert replica in a layer (kernel launch, tile scheduling,
    pipeline fill); paid once per replica that gets any rows."""
    a2a_latency_s: float = 0.0
    """Fixed cost of one dispatch or one combine (launch and synchronisation)."""
    source: str = ""
    """Where the numbers come from."""
    extra: dict = field(default_factory=dict, compare=False)
    """Free-form provenance (a calibration's fit error), kept when saved."""

    def __post_init__(self) -> None:
        name = self.name or "profile"
        if not isinstance(self.flops_per_s, Mapping) or not self.flops_per_s:
            raise EplbError(f"hardware {name}: flops_per_s must map dtypes ({', '.join(FLOP_DTYPES)}) to "
                            f"FLOP/s, got {self.flops_per_s!r}")
        flops = {}
        for dtype, v in self.flops_per_s.items():
            if dtype not in FLOP_DTYPES:
                raise EplbError(f"hardware {name}: flops_per_s.{dtype}: unknown dtype; use {', '.join(FLOP_DTYPES)}")
            flops[dtype] = _positive(name, f"flops_per_s.{dtype}", v)
        object.__setattr__(self, "flops_per_s", flops)
        for key in NUMBER_FIELDS:
            object.__setattr__(self, key, _positive(name, key, getattr(self, key)))
        for key in OVERHEAD_FIELDS:
            object.__setattr__(self, key, _positive(name, key, getattr(self, key), allow_zero=True))

    def flops(self, dtype: str) -> float:
        """Dense FLOP/s for GEMMs in `dtype`; an error names the dtypes the profile has."""
        if dtype not in self.flops_per_s:
            raise EplbError(f"hardware {self.name} has no FLOP/s figure for {dtype}: it gives "
                            f"{', '.join(self.flops_per_s)}; pick one of those dtypes or add flops_per_s.{dtype}")
        return self.flops_per_s[dtype]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["flops_per_s"] = dict(self.flops_per_s)
        return d

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON (what `get_hardware(path)` reads back), atomically: a failed
        write leaves an existing file as it was (eplb.core.outputs)."""
        write_text(path, json.dumps(self.to_dict(), indent=2) + "\n", what="the hardware profile")


def _positive(name: str, key: str, v: Any, allow_zero: bool = False) -> float:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or v < 0 or (v == 0 and not allow_zero):
        need = ">= 0" if allow_zero else "> 0"
        raise EplbError(f"hardware {name}: {key} must be a finite number {need}, got {v!r}")
    return float(v)


# Presets. Spec-sheet figures are dense (half the "with sparsity" ones) and per direction
# (half the bidirectional NVLink totals). Inter-node: one ConnectX-7 400 Gb/s NIC per GPU,
# as in DGX H100/H200/B200 (400 Gb/s = 50 GB/s). The overheads are no spec-sheet figure:
# orders of magnitude of a kernel launch (a few us) and of one DeepEP dispatch/combine's fixed
# part; fit them with `eplb calibrate` where that matters.
_GPU_OVERHEADS = {"expert_overhead_s": 2e-6, "a2a_latency_s": 1e-5}

PROFILES: dict[str, Hardware] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): FP8 3,958 / BF16 1,979 TFLOPS with sparsity,
    # HBM3 3.35 TB/s, NVLink 900 GB/s.
    "h100": Hardware("H100 SXM", {"bf16": 989.5e12, "fp16": 989.5e12, "fp8": 1979e12},
                     hbm_bytes_per_s=3.35e12, nvlink_bytes_per_s=450e9, internode_bytes_per_s=50e9,
                     **_GPU_OVERHEADS, source="NVIDIA H100 datasheet (SXM5); ConnectX-7 400 Gb/s per GPU"),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): same tensor cores as H100, HBM3e 4.8 TB/s,
    # NVLink 900 GB/s.
    "h200": Hardware("H200 SXM", {"bf16": 989.5e12, "fp16": 989.5e12, "fp8": 1979e12},
                     hbm_bytes_per_s=4.8e12, nvlink_bytes_per_s=450e9, internode_bytes_per_s=50e9,
                     **_GPU_OVERHEADS, source="NVIDIA H200 datasheet (SXM); ConnectX-7 400 Gb/s per GPU"),
    # NVIDIA HGX B200 / DGX B200 datasheets, per GPU: FP4 18 / FP8 9 / BF16 4.5 PFLOPS with
    # sparsity, HBM3e 8 TB/s (64 TB/s for 8 GPUs), NVLink 5 1.8 TB/s.
    "b200": Hardware("B200 SXM", {"bf16": 2.25e15, "fp16": 2.25e15, "fp8": 4.5e15, "fp4": 9e15},
                     hbm_bytes_per_s=8e12, nvlink_bytes_per_s=900e9, internode_bytes_per_s=50e9,
                     **_GPU_OVERHEADS, source="NVIDIA HGX B200 datasheet; ConnectX-7 400 Gb/s per GPU"),
    # This project's 2-core development machine (AMD EPYC, KVM), running the runtime shim in
    # fp32 with one torch thread per rank and gloo over loopback: fitted by `eplb calibrate`
    # (4 ranks; docs/results/time.md has the fit and its R^2; fits of the shared machine vary
    # from run to run, memory bandwidth most: 130-310 GB/s). Nodes do not exist there: the
    # inter-node figure is the same loopback transport.
    "cpu": Hardware("2-core CPU (gloo)", {"fp32": 6.4e10},
                    hbm_bytes_per_s=1.3e11, nvlink_bytes_per_s=2.4e7, internode_bytes_per_s=2.4e7,
                    expert_overhead_s=6.5e-4, a2a_latency_s=1.0e-2,
                    source="fitted by eplb calibrate on the 2-core development machine"),
}


def hardware_names() -> list[str]:
    return list(PROFILES)


def get_hardware(name_or_path: str | Path | Hardware) -> Hardware:
    """A preset by name (h100, h200, b200, cpu), a profile file (.json/.yaml), or the value itself."""
    if isinstance(name_or_path, Hardware):
        return name_or_path
    key = str(name_or_path).strip().lower()
    if key in PROFILES:
        return PROFILES[key]
    path = Path(str(name_or_path))
    if path.suffix.lower() in (".json", ".yaml", ".yml") or path.is_file():
        return load_hardware(path)
    raise EplbError(f"unknown hardware {str(name_or_path)!r}: choose one of {', '.join(PROFILES)}, or give a "
                    f"JSON/YAML profile file (see docs/cost-model.md)")


def load_hardware(path: str | Path) -> Hardware:
    """Read a profile file (JSON or YAML; `base: NAME` starts from a preset and overrides it)."""
    path = as_path(path, "hardware profile")
    raw = read_bytes(path, "hardware profile")  # within the input limit (eplb.core.files)
    if path.suffix.lower() in (".yaml", ".yml"):
        d = parse_yaml(raw, str(path))  # plain data only, aliases bounded
    else:
        d = parse_json(raw, str(path))  # bounded depth; errors name the file
    return hardware_from_dict(d, source=str(path))


def _number(v: Any) -> Any:
    """A float from numeric text ("4.8e12"); anything else as it is (the value checks name it)."""
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return v
    return v


def hardware_from_dict(d: Any, *, source: str = "profile") -> Hardware:
    """A Hardware from a mapping of its fields; every missing one is named."""
    if not isinstance(d, Mapping):
        raise EplbError(f"{source}: a hardware profile is a mapping of fields, got {type(d).__name__}")
    d = dict(d)
    known = {"name", "flops_per_s", *NUMBER_FIELDS, *OVERHEAD_FIELDS, "source", "extra", "base"}
    unknown = sorted(str(k) for k in set(d) - known)  # YAML keys may be numbers
    if unknown:
        raise EplbError(f"{source}: unknown field(s) {', '.join(unknown)}; a profile has "
                        f"{', '.join(sorted(known - {'extra'}))}")
    # PyYAML (YAML 1.1) reads 4.8e12, without a sign in the exponent, as text: take numeric text.
    for key in (*NUMBER_FIELDS, *OVERHEAD_FIELDS):
        d[key] = _number(d[key]) if key in d else d.get(key)
        if d[key] is None:
            del d[key]
    if "flops_per_s" in d and not isinstance(d["flops_per_s"], Mapping):
        raise EplbError(f"{source}: flops_per_s must map dtypes ({', '.join(FLOP_DTYPES)}) to FLOP/s, "
                        f"got {d['flops_per_s']!r}")
    for key in ("name", "source"):
        if key in d and not isinstance(d[key], str):
            raise EplbError(f"{source}: {key} must be text, got {d[key]!r}")
    if "extra" in d and not isinstance(d["extra"], Mapping):
        raise EplbError(f"{source}: extra must be a mapping, got {type(d['extra']).__name__}")
    if "flops_per_s" in d:
        d["flops_per_s"] = {k: _number(v) for k, v in d["flops_per_s"].items()}
    base_name = d.pop("base", None)
    if base_name is not None:
        if str(base_name).lower() not in PROFILES:
            raise EplbError(f"{source}: base {base_name!r} is not a preset: choose one of {', '.join(PROFILES)}")
        base = PROFILES[str(base_name).lower()]
        flops = {**base.flops_per_s, **(d.pop("flops_per_s", None) or {})}
        try:
            return replace(base, flops_per_s=flops, source=d.pop("source", f"{source} (base {base_name})"),
                           **{k: v for k, v in d.items()})
        except EplbError as exc:
            raise EplbError(f"{source}: {exc}") from None
    missing = [k for k in ("flops_per_s", *NUMBER_FIELDS) if k not in d]
    if missing:
        raise EplbError(f"{source}: missing field(s) {', '.join(missing)} (or give `base: NAME` to start from "
                        f"one of {', '.join(PROFILES)})")
    d.setdefault("name", Path(source).stem)
    d.setdefault("source", source)
    try:
        return Hardware(**d)
    except EplbError as exc:
        raise EplbError(f"{source}: {exc}") from None
