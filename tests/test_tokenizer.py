"""Tokenizer: the special-token table, the synthetic BPE tokenizer and the strict loader."""

from __future__ import annotations

import base64
import json
import random
import time

import pytest
import tiktoken
import tiktoken.load

from k3bundle import tokenizer_specials as ts
from k3bundle.errors import K3Error, SynthError
from k3bundle.synth.tokenizer import (
    load_corpus,
    pretokenize,
    tiktoken_model_bytes,
    tokenizer_config,
    tokenizer_config_bytes,
    train_bpe,
    write_tokenizer,
)
from k3bundle.tokenizer import TokenizerError, load_tiktoken

VOCAB = 1024

# Spec §4.1 / §1.1, written out by hand (not derived from the table under test).
K3_SPECIAL_IDS = {
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|end_of_msg|>": 163586,
    "<|open|>": 163587,
    "<|close|>": 163588,
    "<|sep|>": 163589,
    "[start_header_id]": 163590,
    "[end_header_id]": 163591,
    "[EOT]": 163593,
    "<|media_begin|>": 163602,
    "<|media_content|>": 163603,
    "<|media_end|>": 163604,
    "<|media_pad|>": 163605,
    "<osagent_mode>": 163649,
    "[UNK]": 163838,
    "[PAD]": 163839,
}

# The release's pattern as one literal (tokenization_kimi.py, K2/K3 family).
RELEASE_PAT_STR = (
    r"[\p{Han}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    assert write_tokenizer(d, VOCAB) == ["tiktoken.model", "tokenizer_config.json"]
    return d


@pytest.fixture(scope="module")
def enc(tok_dir) -> tiktoken.Encoding:
    return load_tiktoken(tok_dir)


# --- the table ----------------------------------------------------------------------------


def test_full_vocab_special_ids_match_spec():
    table = ts.special_tokens(163840)
    assert len(table) == ts.NUM_SPECIAL == 256
    assert sorted(table.values()) == list(range(163584, 163840))
    for name, i in K3_SPECIAL_IDS.items():
        assert table[name] == i, name
    assert table["<|reserved_token_163592|>"] == 163592
    assert table["<|reserved_token_163837|>"] == 163837
    named = {n for n in table if not n.startswith("<|reserved_token_")}
    assert named == set(K3_SPECIAL_IDS)


def test_small_vocab_keeps_offsets_from_the_end():
    table = ts.special_tokens(VOCAB)
    assert table["[BOS]"] == VOCAB - 256
    assert table["<|end_of_msg|>"] == VOCAB - 254
    assert table["[PAD]"] == VOCAB - 1
    assert sorted(table.values()) == list(range(VOCAB - 256, VOCAB))
    with pytest.raises(K3Error):
        ts.special_tokens(511)


def test_pat_str_is_the_release_pattern():
    assert ts.PAT_STR == RELEASE_PAT_STR
    assert pretokenize("Hello world's 中文abc HTTPServer 163840\n\n  x") == [
        "Hello", " world's", " ", "中文", "abc", " HTTPServer", " ", "163", "840", "\n\n",
        " ", " x",
    ]


# --- the synthetic tokenizer ----------------------------------------------------------------


def test_written_files_load_with_plain_tiktoken(tok_dir, enc, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # read the file directly, cache nothing
    lines = (tok_dir / "tiktoken.model").read_bytes().splitlines()
    assert len(lines) == VOCAB - 256
    ranks = tiktoken.load.load_tiktoken_bpe(str(tok_dir / "tiktoken.model"))
    assert sorted(ranks.values()) == list(range(VOCAB - 256))
    assert all(ranks[bytes([b])] == b for b in range(256))
    assert enc.n_vocab == VOCAB
    plain = tiktoken.Encoding("plain", pat_str=ts.PAT_STR, mergeable_ranks=ranks,
                              special_tokens=ts.special_tokens(VOCAB))
    text = "Serving a converted model: 张量 and <|open|> text."
    assert plain.encode(text, disallowed_special=()) == enc.encode(text, disallowed_special=())


def test_tokenizer_config_is_release_style(tok_dir):
    raw = (tok_dir / "tokenizer_config.json").read_text(encoding="utf-8")
    assert raw.endswith("}\n") and not raw.endswith("\n\n")
    cfg = json.loads(raw)
    assert list(cfg) == sorted(cfg)
    assert cfg["auto_map"] == {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    assert cfg["tokenizer_class"] == "TikTokenTokenizer"
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"], cfg["unk_token"]) == (
        "[BOS]", "[EOS]", "[PAD]", "[UNK]")
    assert "chat_template" not in cfg
    dec = cfg["added_tokens_decoder"]
    assert len(dec) == 16
    assert dec[str(VOCAB - 256)]["content"] == "[BOS]"
    assert dec[str(VOCAB - 1)]["content"] == "[PAD]"
    not_special = [dec[k]["content"] for k in dec if not dec[k]["special"]]
    assert not_special == ["<|open|>", "<|close|>", "<|sep|>"]
    full = tokenizer_config(163840)["added_tokens_decoder"]
    assert {v["content"]: int(k) for k, v in full.items()} == K3_SPECIAL_IDS


def test_every_byte_round_trips(enc):
    for b in range(256):
        ids = enc.encode_single_token(bytes([b]))
        assert ids == b
        assert enc.decode_single_token_bytes(ids) == bytes([b])
    text = bytes(range(256)).decode("latin-1") * 2
    assert enc.decode_bytes(enc.encode_ordinary(text)) == text.encode("utf-8")


def test_random_unicode_round_trips(enc):
    rng = random.Random(1234)
    pools = [
        (0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x4E00, 0x9FFF),
        (0x3040, 0x30FF), (0xAC00, 0xD7A3), (0x1F300, 0x1F6FF), (0x0, 0x1F),
    ]
    for _ in range(200):
        n = rng.randint(0, 60)
        chars = []
        for _ in range(n):
            lo, hi = rng.choice(pools)
            chars.append(chr(rng.randint(lo, hi)))
        text = "".join(chars)
        ids = enc.encode(text, disallowed_special=())
        assert enc.decode(ids) == text
        assert all(0 <= i < VOCAB - 256 for i in ids)


def test_specials_only_when_allowed(enc):
    ids = ts.special_tokens(VOCAB)
    text = "<|open|>message<|sep|>hi<|close|>message<|sep|><|end_of_msg|>"
    allowed = enc.encode(text, allowed_special="all")
    assert allowed[0] == ids["<|open|>"]
    assert allowed[-1] == ids["<|end_of_msg|>"]
    assert ids["<|sep|>"] in allowed and ids["<|close|>"] in allowed
    plain = enc.encode(text, disallowed_special=())
    assert all(i < VOCAB - 256 for i in plain)
    assert enc.decode(plain) == text
    assert enc.encode("<|open|>", allowed_special={"<|open|>"}) == [ids["<|open|>"]]
    with pytest.raises(ValueError):
        enc.encode("<|open|>")  # tiktoken's default: disallowed specials raise
    reserved = ts.reserved_name(VOCAB - 100)
    assert enc.encode(reserved, allowed_special="all") == [VOCAB - 100]
    assert enc.decode([ids["[BOS]"]]) == "[BOS]"


def test_same_inputs_same_bytes(tmp_path, tok_dir):
    write_tokenizer(tmp_path, VOCAB)
    for name in ("tiktoken.model", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (tok_dir / name).read_bytes()


def test_merges_compress_and_respect_pieces(enc):
    corpus = load_corpus()
    assert 15_000 <= len(corpus.encode()) <= 25_000
    ids = enc.encode(corpus, disallowed_special=())
    assert len(ids) < len(corpus.encode()) / 2
    # Tokens never straddle a pre-tokenizer piece: trainer and tiktoken split alike.
    sample = corpus[:4000]
    pieces = pretokenize(sample)
    assert "".join(pieces) == sample
    cuts, pos = set(), 0
    for p in pieces:
        pos += len(p.encode())
        cuts.add(pos)
    tok_cuts, pos = set(), 0
    for t in enc.encode(sample, disallowed_special=()):
        pos += len(enc.decode_single_token_bytes(t))
        tok_cuts.add(pos)
    assert cuts <= tok_cuts


def test_train_bpe_is_fast_deterministic_and_bounded():
    corpus = load_corpus()
    t0 = time.perf_counter()
    a = train_bpe(corpus, 768)
    assert time.perf_counter() - t0 < 1.0
    assert a == train_bpe(corpus, 768)
    assert len(a) == 1024 and len(set(a)) == 1024
    assert a[:256] == [bytes([b]) for b in range(256)]
    assert train_bpe(corpus, 100) == a[:356]  # a prefix: merges are learned in order
    with pytest.raises(SynthError, match="merges"):
        train_bpe("ab ab ab", 10)
    with pytest.raises(SynthError):
        write_tokenizer("/nonexistent-unused", 200_000)


# --- the strict loader ----------------------------------------------------------------------


def _copy(tok_dir, tmp_path, lines: list[bytes] | None = None):
    src = (tok_dir / "tiktoken.model").read_bytes().splitlines()
    body = b"\n".join(lines if lines is not None else src) + b"\n"
    (tmp_path / "tiktoken.model").write_bytes(body)
    return src


def _token(ls, i):
    return ls[i].split()[0]


@pytest.mark.parametrize(
    "line, message",
    [
        (lambda ls: b"not-a-valid-line", "malformed line"),
        (lambda ls: ls[300] + b" 7", "malformed line"),
        (lambda ls: b"", "malformed line"),
        (lambda ls: b"@@@@ 300", "not valid base64"),
        (lambda ls: _token(ls, 300) + b" x1", "rank b'x1' is not a decimal"),
        (lambda ls: _token(ls, 300) + b" 5", "rank 5 already given on line 6"),
        (lambda ls: ls[299], "rank 299 already given on line 300"),
        (lambda ls: _token(ls, 299) + b" 300", "already given on line 300"),
        (lambda ls: _token(ls, 300) + b" 9999", "rank 9999 leaves a gap"),
    ],
)
def test_malformed_tiktoken_model_is_one_clear_error(tok_dir, tmp_path, line, message):
    lines = (tok_dir / "tiktoken.model").read_bytes().splitlines()
    lines[300] = line(lines)
    _copy(tok_dir, tmp_path, lines)
    with pytest.raises(TokenizerError, match=r"tiktoken\.model:301: ") as err:
        load_tiktoken(tmp_path)
    assert message in str(err.value)
    assert "\n" not in str(err.value)
    assert isinstance(err.value, K3Error)


def test_loader_rejects_missing_bytes_and_bad_config(tok_dir, tmp_path):
    lines = (tok_dir / "tiktoken.model").read_bytes().splitlines()
    # Drop the token for byte 0x41 ("A") and renumber: contiguous ranks, one byte missing.
    kept = [l for l in lines if base64.b64decode(l.split()[0]) != b"A"]
    renum = [l.split()[0] + b" " + str(i).encode() for i, l in enumerate(kept)]
    _copy(tok_dir, tmp_path, renum)
    with pytest.raises(TokenizerError, match=r"single-byte token.*0x41"):
        load_tiktoken(tmp_path)

    _copy(tok_dir, tmp_path)
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"][str(VOCAB - 256)]["content"] = "<|im_end|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    want = r"added token 768 is '<\|im_end\|>', but K3 has '\[BOS\]'"
    with pytest.raises(TokenizerError, match=want):
        load_tiktoken(tmp_path)

    (tmp_path / "tokenizer_config.json").unlink()
    assert load_tiktoken(tmp_path).n_vocab == VOCAB
    with pytest.raises(TokenizerError, match="cannot read"):
        load_tiktoken(tmp_path / "nope")


def test_loader_at_release_scale(tmp_path):
    # 163,584 ranks (every byte, every byte pair, then byte triples): the release's shape.
    toks = [bytes([b]) for b in range(256)]
    toks += [bytes([a, b]) for a in range(256) for b in range(256)]
    toks += [bytes([c, a, b]) for c in (1, 2) for a in range(256) for b in range(256)]
    del toks[163_584:]
    (tmp_path / "tiktoken.model").write_bytes(tiktoken_model_bytes(toks))
    (tmp_path / "tokenizer_config.json").write_bytes(tokenizer_config_bytes(163_840))
    t0 = time.perf_counter()
    enc = load_tiktoken(tmp_path)
    assert time.perf_counter() - t0 < 5.0
    assert enc.n_vocab == 163_840
    for name, i in K3_SPECIAL_IDS.items():
        assert enc.encode(name, allowed_special="all") == [i]
    assert enc.decode([163_586]) == "<|end_of_msg|>"
