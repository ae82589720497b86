"""lm-evaluation-harness model ``moespec``: any lm-eval task, per execution mode and predictor.

    pip install "moespec[eval]"
    moespec-lm-eval --model moespec --model_args pretrained=MODEL,execute=speculative,predictor=router \\
        --tasks arc_easy --limit 100

``moespec-lm-eval`` is lm-eval's own command line with this model registered (released lm-eval finds
models only in its own package; importing this module registers ``moespec`` for the Python API too:
``import moespec.harness.model; lm_eval.simple_evaluate(model="moespec", ...)``).

Requests run through the offloading runtime: ``loglikelihood`` by the decode path of
moespec/eval/score.py (the requests of one document share one context prefill, and every scored
token comes from a decode step, so speculative and guarded modes act on it; exact mode takes the
equal prefill path unless ``exact_path=decode``), ``generate_until``
greedily through ``Engine.generate``, ``loglikelihood_rolling`` by lm-eval's rolling windows scored
the same way. Tokenisation is lm-eval's HF model's (score.encode_pair). model_args: ``pretrained``
(MODEL, default: the embedded default model) and the runtime options of `moespec chat` by their
flag names with underscores (``execute``, ``predictor``, ``fetch_threshold``, ``cache_experts``, ...).
"""

from __future__ import annotations

import lm_eval.models  # noqa: F401  (lm-eval fills its registry lazily only while it is empty: do it first)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from moespec.errors import OptionError
from moespec.eval.arms import cold_start
from moespec.eval.score import encode, encode_pair, prefix_token_id
from moespec.eval.shared_prefix import scorer_for

# model_args -> build_runtime_config keywords (lm-eval passes batch_size / max_batch_size / device too)
RUNTIME_ARGS = ("device", "dtype", "gpu_memory", "cache_experts", "execute", "predictor", "fetch_threshold",
                "guard_rule", "link_gbps", "calibration", "expert_dtype", "estimator", "group_size",
                "cache_policy", "on_miss", "host_threads", "dense_dtype")


@register_model("moespec")
class MoespecLM(TemplateLM):
    """An lm-eval LM over a model loaded by moespec (batch size 1; ``batch_size`` is accepted and ignored).

    Raises:
        OptionError: an unknown model_arg (names it and the known ones), or a bad value.
        MoespecError: anything `moespec chat` refuses for the same options.
    """

    def __init__(self, pretrained: str | None = None, max_gen_toks: int = 256, threads: int | None = None,
                 exact_path: str = "prefill", batch_size=1, max_batch_size=None, **runtime) -> None:
        super().__init__()
        from moespec.chat.open_model import open_model
        from moespec.cli.common import set_threads
        from moespec.cli.runtime_opts import build_runtime_config, check_predictor_files, enum_option
        from moespec.config import ExecuteMode, Predictor

        unknown = sorted(set(runtime) - set(RUNTIME_ARGS))
        if unknown:
            raise OptionError(f"model_args: unknown argument {unknown[0]!r}",
                              f"known: pretrained, max_gen_toks, threads, exact_path, {', '.join(RUNTIME_ARGS)}")
        opts = {"device": "auto", "dtype": "auto", "gpu_memory": None, "cache_experts": None, "fetch_threshold": None,
                "link_gbps": None, **{k: v for k, v in runtime.items() if v is not None}}
        opts["execute"] = enum_option(ExecuteMode, str(opts.get("execute", "exact")), "execute")
        opts["predictor"] = enum_option(Predictor, str(opts.get("predictor", "router")), "predictor")
        if opts["device"] == "cuda":
            opts["device"] = "auto"  # lm-eval's default --device; moespec picks cuda when there is one
        cfg = build_runtime_config(**opts)
        check_predictor_files(pretrained, cfg)
        set_threads(threads)
        self.opened = open_model(pretrained, cfg)
        self.tokenizer = self.opened.tokenizer
        self.engine = self.opened.engine
        if exact_path not in ("prefill", "decode"):
            raise OptionError(f"model_args: exact_path {exact_path!r} is not valid", "choose one of: prefill, decode")
        self.scorer = scorer_for(self.engine, cfg.execute, exact_path)  # exact's prefill path equals decode
        self.max_gen_toks = int(max_gen_toks)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        return prefix_token_id(self.tokenizer)

    @property
    def max_length(self) -> int:
        return self.engine.om.max_context()

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None:
            return encode(self.tokenizer, string)
        return list(self.tokenizer.encode(string, add_special_tokens=add_special_tokens))

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(Σ log p(continuation), greedy) per request; one document's requests share one scoring pass."""
        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):  # a request without a document is its own group
            groups.setdefault((req.task_name, req.doc_id) if req.doc_id is not None else (None, -1 - i), []).append(i)
        out: list = [None] * len(requests)
        for members in groups.values():
            cold_start(self.engine.om)
            pairs = [encode_pair(self.tokenizer, *requests[i].args) for i in members]
            for i, score in zip(members, self.scorer.score(pairs)):
                out[i] = (score.logprob, score.greedy)
                self.cache_hook.add_partial("loglikelihood", requests[i].args, out[i])
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """Pre-tokenised requests ((context, continuation), context ids, continuation ids), each on its own."""
        return [(s.logprob, s.greedy) for _, ctx, cont in requests for s in self.scorer.score([(ctx, cont)])]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Σ log p of each whole string, in lm-eval's disjoint rolling windows of ``max_length`` tokens."""
        from lm_eval import utils

        out = []
        for req in requests:
            windows = map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                token_list=self.tok_encode(req.args[0]), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            total = sum(self.scorer.score([(list(ctx), list(cont))])[0].logprob for ctx, cont in windows)
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy text of each request up to its ``until`` strings, an end id or ``max_gen_toks``."""
        from moespec.chat.render import stop_ids
        from moespec.eval.run import generate_text

        om = self.engine.om
        ends = stop_ids(self.opened.path, om.config, self.tokenizer)
        out = []
        for req in requests:
            cold_start(om)
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            if kwargs.get("do_sample") and float(kwargs.get("temperature", 1.0)) > 0:
                raise OptionError("moespec's lm-eval model generates greedily only", "use do_sample: false")
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            eos = self.tokenizer.decode([self.eot_token_id])
            text, _ = generate_text(self.engine, self.tokenizer, context, tuple(until + [eos]),
                                    int(kwargs.get("max_gen_toks", self.max_gen_toks)), ends)
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, req.args[1]), text)
        return out
