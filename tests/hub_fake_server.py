"""A Hugging Face Hub stand-in on 127.0.0.1 for the hub tests, plus the fixtures that use it.

It speaks the endpoints huggingface_hub 2.x calls for ``model_info``, ``list_repo_tree`` /
``list_repo_files``, ``hf_hub_download`` and ``snapshot_download``, with the headers it reads
(checked against huggingface_hub/file_download.py and utils/_http.py):
  GET  /api/models/{repo}[/revision/{rev}]     repo info JSON (sha, siblings, gated, private)
  GET  /api/models/{repo}/tree/{rev}?recursive  [{type, oid, size, path, lfs?}]
  HEAD|GET /{repo}/resolve/{rev}/{path}         small files: 200 + ETag (git blob sha1), X-Repo-Commit;
                                                LFS files: 302 to the "CDN" + X-Linked-Etag (sha256),
                                                X-Linked-Size, X-Repo-Commit
  GET  /blobs/{sha256} on a second port          the "CDN": Range requests -> 206 + Content-Range
Errors carry X-Error-Code (RepoNotFound, GatedRepo, RevisionNotFound, EntryNotFound) or
X-Error-Message like the real Hub, since huggingface_hub classifies errors by those headers.
Both servers run on daemon threads and stop by themselves after ``lifetime_s``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import tempfile
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
VALID_TOKEN = "hf_valid_test_token"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    """A repo: commits (sha -> {path: bytes}), refs (branch/tag -> sha), access rules."""

    commits: dict[str, dict[str, bytes]]
    refs: dict[str, str]
    gated: bool = False
    private: bool = False


@dataclass
class RequestLog:
    role: str  # "hub" or "cdn"
    method: str
    path: str
    range: str | None
    authorization: str | None
    sent: int = 0  # body bytes sent (CDN GETs)


@dataclass
class FakeHub:
    """Two HTTP servers (hub + CDN) over ``repos``; see the module docstring.

    Attributes:
        truncate_once: file names whose first CDN GET sends half the body, then drops the connection.
        stall_once: file name -> bytes: its first CDN GET sends that many bytes of the body, then
            hangs (a download to kill mid-file).
        fail_always: file names whose CDN GET answers 500 (a download that cannot finish).
        requests: every request received, in order.
    """

    repos: dict[str, FakeRepo]
    lifetime_s: float = 120.0
    truncate_once: set[str] = field(default_factory=set)
    stall_once: dict[str, int] = field(default_factory=dict)
    fail_always: set[str] = field(default_factory=set)
    requests: list[RequestLog] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._blobs: dict[str, tuple[str, bytes]] = {}  # sha256 -> (file name, bytes)
        for repo in self.repos.values():
            for files in repo.commits.values():
                for path, data in files.items():
                    self._blobs[hashlib.sha256(data).hexdigest()] = (path, data)
        self._lock = threading.Lock()
        self._servers: list[ThreadingHTTPServer] = []
        self._timer: threading.Timer | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "FakeHub":
        for role in ("hub", "cdn"):
            handler = type(f"{role.title()}Handler", (_Handler,), {"hub": self, "role": role})
            server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
            self._servers.append(server)
        self._timer = threading.Timer(self.lifetime_s, self.stop)
        self._timer.daemon = True
        self._timer.start()
        return self

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._servers = []

    def __enter__(self) -> "FakeHub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._servers[0].server_address[1]}"

    @property
    def cdn_url(self) -> str:
        return f"http://127.0.0.1:{self._servers[1].server_address[1]}"

    def gets(self, name: str) -> list[RequestLog]:
        """CDN or hub GETs that transferred file ``name`` (by path suffix or blob)."""
        out = []
        for r in self.requests:
            if r.method != "GET":
                continue
            if r.role == "hub" and "/resolve/" in r.path and r.path.endswith("/" + name):
                out.append(r)
            elif r.role == "cdn" and self._blobs.get(r.path.rsplit("/", 1)[-1], ("",))[0] == name:
                out.append(r)
        return out


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: FakeHub
    role: str

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    # -- plumbing ----------------------------------------------------------------------------
    def _send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, str(value))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj, headers: dict | None = None) -> None:
        self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _error(self, status: int, code: str | None, message: str, extra: dict | None = None) -> None:
        headers = {"X-Error-Message": message, **(extra or {})}
        if code:
            headers["X-Error-Code"] = code
        self._send(status, json.dumps({"error": message}).encode(), headers)

    def do_HEAD(self) -> None:
        self._route()

    def do_GET(self) -> None:
        self._route()

    def _route(self) -> None:
        url = urlsplit(self.path)
        self.log = RequestLog(self.role, self.command, url.path, self.headers.get("Range"),
                              self.headers.get("authorization"))
        with self.hub._lock:
            self.hub.requests.append(self.log)
        if self.role == "cdn":
            return self._cdn(url.path)
        parts = url.path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            return self._api(parts[2] + "/" + parts[3], parts[4:], parse_qs(url.query))
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(parts[0] + "/" + parts[1], unquote(parts[3]), unquote("/".join(parts[4:])))
        self._error(404, None, "Not found")

    # -- access rules like the real Hub ------------------------------------------------------
    def _repo(self, repo_id: str, for_files: bool) -> FakeRepo | None:
        auth = self.headers.get("authorization")
        if auth is not None and auth != f"Bearer {VALID_TOKEN}":
            self._error(401, None, "Invalid credentials in Authorization header")
            return None
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.private and auth is None):
            self._error(404 if repo is None else 401, "RepoNotFound", "Repository not found")
            return None
        if repo.gated and for_files and auth is None:
            self._error(
                401, "GatedRepo",
                f"Access to model {repo_id} is restricted. You must have access to it and be authenticated to access it. Please log in.",
            )
            return None
        return repo

    def _commit(self, repo: FakeRepo, rev: str) -> str | None:
        sha = repo.refs.get(rev) or (rev if rev in repo.commits else None)
        if sha is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return sha

    # -- endpoints ---------------------------------------------------------------------------
    def _api(self, repo_id: str, rest: list[str], query: dict) -> None:
        repo = self._repo(repo_id, for_files=False)
        if repo is None:
            return
        rev = unquote(rest[1]) if len(rest) >= 2 else "main"
        sha = self._commit(repo, rev)
        if sha is None:
            return
        files = repo.commits[sha]
        if not rest or rest[0] == "revision":
            return self._json({
                "_id": "0" * 24, "id": repo_id, "modelId": repo_id, "sha": sha, "private": repo.private,
                "gated": "manual" if repo.gated else False, "disabled": False, "downloads": 0, "likes": 0,
                "tags": ["safetensors"], "library_name": "transformers", "lastModified": "2026-01-01T00:00:00.000Z",
                "siblings": [{"rfilename": p} for p in sorted(files)],
            })
        if rest[0] == "tree":
            return self._json(self._tree(files))
        self._error(404, None, "Not found")

    @staticmethod
    def _tree(files: dict[str, bytes]) -> list[dict]:
        out, folders = [], set()
        for path in sorted(files):
            data = files[path]
            for i in range(1, path.count("/") + 1):
                folders.add("/".join(path.split("/")[:i]))
            entry = {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": path}
            if path.endswith(LFS_SUFFIXES):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            out.append(entry)
        out += [{"type": "directory", "oid": git_blob_sha1(f.encode()), "size": 0, "path": f} for f in sorted(folders)]
        return out

    def _resolve(self, repo_id: str, rev: str, path: str) -> None:
        repo = self._repo(repo_id, for_files=True)
        if repo is None:
            return
        sha = self._commit(repo, rev)
        if sha is None:
            return
        data = repo.commits[sha].get(path)
        if data is None:
            return self._error(404, "EntryNotFound", f"{path} does not exist", {"X-Repo-Commit": sha})
        if path.endswith(LFS_SUFFIXES):
            digest = hashlib.sha256(data).hexdigest()
            return self._send(302, b"", {
                "Location": f"{self.hub.cdn_url}/blobs/{digest}", "X-Repo-Commit": sha, "ETag": f'"{git_blob_sha1(data)}"',
                "X-Linked-Etag": f'"{digest}"', "X-Linked-Size": len(data),
            })
        self._send(200, data, {"ETag": f'"{git_blob_sha1(data)}"', "X-Repo-Commit": sha,
                               "Content-Type": "application/octet-stream"})

    def _cdn(self, path: str) -> None:
        name, data = self.hub._blobs.get(path.rsplit("/", 1)[-1], (None, None))
        if data is None:
            return self._send(404, b"NoSuchKey")
        if name in self.hub.fail_always:
            return self._send(500, b"InternalError")
        start = 0
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            start = int(rng[len("bytes="):].split("-")[0])
        with self.hub._lock:
            truncate = name in self.hub.truncate_once and self.command == "GET"
            self.hub.truncate_once.discard(name)
            stall = self.hub.stall_once.pop(name, None) if self.command == "GET" else None
        body = data[start:]
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if self.command == "HEAD":
            return
        if truncate:  # half the body, then the connection drops: the client must resume with Range
            self.wfile.write(body[: len(body) // 2])
            self.log.sent = len(body) // 2
            self.wfile.flush()
            self.close_connection = True
            return
        if stall is not None:  # part of the body, then nothing until the client is killed
            self.wfile.write(body[:stall])
            self.log.sent = stall
            self.wfile.flush()
            threading.Event().wait(self.hub.lifetime_s)
            self.close_connection = True
            return
        self.wfile.write(body)
        self.log.sent = len(body)


# -- the tiny checkpoints ---------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def tiny_qwen3_moe_files(num_layers: int = 2) -> dict[str, bytes]:
    """A real transformers Qwen3-MoE checkpoint (hidden 16, ``num_layers`` layers, 4 experts, top-2), as bytes."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=num_layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
        vocab_size=64, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(config)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        files = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}
    assert "model.safetensors" in files and "config.json" in files, sorted(files)
    files["tokenizer.json"] = json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}}}).encode()
    files["README.md"] = f"# tiny qwen3 moe, {num_layers} layers\n".encode()
    files["pytorch_model.bin"] = b"\x80\x02pickle-not-wanted" * 64
    files["original/model.safetensors"] = files["model.safetensors"]
    files[".gitattributes"] = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
    return files


SHA_MAIN = "a" * 40
SHA_V1 = "b" * 40


def standard_repos() -> dict[str, FakeRepo]:
    """The repos every hub test serves."""
    main, v1 = tiny_qwen3_moe_files(2), tiny_qwen3_moe_files(1)
    llama_config = json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}).encode()
    return {
        "tiny/qwen3-moe": FakeRepo({SHA_MAIN: main, SHA_V1: v1}, {"main": SHA_MAIN, "v1.0": SHA_V1}),
        "tiny/gated-moe": FakeRepo({SHA_MAIN: main}, {"main": SHA_MAIN}, gated=True),
        "tiny/bin-only": FakeRepo(
            {SHA_MAIN: {"config.json": main["config.json"], "pytorch_model.bin": b"x" * 100, "model-q4.gguf": b"GGUF"}},
            {"main": SHA_MAIN},
        ),
        "tiny/dense-llama": FakeRepo(
            {SHA_MAIN: {"config.json": llama_config, "model.safetensors": main["model.safetensors"]}}, {"main": SHA_MAIN}
        ),
    }


def point_hub_at(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, endpoint: str) -> Path:
    """Point huggingface_hub (env and its import-time constants) and moespec at per-test folders.

    huggingface_hub reads HF_ENDPOINT, HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE into
    ``huggingface_hub.constants`` at import, and reads those attributes at call time, so both the
    environment (for subprocesses) and the attributes (for this process) are set.
    Returns the Hub cache folder.
    """
    from huggingface_hub import constants

    home = tmp_path / "hf_home"
    cache = home / "hub"
    env = {"HF_HOME": str(home), "HF_HUB_CACHE": str(cache), "HF_ENDPOINT": endpoint,
           "MOESPEC_HOME": str(tmp_path / "moespec_home"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in ("HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    attrs = {
        "ENDPOINT": endpoint,
        "HUGGINGFACE_CO_URL_TEMPLATE": endpoint + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": False,
        "HF_TOKEN_PATH": str(home / "token"),
        "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
    }
    for key, value in attrs.items():
        monkeypatch.setattr(constants, key, value)
    return cache


@pytest.fixture
def fake_hub():
    """The standard repos served on 127.0.0.1; stopped after the test (or after 120 s by itself)."""
    with FakeHub(standard_repos()) as hub:
        yield hub


@pytest.fixture
def hub_cache(fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """huggingface_hub and moespec pointed at ``fake_hub`` and an empty per-test cache; returns the cache folder."""
    return point_hub_at(monkeypatch, tmp_path, fake_hub.url)
