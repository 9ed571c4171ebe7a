"""SGLang launcher: eplb's planner as SGLang's EPLB algorithm, and `--init-expert-location` checks.

Legend: H = hidden layers (SGLang's map rows, dense ones included), L = MoE layers,
E = logical experts, G = EP ranks, P = physical slots, T = windows of the recorder.

    python -m eplb.integrations.sglang [--planner rule-aware] [--set KEY=VALUE] [--max-moves K] \\
        -- --model-path deepseek-ai/DeepSeek-V3 --tp-size 32 --ep-size 32 --enable-eplb \\
           --ep-num-redundant-experts 32 --moe-a2a-backend deepep ...

What it does, in this order:
1. Checks the SGLang version (SUPPORTED_VERSIONS) and refuses others, naming them.
2. Checks an `--init-expert-location` file that holds a `physical_to_logical_map` against the
   server's hidden layers and slots (E + `--ep-num-redundant-experts`) when the model's
   `config.json` is on disk; SGLang itself accepts a 58-row file for a 61-layer model, or a
   288-slot file for a 320-slot server, without a word. The same check runs again inside
   every scheduler process, on the model config SGLang loaded.
3. Installs eplb's algorithm in place of `sglang.srt.eplb.eplb_algorithms.rebalance_experts`,
   the one function behind both SGLang's start-up plan from statistics (`--init-expert-location`
   with `logical_count`) and its periodic rebalance (`--enable-eplb`).
4. Primes the planner's kernels (`eplb.integrations.prime`: a tiny plan on a daemon thread,
   which loads them from numba's cache, or after an install starts their compiles in side
   processes), then SGLang's server (`sglang.launch_server`) in this process.
SGLang starts its schedulers with the `spawn` method, so a patch made in this process alone
would not reach them; SGLang loads `sglang.srt.plugins` entry points in every process
(`load_plugins()`), and eplb's (`register`, pyproject.toml) installs the hooks wherever
`EPLB_SGLANG_PLANNER` is set, which the launcher does. Installing eplb changes nothing else.

The algorithm plans with `eplb.plan(..., dispatch=...)` for the rule SGLang applies after a
rebalance: `static` (SglangStatic(path="rebalance")), `dynamic` (an even split) or `lp`
(SglangLp(path="rebalance"): a per-batch LP over every replica), from `--ep-dispatch-algorithm`
or SGLang's default for the MoE backend. It plans against the recorder's windows, keeps the
replicas SGLang serves now in place (plus a move budget), and returns the candidate lists in
slot order, the order the dispatch model assumes. Under `lp` the plan (robust by default: the
rule-aware planner packs for static rules) is then searched for the per-batch re-split
(eplb.planning.resplit_plan: `resplit_repair` of the served placement and of the plan over the
recorder's windows, a move priced at --move-cost, capped by --max-moves; --resplit-rounds passes,
default RESPLIT_ROUNDS, since SGLang's rebalance stalls serving while it plans). Rows with no
tokens (dense layers) get SGLang's trivial row `p % E`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import runpy
import sys
import threading
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np

from eplb.core.files import check_archive, parse_json, read_json
from eplb.core.placement import Placement
from eplb.core.trace import Trace, default_meta
from eplb.dispatch.rules import EvenSplit
from eplb.dispatch.sglang import SglangStatic
from eplb.dispatch.sglang_lp import SglangLp
from eplb.errors import EplbError, reason
from eplb.formats.deepseek import to_deepseek
from eplb.integrations import check_version, parse_spec, prime
from eplb.migration import Budget
from eplb.planning.front_door import plan
from planners.api import planner_names, planner_settings

ENV_PLANNER = "EPLB_SGLANG_PLANNER"
DEFAULT_PLANNER = "rule-aware"
ENV_DISPATCH = "EPLB_SGLANG_DISPATCH"
ENV_ANY_VERSION = "EPLB_SGLANG_ANY_VERSION"
SUPPORTED_VERSIONS = ("0.5.23",)
BUDGET_KEYS = ("max_moves", "max_moves_per_gpu", "move_cost")
RESPLIT_ROUNDS = 2
"""Passes of the re-split search per rebalance under `lp` (PLAN_ROUNDS, 8, from scratch takes
minutes at 32 GPUs on two cores; SGLang serves nothing while its rebalance plans)."""
ALGORITHM = "sglang.srt.eplb.eplb_algorithms.rebalance_experts"
INITIAL = "sglang.srt.eplb.expert_location.compute_initial_expert_location_metadata"


# Checks ---------------------------------------------------------------------------------------

def check_expert_location(data, *, num_layers: int, num_logical_experts: int, num_physical_experts: int,
                          source: str = "--init-expert-location") -> None:
    """Refuse a `physical_to_logical_map` whose rows or slots do not match the server (both numbers)."""
    if not isinstance(data, dict) or "physical_to_logical_map" not in data:
        return  # `logical_count` statistics: SGLang plans from them itself (with eplb's algorithm)
    phy = np.asarray(data["physical_to_logical_map"])
    if phy.ndim != 2:
        raise EplbError(f"{source}: physical_to_logical_map must be [hidden layers, slots], got shape {phy.shape}")
    rows, slots = phy.shape
    if rows != num_layers:
        raise EplbError(f"{source}: the map has {rows} rows, the model has {num_layers} hidden layers: write "
                        f"it with num_hidden_layers={num_layers} (eplb plan takes it from the trace)")
    if slots != num_physical_experts:
        raise EplbError(f"{source}: the map has {slots} slots, the server has {num_physical_experts} "
                        f"({num_logical_experts} experts + {num_physical_experts - num_logical_experts} redundant): "
                        f"launch with --ep-num-redundant-experts {slots - num_logical_experts}, or plan for "
                        f"{num_physical_experts} slots")
    if phy.size and (phy.min() < 0 or phy.max() >= num_logical_experts):
        raise EplbError(f"{source}: the map holds expert ids outside 0..{num_logical_experts - 1}")


def read_expert_location(value: str):
    """What SGLang reads from `--init-expert-location` (a .pt / .json file or inline JSON), or None."""
    if value == "trivial":
        return None
    if value.endswith(".pt"):
        import torch

        check_archive(value, "--init-expert-location file")  # declared size within the input limit
        try:
            return torch.load(value, weights_only=True, map_location="cpu")
        except Exception as exc:  # torch raises several types for unsafe or corrupt files
            raise EplbError(f"--init-expert-location {value}: cannot load as a weights-only torch file "
                            f"({type(exc).__name__}: {reason(exc)})") from None
    if value.endswith(".json"):
        return read_json(value, "--init-expert-location file")  # bounded size and depth (eplb.core.files)
    return parse_json(value.encode("utf-8"), f"--init-expert-location {value[:40]!r}")


def model_shape(model_path: str) -> tuple[int, int] | None:
    """(hidden layers, routed experts) from a local model's config.json, or None when not on disk."""
    cfg = Path(model_path, "config.json")
    if not cfg.is_file():
        return None
    d = read_json(cfg, "model config")
    if not isinstance(d, dict):
        return None
    experts = next((d[k] for k in ("n_routed_experts", "num_experts", "num_local_experts") if k in d), None)
    if "num_hidden_layers" not in d or experts is None:
        return None
    return int(d["num_hidden_layers"]), int(experts)


def check_sglang_version() -> str:
    import sglang

    check_version("SGLang", sglang.__version__, SUPPORTED_VERSIONS, ENV_ANY_VERSION)
    return sglang.__version__


# In SGLang's processes ------------------------------------------------------------------------

def register() -> None:
    """`sglang.srt.plugins` entry point: install eplb's hooks when EPLB_SGLANG_PLANNER is set."""
    spec = os.environ.get(ENV_PLANNER)
    if not spec:
        return
    check_sglang_version()
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(ALGORITHM, rebalance_experts, HookType.REPLACE)
    HookRegistry.register(INITIAL, _checked_initial_location, HookType.AROUND)


def _checked_initial_location(original, model_config, *args, **kwargs):
    """Check the start-up file against the model config SGLang loaded, then run SGLang's code.

    SGLang runs this in the scheduler processes only (each model runner computes its expert
    locations at start-up), the processes whose rebalance calls eplb's algorithm: they load the
    planner's kernels here (`eplb.integrations.prime`), so that their first rebalance does not
    load them inside its stall."""
    from sglang.srt.eplb.expert_location import ModelConfigForExpertLocation
    from sglang.srt.runtime_context import get_exec

    prime(*_primed())
    # The plan from the served map imports the assignment solver on first use (about 0.5 s).
    threading.Thread(target=importlib.import_module, args=("scipy.optimize",), daemon=True).start()
    moe = get_exec().moe
    mc = ModelConfigForExpertLocation.from_model_config(model_config)
    if mc is not None and moe.init_expert_location != "trivial":
        check_expert_location(read_expert_location(moe.init_expert_location), num_layers=mc.num_layers,
                              num_logical_experts=mc.num_logical_experts,
                              num_physical_experts=mc.num_logical_experts + moe.ep_num_redundant_experts)
    return original(model_config, *args, **kwargs)


def _configured() -> tuple[str, dict]:
    """(planner, settings) that EPLB_SGLANG_PLANNER names (the launcher sets it; default rule-aware)."""
    return parse_spec(os.environ.get(ENV_PLANNER, DEFAULT_PLANNER), ENV_PLANNER)


def _primed() -> tuple[str, dict]:
    """(planner, its own settings): the configuration without the budget and search keys, for `prime`."""
    planner, settings = _configured()
    return planner, {k: v for k, v in settings.items() if k not in BUDGET_KEYS + ("resplit_rounds",)}


def _current_map():
    """The map SGLang serves now, [H, P] numpy, or None (start-up, or outside a server)."""
    try:
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

        meta = get_global_expert_location_metadata()
    except Exception:  # no runtime context published: not inside a running server
        return None
    return None if meta is None else meta.physical_to_logical_map_cpu.numpy()


def rebalance_experts(tokens_per_expert, num_physical_experts: int, num_local_physical_experts: int,
                      num_groups, num_nodes: int, algorithm=None):
    """SGLang's `eplb_algorithms.rebalance_experts`, planned by eplb.

    tokens_per_expert: [T, H, E] (or [H, E]) token counts. Returns SGLang's triple:
    physical_to_logical_map [H, P], logical_to_all_physical_map [H, E, X] (slot order, -1
    padded), expert_count [H, E], int64 CPU tensors. `algorithm` (SGLang's choice) is ignored.
    """
    import torch

    planner, settings = _configured()
    counts = tokens_per_expert.detach().cpu().to(torch.float64).numpy()
    if counts.ndim == 2:
        counts = counts[None]
    T, H, E = counts.shape
    G = num_physical_experts // num_local_physical_experts
    P = num_physical_experts
    budget = {k: settings.pop(k) for k in BUDGET_KEYS if k in settings}
    rounds = int(settings.pop("resplit_rounds", RESPLIT_ROUNDS))
    moe = np.flatnonzero(counts.sum(axis=(0, 2)) > 0)
    full_HP = np.tile(np.arange(P, dtype=np.int64) % E, (H, 1))
    if moe.size:
        mode = os.environ.get(ENV_DISPATCH, "static")
        rule = {"static": SglangStatic(path="rebalance", num_hidden_layers=H),
                "lp": SglangLp(path="rebalance")}.get(mode, EvenSplit())
        current = _current_map()
        previous = None
        if current is not None and current.shape == (H, P):
            try:
                previous = Placement(current[moe], G, E, num_nodes, moe)
            except EplbError:
                previous = None  # a map with an expert missing in some layer: plan from scratch
        groups = num_groups if num_groups and E % num_groups == 0 else None
        trace = Trace(np.rint(counts[:, moe]).astype(np.int64), moe, default_meta(H, E))
        budget = Budget(**budget) if previous is not None else None
        result = plan(trace, num_gpus=G, num_nodes=num_nodes, slots_per_gpu=num_local_physical_experts,
                      planner=planner, settings=settings, num_expert_groups=groups, previous=previous,
                      budget=budget, dispatch=rule, resplit_rounds=rounds)
        # The map alone: `result.placement` would score the plan and the contiguous baseline
        # under the rule (two more binds), time SGLang's rebalance stalls on for a report nobody reads.
        full_HP[moe] = result.solution.phy2log_LP
    full = Placement(full_HP, G, E, num_nodes)
    phy, log2phy, count = to_deepseek(full)
    return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in (phy, log2phy, count))


# The launcher ---------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m eplb.integrations.sglang",
        description="Start SGLang's server with eplb's planner as its EPLB algorithm.",
        epilog="example:\n  python -m eplb.integrations.sglang --planner rule-aware -- --model-path "
               "deepseek-ai/DeepSeek-V3 --tp-size 32 --ep-size 32 --enable-eplb --ep-num-redundant-experts 32",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--planner", help=f"eplb planner (default {DEFAULT_PLANNER}; robust under "
                                     f"--ep-dispatch-algorithm lp)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="planner setting (repeatable)")
    p.add_argument("--max-moves", type=int, help="copy at most K experts per rebalance")
    p.add_argument("--max-moves-per-gpu", type=int, help="at most K copies onto any GPU per rebalance")
    p.add_argument("--move-cost", type=float, help="a copy must lower its layer's busiest GPU by C x mean load")
    p.add_argument("--resplit-rounds", type=int, help=f"under --ep-dispatch-algorithm lp: passes of the re-split "
                                                      f"search per rebalance (default {RESPLIT_ROUNDS})")
    return p


def _server_options(sglang_args: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--model-path", "--model")
    p.add_argument("--init-expert-location", default="trivial")
    p.add_argument("--ep-num-redundant-experts", type=int, default=0)
    p.add_argument("--ep-dispatch-algorithm")
    p.add_argument("--moe-a2a-backend", default="none")
    return p.parse_known_args(sglang_args)[0]


def prepare(argv: list[str]) -> list[str]:
    """Steps 1-2 and the environment for step 3; returns SGLang's own arguments."""
    if "--" not in argv:
        raise EplbError("separate eplb's options from SGLang's with --: python -m eplb.integrations.sglang "
                        "[eplb options] -- --model-path ... (SGLang's arguments)")
    cut = argv.index("--")
    args = _parser().parse_args(argv[:cut])
    sglang_args = argv[cut + 1:]
    settings = [s for s in args.set]
    check_sglang_version()
    srv = _server_options(sglang_args)
    mode = srv.ep_dispatch_algorithm or ("dynamic" if srv.moe_a2a_backend == "none" else "static")
    if mode == "lp" and srv.moe_a2a_backend == "none":
        raise EplbError("--ep-dispatch-algorithm lp needs an all-to-all MoE backend (SGLang refuses it with "
                        "--moe-a2a-backend none): add --moe-a2a-backend deepep, or use --ep-dispatch-algorithm dynamic")
    if mode == "lp" and args.planner == "rule-aware":
        raise EplbError("--planner rule-aware plans for SGLang's static rules, not --ep-dispatch-algorithm lp: "
                        "drop --planner (robust), or give greedy / robust")
    if args.resplit_rounds is not None and (mode != "lp" or args.resplit_rounds < 1):
        raise EplbError(f"--resplit-rounds {args.resplit_rounds} sets the re-split search under "
                        f"--ep-dispatch-algorithm lp: give a whole number >= 1 with lp, or drop it")
    args.planner = args.planner or ("robust" if mode == "lp" else DEFAULT_PLANNER)
    if args.planner not in planner_names():
        raise EplbError(f"unknown planner {args.planner!r}: choose one of {', '.join(planner_names())}")
    for item in settings:
        key = item.partition("=")[0].strip()
        if "=" not in item or key not in planner_settings(args.planner):
            raise EplbError(f"--set {item}: planner {args.planner!r} takes KEY=VALUE with KEY one of "
                            f"{', '.join(planner_settings(args.planner)) or 'none'}")
    shape = model_shape(srv.model_path) if srv.model_path else None
    if shape is not None and srv.init_expert_location != "trivial":
        layers, experts = shape
        check_expert_location(read_expert_location(srv.init_expert_location), num_layers=layers,
                              num_logical_experts=experts,
                              num_physical_experts=experts + srv.ep_num_redundant_experts)
    budget = [f"{k}={v}" for k, v in (("max_moves", args.max_moves), ("max_moves_per_gpu", args.max_moves_per_gpu),
                                      ("move_cost", args.move_cost), ("resplit_rounds", args.resplit_rounds))
              if v is not None]
    os.environ[ENV_PLANNER] = ",".join([args.planner] + settings + budget)
    os.environ[ENV_DISPATCH] = mode
    allowed = os.environ.get("SGLANG_PLUGINS")
    if allowed and "eplb" not in allowed.split(","):
        os.environ["SGLANG_PLUGINS"] = allowed + ",eplb"  # SGLang's plug-in allow-list
    if "eplb" not in {ep.name for ep in entry_points(group="sglang.srt.plugins")}:
        raise EplbError("eplb is not installed as a package, so SGLang's scheduler processes cannot load its "
                        "plug-in: pip install eplb (or pip install -e . in a checkout)")
    return sglang_args


def launch_server(sglang_args: list[str]) -> None:
    """Prime the planner's kernels (eplb.integrations.prime: SGLang plans synchronously in every
    scheduler's rebalance), then run `python -m sglang.launch_server <args>` in this process."""
    prime(*_primed())
    sys.argv = ["sglang.launch_server"] + list(sglang_args)
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


def main(argv: list[str] | None = None, launch=launch_server) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        sglang_args = prepare(argv)
    except EplbError as exc:
        print(f"eplb.integrations.sglang: error: {exc}", file=sys.stderr)
        return 2
    launch(sglang_args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
