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
import threading

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


def prime(planner: str, settings: dict | None = None) -> threading.Thread:
    """Plan a tiny load with `planner`, from scratch and from a served map, on a daemon thread.

    Engines plan synchronously inside their rebalance. Run while the engine loads its model,
    this makes every kernel such a plan calls meet the argument types real calls use
    (eplb.core.jit): on a warm cache each loads its machine code here, not inside the first
    rebalance; after an install each asks for its compile in a side process, done long before
    the engine's first rebalance (which meanwhile would run the kernels as plain Python)."""
    def run() -> None:
        import numpy as np

        from eplb.planning.front_door import plan

        load = np.array([[5.0, 3.0, 2.0, 1.0, 1.0, 1.0, 1.0, 2.0]] * 2)
        first = plan(load, num_gpus=2, num_redundant=2, planner=planner, settings=settings)
        plan(load[:, ::-1].copy(), num_gpus=2, num_redundant=2, planner=planner, settings=settings,
             previous=first.placement)

    thread = threading.Thread(target=run, name="eplb-prime", daemon=True)
    thread.start()
    return thread
