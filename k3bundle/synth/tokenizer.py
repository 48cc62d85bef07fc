"""A small, deterministic Kimi-K3-style tokenizer for synthetic checkpoints.

The release tokenizer is ``tiktoken.model`` (one ``base64(token_bytes) rank`` line per
mergeable token) plus ``tokenizer_config.json`` naming the special tokens that follow the
mergeable ranks. Here the ranks are learned by a byte-level BPE trainer on a fixed corpus
shipped with the package (``k3bundle/data/tokenizer_corpus.txt``), split with the release's
pre-tokenizer pattern, so a synthetic vocabulary of any size keeps the release's format,
special-token positions and pre-tokenization, and encodes real text compactly.
"""

from __future__ import annotations

import base64
import heapq
import importlib.resources
import json
import os
from collections import Counter
from pathlib import Path

import regex

from k3bundle import tokenizer_specials as ts
from k3bundle.errors import SynthError

TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"

_CORPUS_RESOURCE = ("data", "tokenizer_corpus.txt")

# ``&&`` (set intersection) in the K3 pattern needs the regex module's V1 behaviour.
_PAT = regex.compile(ts.PAT_STR, regex.V1)

# transformers' default ``model_max_length`` (int(1e30)), which the release's
# tokenizer_config.json carries, as the K2-family files do.
_MODEL_MAX_LENGTH = 1000000000000000019884624838656

# ``tokenization_kimi.TikTokenTokenizer``'s default ``additional_special_tokens`` (NEMO-TOK):
# K2-era names it still registers (docs/chat.md).
_ADDITIONAL_SPECIAL_TOKENS = (
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "[EOT]",
    "<|im_system|>",
    "<|im_middle|>",
)


def pretokenize(text: str) -> list[str]:
    """Split ``text`` into the pieces the release's pattern makes (merges stay inside)."""
    return _PAT.findall(text)


def load_corpus() -> str:
    """The packaged training text for the synthetic tokenizer."""
    res = importlib.resources.files("k3bundle").joinpath(*_CORPUS_RESOURCE)
    return res.read_text(encoding="utf-8")


def train_bpe(corpus: str, num_merges: int) -> list[bytes]:
    """Learn ``num_merges`` byte-level BPE merges on ``corpus``.

    Returns the token bytes in rank order: ranks 0..255 are the single bytes in byte
    order, then one new token per merge. The corpus is split with the release's
    pre-tokenizer pattern and merges never cross a piece. Each step merges the most
    frequent adjacent pair; ties go to the pair with the lowest (left id, right id). A
    merge whose bytes already exist as a token is applied without adding a rank.
    Raises ``SynthError`` when the corpus runs out of pairs first.
    """
    if num_merges < 0:
        raise SynthError(f"num_merges must be >= 0, got {num_merges}")
    vocab: list[bytes] = [bytes([b]) for b in range(256)]
    if num_merges == 0:
        return vocab

    word_freq = Counter(piece.encode("utf-8") for piece in pretokenize(corpus))
    words: list[list[int]] = [list(w) for w in word_freq]
    freqs: list[int] = list(word_freq.values())

    # Upper bound on merges this corpus can yield (each merge shortens some word by one).
    capacity = sum(len(w) - 1 for w in words)
    if num_merges > capacity:
        raise SynthError(
            f"tokenizer corpus supports at most {capacity} BPE merges, {num_merges} asked"
        )

    counts: dict[tuple[int, int], int] = {}
    where: dict[tuple[int, int], set[int]] = {}
    for wi, (w, f) in enumerate(zip(words, freqs)):
        for pair in zip(w, w[1:]):
            counts[pair] = counts.get(pair, 0) + f
            where.setdefault(pair, set()).add(wi)
    heap = [(-c, a, b) for (a, b), c in counts.items()]
    heapq.heapify(heap)
    token_id = {tok: i for i, tok in enumerate(vocab)}

    added = 0
    while added < num_merges:
        if not heap:
            raise SynthError(
                f"tokenizer corpus supports only {added} BPE merges, {num_merges} asked"
            )
        negc, a, b = heapq.heappop(heap)
        cur = counts.get((a, b), 0)
        if cur != -negc:
            if cur > 0:
                heapq.heappush(heap, (-cur, a, b))
            continue
        merged = vocab[a] + vocab[b]
        new = token_id.get(merged)
        if new is None:
            new = len(vocab)
            vocab.append(merged)
            token_id[merged] = new
            added += 1
        touched: set[tuple[int, int]] = set()
        for wi in sorted(where.pop((a, b), ())):
            w, f = words[wi], freqs[wi]
            if len(w) < 2:
                continue
            out: list[int] = []
            i, n, hit = 0, len(w), False
            while i < n:
                if i + 1 < n and w[i] == a and w[i + 1] == b:
                    out.append(new)
                    i += 2
                    hit = True
                else:
                    out.append(w[i])
                    i += 1
            if not hit:
                continue
            for pair in zip(w, w[1:]):
                counts[pair] -= f
                touched.add(pair)
            for pair in zip(out, out[1:]):
                counts[pair] = counts.get(pair, 0) + f
                where.setdefault(pair, set()).add(wi)
                touched.add(pair)
            words[wi] = out
        for pair in sorted(touched):
            c = counts[pair]
            if c <= 0:
                del counts[pair]
            else:
                heapq.heappush(heap, (-c, pair[0], pair[1]))
    return vocab


def tiktoken_model_bytes(tokens: list[bytes]) -> bytes:
    """Serialize tokens (index = rank) in the release's ``tiktoken.model`` format."""
    return b"".join(
        base64.b64encode(tok) + b" " + str(rank).encode("ascii") + b"\n"
        for rank, tok in enumerate(tokens)
    )


def tokenizer_config(vocab_size: int) -> dict:
    """The release-style ``tokenizer_config.json`` for a vocabulary of ``vocab_size``.

    Fields follow the release (docs/chat.md, NEMO-TOK): ``added_tokens_decoder`` holds the 16
    named specials (reserved slots are implicit), bos/eos/pad/unk are ``[BOS]``/``[EOS]``/
    ``[PAD]``/``[UNK]``, ``auto_map`` points at ``tokenization_kimi.TikTokenTokenizer``, and
    there is no ``chat_template`` (K3 renders chats in Python, ``encoding_k3.py``).
    """
    ids = ts.named_special_ids(vocab_size)
    decoder = {
        str(ids[s.name]): {
            "content": s.name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": s.special,
        }
        for s in ts.NAMED_SPECIALS
    }
    return {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": list(_ADDITIONAL_SPECIAL_TOKENS),
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": ts.BOS,
        "clean_up_tokenization_spaces": False,
        "eos_token": ts.EOS,
        "extra_special_tokens": {},
        "model_max_length": _MODEL_MAX_LENGTH,
        "pad_token": ts.PAD,
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": ts.UNK,
    }


def tokenizer_config_bytes(vocab_size: int) -> bytes:
    """``tokenizer_config.json`` as written: sorted keys, indent 2, trailing newline."""
    text = json.dumps(tokenizer_config(vocab_size), indent=2, sort_keys=True, ensure_ascii=False)
    return (text + "\n").encode("utf-8")


def write_tokenizer(out_dir: str | os.PathLike[str], vocab_size: int) -> list[str]:
    """Write ``tiktoken.model`` (vocab_size - 256 ranks) and ``tokenizer_config.json``.

    Returns the file names written, relative to ``out_dir``. The same ``vocab_size``
    always gives byte-identical files.
    """
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise SynthError(f"vocab_size must be an int, got {vocab_size!r}")
    minimum = ts.NUM_BYTE_TOKENS + ts.NUM_SPECIAL
    if vocab_size < minimum:
        raise SynthError(
            f"vocab_size {vocab_size} is too small for the tokenizer: need at least {minimum} "
            f"(256 byte tokens + 256 special slots)"
        )
    num_merges = ts.num_mergeable(vocab_size) - ts.NUM_BYTE_TOKENS
    try:
        tokens = train_bpe(load_corpus(), num_merges)
    except SynthError as e:
        raise SynthError(
            f"vocab_size {vocab_size} is too large for the synthetic tokenizer: {e}"
        ) from None
    assert len(tokens) == ts.num_mergeable(vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / TIKTOKEN_FILE).write_bytes(tiktoken_model_bytes(tokens))
    (out / CONFIG_FILE).write_bytes(tokenizer_config_bytes(vocab_size))
    return [TIKTOKEN_FILE, CONFIG_FILE]
