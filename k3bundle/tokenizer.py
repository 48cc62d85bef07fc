"""Load a Kimi K3 tokenizer directory (``tiktoken.model`` + specials) as a tiktoken Encoding.

Only data is read: the ``base64(token_bytes) rank`` lines of ``tiktoken.model``, and, when
present, ``tokenizer_config.json`` to cross-check its named special tokens, ``tokenizer.json``
(its added tokens) and ``config.json`` (its ``media_placeholder_token_id``) to cross-check the
media tokens. The special tokens themselves come from :mod:`k3bundle.tokenizer_specials` (256
slots after the mergeable ranks); ``tokenization_*.py`` is never imported or executed.
"""

from __future__ import annotations

import base64
import binascii
import os
from pathlib import Path

import tiktoken

from k3bundle import tokenizer_specials as ts
from k3bundle.errors import JsonFileError, K3Error
from k3bundle.file_names import CONFIG as MODEL_CONFIG_FILE
from k3bundle.io.files import open_regular
from k3bundle.io.strict_json import read_json

TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
FAST_FILE = "tokenizer.json"  # what a converted fast tokenizer saves; k3bundle only checks it
# A tokenizer whose media tokens sit below K3's ids is the known conversion bug: transformers'
# fast-tokenizer conversion compacts the special ids over the empty reserved slots, so
# <|media_pad|> moves down (by 3 in the K2.5 family) and images silently miss their placeholders.
_SHIFT_CAUSE = ("the known fast-tokenizer conversion bug in transformers (special ids compacted over "
                "the empty reserved slots), which leaves images without their placeholders; use the "
                "release's tiktoken.model and tokenizer_config.json")


class TokenizerError(K3Error):
    """A tokenizer file is malformed or disagrees with K3's special-token layout."""


def _is_decimal(b: bytes) -> bool:
    return bool(b) and all(48 <= c <= 57 for c in b) and (b == b"0" or b[0] != 48)


def read_mergeable_ranks(path: str | os.PathLike[str]) -> dict[bytes, int]:
    """Parse ``tiktoken.model`` strictly: token bytes -> rank, ranks exactly 0..n-1.

    Every line must be ``<base64> <rank>`` (one space, canonical decimal rank, newline at
    the end of the file optional). Duplicate tokens, duplicate ranks, gaps in the ranks and
    missing single-byte tokens are errors that name the file and, where there is one, the
    line.
    """
    p = Path(path)
    try:  # a regular file only: a FIFO in its place would hang the read
        with os.fdopen(open_regular(p), "rb") as f:
            data = f.read()
    except OSError as e:
        raise TokenizerError(f"{p}: cannot read: {e.strerror or e}") from None
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if not lines:
        raise TokenizerError(f"{p}: empty file, expected '<base64> <rank>' lines")

    ranks: dict[bytes, int] = {}
    line_of_rank: dict[int, int] = {}
    line_of_token: dict[bytes, int] = {}
    for lineno, line in enumerate(lines, start=1):
        where = f"{p}:{lineno}"
        fields = line.split(b" ")
        if len(fields) != 2:
            raise TokenizerError(
                f"{where}: malformed line {line[:60]!r}, expected '<base64> <rank>'"
            )
        tok_b64, rank_txt = fields
        if not _is_decimal(rank_txt):
            raise TokenizerError(f"{where}: rank {rank_txt[:30]!r} is not a decimal integer")
        try:
            tok = base64.b64decode(tok_b64, validate=True)
        except (binascii.Error, ValueError):
            raise TokenizerError(f"{where}: token {tok_b64[:40]!r} is not valid base64") from None
        if not tok:
            raise TokenizerError(f"{where}: token is empty")
        rank = int(rank_txt)
        if rank in line_of_rank:
            raise TokenizerError(
                f"{where}: rank {rank} already given on line {line_of_rank[rank]}"
            )
        if tok in line_of_token:
            raise TokenizerError(
                f"{where}: token {tok!r} already given on line {line_of_token[tok]}"
            )
        line_of_rank[rank] = lineno
        line_of_token[tok] = lineno
        ranks[tok] = rank

    n = len(ranks)
    beyond = [r for r in line_of_rank if r >= n]
    if beyond:
        r = min(beyond)
        missing = min(set(range(n)) - set(line_of_rank))
        raise TokenizerError(
            f"{p}:{line_of_rank[r]}: rank {r} leaves a gap: ranks must be 0..{n - 1} "
            f"with none missing (first missing rank {missing})"
        )
    absent = [b for b in range(256) if bytes([b]) not in ranks]
    if absent:
        raise TokenizerError(
            f"{p}: {len(absent)} single-byte token(s) missing (first 0x{absent[0]:02x}); "
            f"every byte must be a mergeable token"
        )
    return ranks


def _read_object(path: Path) -> dict:
    try:
        data = read_json(path)
    except JsonFileError as e:
        raise TokenizerError(str(e)) from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object at the top level")
    return data


def check_media_ids(path: Path, found: dict[str, int], vocab_size: int) -> None:
    """The media tokens named in ``found`` (token -> id, as ``path`` gives them) must sit at K3's
    ids (docs/chat.md, media tokens); ids moved down name the known conversion bug."""
    want = ts.media_ids(vocab_size)
    for name, wanted in want.items():
        got = found.get(name)
        if got is None or got == wanted:
            continue
        if not isinstance(got, int) or isinstance(got, bool):
            raise TokenizerError(f"{path}: {name} has id {got!r}, not an integer")
        cause = _SHIFT_CAUSE if got < wanted else "images would miss their placeholders"
        raise TokenizerError(f"{path}: {name} is id {got}, K3 has it at {wanted} (shifted by "
                             f"{got - wanted:+d}): {cause}")


def _check_fast(path: Path, vocab_size: int) -> None:
    """A ``tokenizer.json`` beside the files: its added tokens' media ids must be K3's."""
    added = _read_object(path).get("added_tokens", [])
    if not isinstance(added, list) or not all(isinstance(e, dict) for e in added):
        raise TokenizerError(f"{path}: added_tokens is not a list of objects")
    found = {e.get("content"): e.get("id") for e in added if e.get("content") in ts.MEDIA_TOKENS}
    check_media_ids(path, found, vocab_size)


def _check_model_config(path: Path, vocab_size: int) -> None:
    """``config.json``'s ``media_placeholder_token_id``, if it gives one, is this ``<|media_pad|>``."""
    pad_id = _read_object(path).get("media_placeholder_token_id")
    if pad_id is not None:
        check_media_ids(path, {ts.MEDIA_PAD: pad_id}, vocab_size)


def _check_config(path: Path, specials: dict[str, int], vocab_size: int) -> None:
    """Check that ``tokenizer_config.json``'s named specials sit where k3bundle expects."""
    cfg = _read_object(path)
    decoder = cfg.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise TokenizerError(f"{path}: added_tokens_decoder is not an object")
    by_id = {i: name for name, i in specials.items()}
    named: dict[str, int] = {}
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not isinstance(content, str) or not key.isdigit():
            raise TokenizerError(f"{path}: added_tokens_decoder[{key!r}] is malformed")
        named[content] = int(key)
    # the media ids first: a shifted table is the known conversion bug, said as such
    check_media_ids(path, named, vocab_size)
    for key, entry in decoder.items():
        content = entry["content"]
        want = by_id.get(int(key))
        if want is None:
            raise TokenizerError(
                f"{path}: added token {key} ({content!r}) is outside the special range "
                f"{min(by_id)}..{max(by_id)}"
            )
        if content != want:
            raise TokenizerError(
                f"{path}: added token {key} is {content!r}, but K3 has {want!r} there"
            )


def load_tiktoken(directory: str | os.PathLike[str]) -> tiktoken.Encoding:
    """Build a ``tiktoken.Encoding`` from a K3 tokenizer directory.

    Mergeable ranks come from ``tiktoken.model``; the 256 special tokens follow them
    (``tokenizer_specials.special_tokens(n + 256)``), with the release's ``PAT_STR``. If
    ``tokenizer_config.json`` is present, its ``added_tokens_decoder`` must agree; the media
    tokens of a ``tokenizer.json`` and ``config.json``'s ``media_placeholder_token_id``, where
    present, must sit at the ids the vision path splices at (:func:`check_media_ids`).
    """
    d = Path(directory)
    ranks = read_mergeable_ranks(d / TIKTOKEN_FILE)
    vocab_size = len(ranks) + ts.NUM_SPECIAL
    try:
        specials = ts.special_tokens(vocab_size)
    except K3Error as e:
        raise TokenizerError(f"{d / TIKTOKEN_FILE}: {e}") from None
    if (d / CONFIG_FILE).is_file():
        _check_config(d / CONFIG_FILE, specials, vocab_size)
    if (d / FAST_FILE).is_file():
        _check_fast(d / FAST_FILE, vocab_size)
    if (d / MODEL_CONFIG_FILE).is_file():
        _check_model_config(d / MODEL_CONFIG_FILE, vocab_size)
    return tiktoken.Encoding(
        name=TIKTOKEN_FILE,
        pat_str=ts.PAT_STR,
        mergeable_ranks=ranks,
        special_tokens=specials,
        explicit_n_vocab=vocab_size,
    )
