import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_TRACES = os.path.join(os.path.dirname(ROOT), "shared", "traces")

# Kernels compile in the calling thread on first use (eplb.core.jit's "wait" mode), as plain numba
# does: a test's timing must not depend on whether a side process has finished (CI's numba cache
# starts empty). tests/unit/test_jit.py runs the other modes.
os.environ.setdefault("EPLB_JIT", "wait")

# Hypothesis profiles. "ci" (the default) is derandomised, so a CI run is reproducible, and keeps
# Hypothesis' 100 examples per test; the fuzz suite (tests/fuzz) scales its own counts by
# max_examples / 100. For long local runs: `pytest tests/fuzz --hypothesis-profile=long`
# (30x the examples, fresh random inputs each run; add --hypothesis-show-statistics for counts).
_COMMON = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=100, derandomize=True, **_COMMON)
settings.register_profile("long", max_examples=3000, derandomize=False, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


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
