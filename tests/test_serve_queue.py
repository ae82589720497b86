"""The queue of `moespec serve`: four clients at once get their sequential answers, the fifth past
--max-queue 3 gets 429, and a client that goes away stops its generation at the next token.

The worker is held at a known point (a gate in front of the backend or inside the token loop), so
the tests assert states and orderings, never durations.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx2 as httpx  # the HTTP client the openai package depends on
import pytest
from serve_harness import serve, wait_until

from moespec.serve.app import ServeSettings

openai = pytest.importorskip("openai")


def _ask(client, name: str, prompt: str, max_tokens: int = 8) -> str:
    r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content


def _gate_backend(backend):
    """Hold every generation in front of the model until the returned event is set."""
    gate, original = threading.Event(), backend.generate

    def gated(job, req):
        gate.wait()
        return original(job, req)

    backend.generate = gated
    return gate


def test_four_at_once_match_sequential_and_fifth_gets_429(tiny_models):
    with serve(tiny_models["qwen3_moe"], ServeSettings(max_queue=3)) as srv:
        name, queue = srv.app.state.backend.name, srv.app.state.queue
        client = openai.OpenAI(base_url=srv.v1, api_key="-", max_retries=0, timeout=300)
        prompts = ["one", "two", "three", "four"]
        sequential = {p: _ask(client, name, p) for p in prompts}
        gate = _gate_backend(srv.app.state.backend)
        got: dict[str, str] = {}
        threads = [threading.Thread(target=lambda p=p: got.__setitem__(p, _ask(client, name, p))) for p in prompts]
        for t in threads:
            t.start()
        wait_until(lambda: queue.counts() == (1, 3), "one running and three waiting")
        assert httpx.get(srv.url + "/health").json()["waiting"] == 3
        with pytest.raises(openai.RateLimitError) as refused:
            _ask(client, name, "five")
        assert int(refused.value.response.headers["retry-after"]) >= 1
        assert refused.value.response.json()["error"]["code"] == "queue_full"
        gate.set()
        for t in threads:
            t.join(timeout=300)
        assert got == sequential
        # The worker tidies up after the answers went out: it is idle soon after, not at once.
        wait_until(lambda: queue.counts() == (0, 0), "idle")
        assert _ask(client, name, "one") == sequential["one"]  # still serving


def test_waiting_client_that_leaves_is_dropped_from_the_queue(tiny_models):
    with serve(tiny_models["qwen3_moe"], ServeSettings(max_queue=3)) as srv:
        name, queue = srv.app.state.backend.name, srv.app.state.queue
        gate = _gate_backend(srv.app.state.backend)
        client = openai.OpenAI(base_url=srv.v1, api_key="-", max_retries=0, timeout=300)
        first = threading.Thread(target=_ask, args=(client, name, "one"))
        first.start()
        wait_until(lambda: queue.counts() == (1, 0), "the first request running")
        body = {"model": name, "messages": [{"role": "user", "content": "two"}], "max_tokens": 4, "stream": True}
        with httpx.stream("POST", srv.v1 + "/chat/completions", json=body, timeout=300) as r:
            assert r.status_code == 200
            wait_until(lambda: queue.counts() == (1, 1), "the streamed request waiting")
        # Streamed client gone: its job leaves the queue before it ever ran.
        wait_until(lambda: queue.counts() == (1, 0), "the streamed request dropped")
        with pytest.raises(httpx.ReadTimeout):  # a non-streamed client that gives up
            httpx.post(srv.v1 + "/chat/completions", json={**body, "stream": False}, timeout=0.5)
        wait_until(lambda: queue.counts() == (1, 0), "the non-streamed request dropped")
        gate.set()
        first.join(timeout=300)
        wait_until(lambda: queue.counts() == (0, 0), "idle")
        assert [j.tokens for j in queue.finished] == [8]  # only the first request generated anything


def test_disconnect_mid_stream_stops_at_the_next_token(tiny_models):
    with serve(tiny_models["qwen3_moe"], ServeSettings()) as srv:
        backend, queue = srv.app.state.backend, srv.app.state.queue
        name, engine, om = backend.name, backend.engine, backend.engine.om
        client = openai.OpenAI(base_url=srv.v1, api_key="-", max_retries=0, timeout=300)
        after = _ask(client, name, "after")
        held, release, original = threading.Event(), threading.Event(), engine.generate

        def paused_after_three(ids, sampling, stop_ids, *processor):
            for i, tok in enumerate(original(ids, sampling, stop_ids, *processor)):
                if i == 3:  # three tokens are out; hold the fourth until the client has gone
                    held.set()
                    release.wait()
                yield tok

        engine.generate = paused_after_three
        body = {"model": name, "messages": [{"role": "user", "content": "abc"}], "max_tokens": 200, "stream": True}
        with httpx.stream("POST", srv.v1 + "/chat/completions", json=body, timeout=300) as r:
            assert r.status_code == 200
            wait_until(held.is_set, "three tokens generated")
            job = queue.running
        # The connection is closed: the server cancels the job while the worker is held.
        wait_until(job.cancelled.is_set, "the server noticing the disconnect")
        assert job.tokens_at_cancel == 3
        release.set()
        wait_until(lambda: queue.counts() == (0, 0), "the worker free again")
        assert job.tokens_at_stop == job.tokens_at_cancel  # not one more token after the cancel
        pins = [om.cache.pinned(s) for s in range(om.cache.num_slots)]
        assert not any(pins) and om.ledger.held() == {}  # no slot stays pinned
        metrics = httpx.get(srv.url + "/metrics").text
        assert "moespec_cancelled_requests_total 1.0" in metrics
        engine.generate = original
        assert _ask(client, name, "after") == after  # the next request is served, unaffected

        # Unheld, for the record: disconnect -> worker idle (printed, not asserted: the CPU is shared).
        with httpx.stream("POST", srv.v1 + "/chat/completions", json=body, timeout=300) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n == 8:
                    break
            job = queue.running
            t0 = time.perf_counter()
        wait_until(lambda: queue.counts()[0] == 0, "the worker free again")
        print(f"disconnect -> worker free: {(time.perf_counter() - t0) * 1e3:.0f} ms; "
              f"generated {job.tokens_at_stop} of 200 tokens, {job.tokens_at_stop - job.tokens_at_cancel} after the "
              f"cancel")


def test_an_answered_job_no_longer_counts_as_running():
    """A job that emitted its answer no longer counts for admission, even while the worker tidies up
    after it: a client that asks again at once is admitted at --max-queue 0 (it was refused 429)."""
    from moespec.serve.queue import GenerationQueue, Job, QueueFull

    loop = asyncio.new_event_loop()
    answered, tidy = threading.Event(), threading.Event()

    def work(job):
        job.emit("done", [])
        answered.set()
        tidy.wait(30)  # the worker is still inside the job after the client has its answer

    queue = GenerationQueue(max_waiting=0)
    try:
        queue.submit(Job(work=work, loop=loop))
        assert answered.wait(30)
        assert queue.counts() == (1, 0)  # the worker is still inside the answered job
        queue.submit(Job(work=lambda job: job.emit("done", []), loop=loop))  # admitted, not QueueFull
        assert queue.counts() == (1, 1)
        with pytest.raises(QueueFull):
            queue.submit(Job(work=lambda job: None, loop=loop))
    finally:
        tidy.set()
        queue.close()
        loop.close()
