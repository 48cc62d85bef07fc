"""Resolve a Hub revision to a commit and list its files with the Hub's own hashes.

Two metadata calls through ``huggingface_hub.HfApi`` (endpoint from ``HF_ENDPOINT``):

1. ``model_info(repo_id, revision=REV)`` -> ``GET /api/models/{repo}/revision/{rev}``: the
   40-hex ``sha`` of the commit REV points at now, and the card metadata (license).
2. ``list_repo_tree(repo_id, revision=SHA, recursive=True)`` ->
   ``GET /api/models/{repo}/tree/{sha}?recursive=True&expand=False`` (paginated with ``Link``):
   every file's size, git blob id, and for LFS files ``lfs.oid`` = sha256 of the content.

Everything after step 1 uses the sha, never the branch name, so a push to ``main`` during a
pull cannot mix two commits. Files are then fetched from
``{endpoint}/{repo}/resolve/{sha}/{path}`` (see ``download.py``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import quote

from k3bundle.pull.errors import PullError

_HEX40 = re.compile(r"^[0-9a-f]{40}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class RemoteFile:
    """One file of the pinned commit as the Hub lists it."""

    path: str
    size: int
    lfs: bool
    sha256: str | None         # the LFS sha256 (None for plain git files)
    git_blob_sha1: str | None  # git blob id of the content (None for LFS files: theirs is the pointer's)
    url: str


@dataclass(frozen=True)
class HubListing:
    endpoint: str
    repo_id: str
    revision: str
    commit: str
    license: str | None
    files: tuple[RemoteFile, ...]


def hub_endpoint() -> str:
    """``HF_ENDPOINT`` read now (not at import), so tests and mirrors can point elsewhere."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def resolve_url(endpoint: str, repo_id: str, commit: str, path: str) -> str:
    return f"{endpoint}/{repo_id}/resolve/{commit}/{quote(path)}"


def license_of(card: dict | None, tags: list | None = None) -> str | None:
    """``license`` from the card metadata; ``license_name`` when the license is ``other``
    (Kimi checkpoints: ``license: other`` + ``license_name: modified-mit``); else a
    ``license:X`` tag."""
    card = card or {}
    lic = card.get("license")
    if isinstance(lic, list):
        lic = ",".join(str(x) for x in lic)
    if lic == "other" and isinstance(card.get("license_name"), str):
        lic = card["license_name"]
    if not lic:
        for t in tags or ():
            if isinstance(t, str) and t.startswith("license:"):
                return t.split(":", 1)[1]
    return str(lic) if lic else None


def _hub_error(e: Exception, repo_id: str, revision: str, endpoint: str) -> PullError:
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    # Subclasses first: GatedRepoError is a RepositoryNotFoundError.
    if isinstance(e, GatedRepoError):
        return PullError(f"{repo_id}: gated repo: accept its terms on {endpoint}/{repo_id} and log in "
                         f"(`hf auth login` or HF_TOKEN)")
    if isinstance(e, RepositoryNotFoundError):
        return PullError(f"{repo_id}: repository not found on {endpoint} (if it is private, log in with "
                         f"`hf auth login` or set HF_TOKEN)")
    if isinstance(e, RevisionNotFoundError):
        return PullError(f"{repo_id}: revision {revision!r} not found; pass a branch, tag or commit sha "
                         f"that exists (see {endpoint}/{repo_id}/tree/main)")
    if isinstance(e, OfflineModeIsEnabled):
        return PullError(f"{repo_id}: HF_HUB_OFFLINE is set; unset it to pull from {endpoint}")
    if isinstance(e, HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", "?")
        return PullError(f"{repo_id}: the Hub answered HTTP {status} for revision {revision!r}: "
                         f"{str(e).splitlines()[0]}")
    return PullError(f"{repo_id}: cannot reach {endpoint}: {type(e).__name__}: {e}")


def list_hub(repo_id: str, revision: str | None = None, *, token: str | bool | None = None,
             endpoint: str | None = None) -> HubListing:
    """Resolve ``revision`` (branch, tag or sha; default ``main``) and list the commit's files."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import validate_repo_id

    revision = revision or "main"
    endpoint = (endpoint or hub_endpoint()).rstrip("/")
    try:
        validate_repo_id(repo_id)
    except ValueError as e:
        raise PullError(f"{repo_id!r}: not a Hub repo id (org/name) nor an existing directory: {e}") from None
    api = HfApi(endpoint=endpoint, token=token)
    try:
        info = api.model_info(repo_id, revision=revision)
        commit = info.sha
        if not (isinstance(commit, str) and _HEX40.match(commit)):
            raise PullError(f"{repo_id}: the Hub gave {commit!r} as the commit of {revision!r}, not a 40-hex sha")
        card = info.card_data.to_dict() if info.card_data is not None else {}
        lic = license_of(card, info.tags)
        entries = [e for e in api.list_repo_tree(repo_id, revision=commit, recursive=True)
                   if isinstance(e, RepoFile)]
    except PullError:
        raise
    except Exception as e:  # huggingface_hub / httpx errors -> one line
        from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

        if isinstance(e, (HfHubHTTPError, OfflineModeIsEnabled)) or _is_transport_error(e):
            raise _hub_error(e, repo_id, revision, endpoint) from None
        raise
    files = []
    for e in entries:
        if e.lfs is not None:
            sha = str(e.lfs.sha256).lower()
            if not _HEX64.match(sha):
                raise PullError(f"{e.path}: the Hub lists LFS sha256 {sha!r}, not 64 hex digits")
            if e.lfs.size != e.size:
                raise PullError(f"{e.path}: the Hub lists size {e.size} but LFS size {e.lfs.size}")
            files.append(RemoteFile(e.path, int(e.size), True, sha, None,
                                    resolve_url(endpoint, repo_id, commit, e.path)))
        else:
            blob = str(e.blob_id).lower()
            if not _HEX40.match(blob):
                raise PullError(f"{e.path}: the Hub lists git blob id {blob!r}, not 40 hex digits")
            files.append(RemoteFile(e.path, int(e.size), False, None, blob,
                                    resolve_url(endpoint, repo_id, commit, e.path)))
    files.sort(key=lambda f: f.path)
    return HubListing(endpoint, repo_id, revision, commit, lic, tuple(files))


def _is_transport_error(e: Exception) -> bool:
    return any(c.__name__ in ("TransportError", "ConnectionError", "RequestError") for c in type(e).__mro__)
