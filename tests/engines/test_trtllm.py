"""The TensorRT-LLM load-balancer file: eplb's deployment check, and TensorRT-LLM's own config
reader on all ranks when TensorRT-LLM is installed (its wheels come from NVIDIA's index, so
this part usually skips)."""

import numpy as np
import pytest

from eplb.errors import EplbError
from eplb.formats.trtllm import write_trtllm
from eplb.integrations.trtllm import check_load_balancer
from eplb.planning.front_door import plan

G, E, R = 8, 32, 8


@pytest.fixture
def yaml_file(tmp_path):
    rng = np.random.default_rng(5)
    load = rng.integers(1, 1000, size=(4, E)).astype(float)
    p = plan(load, num_gpus=G, num_redundant=R, dispatch="even").placement
    from eplb.core.placement import Placement

    p = Placement(p.phy2log_LP, G, E, 1, np.arange(3, 7))
    path = tmp_path / "lb.yaml"
    write_trtllm(p, path)
    return path, p


def test_eplb_check_accepts_the_export_and_names_mismatches(yaml_file):
    path, p = yaml_file
    back = check_load_balancer(path, num_experts=E, ep_size=G, moe_layer_ids=range(3, 7))
    assert np.array_equal(back.phy2log_LP, p.phy2log_LP)
    with pytest.raises(EplbError, match="40 slots do not split over the EP size 16"):
        check_load_balancer(path, num_experts=E, ep_size=16)
    with pytest.raises(EplbError, match=r"lists 4 MoE layers, the model has 5; missing \[7\]"):
        check_load_balancer(path, num_experts=E, ep_size=G, moe_layer_ids=range(3, 8))


def test_trtllm_reader_on_every_rank(yaml_file):
    pytest.importorskip("tensorrt_llm.llmapi.llm_args", reason="TensorRT-LLM is not installed")
    from eplb.integrations.trtllm import check_with_trtllm

    path, p = yaml_file
    per_rank = check_with_trtllm(path, ep_size=G)
    S = p.slots_per_gpu
    for rank in range(G):
        assert np.array_equal(per_rank[rank], p.phy2log_LP[:, rank * S:(rank + 1) * S])
