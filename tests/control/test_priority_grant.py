"""Priority is an entitlement (issue 30 point 4), through the CLI, HTTP and the official `openai` SDK
against a real `nexa control` process: a key is granted standard and batch unless created with
`--priorities`; asking for another class is a typed 403 that runs nothing; a rotation keeps the
grant; a grant that makes no sense is refused and changes nothing. (Fair sharing under a flood, and
`priority_over_grant = "lower"`, are in tests/e2e/test_fairness.py, with sim nodes.)"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ControllerProcess

MESSAGES: list[Any] = [{"role": "user", "content": "hello"}]


def _client(cp: ControllerProcess, key: str | None = None) -> httpx.Client:
    return httpx.Client(base_url=cp.url, headers={"Authorization": f"Bearer {key or cp.admin_key}"}, timeout=30)


def _cli_json(cp: ControllerProcess, *argv: str) -> Any:
    out = cp.cli(*argv, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _audit_head(cp: ControllerProcess) -> int:
    with _client(cp) as http:
        seq: int = http.get("/api/v1/audit", params={"limit": 1000}).json()["events"][-1]["seq"]
    return seq


@pytest.mark.slow
def test_a_key_asks_only_for_the_priority_classes_it_is_granted(controller_process: ControllerProcess) -> None:
    cp = controller_process
    with _client(cp) as http:
        assert http.post("/api/v1/tenants", json={"id": "acme"}).status_code == 201
    plain = _cli_json(cp, "keys", "create", "--role", "inference", "--tenant", "acme")
    granted = _cli_json(
        cp, "keys", "create", "--role", "inference", "--tenant", "acme", "--priorities", "interactive,standard"
    )
    assert plain["info"]["priorities"] == ["standard", "batch"]
    assert granted["info"]["priorities"] == ["interactive", "standard"]
    assert _cli_json(cp, "keys", "show", granted["info"]["id"])["priorities"] == ["interactive", "standard"]
    assert "interactive,standard" in cp.cli("keys", "show", granted["info"]["id"]).stdout

    head = _audit_head(cp)
    sdk = openai.OpenAI(base_url=f"{cp.url}/v1", api_key=plain["key"], max_retries=0, timeout=30)
    with pytest.raises(openai.PermissionDeniedError) as refused:
        sdk.chat.completions.create(model="chat", messages=MESSAGES, extra_headers={"x-nexa-priority": "interactive"})
    assert refused.value.code == "priority_not_granted"
    assert "standard, batch" in refused.value.message and "--priorities" in refused.value.message
    envelope = {
        "version": "nexa.v1",
        "idempotency_key": "k-1",
        "workload_id": "w-1",
        "capability": "chat",
        "model": "chat",
        "payload": {"messages": MESSAGES},
        "latency_class": "realtime",  # means interactive
    }
    with _client(cp, plain["key"]) as http:
        resp = http.post("/api/v1/workloads", json=envelope)
        assert resp.status_code == 403 and resp.json()["error"]["code"] == "priority_not_granted"
        assert http.get("/api/v1/workloads/w-1").status_code == 404  # refused before anything was stored
    # The granted key gets past the grant (and on to the model, which this controller does not serve).
    with _client(cp, granted["key"]) as http:
        resp = http.post("/api/v1/workloads", json=envelope)
        assert resp.status_code != 403, resp.text
    assert _audit_head(cp) == head  # refusals change nothing

    # A rotation keeps the grant.
    rotated = _cli_json(cp, "keys", "rotate", granted["info"]["id"])
    assert rotated["info"]["priorities"] == ["interactive", "standard"]


@pytest.mark.slow
def test_a_grant_that_makes_no_sense_is_refused_and_changes_nothing(controller_process: ControllerProcess) -> None:
    cp = controller_process
    with _client(cp) as http:
        assert http.post("/api/v1/tenants", json={"id": "acme"}).status_code == 201
        head = _audit_head(cp)
        for body, problem in (
            ({"role": "operator", "priorities": ["interactive"]}, "priorities: only inference keys"),
            ({"role": "inference", "tenant": "acme", "priorities": []}, "priorities: a key needs at least one"),
        ):
            resp = http.post("/api/v1/keys", json=body)
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["code"] == "invalid_request" and problem in resp.text, resp.text
        resp = http.post("/api/v1/keys", json={"role": "inference", "tenant": "acme", "priorities": ["urgent"]})
        assert resp.status_code == 400, resp.text
    assert _audit_head(cp) == head
    out = cp.cli("keys", "create", "--role", "inference", "--tenant", "acme", "--priorities", "urgent")
    assert out.returncode == 2 and "interactive, standard, batch" in out.stderr
