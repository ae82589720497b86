"""Fetch a checkpoint from the Hugging Face Hub into the Hub cache: only what moespec needs.

Two steps so that nothing big moves before we know the model can run:
  1. :func:`plan_download` resolves the revision to a commit, lists the repo, reads config.json
     (a few KB) and refuses unsupported architectures and repos without safetensors;
  2. :func:`download_model` runs huggingface_hub's ``snapshot_download`` restricted to the planned
     files, reporting bytes through a callback.

Resuming: files already in the cache are not fetched again, so re-running after Ctrl-C or a
network failure continues with the missing files; inside a file, huggingface_hub resumes a broken
transfer with an HTTP Range request, and a part left by a killed process is finished from where it
stopped (moespec.hub.resume), so a second run moves only the missing bytes.
"""

from __future__ import annotations

import glob
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from moespec.errors import CheckpointError, MoespecError
from moespec.hub.checkpoint_files import CONFIG_FILE, INDEX_FILE, CheckpointFiles, check_local_checkpoint, select_files
from moespec.hub.errors import HubUnreachableError, hub_endpoint, hub_offline, translate_hub_error
from moespec.hub.sizes import ModelSizes, model_sizes, sized_model_types
from moespec.hub.support import check_supported


@dataclass(frozen=True)
class DownloadPlan:
    """What `moespec download` will fetch, known before any weight moves.

    Attributes:
        repo_id: the Hub id.
        revision: what the user asked for ("main" when nothing).
        commit: the 40-hex commit the revision resolved to.
        files: the repo files moespec needs (and those it skips).
        file_bytes: size in bytes of every wanted file, from the Hub's tree listing.
        cached: wanted files already on disk at this commit (not fetched again).
        config: the parsed config.json.
        sizes: the config-derived size breakdown; None for a model_type without a size rule (--force).
        local_dir: target folder instead of the Hub cache, or None.
        file_etags: every wanted file's blob etag (LFS: its SHA-256; else its git blob id).
        partial_bytes: bytes of wanted files already on disk in parts a killed download left
            (moespec.hub.resume finishes them; they do not cross the network again).
    """

    repo_id: str
    revision: str
    commit: str
    files: CheckpointFiles
    file_bytes: dict[str, int]
    cached: frozenset[str]
    config: dict[str, Any]
    sizes: ModelSizes | None
    local_dir: Path | None = None
    file_etags: dict[str, str] = field(default_factory=dict)
    partial_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """Bytes of all wanted files (what the model occupies on disk)."""
        return sum(self.file_bytes.get(f, 0) for f in self.files.wanted)

    @property
    def fetch_bytes(self) -> int:
        """Bytes still to download (wanted files not cached yet)."""
        return sum(self.file_bytes.get(f, 0) for f in self.files.wanted if f not in self.cached)

    @property
    def to_fetch(self) -> list[str]:
        return [f for f in self.files.wanted if f not in self.cached]


def _hub_call(fn: Callable[[], Any], model: str, revision: str | None) -> Any:
    """Run a huggingface_hub call, turning its exceptions into moespec errors."""
    try:
        return fn()
    except MoespecError:
        raise
    except Exception as exc:  # huggingface_hub / httpx errors; anything unknown propagates as is
        err = translate_hub_error(exc, model, revision)
        if err is None:
            raise
        raise err from exc


def _cached_files(repo_id: str, commit: str, wanted: list[str], local_dir: Path | None) -> frozenset[str]:
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    if local_dir is not None:
        base = local_dir
    else:
        base = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "snapshots" / commit
    return frozenset(f for f in wanted if (base / f).is_file())


def plan_download(
    repo_id: str,
    revision: str | None = None,
    token: str | None = None,
    force: bool = False,
    local_dir: Path | None = None,
) -> DownloadPlan:
    """Resolve ``revision``, list the repo and read config.json; download no weights.

    Args:
        repo_id: Hub id "org/name".
        revision: branch, tag or commit; None = "main".
        token: Hub token; None = HF_TOKEN or the saved login.
        force: accept architectures moespec cannot run yet.
        local_dir: download into this folder instead of the Hub cache.

    Raises:
        HubUnreachableError: offline mode, no network, or a server error.
        HubAccessError: gated/private repo without a valid token.
        ModelNotFoundError: unknown repo or revision.
        UnsupportedModelError: the model_type is not supported (unless ``force``).
        CheckpointError: no config.json or no safetensors weights (e.g. only .bin or GGUF).
    """
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.hf_api import RepoFile

    if hub_offline():
        raise HubUnreachableError(
            f"HF_HUB_OFFLINE is set, so `moespec download {repo_id}` cannot reach {hub_endpoint()}",
            "unset HF_HUB_OFFLINE to download; a model already in the cache runs without it",
        )
    api = HfApi(token=token)
    info = _hub_call(lambda: api.model_info(repo_id, revision=revision), repo_id, revision)
    commit = str(info.sha)
    tree = _hub_call(lambda: list(api.list_repo_tree(repo_id, revision=commit, recursive=True)), repo_id, revision)
    file_bytes = {f.path: int(f.size) for f in tree if isinstance(f, RepoFile)}
    etags = {f.path: (f.lfs.sha256 if f.lfs else f.blob_id) for f in tree if isinstance(f, RepoFile)}
    if CONFIG_FILE not in file_bytes:
        select_files(file_bytes, repo_id)  # raises the "no config.json" CheckpointError

    # config.json (and the index) go to a temporary folder: a refused repo leaves nothing in the cache.
    with tempfile.TemporaryDirectory(prefix="moespec-plan-") as tmp:

        def fetch_json(name: str) -> dict:
            path = _hub_call(lambda: hf_hub_download(repo_id, name, revision=commit, token=token, local_dir=tmp),
                             repo_id, revision)
            try:
                return json.loads(Path(path).read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{repo_id}: {name} is not valid JSON ({exc})", "report it to the repo owner") from exc

        config = fetch_json(CONFIG_FILE)
        model_type = check_supported(config, repo_id, force)
        files = select_files(file_bytes, repo_id, fetch_json(INDEX_FILE) if INDEX_FILE in file_bytes else None)
    sizes = model_sizes(config) if model_type in sized_model_types() else None
    cached = _cached_files(repo_id, commit, files.wanted, local_dir)
    etags = {f: etags[f] for f in files.wanted if etags.get(f)}
    wanted_bytes = {f: file_bytes[f] for f in files.wanted}
    partial = 0
    if local_dir is None:
        from moespec.hub.resume import partial_bytes

        partial = partial_bytes(repo_id, etags, wanted_bytes, [f for f in files.wanted if f not in cached])
    return DownloadPlan(
        repo_id=repo_id,
        revision=revision or "main",
        commit=commit,
        files=files,
        file_bytes=wanted_bytes,
        cached=cached,
        config=config,
        sizes=sizes,
        local_dir=local_dir,
        file_etags=etags,
        partial_bytes=partial,
    )


def download_model(
    plan: DownloadPlan,
    token: str | None = None,
    on_bytes: Callable[[int], None] | None = None,
    max_workers: int = 8,
) -> Path:
    """Fetch the planned files; return the local folder (Hub-cache snapshot or ``plan.local_dir``).

    Args:
        plan: from :func:`plan_download`.
        token: Hub token; None = HF_TOKEN or the saved login.
        on_bytes: called with the bytes downloaded so far (from worker threads).
        max_workers: files fetched in parallel.

    Raises:
        HubUnreachableError, HubAccessError, ModelNotFoundError: as in :func:`plan_download`.
        CheckpointError: the folder lacks files after the download (a shard missing on the Hub).
        OutputError: the disk cannot hold the files still to fetch (said before any byte moves).
    """
    from huggingface_hub import constants, snapshot_download

    from moespec.hub.progress import byte_progress_class
    from moespec.hub.resume import drop_finished_parts, resume_partial_files

    from moespec.fsutil import check_free_space

    target = plan.local_dir or Path(constants.HF_HUB_CACHE)
    check_free_space(target, plan.fetch_bytes - plan.partial_bytes)  # before any byte moves
    report = on_bytes or (lambda done: None)
    resumed = 0
    if plan.local_dir is None and plan.partial_bytes:  # a killed download's parts: only the rest moves
        resumed = _hub_call(lambda: resume_partial_files(plan.repo_id, plan.commit, plan.to_fetch, plan.file_etags,
                                                         plan.file_bytes, token, report), plan.repo_id, plan.revision)
    tqdm_class = byte_progress_class(lambda done: report(resumed + done))
    # The user's revision (not the commit) so that refs/<revision> is recorded in the cache and
    # offline resolution of "org/name" finds this snapshot later.
    path = _hub_call(
        lambda: snapshot_download(
            plan.repo_id,
            revision=plan.revision,
            allow_patterns=[glob.escape(f) for f in plan.files.wanted],
            token=token,
            local_dir=plan.local_dir,
            tqdm_class=tqdm_class,
            max_workers=max_workers,
        ),
        plan.repo_id,
        plan.revision,
    )
    folder = Path(path)
    if plan.local_dir is None:
        drop_finished_parts(plan.repo_id, plan.file_etags)  # what earlier killed runs left of these files
    check_local_checkpoint(folder, plan.repo_id)
    return folder
