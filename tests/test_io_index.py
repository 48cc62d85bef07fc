"""model.safetensors.index.json: exact text, validation, cross-check against shard headers."""

import json

import pytest
import torch
from safetensors.torch import save_file

from k3bundle.errors import SafetensorsError
from k3bundle.io import INDEX_NAME, check_index, read_index, write_index

S1, S2 = "model-00001-of-000002.safetensors", "model-00002-of-000002.safetensors"


@pytest.fixture
def ckpt(tmp_path):
    """Two shards written by the official writer: 4 tensors, 8+16+4+2 = 30 bytes."""
    save_file({"a": torch.zeros(2), "b": torch.zeros(4)}, str(tmp_path / S1))
    save_file({"c": torch.zeros(1), "d": torch.zeros(1, dtype=torch.bfloat16)}, str(tmp_path / S2))
    weight_map = {"a": S1, "b": S1, "c": S2, "d": S2}
    return tmp_path, weight_map


def _write_raw_index(directory, weight_map, total_size):
    doc = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(doc))


def test_write_index_exact_text(tmp_path):
    path = write_index(tmp_path, {"z.w": S2, "a.w": S1}, 30)
    assert path == str(tmp_path / INDEX_NAME)
    assert (tmp_path / INDEX_NAME).read_text() == (
        "{\n"
        '  "metadata": {\n'
        '    "total_size": 30\n'
        "  },\n"
        '  "weight_map": {\n'
        f'    "a.w": "{S1}",\n'
        f'    "z.w": "{S2}"\n'
        "  }\n"
        "}\n"
    )
    index = read_index(tmp_path)
    assert index.total_size == 30 and index.weight_map == {"a.w": S1, "z.w": S2}
    assert index.shards == [S1, S2]
    assert [p.name for p in tmp_path.iterdir()] == [INDEX_NAME]


def test_check_index_passes_and_returns_headers(ckpt):
    root, weight_map = ckpt
    write_index(root, weight_map, 30)
    result = check_index(root)
    assert result.index.total_size == 30
    assert sorted(result.headers) == [S1, S2]
    assert list(result.headers[S2].tensors) == ["c", "d"]


def _problems(root):
    with pytest.raises(SafetensorsError) as e:
        check_index(root)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(root / INDEX_NAME) + ": ")
    return msg, e.value.problems


def test_missing_shard(ckpt):
    root, weight_map = ckpt
    (root / S2).unlink()
    write_index(root, weight_map, 30)
    msg, problems = _problems(root)
    assert problems == [f"missing shard '{S2}' (2 keys)"]
    assert msg == f"{root / INDEX_NAME}: 1 problem(s) with the shards: [missing shard '{S2}' (2 keys)]"


def test_missing_key(ckpt):
    root, weight_map = ckpt
    write_index(root, {**weight_map, "ghost": S1}, 30)
    _, problems = _problems(root)
    assert problems == [f"key 'ghost' mapped to '{S1}' but not in it"]


def test_extra_key(ckpt):
    root, weight_map = ckpt
    del weight_map["d"]
    write_index(root, weight_map, 30)
    _, problems = _problems(root)
    assert problems == [f"key 'd' in '{S2}' is missing from weight_map"]


def test_key_mapped_to_wrong_shard(ckpt):
    root, weight_map = ckpt
    write_index(root, {**weight_map, "c": S1}, 30)
    _, problems = _problems(root)
    assert problems == [f"key 'c' mapped to '{S1}' but not in it",
                        f"key 'c' in '{S2}' but weight_map maps it to '{S1}'"]


def test_wrong_total_size(ckpt):
    root, weight_map = ckpt
    write_index(root, weight_map, 31)
    _, problems = _problems(root)
    assert problems == ["metadata.total_size is 31 but the shards hold 30 tensor bytes"]


def test_all_problems_collected_and_raised_once(ckpt):
    root, weight_map = ckpt
    (root / "model-00003-of-000003.safetensors").write_bytes(b"\x02\0\0\0\0\0\0\0{}!")  # trailing byte
    weight_map = {**weight_map, "ghost": S1, "x": "model-00003-of-000003.safetensors", "y": "gone.safetensors"}
    del weight_map["a"]
    write_index(root, weight_map, 0)
    msg, problems = _problems(root)
    assert len(problems) == 4  # no total_size check while a shard is unreadable
    assert msg.startswith(f"{root / INDEX_NAME}: 4 problem(s) with the shards: [")
    assert "missing shard 'gone.safetensors' (1 keys)" in msg
    assert "key 'ghost'" in msg and "key 'a'" in msg and "trailing bytes" in msg


def test_many_problems_are_summarised(tmp_path):
    write_index(tmp_path, {f"k{i}": f"s{i:02d}.safetensors" for i in range(9)}, 0)
    msg, problems = _problems(tmp_path)
    assert len(problems) == 9 and msg.endswith("; and 4 more]")


@pytest.mark.parametrize("shard", ["../x.safetensors", "/abs.safetensors", "sub/x.safetensors",
                                   "a\\b.safetensors", "..", "", 7])
def test_unsafe_shard_names_rejected(tmp_path, shard):
    _write_raw_index(tmp_path, {"w": shard}, 0)
    with pytest.raises(SafetensorsError, match="weight_map\\['w'\\]"):
        read_index(tmp_path)
    with pytest.raises(SafetensorsError, match="weight_map\\['w'\\]"):
        write_index(tmp_path / "other", {"w": shard}, 0)


@pytest.mark.parametrize("text,what", [
    ("[]", "not a JSON object"),
    ("{", "not a valid JSON index"),
    ('{"weight_map": {}}', "'metadata' is missing"),
    ('{"metadata": {"total_size": 1.5}, "weight_map": {}}', "total_size 1.5"),
    ('{"metadata": {"total_size": true}, "weight_map": {}}', "total_size True"),
    ('{"metadata": {"total_size": 1}}', "'weight_map' is missing"),
    ('{"metadata": {"total_size": 1}, "weight_map": {"a": "x", "a": "y"}}', "duplicate key 'a'"),
])
def test_index_validation(tmp_path, text, what):
    (tmp_path / INDEX_NAME).write_text(text)
    with pytest.raises(SafetensorsError) as e:
        read_index(tmp_path / INDEX_NAME)
    assert str(e.value).startswith(str(tmp_path / INDEX_NAME)) and what in str(e.value)


def test_missing_index_file(tmp_path):
    with pytest.raises(SafetensorsError, match="index file not found"):
        check_index(tmp_path)
