"""Constrained-decoding overhead: TPOT with a JSON schema vs without, on the default model.

Two measurements, each as interleaved pairs (A B A B ...), greedy, the same max_tokens; the
schema needs a long string, so both arms run to max_tokens.

1. Same tokens (in-process, the server's own code path): a json_schema choice (grammar mask at
   every step) against the same choice whose processor only replays the tokens the constrained
   run produced. Both arms run the very same forwards and expert copies, so the ratio is the
   cost of constrained decoding alone.
2. End to end (``--server``): `moespec serve` in a subprocess, streamed free-text vs json_schema
   requests; TPOT as a client sees it ((last chunk - first chunk) / (chunks - 1)). The two arms
   generate different text, so different experts miss: this ratio includes that, not only the mask.

The last stdout line is one JSON object.

  python scripts/serve_json_tpot.py [--model PATH] [--tokens 64] [--pairs 5] [--server] [-- RUNTIME OPTIONS]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

PROMPT = "Write a long story about a lighthouse keeper and the sea."
SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                           "story": {"type": "string", "minLength": 2000}},
          "required": ["title", "story"], "additionalProperties": False}


def _stream(client, name: str, tokens: int, fmt: dict | None) -> tuple[float, int]:
    """(client-side TPOT in ms, content chunks) of one streamed greedy request."""
    extra = {"response_format": fmt} if fmt else {}
    stamps = []
    for ch in client.chat.completions.create(model=name, messages=[{"role": "user", "content": PROMPT}],
                                             max_tokens=tokens, temperature=0, stream=True, **extra):
        if ch.choices and ch.choices[0].delta.content:
            stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3, len(stamps)


def _mask_ms(model: list[str]) -> dict:
    """The grammar alone on the model's tokenizer: compile, per-token mask+advance (greedy JSON)."""
    import torch
    from transformers import AutoTokenizer

    from moespec.default_model import ensure_default_model
    from moespec.hub.resolve import resolve_model
    from moespec.sampling.grammar import GrammarCompiler, json_schema_grammar

    path = resolve_model(model[0]) if model else ensure_default_model()
    tok = AutoTokenizer.from_pretrained(path)
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tok, len(tok), {tok.eos_token_id})
    compiler.tokenizer()
    wrap_s = time.perf_counter() - t0
    grammar = json_schema_grammar(SCHEMA)
    t0 = time.perf_counter()
    compiler.compile(grammar)
    compile_ms = (time.perf_counter() - t0) * 1e3
    c = compiler.constraint(grammar)
    gen, times = torch.Generator().manual_seed(0), []
    for _ in range(200):
        logits = torch.randn(len(tok), generator=gen)
        t0 = time.perf_counter()
        t = int(torch.argmax(c.mask(logits)))
        c.accept(t)
        times.append(time.perf_counter() - t0)
    return {"tokenizer_wrap_s": round(wrap_s, 2), "compile_ms": round(compile_ms, 2),
            "mask_ms_median": round(statistics.median(times) * 1e3, 3)}


class _Replay:
    """A logits processor that forces a recorded token sequence (the "free" arm of the same-token A/B).

    numpy, like the grammar mask: a torch op over 49k logits runs on torch's intra-op threads and
    would cost this baseline more than the mask costs the other arm.
    """

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.i = tokens, 0

    def __call__(self, logits):
        import numpy as np
        import torch

        out = np.full(logits.shape[-1], -np.inf, dtype=np.float32)
        out[self.tokens[min(self.i, len(self.tokens) - 1)]] = 0.0
        self.i += 1
        return torch.from_numpy(out)


def _same_tokens(model: list[str], tokens: int, pairs: int) -> dict:
    """Arm A: a json_schema choice through the server's code; arm B: its tokens replayed."""
    import threading
    from dataclasses import replace

    from moespec.chat.open_model import open_model
    from moespec.config import ExecuteMode, Predictor, RuntimeConfig
    from moespec.serve.backend import ModelBackend
    from moespec.serve.generate import run_choice
    from moespec.serve.plan import Limits, chat_choices
    from moespec.serve.schemas import ChatCompletionRequest

    # `moespec serve`'s defaults on this CPU machine (every expert fits: the fastest TPOT, so the
    # largest ratio a fixed per-token cost can give).
    cfg = RuntimeConfig(device="cpu", predictor=Predictor.ROUTER, execute=ExecuteMode.EXACT)
    opened = open_model(model[0] if model else None, cfg)
    backend, engine = ModelBackend(opened, "m"), opened.engine
    fmt = {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA, "strict": True}}
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": PROMPT}],
                                                 "max_tokens": tokens, "temperature": 0, "response_format": fmt})
    (spec,) = chat_choices(body, backend, Limits())
    original = engine.generate

    def run(s, force: list[int] | None) -> tuple[float, float, list[int]]:
        seen, stamps, cpu = [], [], []

        def generate(ids, sampling, stop_ids, processor=None):
            for t in original(ids, sampling, stop_ids, _Replay(force) if force is not None else processor):
                stamps.append(time.perf_counter())
                cpu.append(time.process_time())  # CPU seconds of this process: robust to a busy host
                seen.append(t)
                yield t

        engine.generate = generate
        try:
            run_choice(engine, backend.tokenizer, threading.Lock(), backend.stop_ids, s, threading.Event(),
                       lambda d: None, lambda: None)
        finally:
            engine.generate = original
        n = len(stamps) - 1
        return (stamps[-1] - stamps[0]) / n * 1e3, (cpu[-1] - cpu[0]) / n * 1e3, seen

    _, _, trace = run(spec, None)  # warm-up: compiles the grammar, fills the expert cache
    free_spec = replace(spec, controls=None)
    a, b, ratios, cpu_ratios = [], [], [], []
    for _ in range(pairs):
        ta, ca, trace = run(spec, None)
        tb, cb, replayed = run(free_spec, trace)
        assert replayed == trace
        a.append(ta)
        b.append(tb)
        ratios.append(ta / tb)
        cpu_ratios.append(ca / cb)
        print(f"same {len(trace)} tokens: json_schema {ta:.2f} ms/token ({ca:.2f} CPU), replayed {tb:.2f} "
              f"ms/token ({cb:.2f} CPU), wall ratio {ta / tb:.3f}, CPU ratio {ca / cb:.3f}", flush=True)
    opened.close()
    return {"same_tokens_json_ms_median": round(statistics.median(a), 2),
            "same_tokens_free_ms_median": round(statistics.median(b), 2),
            "same_tokens_ratio_median": round(statistics.median(ratios), 3),
            "same_tokens_ratio_min": round(min(ratios), 3), "same_tokens_ratio_max": round(max(ratios), 3),
            "same_tokens_cpu_ratio_median": round(statistics.median(cpu_ratios), 3),
            "same_tokens_cpu_ratio_min": round(min(cpu_ratios), 3),
            "same_tokens_cpu_ratio_max": round(max(cpu_ratios), 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--port", type=int, default=8791)
    ap.add_argument("--server", action="store_true", help="also measure end to end through moespec serve")
    ap.add_argument("extra", nargs="*")
    args = ap.parse_args()
    model = [args.model] if args.model else []
    out = {"tokens": args.tokens, "pairs": args.pairs, **_same_tokens(model, args.tokens, args.pairs),
           **_mask_ms(model)}
    if args.server:
        out.update(_end_to_end(model, args))
    print(json.dumps(out))


def _end_to_end(model: list[str], args) -> dict:
    import httpx2 as httpx
    import openai

    cmd = [sys.executable, "-m", "moespec", "serve", *model, "--port", str(args.port), *args.extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{args.port}"
    try:
        while True:
            try:
                name = httpx.get(url + "/health").json()["model"]
                break
            except httpx.TransportError:
                if proc.poll() is not None:
                    raise SystemExit("moespec serve exited") from None
                time.sleep(0.5)
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=600)
        fmt = {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA, "strict": True}}
        t0 = time.perf_counter()
        _stream(client, name, 4, fmt)  # warm-up; compiles the grammar (and wraps the tokenizer once)
        first_ms = (time.perf_counter() - t0) * 1e3
        _stream(client, name, 4, None)
        free, constrained, ratios = [], [], []
        for _ in range(args.pairs):
            a, na = _stream(client, name, args.tokens, None)
            b, nb = _stream(client, name, args.tokens, fmt)
            free.append(a)
            constrained.append(b)
            ratios.append(b / a)
            print(f"end to end: free {a:.2f} ms/token ({na} chunks)  json_schema {b:.2f} ms/token ({nb} chunks)  "
                  f"ratio {b / a:.3f}", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {"model": name, "e2e_free_ms_median": round(statistics.median(free), 2),
            "e2e_json_ms_median": round(statistics.median(constrained), 2),
            "e2e_ratio_median": round(statistics.median(ratios), 3), "e2e_ratio_min": round(min(ratios), 3),
            "e2e_ratio_max": round(max(ratios), 3), "first_json_request_ms": round(first_ms, 1)}


if __name__ == "__main__":
    main()
