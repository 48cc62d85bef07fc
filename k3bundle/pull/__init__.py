"""``k3bundle pull``: a pinned, hash-verified, resumable pull from the Hugging Face Hub or a local
directory, recorded in ``source.json``.

Public API::

    pull(source, out=None, *, revision=None, include=(), exclude=(), workers=8, retries=5,
         recheck=False, token=None, progress=None) -> PullResult
    pull_hub(repo_id, out, ...) / pull_local(src, out=None, ...)
    read_source(dir_or_file) -> SourceRecord     write_source(dir, record) -> Path
    list_hub(repo_id, revision) -> HubListing    (metadata only, no file bytes)
    PullError

Modules: ``hub`` (resolve + list via ``huggingface_hub.HfApi``), ``download`` (streaming GET with
the hash in the same pass, Range resume, the worker pool), ``local`` (directory pulls),
``record`` (source.json), ``state`` (which files are already verified), ``paths`` (name
safety, globs). See ``docs/pull.md``.
"""

from k3bundle.pull.errors import PullError
from k3bundle.pull.hub import HubListing, RemoteFile, list_hub
from k3bundle.pull.record import SCHEMA_VERSION, FileEntry, SourceRecord, read_source, write_source
from k3bundle.pull.run import PullResult, pull, pull_hub, pull_local

__all__ = [
    "PullError", "HubListing", "RemoteFile", "list_hub", "SCHEMA_VERSION", "FileEntry", "SourceRecord",
    "read_source", "write_source", "PullResult", "pull", "pull_hub", "pull_local",
]
