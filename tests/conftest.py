import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_TRACES = os.path.join(os.path.dirname(ROOT), "shared", "traces")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
