"""API keys that expire and rotate, through the CLI and HTTP against a real `nexa control` process."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.conftest import ControllerProcess

#: How long a test waits for a short-lived key to pass its expiry (poll, never a fixed sleep).
TIMEOUT_S = 60
_CSRF_RE = re.compile(r'name="csrf_token" value="([^"]+)"')


def _client(cp: ControllerProcess, key: str | None = None) -> httpx.Client:
    return httpx.Client(base_url=cp.url, headers={"Authorization": f"Bearer {key or cp.admin_key}"}, timeout=30)


def _cli_json(cp: ControllerProcess, *argv: str) -> Any:
    out = cp.cli(*argv, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _poll(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not done():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.2)


def _audit(cp: ControllerProcess) -> list[dict[str, Any]]:
    with _client(cp) as http:
        events: list[dict[str, Any]] = http.get("/api/v1/audit", params={"limit": 1000}).json()["events"]
    return events


def _sign_in(browser: httpx.Client, key: str) -> httpx.Response:
    form = browser.get("/console/login")
    match = _CSRF_RE.search(form.text)
    assert match
    return browser.post("/console/login", data={"csrf_token": match.group(1), "api_key": key})


def _expired(resp: httpx.Response) -> bool:
    if resp.status_code == 200:
        return False
    assert resp.status_code == 401, resp.text
    err = resp.json()["error"]
    assert err["code"] == "key_expired"
    assert "nexa keys create" in err["message"] and "nexa keys rotate" in err["message"]
    return True


@pytest.mark.slow
def test_a_key_with_an_expiry_is_shown_works_and_then_is_refused_as_key_expired(
    controller_process: ControllerProcess,
) -> None:
    cp = controller_process
    cp.cli("tenants", "create", "acme", check=True)
    with _client(cp) as admin:
        # Short-lived keys made over HTTP: used within milliseconds, well inside their 10 s.
        short = {"expires_in_s": 10}
        created = admin.post("/api/v1/keys", json={"role": "operator", **short}).json()
        inference = admin.post("/api/v1/keys", json={"role": "inference", "tenant": "acme", **short}).json()
    key_id = created["info"]["id"]
    with _client(cp, created["key"]) as op, _client(cp, inference["key"]) as inf:
        assert op.get("/api/v1/nodes").status_code == 200
        assert inf.get("/v1/models").status_code == 200
        with httpx.Client(base_url=cp.url, timeout=30) as browser:
            signed_in = _sign_in(browser, created["key"])
            assert signed_in.status_code == 303, signed_in.text
            assert browser.get("/console/nodes").status_code == 200
            _poll(lambda: _expired(op.get("/api/v1/nodes")))
            _poll(lambda: _expired(inf.get("/v1/models")))
            # The console session of an expired key ends at its next request.
            assert browser.get("/console/nodes").headers["location"] == "/console/login"
        head = _audit(cp)[-1]["seq"]
        assert _expired(op.post("/api/v1/runtimes", json={}))  # a mutation: refused before it is read
    assert _audit(cp)[-1]["seq"] == head  # nothing changed, nothing written
    with httpx.Client(base_url=cp.url, timeout=30) as browser:
        signin = _sign_in(browser, created["key"])
    assert signin.status_code == 401 and "expired" in signin.text

    # Through the CLI: `--expires`, and `expires_at` in `keys create/show/list`.
    later = _cli_json(cp, "keys", "create", "--role", "operator", "--expires", "90d")
    forever = _cli_json(cp, "keys", "create", "--role", "operator")
    assert later["info"]["expires_at"] == pytest.approx(later["info"]["created_at"] + 90 * 86400, abs=0.01)
    assert forever["info"]["expires_at"] is None
    assert _cli_json(cp, "keys", "show", later["info"]["id"])["expires_at"] == later["info"]["expires_at"]
    table = cp.cli("keys", "show", key_id).stdout.splitlines()
    assert table[0].split()[-5:] == ["EXPIRES_AT", "REVOKED_AT", "ROTATED_TO", "CREATED_BY", "PRIORITIES"]
    rows = {row.split()[0]: row.split() for row in cp.cli("keys", "list").stdout.splitlines()[1:]}
    assert "expired" in rows[key_id] and "expired" in rows[inference["info"]["id"]]
    assert "active" in rows[forever["info"]["id"]] and "active" in rows[later["info"]["id"]]
    with _client(cp, forever["key"]) as op:
        assert op.get("/api/v1/nodes").status_code == 200
    with _client(cp) as http:
        text = http.get("/metrics").text
    assert re.search(r'nexa_auth_failures_total\{code="key_expired"\} [1-9]', text), text


@pytest.mark.slow
def test_rotate_issues_a_successor_and_the_old_key_works_through_its_grace_then_expires(
    controller_process: ControllerProcess,
) -> None:
    cp = controller_process
    old = _cli_json(cp, "keys", "create", "--role", "operator", "--name", "ci", "--expires", "90d")
    short = _cli_json(cp, "keys", "create", "--role", "operator", "--name", "short")
    old_id = old["info"]["id"]

    out = cp.cli("keys", "rotate", old_id)  # the default grace: a day
    assert out.returncode == 0, out.stderr
    successor_key = out.stdout.strip().splitlines()[-1]
    assert successor_key.startswith("nxk_") and successor_key not in out.stderr
    previous = _cli_json(cp, "keys", "show", old_id)
    successor_id = previous["rotated_to"]
    successor = _cli_json(cp, "keys", "show", successor_id)
    assert (successor["role"], successor["name"], successor["tenant"]) == ("operator", "ci", None)
    assert previous["expires_at"] == pytest.approx(time.time() + 86400, abs=120)
    assert successor["expires_at"] - successor["created_at"] == pytest.approx(90 * 86400, abs=0.01)
    with _client(cp, successor_key) as new, _client(cp, old["key"]) as during_grace:
        assert new.get("/api/v1/nodes").status_code == 200
        assert during_grace.get("/api/v1/nodes").status_code == 200
    actions = {(e["action"], e["target"]) for e in _audit(cp)}
    assert {("key.rotate", f"key/{old_id}"), ("key.create", f"key/{successor_id}")} <= actions

    # A short grace: the old key stops working once it has passed; its successor goes on.
    rotated = _cli_json(cp, "keys", "rotate", short["info"]["id"], "--grace", "2s")
    assert rotated["previous"]["expires_at"] <= rotated["info"]["created_at"] + 2
    assert rotated["info"]["expires_at"] is None  # the old key never expired: neither does its successor
    with _client(cp, short["key"]) as stale, _client(cp, rotated["key"]) as fresh:
        _poll(lambda: _expired(stale.get("/api/v1/nodes")))
        assert fresh.get("/api/v1/nodes").status_code == 200


@pytest.mark.slow
def test_refused_rotations_and_lifetimes_are_typed_and_change_nothing(controller_process: ControllerProcess) -> None:
    cp = controller_process
    key = _cli_json(cp, "keys", "create", "--role", "audit")
    key_id = key["info"]["id"]
    spare = _cli_json(cp, "keys", "create", "--role", "audit")["info"]["id"]
    _cli_json(cp, "keys", "rotate", key_id)
    before = (_audit(cp)[-1]["seq"], _cli_json(cp, "keys", "list"))
    with _client(cp) as http:
        again = http.post(f"/api/v1/keys/{key_id}/rotate", json={})
        assert again.status_code == 409 and again.json()["error"]["code"] == "conflict"
        assert "rotated already" in again.json()["error"]["message"]
        missing = http.post("/api/v1/keys/000000000000/rotate", json={})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        for body in ({"grace_s": -1}, {"grace_s": 1e12}, {"expires_in_s": 0}, {"grace_s": "soon"}):
            bad = http.post(f"/api/v1/keys/{spare}/rotate", json=body)
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request", body
        for body in ({"role": "audit", "expires_in_s": 0.5}, {"role": "audit", "expires_in_s": 4e8}):
            bad = http.post("/api/v1/keys", json=body)
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request", body
        assert (_audit(cp)[-1]["seq"], _cli_json(cp, "keys", "list")) == before
        revoked = _cli_json(cp, "keys", "create", "--role", "audit")["info"]["id"]
        assert http.delete(f"/api/v1/keys/{revoked}").status_code == 200
        before = (_audit(cp)[-1]["seq"], _cli_json(cp, "keys", "list"))
        gone = http.post(f"/api/v1/keys/{revoked}/rotate", json={})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"
    assert (_audit(cp)[-1]["seq"], _cli_json(cp, "keys", "list")) == before
    out = cp.cli("keys", "rotate", key_id)
    assert out.returncode == 1 and "conflict" in out.stderr and "nxk_" not in out.stdout + out.stderr
    bad_flag = cp.cli("keys", "create", "--role", "audit", "--expires", "soon")
    assert bad_flag.returncode != 0 and "not a duration" in bad_flag.stderr
