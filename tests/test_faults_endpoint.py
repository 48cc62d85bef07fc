"""``k3bundle faults`` against a live ``k3bundle serve`` on the trained tiny model.

Oracles: the context length the test gives the server (the over-context error must name it); the
OpenAI API's error shape (a 4xx with a message) checked on the test's own malformed bodies; the
executor's greedy tokens for the reference the faults re-validate with; the planted hang fault's
definition for the run that must fail; the checklist's four hardware faults, which an endpoint
cannot provoke, recorded not run.
"""

from __future__ import annotations

import json

from tests._bundles import single_threaded_torch  # noqa: F401  (autouse: one torch thread)
from tests._serving import serving
from tests.conftest import run_cli

CONTEXT = 512
ENV = {"K3BUNDLE_THREADS": "1"}


def _faults(url, out, *args):
    return run_cli("faults", "--endpoint", url, "--out", str(out), "--max-tokens", "4", *args, env=ENV)


def test_each_endpoint_fault_ends_cleanly_and_the_server_keeps_serving(tiny_trained_ckpt, tmp_path):
    from k3bundle.checklist.faults import FAULT_PATHS
    from k3bundle.checklist.stages import fault_paths_stage
    from k3bundle.serve import Engine

    with serving(Engine(tiny_trained_ckpt, max_model_len=CONTEXT)) as url:
        r = _faults(url, tmp_path / "reports", "--timeout", "60")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads((tmp_path / "reports" / "faults.json").read_text())
    assert (doc["kind"], doc["schema_version"]) == ("k3bundle.faults", 1)
    got = {f["fault"]: f for f in doc["faults"]}

    over = got["over_context"]
    assert over["outcome"] == "clean_error" and over["revalidated"] is True
    assert over["error"].startswith("HTTP 400: ") and f"maximum context length is {CONTEXT} tokens" in over["error"]
    assert f"{CONTEXT + 1} in the completion" in over["error"]
    assert got["client_disconnect"]["outcome"] == "survived" and got["client_disconnect"]["revalidated"] is True
    bad = got["malformed_request"]
    assert bad["outcome"] == "clean_error" and bad["revalidated"] is True
    assert "not JSON: HTTP 400" in bad["error"] and "messages a string: HTTP 400: messages" in bad["error"]

    # the hardware faults are not run here, never passed: each says how to run it
    for f in FAULT_PATHS:
        assert got[f.key]["outcome"] == "not_run" and got[f.key]["revalidated"] is None
        assert f.inject in got[f.key]["run"]
    assert "validate BUNDLE --serving" in got["bad_page"]["run"]

    s = fault_paths_stage(tmp_path)
    assert not s.done
    assert s.missing == "; ".join(f"{f.key}: outcome 'not_run', not 'clean_error'" for f in FAULT_PATHS)
    assert [n.split(":")[0] for n in s.notes] == ["over_context", "client_disconnect", "malformed_request"]


def test_a_server_that_stalls_fails_the_fault_that_meets_the_stall(tiny_trained_ckpt, tmp_path):
    """With every third decode stalled, the third request the run makes (the long stream of the
    disconnect fault: reference, re-check after over_context, then it) never gets past its first
    token, so that fault fails and the checklist names it."""
    from k3bundle.checklist.stages import fault_paths_stage
    from k3bundle.serve import Engine

    with serving(Engine(tiny_trained_ckpt, max_model_len=CONTEXT, fault="hang")) as url:
        r = _faults(url, tmp_path / "reports", "--timeout", "4")
    assert r.returncode == 1, r.stdout + r.stderr
    got = {f["fault"]: f for f in json.loads((tmp_path / "reports" / "faults.json").read_text())["faults"]}
    assert got["over_context"]["outcome"] == "clean_error"
    assert got["client_disconnect"]["outcome"] == "failed"
    assert "client_disconnect: outcome 'failed'" in fault_paths_stage(tmp_path).missing
