"""`moespec serve` as a real process: SIGINT or SIGTERM while a stream runs shuts it down within
2 s, with the exit code uvicorn's signal handling leads to (it re-raises the signal after a
graceful shutdown: Ctrl-C ends as moespec's 130, SIGTERM as killed by SIGTERM), the stream ends
with an error event, and nothing prints a traceback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx2 as httpx
import pytest
from serve_harness import wait_until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _default_sigint() -> None:
    """The server starts as from a terminal: SIGINT at its default. Why: a runner started in the
    background of a script (`cmd &`, no job control) ignores SIGINT, the child inherits that, and
    after its graceful shutdown uvicorn's re-raised SIGINT is ignored too (exit 0, not 130)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, -signal.SIGTERM)],
                         ids=["SIGINT", "SIGTERM"])
def test_signal_while_streaming(tiny_models, sig, code):
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "moespec", "serve", str(tiny_models["qwen3_moe"]), "--port",
                             str(port), "--device", "cpu", "--cache-experts", "4", "--predictor", "router"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
                            preexec_fn=_default_sigint)
    base = f"http://127.0.0.1:{port}"
    lines: list[str] = []
    try:
        def up() -> bool:
            assert proc.poll() is None, proc.stderr.read()
            try:
                return httpx.get(base + "/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, "the server answering", timeout_s=120)
        body = {"model": "qwen3_moe", "messages": [{"role": "user", "content": "go"}], "max_tokens": 250,
                "stream": True}

        def read() -> None:
            try:
                with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        lines.append(line)
            except httpx.TransportError:
                lines.append("<closed>")

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        wait_until(lambda: len([x for x in lines if '"content"' in x]) >= 3, "tokens streaming")
        t0 = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(timeout=30)
        took = time.monotonic() - t0
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert rc == code, err
    assert took <= 2.0, f"shutdown took {took:.2f} s"
    assert "Traceback" not in err and "CancelledError" not in err, err
    events = [x for x in lines if x]
    # The stream ends cleanly: an error event saying why (503, shutting down) and [DONE].
    assert events[-1] == "data: [DONE]" and "shutting_down" in events[-2], events[-3:]
