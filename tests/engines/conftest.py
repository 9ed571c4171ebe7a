"""The engine tier: tests that run vLLM's, SGLang's and TensorRT-LLM's own code against eplb.

Each test module skips itself when its engine is not importable (`pytest.importorskip`), so
the ordinary suite passes without the engines; `.ci/engines` installs them and runs this
folder. vLLM's own test file comes from vLLM's source distribution: `EPLB_VLLM_TESTS` names
its `tests` folder (`.ci/engines` unpacks it).
"""

import os
from pathlib import Path

import pytest


def vllm_tests_dir() -> Path:
    """vLLM's `tests` folder from its sdist, or skip."""
    path = os.environ.get("EPLB_VLLM_TESTS")
    if not path:
        pytest.skip("EPLB_VLLM_TESTS is not set (the tests folder of vLLM's sdist; .ci/engines sets it)",
                    allow_module_level=True)
    if not Path(path, "distributed", "test_eplb_algo.py").is_file():
        pytest.skip(f"EPLB_VLLM_TESTS={path} holds no distributed/test_eplb_algo.py", allow_module_level=True)
    return Path(path)
