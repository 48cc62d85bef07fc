"""Media tokens (docs/chat.md): the media block's ids in a rendered prompt, the image golden case on
the tiny model's tokenizer, and tokenizers whose media ids are shifted."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from k3bundle.chat import render_ids
from k3bundle.golden.cases import load_case
from k3bundle.golden.errors import CaseError
from k3bundle.synth.tokenizer import tiktoken_model_bytes, tokenizer_config_bytes, write_tokenizer
from k3bundle.tokenizer import TokenizerError, load_tiktoken

# docs/kimi-k3.md §4.1, written out by hand: the release's media ids
BEGIN, CONTENT, END, PAD = 163602, 163603, 163604, 163605
# a tiny model's vocabulary keeps the release's offsets from the end: V-238 .. V-235
TINY = 1024
T_BEGIN, T_CONTENT, T_END, T_PAD = 786, 787, 788, 789
CAUSE = "known fast-tokenizer conversion bug"


@pytest.fixture(scope="module")
def release_enc(tmp_path_factory):
    # 163,584 ranks (every byte, every byte pair, then byte triples): the release's id layout
    d = tmp_path_factory.mktemp("k3tok")
    toks = [bytes([b]) for b in range(256)]
    toks += [bytes([a, b]) for a in range(256) for b in range(256)]
    toks += [bytes([c, a, b]) for c in (1, 2) for a in range(256) for b in range(256)]
    (d / "tiktoken.model").write_bytes(tiktoken_model_bytes(toks[:163_584]))
    (d / "tokenizer_config.json").write_bytes(tokenizer_config_bytes(163_840))
    return load_tiktoken(d)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tinytok")
    write_tokenizer(d, TINY)
    return d


def _user_image(text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def test_one_image_renders_the_media_block_at_release_ids(release_enc):
    # 640x480: 45*34 whole patches fit the budget, no resize; padded to 644x504 = 23 x 18 merged blocks
    ids = render_ids(_user_image("Hi"), release_enc, thinking=False, images=[(640, 480, 23 * 18)])
    block = [BEGIN] + release_enc.encode("image 640x480") + [CONTENT] + [PAD] * 414 + [END]
    head = release_enc.encode('<|open|>message role="user"<|sep|>', allowed_special="all")
    assert ids[: len(head) + len(block)] == head + block
    assert ids.count(PAD) == 414 and ids.count(BEGIN) == ids.count(CONTENT) == ids.count(END) == 1


def test_the_image_case_renders_on_the_tiny_tokenizer(tiny_dir):
    enc = load_tiktoken(tiny_dir)
    case = load_case("golden/cases/image.yaml")
    ids = case.build_ids(enc)
    # 56x56: a 4x4 patch grid, 2x2 merged blocks -> four <|media_pad|>
    block = [T_BEGIN] + enc.encode("image 56x56") + [T_CONTENT] + [T_PAD] * 4 + [T_END]
    starts = [i for i in range(len(ids)) if ids[i:i + len(block)] == block]
    assert len(starts) == 1 and ids.count(T_PAD) == 4
    assert "kimi_image_placeholder" not in enc.decode(ids)
    assert enc.decode(ids[starts[0] + len(block):]).startswith("What pattern is in this image?")
    # what the vision tower gets fills exactly those positions: 16 patches -> 4 merged tokens
    image = case.image_input()
    assert tuple(image.patches.shape) == (16, 3, 14, 14) and image.grid_thw == (1, 4, 4)
    assert image.num_tokens * 4 == image.patches.shape[0] and image.size == (56, 56)


def _copy(src, dst):
    for f in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(src / f, dst / f)


def test_a_tokenizer_config_with_media_ids_shifted_down_is_rejected(tiny_dir, tmp_path):
    _copy(tiny_dir, tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    dec = cfg["added_tokens_decoder"]
    for i in (T_BEGIN, T_CONTENT, T_END, T_PAD):  # what a compacting conversion writes: every one 3 lower
        dec[str(i - 3)] = dec.pop(str(i))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError) as e:
        load_tiktoken(tmp_path)
    msg = str(e.value)
    assert msg.startswith(str(tmp_path / "tokenizer_config.json") + ": <|media_begin|> is id 783, K3 has it at 786")
    assert "shifted by -3" in msg and CAUSE in msg and "\n" not in msg


def test_a_tokenizer_json_with_a_shifted_media_pad_is_rejected(tiny_dir, tmp_path):
    _copy(tiny_dir, tmp_path)
    added = [{"id": T_PAD - 3, "content": "<|media_pad|>", "special": True},
             {"id": TINY - 256, "content": "[BOS]", "special": True}]
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: <\|media_pad\|> is id 786, K3 has it at 789 "
                                             r"\(shifted by -3\): the " + CAUSE):
        load_tiktoken(tmp_path)
    added[0]["id"] = T_PAD
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    assert load_tiktoken(tmp_path).encode("<|media_pad|>", allowed_special="all") == [T_PAD]


def test_config_media_placeholder_must_be_the_media_pad(tiny_dir, tmp_path):
    _copy(tiny_dir, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"media_placeholder_token_id": T_PAD - 3}))
    with pytest.raises(TokenizerError, match=r"config\.json: <\|media_pad\|> is id 786, K3 has it at 789 "
                                             r"\(shifted by -3\): the " + CAUSE):
        load_tiktoken(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"media_placeholder_token_id": T_PAD + 2}))
    with pytest.raises(TokenizerError, match=r"shifted by \+2\): images would miss their placeholders$"):
        load_tiktoken(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"media_placeholder_token_id": T_PAD}))
    assert load_tiktoken(tmp_path).n_vocab == TINY


# --- the image case file --------------------------------------------------------------------------


def _case(tmp_path, **change) -> str:
    data = yaml.safe_load(open("golden/cases/image.yaml"))
    data.update(change)
    data = {k: v for k, v in data.items() if v is not None}
    path = tmp_path / "case.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize("change,words", [
    ({"image": {"kind": "noise", "width": 56, "height": 56}}, "image.kind 'noise' is not one of"),
    ({"image": {"kind": "checkerboard", "width": 56, "height": 56, "seed": 1}}, "unknown field image.seed"),
    ({"image": None}, "an image case, and only an image case, declares image"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}]},
     "exactly one image part, found 2"),
])
def test_bad_image_cases_name_the_file(tmp_path, change, words):
    path = _case(tmp_path, **change)
    with pytest.raises(CaseError) as e:
        load_case(path)
    assert str(e.value).startswith(f"{path}: ") and words in str(e.value) and "\n" not in str(e.value)
