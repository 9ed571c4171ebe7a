"""Overhead of the router-trace collector: forward time with and without its hooks.

    python benchmarks/bench_collect.py                 # CPU, a few minutes at most
    python benchmarks/bench_collect.py --device cuda --reps 50

Cases: the tiny reference model, a wider one (E = 64, K = 6), the DeepSeek-V3 router shape
(E = 256, K = 8, 8 groups) at a small hidden size, and the bare router of that shape (the
worst case: nothing but the gate runs, so the hook is the largest possible fraction).
Modes: plain forward; counts only; counts with windows every 512 tokens; counts plus a
per-token buffer. Runs of the modes are interleaved rep by rep so that background load hits
them alike; the table shows median milliseconds (process CPU time on CPU, so that other
processes on the machine do not inflate it) and the ratio to the plain forward.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from _report import add_write_docs, results_page  # noqa: E402  (benchmarks/_report.py)

from eplb.commands.common import format_table  # noqa: E402
from eplb.runtime.collect import RouterCollector  # noqa: E402
from eplb.runtime.model import DeepSeekModel, ModelConfig, Router  # noqa: E402

CASES = {
    "tiny (E16 K4)": ModelConfig(),
    "wide (E64 K6)": ModelConfig(hidden=256, num_layers=4, first_moe_layer=1, num_heads=8, num_logical_experts=64,
                                 top_k=6, num_expert_groups=8, topk_groups=4, expert_hidden=128, kv_lora_rank=64,
                                 q_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32),
    "V3 router (E256 K8)": ModelConfig(hidden=64, num_layers=3, first_moe_layer=1, num_logical_experts=256, top_k=8,
                                       num_expert_groups=8, topk_groups=4, expert_hidden=16),
}
MODES = ("plain", "counts", "counts+windows", "counts+tokens")


class RouterOnly(torch.nn.Module):
    """Just the gates of a model: the collector's worst case."""

    def __init__(self, cfg: ModelConfig, layers: int) -> None:
        super().__init__()
        self.config = cfg
        self.gates = torch.nn.ModuleList(Router(cfg) for _ in range(layers))

    def forward(self, x_TD):
        for g in self.gates:
            g(x_TD)


def timed(fn, sync, clock) -> float:
    sync()
    t0 = clock()
    fn()
    sync()
    return clock() - t0


def bench(model, make_input, reps: int, warmup: int, device) -> dict[str, float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # On CPU with one thread, process CPU time is what the hooks add and is not inflated by
    # other processes sharing the cores; on accelerators wall time after a sync is.
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    x = make_input()
    collectors = {
        "counts": lambda: RouterCollector(model, layer_ids=None),
        "counts+windows": lambda: RouterCollector(model, window_tokens=512),
        "counts+tokens": lambda: RouterCollector(model, keep_tokens=10**9),
    }
    times = {m: [] for m in MODES}
    with torch.no_grad():
        for _ in range(warmup):
            model(x)
        for _ in range(reps):
            times["plain"].append(timed(lambda: model(x), sync, clock))
            for m, make in collectors.items():
                with make():
                    times[m].append(timed(lambda: model(x), sync, clock))
    return {m: statistics.median(v) for m, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny matmuls: 1 is fastest)")
    add_write_docs(ap, "collect")
    args = ap.parse_args(argv)
    with results_page("collect", "Collector overhead", args.write_docs, argv):
        return run(args)


def run(args) -> int:
    """The benchmark itself: print its tables (main() adds the results page)."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"median of {args.reps} interleaved reps, "
          f"{'process CPU time' if device.type == 'cpu' else 'wall time'}")
    rows = []
    for name, cfg in CASES.items():
        torch.manual_seed(0)
        model = DeepSeekModel(cfg).to(device).eval()
        for T in args.tokens:
            seq = 128
            batch = lambda cfg=cfg, T=T, seq=seq: torch.randint(0, cfg.vocab, (max(1, T // seq), min(T, seq)),  # noqa: E731
                                                                device=device)
            med = bench(model, batch, args.reps, args.warmup, device)
            rows.append([name, T, *[med[m] * 1e3 for m in MODES], *[med[m] / med["plain"] for m in MODES[1:]]])
    cfg = CASES["V3 router (E256 K8)"]
    torch.manual_seed(0)
    gates = RouterOnly(cfg, layers=4).to(device)
    for T in args.tokens:
        med = bench(gates, lambda T=T: torch.randn(T, cfg.hidden, device=device), args.reps, args.warmup, device)
        rows.append(["router only, 4 gates (E256 K8)", T, *[med[m] * 1e3 for m in MODES],
                     *[med[m] / med["plain"] for m in MODES[1:]]])
    print(format_table(["case", "tokens", "plain ms", "counts ms", "+windows ms", "+tokens ms",
                        "counts x", "+windows x", "+tokens x"], rows))

    # The hook alone, called directly: what one router call pays, free of forward-pass noise.
    rows = []
    for T in args.tokens:
        ids = torch.randint(0, cfg.num_logical_experts, (T, cfg.top_k), device=device)
        out = (ids, None)
        gate = gates.gates[0]
        for label, kw in (("counts", {}), ("counts+windows", {"window_tokens": 512}),
                          ("counts+tokens", {"keep_tokens": 10**9})):
            rec = RouterCollector(gates, **kw)
            hook = rec._make_hook(0)
            sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            clock = time.process_time if device.type == "cpu" else time.perf_counter
            per = []
            for _ in range(args.reps):
                per.append(timed(lambda hook=hook, gate=gate, out=out: [hook(gate, (), out) for _ in range(100)],
                                 sync, clock) / 100)
            rows.append([label, T, statistics.median(per) * 1e6])
    print("\nhook alone (E256 K8), per router call")
    print(format_table(["mode", "tokens", "microseconds"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
