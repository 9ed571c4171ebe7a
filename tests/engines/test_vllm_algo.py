"""vLLM 0.33.0's own `tests/distributed/test_eplb_algo.py`, with eplb's policy swapped in.

The file is loaded from vLLM's sdist (EPLB_VLLM_TESTS) and its test functions are collected
here with their marks; the name `DefaultEplbPolicy` in that module is rebound to eplb's
policy class, so every call the tests make goes to eplb. One test is replaced:
`test_basic_rebalance` asserts the exact maps DeepSeek's algorithm gives (`expected_phy2log`,
`expected_logcnt`); eplb's planner makes other (better balanced) maps, so
`test_basic_rebalance_invariants` below checks on the same input what those maps promise:
the shapes, ids in range, every expert placed, the replica total, at most one replica of an
expert per GPU, and a busiest GPU no worse than vLLM's own policy's.
"""

import importlib.util

import numpy as np
import pytest

pytest.importorskip("vllm.distributed.eplb.policy", reason="vLLM is not installed")
torch = pytest.importorskip("torch")

from eplb.integrations.vllm import configure, policy_class  # noqa: E402
from tests.engines.conftest import vllm_tests_dir  # noqa: E402

REPLACED = {"test_basic_rebalance": "asserts DeepSeek's exact expected_phy2log / expected_logcnt"}


def _load_vllm_module():
    path = vllm_tests_dir() / "distributed" / "test_eplb_algo.py"
    spec = importlib.util.spec_from_file_location("vllm_test_eplb_algo", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_vllm = _load_vllm_module()
EplbPolicy = policy_class()
configure(EplbPolicy, "greedy")
_vllm.DefaultEplbPolicy = EplbPolicy
for _name in dir(_vllm):
    if _name.startswith("test_") and _name not in REPLACED:
        globals()[_name] = getattr(_vllm, _name)


def test_every_vllm_test_is_run_or_replaced():
    names = {n for n in dir(_vllm) if n.startswith("test_")}
    assert "test_basic_rebalance" in names and len(names) >= 10
    assert all(n in globals() or n in REPLACED for n in names)


def test_basic_rebalance_invariants():
    from vllm.distributed.eplb.eplb_state import compute_logical_maps
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    # The input of vLLM's test_basic_rebalance (DeepSeek EPLB's README example).
    weight = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                           [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    num_replicas, num_groups, num_nodes, num_gpus = 16, 4, 2, 8
    phy2log = EplbPolicy.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    log2phy, logcnt = compute_logical_maps(phy2log, weight.shape[-1])
    assert phy2log.shape == (2, 16) and phy2log.dtype == torch.int64
    assert log2phy.shape[:2] == (2, 12) and logcnt.shape == (2, 12)
    assert torch.all((phy2log >= 0) & (phy2log < 12))
    assert torch.all(logcnt >= 1) and int(logcnt.sum()) == num_replicas * 2
    per_gpu = phy2log.reshape(2, num_gpus, -1)
    for l in range(2):
        for g in range(num_gpus):
            assert len(set(per_gpu[l, g].tolist())) == per_gpu.shape[2]

    def busiest(p):
        cnt = torch.zeros(2, 12).scatter_add_(1, p, torch.ones(p.shape))
        per = torch.gather(weight / cnt, 1, p)
        return per.reshape(2, num_gpus, -1).sum(-1).max(-1).values

    vllm_phy2log = DefaultEplbPolicy.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    assert torch.all(busiest(phy2log) <= busiest(vllm_phy2log) + 1e-9)


def test_policy_raises_what_vllm_expects():
    from eplb.errors import EplbError

    weight = torch.tensor([[10, 20, 30, 40]])
    with pytest.raises(AssertionError, match=r"num_replicas \(7\) must be a multiple of num_ranks \(4\)"):
        EplbPolicy.rebalance_experts(weight, 7, 2, 2, 4)
    with pytest.raises(EplbError, match="num_ranks"):
        EplbPolicy.rebalance_experts(weight, 8, 2, 3, 4)
    with pytest.raises(AssertionError, match="cannot hold"):
        EplbPolicy.rebalance_experts(weight, 2, 1, 1, 2)


def test_migration_keeps_replicas_in_place():
    rng = np.random.default_rng(0)
    weight = torch.from_numpy(rng.integers(1, 1000, size=(3, 16)))
    first = EplbPolicy.rebalance_experts(weight, 24, 4, 2, 8)
    shifted = torch.from_numpy(np.roll(weight.numpy(), 1, axis=1))
    scratch = EplbPolicy.rebalance_experts(shifted, 24, 4, 2, 8)
    kept = EplbPolicy.rebalance_experts(shifted, 24, 4, 2, 8, first)
    assert int((kept == first).sum()) > int((scratch == first).sum())
