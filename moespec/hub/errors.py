"""Turn huggingface_hub's exceptions into moespec errors that say what to do.

huggingface_hub reports a gated repo, a private repo, a typo in the id, a missing revision and a
dead network with different exception classes whose messages speak of URLs and HTTP codes; a user
of `moespec download` needs the model name, the cause and the flag or command that fixes it.
"""

from __future__ import annotations

from moespec.errors import (CheckpointError, HubAccessError, HubUnreachableError,  # noqa: F401 (re-exported)
                            MoespecError, ModelNotFoundError)


def hub_endpoint() -> str:
    """The Hub URL huggingface_hub talks to (``HF_ENDPOINT`` or https://huggingface.co)."""
    from huggingface_hub import constants

    return constants.ENDPOINT


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) forbids network calls."""
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def translate_hub_error(exc: BaseException, model: str, revision: str | None) -> MoespecError | None:
    """The moespec error for a huggingface_hub exception, or None when ``exc`` is not one we know.

    Args:
        exc: what huggingface_hub (or httpx underneath it) raised.
        model: the Hub id, named in the message.
        revision: the requested revision (None = main).
    """
    import httpx2
    from huggingface_hub import errors as hf

    endpoint = hub_endpoint()
    at_rev = f" at revision {revision!r}" if revision else ""
    token_hint = "pass --token hf_... (or set HF_TOKEN, or run `hf auth login`)"
    if isinstance(exc, hf.GatedRepoError):  # before RepositoryNotFoundError: it is a subclass
        return HubAccessError(
            f"{model} is a gated repo: its files need an account that accepted the model's terms",
            f"accept them at {endpoint}/{model}, then {token_hint} with that account's token",
        )
    if isinstance(exc, hf.RepositoryNotFoundError):
        return ModelNotFoundError(
            f"{model} was not found on {endpoint} (no such repo, or a private one this token cannot see)",
            f"check the id (org/name, as on the model page); for a private repo {token_hint}",
        )
    if isinstance(exc, hf.RevisionNotFoundError):
        return ModelNotFoundError(
            f"{model} has no revision {revision!r} (branch, tag or commit)",
            "pass an existing branch, tag or commit hash to --revision, or omit it for main",
        )
    if isinstance(exc, hf.RemoteEntryNotFoundError):
        return CheckpointError(f"a file of {model}{at_rev} vanished from the Hub during the download", "run it again")
    if isinstance(exc, hf.HfHubHTTPError) and exc.response is not None and exc.response.status_code in (401, 403):
        return HubAccessError(
            f"{endpoint} refused access to {model} (HTTP {exc.response.status_code}): the token is invalid or lacks rights",
            f"create a read token at {endpoint}/settings/tokens and {token_hint}",
        )
    if isinstance(exc, hf.IncompleteSnapshotError):
        return CheckpointError(
            f"the cached copy of {model}{at_rev} is incomplete and the Hub cannot be reached",
            f"run `moespec download {model}` with network access to finish it",
        )
    if isinstance(exc, (hf.OfflineModeIsEnabled, hf.LocalEntryNotFoundError)) and hub_offline():
        return HubUnreachableError(
            f"HF_HUB_OFFLINE is set, so moespec cannot fetch {model}{at_rev} and it is not in the local cache",
            "unset HF_HUB_OFFLINE (or set it to 0) to download, or copy the model folder here and pass its path",
        )
    if isinstance(exc, (hf.LocalEntryNotFoundError, httpx2.TransportError, hf.OfflineModeIsEnabled)):
        return HubUnreachableError(
            f"cannot reach {endpoint} to fetch {model}{at_rev}",
            "check the network (and HF_ENDPOINT if you use a mirror); models already downloaded still run offline",
        )
    if isinstance(exc, hf.HfHubHTTPError):
        code = exc.response.status_code if exc.response is not None else "?"
        return HubUnreachableError(f"{endpoint} answered HTTP {code} for {model}{at_rev}", "try again later")
    if isinstance(exc, hf.HFValidationError):
        return ModelNotFoundError(
            f"{model!r} is not a Hub id ({exc})", "write it as org/name, or pass a folder path that exists"
        )
    return None
