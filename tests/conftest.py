import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_TRACES = os.path.join(os.path.dirname(ROOT), "shared", "traces")

# Hypothesis profiles. "ci" (the default) is derandomised, so a CI run is reproducible, and keeps
# Hypothesis' 100 examples per test; the fuzz suite (tests/fuzz) scales its own counts by
# max_examples / 100. For long local runs: `pytest tests/fuzz --hypothesis-profile=long`
# (30x the examples, fresh random inputs each run; add --hypothesis-show-statistics for counts).
_COMMON = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=100, derandomize=True, **_COMMON)
settings.register_profile("long", max_examples=3000, derandomize=False, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session", autouse=True)
def kernels_compiled():
    """Every kernel a Rebalancer warms, loaded (after an install: compiled) before the first test.

    In the first process after an install a Rebalancer holds back due checks while its kernels
    compile (eplb.serving.rebalance `_unless_compiling`): a test's outcome must not depend on the numba
    cache it happens to find (CI's is empty)."""
    from eplb.core.jit import warm_up_in_background
    from eplb.planning.kernel_sets import kernel_modules
    from eplb.serving.policy import AdaptivePolicy
    from planners.api import planner_names

    policy = AdaptivePolicy(rule="resplit")
    names = sorted({m for p in planner_names() for m in kernel_modules(p, policy, 2)})
    warmup = warm_up_in_background(tuple(names))
    warmup.wait()
    assert warmup.status.startswith("ready"), warmup.status


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def torch_one_thread():
    """Tiny tensors: one thread avoids OpenMP spin-waits that slow them 10x+ on a busy machine."""
    torch = pytest.importorskip("torch")  # only the tests that ask for this fixture need torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def world_of_one(tmp_path):
    """A one-rank gloo process group (the WORLD group): drives torch.distributed code without torchrun."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
