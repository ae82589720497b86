"""Start the real `moespec serve` app (uvicorn in a thread) on a free loopback port, for tests."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from moespec.config import ExecuteMode, Predictor, RuntimeConfig


@dataclass
class Running:
    """A started server: its base URL (…/v1 is the OpenAI base) and the app (state: backend, queue, metrics)."""

    url: str
    app: object

    @property
    def v1(self) -> str:
        return self.url + "/v1"


def tiny_runtime(cache_experts: int = 4) -> RuntimeConfig:
    """The runtime settings every serve test uses (and passes to `moespec chat` for comparisons)."""
    return RuntimeConfig(device="cpu", cache_experts=cache_experts, predictor=Predictor.ROUTER,
                         execute=ExecuteMode.EXACT)


@contextmanager
def serve(model_path, settings, cfg: RuntimeConfig | None = None):
    """Yield a Running server on 127.0.0.1:<free port>; stop it, its worker and the model after."""
    import uvicorn

    from moespec.chat.open_model import open_model
    from moespec.cli.serve_cmd import served_name
    from moespec.serve.app import create_app
    from moespec.serve.backend import ModelBackend

    opened = open_model(str(model_path), cfg or tiny_runtime())
    app = create_app(ModelBackend(opened, served_name(str(model_path), opened.path)), settings)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # the OS picks a free port; uvicorn serves this very socket (no race)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:  # readiness, not a timing assertion
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield Running(f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        app.state.queue.close()
        opened.close()
        sock.close()


def wait_until(predicate, what: str, timeout_s: float = 60.0) -> None:
    """Poll ``predicate`` until it holds (a state, not a duration, is what tests assert)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)
