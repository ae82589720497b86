"""Constrained-decoding overhead: TPOT with a JSON schema vs without, through `moespec serve`.

Starts `moespec serve` (default model unless --model) once, then sends paired streamed requests,
free text and ``response_format: json_schema`` interleaved (A B A B ...), each greedy with the
same max_tokens; the schema needs a long string, so both run to max_tokens. TPOT is what a
client sees: (last content chunk - first content chunk) / (chunks - 1). Also times the grammar's
compile (first request vs cached) and the mask alone (in-process, the same tokenizer). The last
stdout line is one JSON object.

  python scripts/serve_json_tpot.py [--model PATH] [--tokens 64] [--pairs 5] [-- RUNTIME OPTIONS]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--port", type=int, default=8791)
    ap.add_argument("extra", nargs="*")
    args = ap.parse_args()
    import httpx2 as httpx
    import openai

    model = [args.model] if args.model else []
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
            print(f"free {a:.2f} ms/token ({na} chunks)  json_schema {b:.2f} ms/token ({nb} chunks)  "
                  f"ratio {b / a:.3f}", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    out = {"model": name, "tokens": args.tokens, "pairs": args.pairs,
           "tpot_free_ms_median": round(statistics.median(free), 2),
           "tpot_json_ms_median": round(statistics.median(constrained), 2),
           "ratio_median": round(statistics.median(ratios), 3), "ratio_min": round(min(ratios), 3),
           "ratio_max": round(max(ratios), 3), "first_json_request_ms": round(first_ms, 1), **_mask_ms(model)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
