"""Server overhead: TPOT through `moespec serve` vs `moespec chat --json`, same model and settings.

Runs `moespec chat MODEL --prompt P --json` once, then starts `moespec serve` in a subprocess
with the same runtime options, streams the same prompt through the openai client (greedy, same
max tokens) and compares: the server's own decode-step TPOT (from /metrics), the TPOT a client
sees (last chunk - first chunk over the tokens between), and the text. The last stdout line is
one JSON object.

  python scripts/serve_overhead.py [--model PATH] [--tokens 64] [--rounds 1] [-- RUNTIME OPTIONS]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

PROMPT = "Write a short story about a lighthouse keeper."


def _chat(model: list[str], tokens: int, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "moespec", "chat", *model, "--prompt", PROMPT, "--json",
           "--max-new-tokens", str(tokens), *extra]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _metric(url: str, name: str) -> float:
    import httpx2 as httpx
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise KeyError(name)


class _Server:
    """`moespec serve` in a subprocess (started on enter, terminated on exit)."""

    def __init__(self, model: list[str], extra: list[str], port: int) -> None:
        self.cmd = [sys.executable, "-m", "moespec", "serve", *model, "--port", str(port), *extra]
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> "_Server":
        import httpx2 as httpx

        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while True:
            try:
                self.name = httpx.get(self.url + "/health").json()["model"]
                return self
            except httpx.TransportError:
                if self.proc.poll() is not None:
                    raise SystemExit("moespec serve exited") from None
                time.sleep(0.5)

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)

    def ask(self, tokens: int) -> dict:
        """Stream PROMPT once; the client's and the server's TPOT of this request, and the text."""
        import openai

        client = openai.OpenAI(base_url=self.url + "/v1", api_key="-", max_retries=0, timeout=3600)
        sum0 = _metric(self.url, "moespec_time_per_output_token_seconds_sum")
        cnt0 = _metric(self.url, "moespec_time_per_output_token_seconds_count")
        stamps, text, usage = [], [], None
        for chunk in client.chat.completions.create(
                model=self.name, messages=[{"role": "user", "content": PROMPT}], max_tokens=tokens, temperature=0,
                stream=True, stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.perf_counter())
                text.append(chunk.choices[0].delta.content)
            if chunk.usage:
                usage = chunk.usage
        n = usage.completion_tokens
        steps_s = _metric(self.url, "moespec_time_per_output_token_seconds_sum") - sum0
        steps = _metric(self.url, "moespec_time_per_output_token_seconds_count") - cnt0
        return {"text": "".join(text), "client_tpot_ms": (stamps[-1] - stamps[0]) / max(n - 1, 1) * 1e3,
                "server_tpot_ms": steps_s / steps * 1e3}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--rounds", type=int, default=1, help="chat / serve runs, interleaved")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    model = [args.model] if args.model else []
    rows = []
    with _Server(model, extra, args.port) as server:
        for _ in range(args.rounds):
            chat = _chat(model, args.tokens, extra)
            served = server.ask(args.tokens)
            row = {"chat_tpot_ms": round(chat["stats"]["tpot_ms"], 2),
                   "serve_step_tpot_ms": round(served["server_tpot_ms"], 2),
                   "serve_client_tpot_ms": round(served["client_tpot_ms"], 2),
                   "same_text": served["text"] == chat["text"]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "same_text"}
    print(json.dumps({"model": args.model or "default", "tokens": args.tokens, "options": extra, "rounds": args.rounds,
                      **med, "ratio_step": round(med["serve_step_tpot_ms"] / med["chat_tpot_ms"], 3),
                      "ratio_client": round(med["serve_client_tpot_ms"] / med["chat_tpot_ms"], 3),
                      "same_text": all(r["same_text"] for r in rows)}))


if __name__ == "__main__":
    main()
