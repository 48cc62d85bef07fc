"""The one strict JSON reader: a key given twice, NaN/Infinity and a wrong kind or schema version are
each one ``JsonFileError`` naming the file, wherever k3bundle reads JSON."""

from __future__ import annotations

import json
import os
import pickle

import pytest

from k3bundle.bundle.errors import BundleError
from k3bundle.bundle.index import lookup, read_index
from k3bundle.bundle.signoff import read_signoff
from k3bundle.errors import ConfigError, JsonFileError, SafetensorsError
from k3bundle.io.strict_json import loads, nonfinite_as_text, nonfinite_problem, read_json
from tests.conftest import run_cli


def _file(tmp_path, text: str, name: str = "doc.json"):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def test_a_clean_document_reads_as_json_reads_it(tmp_path):
    doc = {"kind": "k3bundle.x", "schema_version": 1, "a": [1, 2.5, {"b": None, "c": "é"}], "d": True}
    text = json.dumps(doc, indent=1)
    assert read_json(_file(tmp_path, text)) == json.loads(text) == doc
    assert read_json(_file(tmp_path, text), kind="k3bundle.x", version=1) == doc
    assert loads(text.encode(), "x") == doc


@pytest.mark.parametrize("text,where", [
    ('{"a": 1, "a": 2}', "duplicate key 'a'"),
    ('{"a": {"b": [1, {"c": 1, "c": 1}]}}', "duplicate key 'c' in a.b.1"),
    ('{"x": [1, NaN]}', "x.1 must be a finite number, got NaN"),
    ('{"x": {"y": Infinity}}', "x.y must be a finite number, got Infinity"),
    ('{"x": -Infinity}', "x must be a finite number, got -Infinity"),
])
def test_a_duplicate_key_or_a_non_finite_number_is_one_error_naming_file_and_place(tmp_path, text, where):
    p = _file(tmp_path, text)
    with pytest.raises(JsonFileError) as e:
        read_json(p)
    assert str(e.value) == f"{p}: {where}" and e.value.cause == "content"
    assert json.loads(text) is not None  # Python's own reader takes every one of them


@pytest.mark.parametrize("kwargs,doc,message", [
    ({"version": 1}, {"schema_version": 2}, "schema_version 2, this k3bundle reads 1"),
    ({"kind": "k3bundle.manifest", "version": 1}, {"kind": "k3bundle.other", "schema_version": 1},
     "not a k3bundle.manifest file (kind 'k3bundle.other')"),
    ({"version": 1}, [1], "not a k3bundle file: the top level is not a JSON object"),
])
def test_a_wrong_kind_or_version_is_one_error_naming_the_file(tmp_path, kwargs, doc, message):
    p = _file(tmp_path, json.dumps(doc))
    with pytest.raises(JsonFileError) as e:
        read_json(p, **kwargs)
    assert str(e.value) == f"{p}: {message}" and e.value.cause == "version"


def test_unreadable_files_are_named_and_a_fifo_does_not_hang(tmp_path):
    with pytest.raises(JsonFileError, match="no such file") as e:
        read_json(tmp_path / "absent.json")
    assert e.value.cause == "missing"
    os.mkfifo(tmp_path / "fifo.json")
    with pytest.raises(JsonFileError, match="is a FIFO, not a regular file") as e:
        read_json(tmp_path / "fifo.json")
    assert e.value.cause == "unreadable"
    (tmp_path / "bad.json").write_bytes(b'{"a": "\xff"}')
    with pytest.raises(JsonFileError, match="not valid UTF-8 at byte 7"):
        read_json(tmp_path / "bad.json")
    with pytest.raises(JsonFileError, match=r"not valid JSON: .* at line 1 column 9"):
        read_json(_file(tmp_path, '{"a": 1,'))


def test_the_error_survives_a_trip_between_processes(tmp_path):
    with pytest.raises(JsonFileError) as e:
        loads('{"a": {"b": 1, "b": 2}}', "f.json")
    back = pickle.loads(pickle.dumps(e.value))
    assert (str(back), back.key, back.at, back.cause) == ("f.json: duplicate key 'b' in a", "b", ("a",), "content")


def test_writers_spell_non_finite_numbers_as_text_the_reader_takes():
    doc = {"v": [float("nan"), float("inf"), -float("inf"), 1.5], "t": (1, float("nan"))}
    clean = nonfinite_as_text(doc)
    assert clean == {"v": ["nan", "inf", "-inf", 1.5], "t": [1, "nan"]}
    assert loads(json.dumps(clean), "x") == clean
    assert nonfinite_problem(doc) == "v.0 must be a finite number, got nan" and nonfinite_problem(clean) is None


def test_every_reader_refuses_through_the_one_check(tmp_path):
    """The config, the source index, a bundle file and the sign-off each refuse a key given twice,
    in their own error type, naming the file."""
    cfg = _file(tmp_path, '{"model_type": "kimi_k3", "text_config": {"a": 1, "a": 1}}', "config.json")
    with pytest.raises(ConfigError, match=f'{cfg}: duplicate key "a" in text_config'):
        from k3bundle.config import load_config
        load_config(cfg)
    idx = _file(tmp_path, '{"metadata": {"total_size": NaN}, "weight_map": {}}', "model.safetensors.index.json")
    from k3bundle.io import read_index as read_source_index
    with pytest.raises(SafetensorsError, match=f"{idx}: not a valid JSON index: metadata.total_size must be a "
                                               "finite number, got NaN"):
        read_source_index(idx)
    wi = _file(tmp_path, '{"kind": "k3bundle.weights_index", "schema_version": 1, "tensors": [], "tensors": []}',
               "weights.index.json")
    for read in (read_index, lambda p: lookup(p, 0, "x")):
        with pytest.raises(BundleError, match=f"{wi}: duplicate key 'tensors'"):
            read(wi)
    so = _file(tmp_path, '{"schema_version": 1, "cases": [], "passed": true, "passed": false}', "signoff.json")
    with pytest.raises(BundleError, match=f"{so}: not readable JSON \\(duplicate key 'passed'\\)"):
        read_signoff(so)


def test_the_command_line_names_the_file_and_the_place(tmp_path):
    so = _file(tmp_path, '{"schema_version": 1, "cases": [{"name": "greedy", "seconds": NaN}]}', "signoff.json")
    r = run_cli("report", "diff", str(so), str(so))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0] == f"error: {so}: not readable JSON (cases.0.seconds must be a finite number, got NaN)"
