"""Resuming a file whose download was killed: only the bytes still missing cross the network.

huggingface_hub (2.x) downloads each file into ``blobs/<etag>.<random>.incomplete`` and deletes it
when the transfer fails, but a killed process leaves it behind, and the next run starts that file
from zero in a new temp file. Before `moespec download` hands the rest to ``snapshot_download``,
:func:`resume_partial_files` takes each leftover part that no running download holds (its
``.locks/<repo>/<etag>.lock``, huggingface_hub's own lock), fetches the missing range with
huggingface_hub's ``http_get(resume_size=...)`` (an HTTP Range request), checks the whole file
against its SHA-256 (LFS files: the etag is the SHA-256) and moves it into place as
``blobs/<etag>``; ``snapshot_download`` then only links it into the snapshot. A part that does not
check out is deleted, and that file is fetched whole as before.

Downloads into ``--local-dir`` are not resumed this way (huggingface_hub keeps their parts elsewhere).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Callable

SHA256 = re.compile(r"^[0-9a-f]{64}$")


def blobs_dir(repo_id: str) -> Path:
    """The Hub cache's ``blobs`` folder of ``repo_id``."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "blobs"


def lock_path(repo_id: str, etag: str) -> Path:
    """huggingface_hub's download lock of the blob ``etag`` of ``repo_id``."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return Path(constants.HF_HUB_CACHE) / ".locks" / repo_folder_name(repo_id=repo_id, repo_type="model") / f"{etag}.lock"


def partial_part(repo_id: str, etag: str, size: int) -> Path | None:
    """The largest leftover part of blob ``etag`` shorter than ``size`` bytes that no download holds, or None."""
    from moespec.tempfiles import download_lock_free

    folder = blobs_dir(repo_id)
    if not folder.is_dir() or not download_lock_free(lock_path(repo_id, etag)):
        return None
    parts = [p for p in folder.glob(f"{etag}*.incomplete") if 0 < p.stat().st_size < size]
    return max(parts, key=lambda p: p.stat().st_size, default=None)


def partial_bytes(repo_id: str, etags: dict[str, str], sizes: dict[str, int], files: list[str]) -> int:
    """Bytes of ``files`` already on disk in resumable parts (what a resumed download will not move)."""
    total = 0
    for name in files:
        etag = etags.get(name)
        part = partial_part(repo_id, etag, sizes.get(name, 0)) if etag else None
        total += part.stat().st_size if part is not None else 0
    return total


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def resume_partial_files(repo_id: str, commit: str, files: list[str], etags: dict[str, str], sizes: dict[str, int],
                         token: str | None = None, on_bytes: Callable[[int], None] | None = None) -> int:
    """Finish every killed download of ``files`` that left a part; returns the bytes fetched.

    Args:
        repo_id, commit: the repo and the commit the files come from.
        files: the files still to fetch; etags / sizes: each one's blob etag and bytes (the tree listing).
        token: Hub token; on_bytes: called with the bytes fetched so far.

    Raises:
        huggingface_hub / httpx errors, as ``hf_hub_download`` raises them (the caller translates them).
    """
    from filelock import FileLock, Timeout
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    moved = 0
    for name in files:
        etag, size = etags.get(name), sizes.get(name, 0)
        part = partial_part(repo_id, etag, size) if etag else None
        if part is None:
            continue
        lock = lock_path(repo_id, etag)
        lock.parent.mkdir(parents=True, exist_ok=True)
        try:
            with FileLock(str(lock), timeout=0):
                done = part.stat().st_size
                meta = get_hf_file_metadata(hf_hub_url(repo_id, name, revision=commit), token=token)
                if meta.etag != etag:  # the file changed on the Hub since: the part is of no use
                    part.unlink(missing_ok=True)
                    continue
                with open(part, "ab") as fh:
                    http_get(meta.location, fh, resume_size=done, headers=build_hf_headers(token=token),
                             expected_size=size, displayed_filename=name,
                             tqdm_class=_counter(on_bytes, moved - done))  # its bar starts at ``done``
                moved += part.stat().st_size - done
                if part.stat().st_size != size or (SHA256.match(etag) and _sha256(part) != etag):
                    part.unlink(missing_ok=True)  # not the file: fetched whole by snapshot_download
                    continue
                os.replace(part, part.parent / etag)
                for other in part.parent.glob(f"{etag}*.incomplete"):
                    other.unlink(missing_ok=True)  # older parts of the same blob, now finished
        except Timeout:
            continue  # another process downloads this file right now
    return moved


def _counter(on_bytes: Callable[[int], None] | None, before: int):
    """A tqdm class for http_get that reports ``before`` + its bar's count to ``on_bytes``."""
    from moespec.hub.progress import byte_progress_class

    return byte_progress_class(lambda done: on_bytes(before + done) if on_bytes else None)


def drop_finished_parts(repo_id: str, etags: dict[str, str]) -> int:
    """Delete the parts that killed downloads left of blobs now complete (none is running); bytes freed.

    A part too short to resume (nothing reached the disk) or of a file fetched whole since is of no
    further use; huggingface_hub never removes it.
    """
    from moespec.tempfiles import download_lock_free

    folder, freed = blobs_dir(repo_id), 0
    for etag in set(etags.values()):
        if not (folder / etag).is_file() or not download_lock_free(lock_path(repo_id, etag)):
            continue
        for part in folder.glob(f"{etag}*.incomplete"):
            freed += part.stat().st_size
            part.unlink(missing_ok=True)
    return freed
