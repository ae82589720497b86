"""Unit tests of the default model's conversion steps on small synthetic layers (no GGUF, seconds)."""

from __future__ import annotations

import torch

from moespec.default_model.refit import moe_features, refit_down, relative_error
from moespec.default_model.router_fit import fit_router, minibatch_rows, oracle_topk, oracle_topk_factored, topk_weights
from moespec.default_model.split import balanced_kmeans, split_neurons


def _swiglu_layer(tokens: int = 2048, hidden: int = 32, inter: int = 96, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(tokens, hidden, generator=gen)
    w_gate = torch.randn(inter, hidden, generator=gen) / hidden ** 0.5
    w_up = torch.randn(inter, hidden, generator=gen) / hidden ** 0.5
    w_down = torch.randn(hidden, inter, generator=gen) / inter ** 0.5
    act = torch.nn.functional.silu(s @ w_gate.T) * (s @ w_up.T)  # [T, I]
    return s, act, w_down


def test_split_is_a_partition_and_all_experts_reproduce_the_dense_ffn():
    s, act, w_down = _swiglu_layer()
    split = split_neurons(act, w_down, n_shared=32, n_experts=8)
    assert split.shared.shape == (32,) and split.experts.shape == (8, 8)
    every = torch.cat([split.shared, split.experts.flatten()])
    assert torch.equal(torch.sort(every).values, torch.arange(96))  # each neuron exactly once
    importance = act.abs().mean(0) * w_down.norm(dim=0)
    assert importance[split.shared].min() >= importance[split.experts.flatten()].max()
    # MoEfication is exact: shared + every routed expert with weight 1 is the dense FFN.
    ids = torch.arange(8).expand(s.shape[0], -1)
    features = moe_features(act[:, split.shared], act[:, split.experts], ids, torch.ones(s.shape[0], 8))
    columns = torch.cat([split.shared, split.experts.flatten()])
    torch.testing.assert_close(features @ w_down[:, columns].T, act @ w_down.T, rtol=1e-5, atol=1e-5)


def test_balanced_kmeans_gives_equal_groups_and_separates_clear_clusters():
    gen = torch.Generator().manual_seed(0)
    centres = torch.eye(4, 16) * 10
    rows = torch.cat([centres[i] + 0.1 * torch.randn(6, 16, generator=gen) for i in range(4)])  # 4 clusters x 6
    groups = balanced_kmeans(rows, 4)
    assert groups.shape == (4, 6)
    assert sorted(sorted((g // 6).tolist()) for g in groups) == [[i] * 6 for i in range(4)]


def test_refit_recovers_an_exact_down_projection():
    gen = torch.Generator().manual_seed(1)
    features = torch.randn(512, 24, generator=gen)
    down = torch.randn(8, 24, generator=gen)
    fitted = refit_down(features, features @ down.T, ridge=1e-9)
    torch.testing.assert_close(fitted, down, rtol=1e-4, atol=1e-4)


def test_relative_refit_is_not_captured_by_one_massive_token():
    """A single attention-sink-like token (output 1000x the others, off the linear model) ruins
    plain least squares for every other token; weighting by 1/||target||^2 does not."""
    gen = torch.Generator().manual_seed(2)
    features = torch.randn(400, 16, generator=gen)
    down = torch.randn(8, 16, generator=gen)
    target = features @ down.T + 0.05 * torch.randn(400, 8, generator=gen)
    target[0] = 1000.0 * torch.randn(8, generator=gen)  # not explained by the features
    rest = slice(1, None)
    plain = relative_error(target[rest], features[rest] @ refit_down(features, target, relative=False).T)
    weighted = relative_error(target[rest], features[rest] @ refit_down(features, target, relative=True).T)
    assert weighted < 0.01 < plain


def test_oracle_picks_the_experts_that_remove_most_error():
    outputs = torch.zeros(1, 4, 3)
    outputs[0, 0, 0], outputs[0, 1, 1], outputs[0, 2, 2], outputs[0, 3, 0] = 3.0, 1.0, 2.0, 0.5
    assert sorted(oracle_topk(outputs, 2)[0].tolist()) == [0, 2]


def test_factored_oracle_matches_the_reference_on_expert_outputs():
    gen = torch.Generator().manual_seed(4)
    tokens, hidden, n_experts, width, k = 300, 12, 6, 5, 2
    act = torch.randn(tokens, n_experts, width, generator=gen, dtype=torch.float64)
    down = torch.randn(hidden, n_experts, width, generator=gen, dtype=torch.float64)
    outputs = torch.einsum("tei,hei->teh", act, down)  # [T, E, H]
    reference = oracle_topk(outputs, k)
    fast = oracle_topk_factored(act, down, k, chunk=64)  # several chunks, the last one partial
    assert torch.equal(fast, reference)


def test_router_fit_learns_a_linearly_decidable_routing():
    gen = torch.Generator().manual_seed(3)
    tokens, hidden, n_experts, k = 4096, 16, 8, 2
    s = torch.randn(tokens, hidden, generator=gen)
    directions = torch.randn(n_experts, hidden, generator=gen)
    scores = s @ directions.T  # [T, E]: the expert's output grows with its direction's score
    outputs = torch.zeros(tokens, n_experts, n_experts)
    outputs[:, torch.arange(n_experts), torch.arange(n_experts)] = scores.clamp_min(0) + 0.01  # orthogonal
    fit = fit_router(s, oracle_topk(outputs, k), n_experts, steps=200, lr=1e-2)
    assert fit.weight.shape == (n_experts, hidden)
    assert fit.recall >= 0.9
    weights, ids = topk_weights(s[:4] @ fit.weight.T, k)
    torch.testing.assert_close(weights.sum(-1), torch.ones(4))
    assert ids.shape == (4, k)


def test_minibatches_use_each_row_once_per_epoch_and_reshuffle():
    batches = list(minibatch_rows(10, 3, steps=6, seed=0))  # 3 batches per epoch, 1 row skipped
    assert [b.numel() for b in batches] == [3] * 6
    for epoch in (batches[:3], batches[3:]):
        rows = torch.cat(epoch)
        assert rows.unique().numel() == 9 and int(rows.max()) <= 9
    assert not torch.equal(torch.cat(batches[:3]), torch.cat(batches[3:]))
    assert list(minibatch_rows(4, 8, steps=2)) == [slice(None), slice(None)]


def test_minibatch_router_fit_learns_the_routing_and_repeats_itself():
    gen = torch.Generator().manual_seed(5)
    tokens, hidden, n_experts, k = 3000, 16, 8, 2
    s = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    scores = s @ torch.randn(n_experts, hidden, generator=gen, dtype=torch.float64).T  # [T, E]
    oracle = torch.topk(scores, k, dim=-1).indices  # a linearly decidable routing
    first = fit_router(s, oracle, n_experts, steps=300, lr=1e-2, batch_tokens=512, seed=1)
    again = fit_router(s, oracle, n_experts, steps=300, lr=1e-2, batch_tokens=512, seed=1)
    assert first.recall >= 0.9
    torch.testing.assert_close(first.weight, again.weight, rtol=1e-9, atol=1e-12)  # float64 kernels: ~1e-15


def test_expert_width_must_suit_the_grouped_matmul():
    import pytest
    from transformers import LlamaConfig, LlamaForCausalLM

    from moespec.default_model.convert import MoeLayout, moe_config

    dense = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    config = moe_config(dense, MoeLayout(n_experts=8, top_k=2, shared_neurons=32))  # 8 neurons per expert
    assert config.moe_intermediate_size == 8 and config.shared_expert_intermediate_size == 32
    with pytest.raises(ValueError, match="multiple of 4"):
        moe_config(dense, MoeLayout(n_experts=8, top_k=2, shared_neurons=48))  # 6 neurons per expert
    with pytest.raises(ValueError, match="equal experts"):
        moe_config(dense, MoeLayout(n_experts=8, top_k=2, shared_neurons=36))


def test_conversion_of_a_tiny_dense_model_is_reproducible_and_loads_as_qwen2_moe(tmp_path):
    """Two conversions give the same weights (float64 fits: differences stay far below float32
    rounding), and the written checkpoint is a plain transformers Qwen2-MoE whose top-K routing
    on the calibration tokens is the one the conversion fitted."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from moespec.default_model.convert import MoeLayout, convert

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    dense = LlamaForCausalLM(config).eval()
    calib = torch.randint(0, 96, (4, 64), generator=torch.Generator().manual_seed(1))
    layout = MoeLayout(n_experts=8, top_k=2, shared_neurons=64, router_batch=128, router_steps=30)
    first, report = convert(dense, calib, layout)
    second, _ = convert(dense, calib, layout)
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    assert [layer.layer for layer in report.layers] == [0, 1]
    assert all(0 <= layer.rel_err < layer.shared_only_rel_err for layer in report.layers)

    first.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert loaded.config.model_type == "qwen2_moe"
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=calib).logits, first(input_ids=calib).logits)
