"""A `moespec download` killed mid-file: the next run fetches only the bytes that were missing."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import time

from huggingface_hub import constants
from typer.testing import CliRunner

from hub_fake_server import fake_hub, hub_cache, tiny_qwen3_moe_files  # noqa: F401
from moespec.cli.app import app
from moespec.cleanup import find_leftovers
from moespec.hub.download import download_model, plan_download


def _kill_mid_file(hub_cache, repo: str) -> int:
    """Download ``repo`` in a forked child; SIGKILL it once its model.safetensors part is on disk.

    Returns the bytes of the part it left."""
    blobs = hub_cache / f"models--{repo.replace('/', '--')}" / "blobs"
    etag = hashlib.sha256(tiny_qwen3_moe_files(2)["model.safetensors"]).hexdigest()
    pid = os.fork()
    if pid == 0:
        try:
            constants.DOWNLOAD_CHUNK_SIZE = 4096  # so the bytes received reach the file before the kill
            download_model(plan_download(repo))
        finally:
            os._exit(0)
    deadline = time.monotonic() + 60
    try:
        while not any(p.stat().st_size >= 8192 for p in blobs.glob(f"{etag}.*.incomplete")):
            assert time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG)[0] == 0, "no part appeared"
            time.sleep(0.002)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    (part,) = blobs.glob(f"{etag}.*.incomplete")
    return part.stat().st_size


def test_a_killed_download_resumes_where_it_stopped(fake_hub, hub_cache):
    served = tiny_qwen3_moe_files(2)["model.safetensors"]
    fake_hub.stall_once["model.safetensors"] = len(served) // 2
    on_disk = _kill_mid_file(hub_cache, "tiny/qwen3-moe")
    assert 0 < on_disk <= len(served) // 2

    leftovers = find_leftovers(hub_cache=hub_cache)  # `models` counts it, and --clean would remove it
    assert on_disk in [item.bytes for item in leftovers if item.path.name.endswith(".incomplete")]
    listing = CliRunner().invoke(app, ["models"])
    assert "reclaimable" in listing.output, listing.output

    before = len(fake_hub.requests)
    plan = plan_download("tiny/qwen3-moe")
    assert plan.partial_bytes == on_disk
    seen: list[int] = []
    folder = download_model(plan, on_bytes=seen.append)

    gets = [r for r in fake_hub.requests[before:] if r.role == "cdn" and r.method == "GET"]
    assert [r.range for r in gets] == [f"bytes={on_disk}-"]  # one request, for the rest only
    assert sum(r.sent for r in gets) == len(served) - on_disk  # measured: only the missing bytes moved
    assert hashlib.sha256((folder / "model.safetensors").read_bytes()).digest() == hashlib.sha256(served).digest()
    assert not list((hub_cache / "models--tiny--qwen3-moe" / "blobs").glob("*.incomplete"))
    assert len(served) - on_disk <= max(seen) <= plan.fetch_bytes - on_disk  # the bar counts the resumed bytes


def test_models_clean_removes_a_killed_download_part(fake_hub, hub_cache):
    served = tiny_qwen3_moe_files(2)["model.safetensors"]
    fake_hub.stall_once["model.safetensors"] = len(served) // 2
    on_disk = _kill_mid_file(hub_cache, "tiny/qwen3-moe")
    r = CliRunner().invoke(app, ["models", "--clean"])
    assert r.exit_code == 0, r.output
    assert "removed" in r.output and "interrupted download" in r.output
    assert not list(hub_cache.glob("models--*/blobs/*.incomplete")) and on_disk > 0
