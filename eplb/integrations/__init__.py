"""Engine integrations, one module per engine; the only eplb code that imports an engine.

- `eplb.integrations.vllm`: a `vllm.general_plugins` entry point that installs eplb's planner
  as vLLM's EPLB policy when `EPLB_VLLM_POLICY` is set.
- `eplb.integrations.sglang`: `python -m eplb.integrations.sglang [eplb options] -- <SGLang
  server args>`, and the `sglang.srt.plugins` entry point it drives.
- `eplb.integrations.trtllm`: checks a `load_balancer` YAML against a TensorRT-LLM
  deployment (TensorRT-LLM has no Python policy hook: static YAML only).
Each module checks the engine version it was written for. See docs/engines.md.
"""

from __future__ import annotations

import os

from eplb.errors import EplbError
from planners.api import setting_value


def check_version(engine: str, version: str, supported: tuple[str, ...], override_env: str) -> None:
    """Refuse an engine version the integration was not written for, naming the supported ones.

    The environment variable `override_env`=1 accepts another version at the user's risk
    (the integration then logs nothing more: the engine's own code decides what works).
    """
    base = version.split("+")[0]
    if base in supported or os.environ.get(override_env) == "1":
        return
    raise EplbError(f"{engine} {version} is not a version eplb's integration was written for "
                    f"(supported: {', '.join(supported)}): install one of those, or set {override_env}=1 "
                    f"to try it anyway")


def parse_spec(spec: str, env: str) -> tuple[str, dict]:
    """"PLANNER[,key=value...]" -> (planner, settings); values read as int, float, bool or text."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise EplbError(f"{env} is empty: give a planner name, e.g. {env}=greedy")
    settings: dict = {}
    for item in parts[1:]:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise EplbError(f"{env}={spec!r}: expected PLANNER,key=value,..., got {item!r}")
        settings[key.strip()] = setting_value(text)
    return parts[0], settings


def compile_aside(planner: str) -> None:
    """Start compiling the kernels a plan with `planner` runs, in detached processes (one per
    warm-up, eplb.core.jit.compile_detached).

    Engines plan synchronously inside their rebalance, so after an install the first one would
    compile numba's kernels inside it, a stall of seconds. Started while the engine loads the
    model, the compile is done before then; on a warm cache each process only loads the
    kernels and exits (about a second). Concurrent compiles of one warm-up take turns
    (eplb.core.jit.compile_once), so several processes starting this cost one compile."""
    from eplb.core.jit import compile_detached
    from eplb.planning.kernel_sets import kernel_modules

    for name in kernel_modules(planner):
        compile_detached(name)
