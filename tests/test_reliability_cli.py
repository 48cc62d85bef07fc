"""Errors, not tracebacks: usage errors, odd files where data should be, bad config values."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from k3bundle.config import load_config
from k3bundle.errors import ConfigError, SafetensorsError
from k3bundle.io import read_header
from k3bundle.presets import preset_config_dict
from tests.conftest import run_cli


@pytest.mark.parametrize("argv", [
    ["convert"],                                            # missing arguments
    ["convert", "SRC", "--frobnicate"],                     # unknown option
    ["convert", "SRC", "--target", "b300-tp8", "--out", "O", "--workers", "two"],  # bad value
    ["trace", "BUNDLE", "-1", "KEY"],                       # a negative number read as an option
    ["frobnicate"],                                         # unknown command
])
def test_usage_errors_exit_2_with_the_usage_and_no_traceback(argv):
    r = run_cli(*argv)
    assert r.returncode == 2, (argv, r.stderr)
    assert "Usage:" in r.stderr and "Error:" in r.stderr
    assert "Traceback" not in r.stderr


def test_inspect_names_what_is_there_instead_of_hanging(tmp_path):
    fifo = tmp_path / "shard.safetensors"
    os.mkfifo(fifo)
    r = run_cli("inspect", str(tmp_path / "nonexistent"))
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(SafetensorsError, match="is a FIFO, not a regular file"):
        read_header(fifo)  # returns at once: the open is non-blocking
    with pytest.raises(SafetensorsError, match="is a character device"):
        read_header("/dev/null")


def test_a_fifo_or_folder_where_a_shard_should_be_is_named_as_such(tiny_ckpt, tmp_path):
    import shutil

    from k3bundle.io.index import check_index

    d = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, d)
    shards = sorted(p for p in d.glob("*.safetensors"))
    shards[0].unlink()
    os.mkfifo(shards[0])
    shards[1].unlink()
    shards[1].mkdir()
    with pytest.raises(SafetensorsError) as e:
        check_index(d)
    text = str(e.value) + " ".join(getattr(e.value, "problems", []))
    assert "is a FIFO, not a regular file" in text and "is a directory, not a regular file" in text
    assert "missing shard" not in text


def _write(tmp_path, text: str):
    p = tmp_path / "config.json"
    p.write_text(text)
    return p


@pytest.mark.parametrize("key", ["activation_situ_beta", "routed_scaling_factor", "linear_attn_config.gate_lower_bound"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_config_values_are_refused_naming_key_and_value(tmp_path, key, value):
    cfg = copy.deepcopy(preset_config_dict("tiny"))
    text = cfg["text_config"]
    *outer, last = key.split(".")
    for k in outer:
        text = text[k]
    text[last] = float("nan") if value == "NaN" else float(value.replace("Infinity", "inf"))
    with pytest.raises(ConfigError, match=rf"text_config\.{key} must be a finite number, got "):
        load_config(_write(tmp_path, json.dumps(cfg)))


def test_duplicate_config_keys_are_refused(tmp_path):
    cfg = json.dumps(preset_config_dict("tiny"))
    dup = cfg.replace('"hidden_size":', '"hidden_size": 8, "hidden_size":', 1)
    with pytest.raises(ConfigError, match='duplicate key "hidden_size"'):
        load_config(_write(tmp_path, dup))


@pytest.mark.parametrize("key,value", [("num_hidden_layers", 100_000_000), ("num_hidden_layers", 10**30),
                                       ("hidden_size", 10**12), ("vocab_size", 10**9), ("num_experts", 10**8)])
def test_absurd_sizes_are_refused_up_front(tmp_path, key, value):
    cfg = copy.deepcopy(preset_config_dict("tiny"))
    cfg["text_config"][key] = value
    with pytest.raises(ConfigError, match=rf"text_config\.{key} is {value}, above the supported"):
        load_config(_write(tmp_path, json.dumps(cfg)))


def test_a_config_error_names_json_types_not_python_classes(tmp_path):
    cfg = copy.deepcopy(preset_config_dict("tiny"))
    cfg["text_config"] = [1, 2]
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, json.dumps(cfg)))
    assert "list" not in str(e.value) and "[1, 2]" in str(e.value)


def test_a_metadata_error_names_the_json_type_not_an_internal_class(tmp_path):
    import struct

    header = json.dumps({"__metadata__": {"k": {"nested": 1}}}).encode()
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(SafetensorsError) as e:
        read_header(p)
    assert "_Pairs" not in str(e.value) and "is an object, not a string" in str(e.value)


@pytest.mark.parametrize("delay", [0.2, 0.6])
def test_ctrl_c_while_a_command_imports_is_one_line(delay):
    """SIGINT while ``validate`` still imports its modules (torch among them): "aborted", exit 130."""
    p = subprocess.Popen([sys.executable, "-m", "k3bundle", "validate", "/nonexistent-bundle"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert "Traceback" not in err and p.returncode == 130 and err.strip() == "aborted", (p.returncode, err)
