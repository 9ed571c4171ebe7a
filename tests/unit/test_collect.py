"""Router-trace collectors: counts, windows, per-token buffer, hooks, files, all_reduce."""

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import eplb  # noqa: E402
from eplb.errors import EplbError  # noqa: E402
from eplb.formats import load_trace  # noqa: E402
from eplb.runtime.collect import RouterCollector, collect_trace, count_experts, scatter_count  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")
from eplb.runtime.config import ModelConfig  # noqa: E402
from eplb.runtime.model import DeepSeekModel  # noqa: E402


class IdsGate(nn.Module):
    """Toy router: the expert ids are written in the first K columns of its input."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, x_TD):
        ids = x_TD[:, : self.k].long()
        return torch.ones_like(x_TD[:, : self.k]), ids  # (weights, ids): ids at index 1


class ToyLayer(nn.Module):
    def __init__(self, k: int, shift: int) -> None:
        super().__init__()
        self.router = IdsGate(k)
        self.shift = shift

    def forward(self, x_TD):
        self.router(x_TD)
        # Next layer sees the ids shifted by one (mod 8): a different, known routing per layer.
        y = x_TD.clone()
        y[:, : self.router.k] = (x_TD[:, : self.router.k] + self.shift) % 8
        return y


class ToyModel(nn.Module):
    def __init__(self, k=2, layers=3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ToyLayer(k, 1) for _ in range(layers))
        self.config = types.SimpleNamespace(num_hidden_layers=layers, n_routed_experts=8,
                                            num_experts_per_tok=k, n_group=None, model_type="toy")

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _batch(ids_TK):
    """Input for ToyModel whose first layer routes to ids_TK."""
    return torch.as_tensor(ids_TK, dtype=torch.float32)


def _expected_counts(ids_NK, cuts, layers=3, E=8):
    """[T, L, E] counts of the token stream ids_NK cut at token positions `cuts`."""
    bounds = [0, *cuts, len(ids_NK)]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        out.append([np.bincount(((ids_NK[a:b] + l) % 8).ravel(), minlength=E) for l in range(layers)])
    return np.array(out)


def test_toy_router_by_name_with_exact_token_windows():
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(8, 2, replace=False) for _ in range(23)])
    model = ToyModel()
    with RouterCollector(model, name_pattern=r"\.router$", ids_from=1, window_tokens=7) as rec:
        for a in range(0, 23, 5):                   # batches of 5 straddle the 7-token windows
            model(_batch(ids[a:a + 5]))
    t = rec.trace()
    assert t.layer_ids.tolist() == [0, 1, 2]
    np.testing.assert_array_equal(t.counts_TLE, _expected_counts(ids, [7, 14, 21]))
    assert t.meta["num_experts"] == 8 and t.meta["top_k"] == 2 and t.meta["tokens_per_window"] == 7
    assert t.meta["num_hidden_layers"] == 3 and t.meta["model"] == "toy"


def test_manual_windows_and_hooks_removed():
    model = ToyModel()
    ids = np.array([[0, 1], [2, 3], [4, 5], [6, 7]])
    rec = RouterCollector(model, router_class=IdsGate, ids_from=lambda out: out[1])
    with rec:
        model(_batch(ids[:3]))
        rec.next_window()
        rec.next_window()                            # empty window: no-op
        model(_batch(ids[3:]))
    assert all(not m._forward_hooks for m in model.modules())
    model(_batch(ids))                               # not counted any more
    np.testing.assert_array_equal(rec.counts(), _expected_counts(ids, [3]))
    assert rec.tokens_seen == 4


def test_keep_tokens_buffer_is_bounded_and_windowed():
    rng = np.random.default_rng(1)
    ids = np.stack([rng.choice(8, 2, replace=False) for _ in range(30)])
    model = ToyModel()
    with RouterCollector(model, router_class=IdsGate, ids_from=1, window_tokens=4, keep_tokens=10) as rec:
        for a in range(0, 30, 3):
            model(_batch(ids[a:a + 3]))
    t = rec.trace()
    assert t.topk_ids_NLK.shape == (10, 3, 2)
    np.testing.assert_array_equal(t.topk_ids_NLK[:, 0], ids[:10])
    np.testing.assert_array_equal(t.topk_ids_NLK[:, 2], (ids[:10] + 2) % 8)
    np.testing.assert_array_equal(t.token_window_N, np.arange(10) // 4)


def test_reference_model_counts_match_router_outputs(tmp_path):
    cfg = ModelConfig(num_layers=3, first_moe_layer=1)
    torch.manual_seed(0)
    model = DeepSeekModel(cfg).eval()
    seen = {}
    for lid, moe in model.moe_layers():
        moe.gate.register_forward_hook(lambda m, i, o, lid=lid: seen.setdefault(lid, []).append(o[0]))
    tokens = torch.randint(0, cfg.vocab, (3, 11))
    with RouterCollector(model) as rec, torch.no_grad():
        model(tokens)
        model(tokens[:1])
    t = rec.save(tmp_path / "t.npz")
    back = load_trace(tmp_path / "t.npz")
    assert back.layer_ids.tolist() == cfg.moe_layer_ids
    for l, lid in enumerate(cfg.moe_layer_ids):
        want = torch.bincount(torch.cat(seen[lid]).flatten(), minlength=cfg.num_logical_experts).numpy()
        np.testing.assert_array_equal(back.counts_TLE[0, l], want)
    assert back.counts_TLE.sum() == 4 * 11 * cfg.top_k * cfg.num_moe_layers
    assert back.meta["model"] == cfg.name and back.meta["num_expert_groups"] == cfg.num_expert_groups
    assert back.meta["num_hidden_layers"] == cfg.num_layers and not back.meta["synthetic"]
    np.testing.assert_array_equal(back.counts_TLE, t.counts_TLE)


def test_collected_driven_trace_plans():
    cfg = ModelConfig(num_layers=3, first_moe_layer=1, num_logical_experts=16)
    torch.manual_seed(1)
    model = DeepSeekModel(cfg).eval()
    freq = np.ones((2, 16))
    freq[:, 0] = 12.0                                # one hot expert per layer
    model.drive_routing(freq, torch.Generator().manual_seed(0))
    tokens = [torch.randint(0, cfg.vocab, (4, 32)) for _ in range(4)]
    trace = collect_trace(model, tokens, window_tokens=64, meta={"source": "test"})
    assert trace.num_windows == 8 and trace.meta["source"] == "test"
    assert (trace.counts_TLE[:, :, 0] == 64).all()   # pi capped at 1: every token uses expert 0
    result = eplb.plan(trace, num_gpus=4)
    assert result.after.imbalance_L.max() < result.before.imbalance_L.max()


def test_errors_are_eplb_errors():
    model = ToyModel()
    with pytest.raises(EplbError, match="no module name matches"):
        RouterCollector(model, name_pattern="nothing_here")
    with pytest.raises(EplbError, match="not a valid regular expression"):
        RouterCollector(model, name_pattern="(")
    with pytest.raises(EplbError, match="integer expert ids"):
        with RouterCollector(model, router_class=IdsGate, ids_from=0):
            model(_batch([[0, 1]]))
    with pytest.raises(EplbError, match="no tokens were routed"):
        RouterCollector(model, router_class=IdsGate, ids_from=1).trace()
    with pytest.raises(EplbError, match="window_tokens"):
        RouterCollector(model, router_class=IdsGate, window_tokens=0)
    with pytest.raises(EplbError, match="expert id 9"):
        count_experts(torch.tensor([0, 9]), 8)
    with pytest.raises(EplbError, match="expert id -1"):
        count_experts(torch.tensor([0, -1]), 8)


def test_scatter_count_matches_bincount():
    ids = torch.randint(0, 16, (500,), generator=torch.Generator().manual_seed(3))
    assert torch.equal(scatter_count(ids, 16), torch.bincount(ids, minlength=16))


def test_all_reduce_world_size_one(world_of_one):
    import torch.distributed as dist

    group = dist.new_group([0])
    model = ToyModel()
    ids = np.array([[0, 1], [2, 3], [1, 4]])
    with RouterCollector(model, router_class=IdsGate, ids_from=1, window_tokens=2,
                         process_group=group) as rec:
        model(_batch(ids))
    t = rec.trace()
    np.testing.assert_array_equal(t.counts_TLE, _expected_counts(ids, [2]))
    assert t.meta["ranks_summed"] == 1 and t.meta["tokens_per_window"] == 2


def test_forwards_in_and_out_of_inference_mode_count_into_one_window():
    # Engines run under torch.inference_mode(); a warm-up there followed by forwards under
    # no_grad (or plain) must keep counting into the same window.
    model = ToyModel()
    ids = np.array([[0, 1], [2, 3], [4, 5], [6, 7]])
    with RouterCollector(model, router_class=IdsGate, ids_from=1, window_tokens=100, keep_tokens=3) as rec:
        with torch.inference_mode():
            model(_batch(ids[:2]))
        with torch.no_grad():
            model(_batch(ids[2:3]))
        model(_batch(ids[3:]))
    np.testing.assert_array_equal(rec.counts(), _expected_counts(ids, []))
    np.testing.assert_array_equal(rec.trace().topk_ids_NLK[:, 0], ids[:3])


def test_meta_carries_the_group_limit(tmp_path):
    # Groups a token may use (topk_groups) went missing from collected traces, so readers
    # guessed num_groups // 2: a model with 3 of 4 groups and top-10 could not be rebuilt.
    cfg = ModelConfig(num_layers=2, num_logical_experts=16, num_expert_groups=4, topk_groups=3, top_k=10)
    torch.manual_seed(0)
    with RouterCollector(DeepSeekModel(cfg).eval()) as rec, torch.no_grad():
        rec.model(torch.randint(0, cfg.vocab, (1, 5)))
    rec.save(tmp_path / "t.npz")
    assert load_trace(tmp_path / "t.npz").meta["topk_groups"] == 3
    model = ToyModel()
    model.config.topk_group = 2                        # HF DeepSeek config name
    assert RouterCollector(model, router_class=IdsGate, ids_from=1).meta["topk_groups"] == 2
