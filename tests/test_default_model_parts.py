"""Unit tests of the default model's conversion steps on small synthetic layers (no GGUF, seconds)."""

from __future__ import annotations

import pytest
import torch

from moespec.default_model.refit import moe_features, refit_down, refit_down_routed, relative_error
from moespec.default_model.router_fit import fit_router, minibatch_rows, oracle_topk, oracle_topk_factored, topk_weights
from moespec.default_model.split import balanced_kmeans, cluster_experts, split_neurons


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


def test_cluster_experts_take_the_neurons_of_their_token_cluster():
    """Tokens come in 4 directions; pool neurons 8c..8c+7 fire (x5) only on direction c's tokens.
    Each clustered expert (top-1 membership) must hold exactly one direction's 8 neurons, and
    the shared expert the most important neurons, as in split_neurons."""
    gen = torch.Generator().manual_seed(3)
    n_dirs, per_dir, hidden = 4, 256, 16
    directions = torch.eye(n_dirs, hidden) * 4
    s = torch.cat([directions[c] + 0.3 * torch.randn(per_dir, hidden, generator=gen) for c in range(n_dirs)])
    cluster = torch.arange(n_dirs).repeat_interleave(per_dir)  # [T]
    shared_act = 10 + torch.rand(s.shape[0], 8, generator=gen)  # 8 always-on, most important neurons
    pool_act = 0.2 * torch.rand(s.shape[0], 32, generator=gen)
    pool_act[torch.arange(s.shape[0])[:, None], cluster[:, None] * 8 + torch.arange(8)] += 5.0
    act = torch.cat([pool_act, shared_act], dim=1)  # shared neurons are 32..39
    w_down = torch.ones(hidden, 40)
    perm = torch.randperm(s.shape[0], generator=gen)  # clustering uses the first tokens: mix them
    split = cluster_experts(s[perm], act[perm], w_down, n_shared=8, n_experts=4, top_k=1, expert_neurons=8,
                            max_cluster_tokens=512)
    assert torch.equal(split.shared, torch.arange(32, 40))
    assert sorted(split.experts.tolist()) == [list(range(8 * c, 8 * c + 8)) for c in range(4)]
    wider = cluster_experts(s, act, w_down, n_shared=8, n_experts=4, top_k=1, expert_neurons=12)
    assert wider.experts.shape == (4, 12)  # overlapping experts: 4 x 12 > 32 pool neurons allowed
    assert all(len(set(row)) == 12 and set(row) <= set(range(32)) for row in wider.experts.tolist())
    import pytest
    with pytest.raises(ValueError, match="pool of 32"):
        cluster_experts(s, act, w_down, n_shared=8, n_experts=4, top_k=1, expert_neurons=33)


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


def test_blockwise_refit_equals_the_dense_reference():
    """refit_down_routed skips the unchosen experts' zeros; refit_down on the full features is its reference."""
    gen = torch.Generator().manual_seed(4)
    tokens, n_sh, n_experts, width, k, hidden = 1500, 20, 6, 4, 2, 10
    act_shared = torch.randn(tokens, n_sh, generator=gen, dtype=torch.float64)
    act_routed = torch.randn(tokens, n_experts, width, generator=gen, dtype=torch.float64)
    ids = torch.argsort(torch.rand(tokens, n_experts, generator=gen), dim=1)[:, :k]
    weights = torch.rand(tokens, k, generator=gen, dtype=torch.float64)
    target = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    for relative in (True, False):
        slow = refit_down(moe_features(act_shared, act_routed, ids, weights), target, 1e-3, relative)
        fast = refit_down_routed(act_shared, act_routed, ids, weights, target, 1e-3, relative)
        assert fast.shape == (hidden, n_sh + n_experts * width)
        torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-12)


def _peak_tensor_bytes(fn) -> int:
    """Most bytes of CPU tensors ``fn`` held at once, from the profiler's allocation records
    (allocations and frees of every op, in order: deterministic, unlike a process's RSS)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def test_refit_keeps_one_working_copy_of_its_inputs():
    """The refit is the default-model build's peak memory: float32 activations in, one float64
    working copy of each (scaled and weighted in place), results equal to the float64 reference.
    Separate scaled and weighted copies (as the refit made them before) held 1.9x (measured)."""
    gen = torch.Generator().manual_seed(6)
    tokens, n_sh, n_experts, width, k, hidden = 4000, 64, 8, 8, 2, 32
    act_shared = torch.randn(tokens, n_sh, generator=gen)
    act_routed = torch.randn(tokens, n_experts, width, generator=gen)
    ids = torch.argsort(torch.rand(tokens, n_experts, generator=gen), dim=1)[:, :k]
    weights = torch.rand(tokens, k, generator=gen, dtype=torch.float64)
    target = torch.randn(tokens, hidden, generator=gen)
    inputs = [t.clone() for t in (act_shared, act_routed, target)]
    working = (n_sh + n_experts * width + hidden) * tokens * 8  # bytes of the float64 copies
    peak = _peak_tensor_bytes(lambda: refit_down_routed(act_shared, act_routed, ids, weights, target,
                                                        dtype=torch.float64))
    assert working <= peak <= 1.25 * working
    assert all(torch.equal(a, b) for a, b in zip(inputs, (act_shared, act_routed, target)))  # not changed
    fast = refit_down_routed(act_shared, act_routed, ids, weights, target, dtype=torch.float64)
    want = refit_down_routed(act_shared.double(), act_routed.double(), ids, weights, target.double())
    assert fast.dtype == torch.float64 and torch.equal(fast, want)


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
    # Experts 0 and 3 share a neuron (both point along axis 0): against the true residual
    # R = (0.5, 1, 0), expert 1 and the small expert 3 remove the most error, not the big expert 0.
    residual = torch.tensor([[0.5, 1.0, 0.0]])
    assert sorted(oracle_topk(outputs, 2, residual)[0].tolist()) == [1, 3]


def test_factored_oracle_matches_the_reference_on_expert_outputs():
    gen = torch.Generator().manual_seed(4)
    tokens, hidden, n_experts, width, k = 300, 12, 6, 5, 2
    act = torch.randn(tokens, n_experts, width, generator=gen, dtype=torch.float64)
    down = torch.randn(hidden, n_experts, width, generator=gen, dtype=torch.float64)
    outputs = torch.einsum("tei,hei->teh", act, down)  # [T, E, H]
    reference = oracle_topk(outputs, k)
    fast = oracle_topk_factored(act, down, k, chunk=64)  # several chunks, the last one partial
    assert torch.equal(fast, reference)
    residual = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    assert torch.equal(oracle_topk_factored(act, down, k, residual, chunk=64), oracle_topk(outputs, k, residual))


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
    partition = MoeLayout(n_experts=8, top_k=2, shared_neurons=32, expert_neurons=None)  # 8 neurons per expert
    config = moe_config(dense, partition)
    assert config.moe_intermediate_size == 8 and config.shared_expert_intermediate_size == 32
    assert moe_config(dense, MoeLayout(n_experts=8, top_k=2, shared_neurons=32, expert_neurons=24)).moe_intermediate_size == 24
    with pytest.raises(ValueError, match="multiple of 4"):
        moe_config(dense, MoeLayout(n_experts=8, top_k=2, shared_neurons=48, expert_neurons=None))  # 6 per expert
    with pytest.raises(ValueError, match="multiple of 4"):
        moe_config(dense, MoeLayout(n_experts=8, top_k=2, shared_neurons=32, expert_neurons=10))
    with pytest.raises(ValueError, match="equal experts"):
        moe_config(dense, MoeLayout(n_experts=8, top_k=2, shared_neurons=36, expert_neurons=None))
    with pytest.raises(ValueError, match="pool of 64"):
        moe_config(dense, MoeLayout(n_experts=8, top_k=2, shared_neurons=32, expert_neurons=68))


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
    layout = MoeLayout(n_experts=8, top_k=2, shared_neurons=64, expert_neurons=8, router_batch=128, router_steps=30)
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


def test_keep_freed_memory_applies_on_glibc_and_changes_no_result():
    import platform

    from moespec.default_model.heap import keep_freed_memory

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2000, 3000, generator=gen, dtype=torch.float64)  # 48 MB: above any mmap threshold
    want = x.T @ x
    with keep_freed_memory() as applied:
        got = x.T @ x
        for _ in range(3):
            torch.empty(8_000_000, dtype=torch.float64).fill_(1.0)  # allocated and freed: kept for reuse
    assert applied == (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")
    assert torch.equal(got, want)


def _tiny_dense():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def test_interrupted_build_resumes_at_the_next_layer_and_equals_an_uninterrupted_one(tmp_path, monkeypatch):
    """Ctrl-C while layer 2 converts keeps layers 0 and 1 (checkpoint files); the next run converts
    only layer 2 and gives the same weights as convert() in one go. Checkpoints of another recipe
    digest are discarded."""
    import io

    from rich.console import Console

    from moespec.default_model import convert as convert_mod
    from moespec.default_model.build import convert_resumable
    from moespec.default_model.checkpoints import LayerCheckpoints
    from moespec.default_model.convert import MoeLayout, convert

    dense = _tiny_dense()
    calib = torch.randint(0, 96, (4, 64), generator=torch.Generator().manual_seed(1))
    layout = MoeLayout(n_experts=8, top_k=2, shared_neurons=64, expert_neurons=8, router_batch=128, router_steps=30)
    want, _ = convert(dense, calib, layout)
    console = Console(file=io.StringIO())

    real = convert_mod.convert_layer
    calls = []

    def interrupt_at_layer_2(dense_layer, *args):
        calls.append(dense_layer)
        if dense_layer is dense.model.layers[2]:
            raise KeyboardInterrupt
        return real(dense_layer, *args)

    monkeypatch.setattr(convert_mod, "convert_layer", interrupt_at_layer_2)
    state = LayerCheckpoints(tmp_path / "state", "digest-a")
    with pytest.raises(KeyboardInterrupt):
        convert_resumable(dense, calib, layout, state, console)
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [
        "hidden.safetensors", "layer-00.safetensors", "layer-01.safetensors", "state.json"]

    assert [layer.mlp is None for layer in dense.model.layers] == [True, True, False]  # converted: released

    calls.clear()
    monkeypatch.setattr(convert_mod, "convert_layer", real)
    monkeypatch.setattr(convert_mod, "convert_layer", lambda d, *a: calls.append(d) or real(d, *a))
    dense = _tiny_dense()  # the same weights (seeded), every FFN present
    got, report, fits = convert_resumable(dense, calib, layout, state, console)
    assert calls == [dense.model.layers[2]]  # layers 0 and 1 came from their checkpoints
    assert all(layer.mlp is None for layer in dense.model.layers)
    assert [r.layer for r in report.layers] == [0, 1, 2]
    for (name, a), (_, b) in zip(want.state_dict().items(), got.state_dict().items()):
        assert torch.equal(a, b), name

    # A build on recorded fits (fits.py) refits only the down projections and gets the same model.
    from moespec.default_model import fits as fits_mod

    fits_mod.save_fits(tmp_path / "fits.safetensors", fits, "digest-a")
    monkeypatch.setattr(fits_mod, "fits_path", lambda: tmp_path / "fits.safetensors")
    assert fits_mod.recorded_fits("digest-other", 3) is None and fits_mod.recorded_fits("digest-a", 4) is None
    recorded = fits_mod.recorded_fits("digest-a", 3)
    monkeypatch.setattr(convert_mod, "fit_layer", lambda *a: pytest.fail("the recorded fits must be used"))
    again, _, _ = convert_resumable(_tiny_dense(), calib, layout, LayerCheckpoints(tmp_path / "s2", "digest-a"),
                                    console, recorded)
    for (name, a), (_, b) in zip(want.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name

    calls.clear()
    assert LayerCheckpoints(tmp_path / "state", "digest-b").open() == 0  # another recipe: start over
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["state.json"]
