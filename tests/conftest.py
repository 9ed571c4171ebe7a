import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_TRACES = os.path.join(os.path.dirname(ROOT), "shared", "traces")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def torch_one_thread():
    """Tiny tensors: one thread avoids OpenMP spin-waits that slow them 10x+ on a busy machine."""
    import torch  # only the tests that ask for this fixture need torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
