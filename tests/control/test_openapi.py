"""The OpenAPI document (`GET /api/v1/openapi.json`): valid, complete, served, and fuzzed with
schemathesis against a real `nexa control` process with every kind of key."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from openapi_spec_validator import validate

from nexa.channel.links import generate_curve_keypair
from nexa.contracts import codec
from nexa.contracts.api import ReceiptPublicKey
from nexa.control.datapath.inference_routes import INFERENCE_ROUTES, ROUTES
from nexa.control.http import health, openapi
from nexa.control.http.declare import Route, collect, route
from nexa.control.http.resources import ROLES as ROUTE_ROLES
from nexa.security import generate_signing_key, split_enrollment_token
from tests.conftest import Controller, ControllerProcess

#: Examples per operation, generation mode (positive, negative) and key: with the keys the route
#: serves, and with each other key (its refusals). ~55 operations keep the run to a few minutes.
FUZZ_EXAMPLES = 12
FUZZ_REFUSED_EXAMPLES = 2
#: Reproducible in CI; set False by hand to explore further.
FUZZ_DERANDOMIZE = True
#: Loopback only: a registry reference the controller would dial is pinned to a closed local port.
_LOOPBACK_REGISTRY = "127.0.0.1:1/x"


def _operations(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (method.upper(), path): op
        for path, item in doc["paths"].items()
        for method, op in item.items()
        if method in {"get", "put", "post", "delete", "patch"}
    }


def _template(rule: str) -> str:
    return rule.replace("<", "{").replace(">", "}")


def test_the_document_is_valid_openapi_3_1() -> None:
    doc = openapi.document()
    assert doc["openapi"].startswith("3.1")
    validate(doc)  # openapi-spec-validator: raises on any violation of the 3.1 schema
    # The generator is deterministic: the served bytes are the same document.
    assert json.loads(openapi.document_json()) == doc


def test_every_route_is_described_with_its_roles_and_errors() -> None:
    doc = openapi.document()
    ops = _operations(doc)
    table = {**ROUTE_ROLES, **INFERENCE_ROUTES}
    assert set(ops) == {(m, _template(r)) for m, r in table}
    for (method, rule), roles in table.items():
        op = ops[(method, _template(rule))]
        assert op["x-nexa-roles"] == sorted(r.value for r in roles or ())
        assert op["security"] == ([] if roles is None else [{"bearer": []}])
        errors = {status: r for status, r in op["responses"].items() if int(status) >= 400}
        if roles is not None:
            assert "unauthenticated" in errors["401"]["x-nexa-error-codes"]
            assert "forbidden" in errors["403"]["x-nexa-error-codes"]
        if "<" in rule:
            assert "not_found" in errors["404"]["x-nexa-error-codes"]
        envelope = "OpenAIError" if rule.startswith("/v1/") else "ErrorEnvelope"
        if rule in ("/rerank", "/v2/rerank", "/score", "/tokenize", "/detokenize"):
            envelope = "OpenAIError"  # vLLM's own paths answer in OpenAI's shape, as vLLM does
        if rule.startswith("/v1/messages"):
            envelope = "AnthropicError"  # Anthropic's SDKs read their own shape
        for response in errors.values():
            assert response["content"]["application/json"]["schema"]["$ref"].endswith("/" + envelope)
    # The one keyless document route is itself in the table.
    assert ROUTE_ROLES[openapi.DOCUMENT_ROUTE] is None
    # OpenAI's Responses API: its body as the translation takes it, streamed or not, errors in OpenAI's shape.
    responses = ops[("POST", "/v1/responses")]
    body = responses["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["model", "input"] and body["additionalProperties"] is False
    assert set(responses["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "field_not_supported" in responses["responses"]["400"]["x-nexa-error-codes"]


def test_every_inference_answer_names_the_overhead_header() -> None:
    ops = _operations(openapi.document())
    for method, rule in INFERENCE_ROUTES:
        for status, response in ops[(method, _template(rule))]["responses"].items():
            header = response["headers"]["x-nexa-overhead-ms"]
            assert header["schema"]["type"] == "string" and "ms" in header["description"], (method, rule, status)
    for (method, path), op in ops.items():
        if (method, path.replace("{", "<").replace("}", ">")) not in INFERENCE_ROUTES:
            assert all("headers" not in r for r in op["responses"].values()), (method, path)


def test_a_route_cannot_be_declared_without_its_roles_or_description_nor_twice() -> None:
    # The one declaration is the description: a route without one does not exist.
    with pytest.raises(TypeError, match="new-thing"):
        route("GET", "/api/v1/new-thing", summary="A new thing", tag="meta")  # no roles named
    with pytest.raises(TypeError, match="summary"):
        route("GET", "/api/v1/new-thing", roles=None, tag="meta")  # type: ignore[call-arg]
    with pytest.raises(LookupError, match=r"GET /healthz is declared in nexa\.control\.http\.health and in"):
        collect([health, health])


def test_every_paged_list_takes_the_same_cursor_and_limit_and_answers_next_cursor() -> None:
    doc = openapi.document()
    schemas = doc["components"]["schemas"]
    paged = {}
    for (method, path), op in _operations(doc).items():
        query = {p["name"]: p for p in op["parameters"] if p["in"] == "query"}
        success = next(r for status, r in op["responses"].items() if int(status) < 400)
        ref = success["content"].get("application/json", {}).get("schema", {}).get("$ref", "")
        answer = schemas.get(ref.rpartition("/")[2], {}).get("properties", {})
        assert ("cursor" in query) == ("limit" in query) == ("next_cursor" in answer), (method, path)
        if "cursor" in query:
            paged[path] = (query["cursor"], query["limit"], answer["next_cursor"])
    assert set(paged) >= {  # and any list added since
        "/api/v1/keys",
        "/api/v1/tenants",
        "/api/v1/nodes",
        "/api/v1/audit",
        "/api/v1/deployments",
        "/api/v1/usage",
    }
    assert len({json.dumps(v, sort_keys=True) for v in paged.values()}) == 1  # one description, not copies
    cursor, limit, next_cursor = paged["/api/v1/keys"]
    assert cursor["description"] and limit["schema"]["default"] == 100 and limit["schema"]["maximum"] == 1000
    assert next_cursor == {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}


def test_a_paged_answer_without_the_page_query_fails_the_generator() -> None:
    declared: list[Route] = list(openapi.routes())
    at = next(i for i, r in enumerate(declared) if r.key == ("GET", "/api/v1/tenants"))
    declared[at] = attrs.evolve(declared[at], params=())
    with pytest.raises(LookupError, match="tenants"):
        openapi.document(declared)


async def test_the_receipts_key_is_answered_and_described_as_its_contract_type(controller: Controller) -> None:
    async with controller.client() as http:
        resp = await http.get("/api/v1/receipts/public-key")
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert sorted(answer) == ["key_id", "keys", "public_key"]
    assert len(base64.b64decode(answer["public_key"], validate=True)) == 32
    listed = codec.loads(codec.api, resp.content, ReceiptPublicKey)
    # Before any rotation: one key, the current one, by its id.
    assert [(k.key_id, k.public_key, k.retired_at) for k in listed.keys] == [(listed.key_id, listed.public_key, 0.0)]
    doc = openapi.document()
    op = doc["paths"]["/api/v1/receipts/public-key"]["get"]
    assert op["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ReceiptPublicKey"
    }
    assert doc["components"]["schemas"]["ReceiptPublicKey"]["required"] == ["public_key"]


def test_readiness_and_the_cluster_view_are_described_as_their_contract_types() -> None:
    doc = openapi.document()
    for path, schema in (("/readyz", "Readiness"), ("/api/v1/cluster", "ClusterView")):
        answer = doc["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
        assert answer == {"$ref": f"#/components/schemas/{schema}"}
    assert set(doc["components"]["schemas"]["Readiness"]["properties"]) == {"status", "role", "epoch", "lease_age_s"}
    member = doc["components"]["schemas"]["ClusterMember"]["properties"]
    assert {"id", "address", "role", "epoch", "seen_age_s", "leader", "lease_age_s"} <= set(member)


def test_bodies_are_generated_from_the_contract_types() -> None:
    schemas = openapi.document()["components"]["schemas"]
    key_create = schemas["KeyCreate"]
    # Required = the fields without a default; unknown keys refused, as the API codec does.
    assert key_create["required"] == ["role"]
    assert key_create["additionalProperties"] is False
    assert key_create["properties"]["role"] == {"$ref": "#/components/schemas/Role"}
    assert schemas["Role"]["enum"] == ["admin", "operator", "inference", "audit", "monitoring", "retention-reader"]
    assert key_create["properties"]["tenant"]["anyOf"] == [{"type": "string"}, {"type": "null"}]
    # JSON names differ from Python's where a class says so (`from_` is `from` on the wire).
    assert "from" in schemas["AliasReceipt"]["properties"]
    assert "from_" not in schemas["AliasReceipt"]["properties"]
    # tuple[X, ...] is an array; dict[str, float] an object of numbers.
    assert schemas["NodeInventory"]["properties"]["gpus"]["type"] == "array"
    metrics = schemas["EvaluationCreate"]["properties"]["metrics"]
    assert metrics == {"type": "object", "additionalProperties": {"type": "number"}}


def test_evidence_describes_report_signatures_and_provenance() -> None:
    """Issue 30 point 10: the request carries each report's signature; the manifest, where each part comes from."""
    schemas = openapi.document()["components"]["schemas"]
    request = schemas["EvidenceRequest"]["properties"]
    for name in ("sim_signature", "gate_signature"):
        assert request[name]["anyOf"] == [{"$ref": "#/components/schemas/ReportSignature"}, {"type": "null"}]
    assert schemas["ReportSignature"]["required"] == ["public_key", "signature"]
    manifest = schemas["EvidenceManifest"]["properties"]
    assert manifest["provenance"]["anyOf"] == [{"$ref": "#/components/schemas/EvidenceProvenance"}, {"type": "null"}]
    assert schemas["EvidenceProvenance"]["required"] == ["sim", "gate"]
    assert schemas["PartProvenance"]["properties"]["provenance"] == {"$ref": "#/components/schemas/Origin"}
    assert schemas["Origin"]["enum"] == ["verified", "asserted", "absent"]


async def test_the_document_is_served_without_a_key(controller: Controller) -> None:
    async with httpx.AsyncClient(base_url=controller.url) as http:
        resp = await http.get("/api/v1/openapi.json")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("application/json")
    assert resp.json() == openapi.document()


def test_nexa_openapi_prints_the_same_document() -> None:
    out = subprocess.run([sys.executable, "-m", "nexa", "openapi"], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == openapi.document()


# ---- what the fuzzer found (each was a 500) ----------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "query"),
    [
        ("/api/v1/usage", "since=nan"),
        ("/api/v1/usage", "until=inf"),
        ("/api/v1/audit", "since=-Infinity"),
        ("/api/v1/audit", "limit=%C2%B2"),  # "²".isdigit() is true; int() refuses it
        ("/api/v1/audit", "after=" + "9" * 5000),  # int() refuses more than 4300 digits
    ],
)
async def test_bad_query_numbers_are_400(controller: Controller, path: str, query: str) -> None:
    async with controller.client() as http:
        resp = await http.get(f"{path}?{query}")
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "invalid_request"


@pytest.mark.parametrize("deadline", [b"\xb2", b"1" * 5000, b"-5", b"1.5"])
async def test_a_bad_deadline_header_is_400_in_openai_shape(controller: Controller, deadline: bytes) -> None:
    async with controller.client() as http:
        assert (await http.post("/api/v1/tenants", json={"id": "acme"})).status_code == 201
        made = await http.post("/api/v1/keys", json={"role": "inference", "tenant": "acme"})
    key = made.json()["key"]
    async with controller.client(key) as http:
        resp = await http.post(
            "/v1/chat/completions",
            headers={"x-nexa-deadline-ms": deadline},
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "invalid_request"
    assert error["type"] == "invalid_request_error"


# ---- fuzzing ----------------------------------------------------------------------------------------


#: The inference routes outside /v1/ that answer in OpenAI's error shape (vLLM's own paths).
_OPENAI_SHAPED = {r.path for r in ROUTES if r.tag == "openai"}


def _envelope_problem(case: schemathesis.Case, response: schemathesis.Response) -> str | None:
    """Why a 4xx answer is not in its route's error shape, or None."""
    try:
        body = json.loads(response.content)
    except ValueError:
        return "not JSON"
    if case.path.startswith("/v1/messages"):  # Anthropic's shape
        error = body.get("error") if isinstance(body, dict) else None
        if set(body) != {"type", "error", "request_id"} or body["type"] != "error" or not isinstance(error, dict):
            return "not Anthropic's {'type': 'error', 'error': {...}}"
        return None if set(error) == {"type", "message"} else "not Anthropic's error shape"
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return "not {'error': {...}}"
    error = body["error"]
    if case.path.startswith("/v1/") or case.path in _OPENAI_SHAPED:  # also vLLM's /rerank, /tokenize …
        if not {"message", "type", "code"} <= set(error):
            return "not OpenAI's error shape"
        return None
    if set(error) != {"code", "message", "retryable", "request_id"}:
        return f"envelope keys {sorted(error)}"
    if error["request_id"] != response.headers.get("x-request-id", [""])[0]:
        return "request_id is not the X-Request-Id header"
    return None


def _loopback_only(case: schemathesis.Case) -> schemathesis.Case:
    """Pin any image reference to a loopback registry, so no fuzzed request makes the controller
    dial out (runtime registration fetches the image's manifest from its registry)."""
    if isinstance(case.body, dict) and isinstance(case.body.get("image"), str):
        case.body["image"] = _LOOPBACK_REGISTRY + case.body["image"]
    return case


def _make_keys(url: str, admin: str) -> dict[str, str | None]:
    keys: dict[str, str | None] = {"admin": admin, "none": None}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin}"}, timeout=10) as http:
        assert http.post("/api/v1/tenants", json={"id": "fuzz"}).status_code == 201
        for role in ("operator", "inference", "audit"):
            body = {"role": role, "name": f"fuzz {role}", "tenant": "fuzz" if role == "inference" else None}
            resp = http.post("/api/v1/keys", json=body)
            assert resp.status_code == 201, resp.text
            keys[role] = resp.json()["key"]
    return keys


def _seed(url: str, admin: str) -> dict[str, str]:
    """Something for path parameters to name (an enrolled node, a spare key, the tenant), so the
    fuzzer also reaches answers past `not_found`: their schemas are checked too."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin}"}, timeout=10) as http:
        token = http.post("/api/v1/enrollment-tokens", json={}).json()["token"]
        enrolled = http.post(
            "/api/v1/enroll",
            json={
                "token": split_enrollment_token(token)[0],
                "hostname": "fuzz-node",
                "signing_public_key": generate_signing_key().public.b64,
                "curve_public_key": generate_curve_keypair().public,
            },
        )
        assert enrolled.status_code == 201, enrolled.text
        spare = http.post("/api/v1/keys", json={"role": "monitoring", "name": "spare"})
        assert spare.status_code == 201, spare.text
    return {"node_id": enrolled.json()["node_id"], "key_id": spare.json()["info"]["id"], "tenant": "fuzz"}


def _fuzz_operation(
    operation: schemathesis.APIOperation,
    mode: schemathesis.GenerationMode,
    url: str,
    role: str,
    key: str | None,
    examples: int,
    path_parameters: dict[str, str] | None = None,
) -> set[int]:
    """Send `examples` generated requests with one key; every answer is checked. The statuses seen."""
    seen: set[int] = set()
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=FUZZ_DERANDOMIZE,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: the report names the request
        suppress_health_check=list(HealthCheck),
    )
    @given(operation.as_strategy(generation_mode=mode, path_parameters=path_parameters).map(_loopback_only))
    def run(case: schemathesis.Case) -> None:
        response = case.call(base_url=url, headers=headers, timeout=30)
        status = response.status_code
        seen.add(status)
        where = f"{case.method} {case.formatted_path} as {role} ({mode.value}) -> {status}"
        assert status < 500, f"{where}: {response.content[:500]!r}"
        if 400 <= status < 500:
            problem = _envelope_problem(case, response)
            assert problem is None, f"{where}: {problem}: {response.content[:500]!r}"
        # The document tells the truth: the status is one it lists, a JSON answer has its schema.
        checks = [schemathesis.checks.status_code_conformance]
        if response.headers.get("content-type", [""])[0].startswith("application/json"):
            checks.append(schemathesis.checks.response_schema_conformance)
        try:
            case.validate_response(response, checks=checks)
        except schemathesis.errors.FailureGroup as group:
            found = "; ".join(str(e).strip().splitlines()[0] for e in group.exceptions)
            raise AssertionError(f"{where}: {found}") from None

    run()
    return seen


@pytest.mark.slow
def test_fuzz_every_route_with_every_role(controller_process: ControllerProcess, tmp_path: Path) -> None:
    url = controller_process.url
    assert url.startswith("http://127.0.0.1:")  # fuzzing never leaves loopback
    assert controller_process.admin_key is not None
    keys = _make_keys(url, controller_process.admin_key)
    known = _seed(url, controller_process.admin_key)
    # The schema as served, not as generated here.
    doc = httpx.get(url + "/api/v1/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_dict(doc)
    statuses: dict[str, set[int]] = {role: set() for role in keys}
    fuzzed: set[tuple[str, str]] = set()
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        allowed = set(_operations(doc)[(operation.method.upper(), operation.path)]["x-nexa-roles"])
        modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
        for role, key in keys.items():
            # Most examples with the keys the route serves; a few with the others (401/403 shape).
            examples = FUZZ_EXAMPLES if role in allowed or not allowed else FUZZ_REFUSED_EXAMPLES
            for mode in list(modes):
                try:
                    statuses[role] |= _fuzz_operation(operation, mode, url, role, key, examples)
                except AssertionError as exc:
                    failures.append(str(exc).splitlines()[0])
                except Unsatisfiable:
                    if mode is schemathesis.GenerationMode.POSITIVE:
                        failures.append(f"{operation.label}: no example could be generated")
                    # Nothing to negate (no body, no parameter with a type to break): positive only.
                    modes.remove(mode)
            names = {parameter.name for parameter in operation.path_parameters}
            if names and names <= set(known) and (role in allowed or not allowed):
                ids = {name: known[name] for name in names}
                try:
                    statuses[role] |= _fuzz_operation(operation, modes[0], url, role, key, examples, ids)
                except AssertionError as exc:
                    failures.append(str(exc).splitlines()[0])
        fuzzed.add((operation.method.upper(), operation.path))
    assert not failures, "\n".join(failures)
    assert fuzzed == set(_operations(doc))
    # Every kind of key was used, and got answers past authentication.
    for role in ("admin", "operator", "inference", "audit"):
        assert statuses[role] - {401, 403}, f"{role}: only {statuses[role]}"
    assert controller_process.proc is not None and controller_process.proc.poll() is None
    assert httpx.get(url + "/healthz", timeout=10).json() == {"status": "ok"}


@pytest.mark.slow
def test_a_schemathesis_run_with_several_workers_gets_every_request_answered(
    controller_process: ControllerProcess, tmp_path: Path
) -> None:
    """The schemathesis CLI as an operator runs it (coverage then fuzzing phases, four workers, keep-alive
    connections): every request is answered within its 10 s timeout and none with a 5xx. Before the
    early-answer fix, requests that followed an answer sent before their body arrived on the same
    connection got no answer at all (10 of 445 in a coverage run). `/api/v1/runtimes` is left out:
    registering one makes the controller dial the image's registry (the in-process fuzz above pins that
    to loopback)."""
    url = controller_process.url
    assert url.startswith("http://127.0.0.1:")  # fuzzing never leaves loopback
    cli = Path(sys.executable).with_name("schemathesis")
    argv = [str(cli), "run", f"{url}/api/v1/openapi.json", "--phases", "coverage,fuzzing", "--workers", "4"]
    argv += ["--max-examples", "25", "--request-timeout", "10", "--seed", "1", "--checks", "not_a_server_error"]
    argv += ["-H", f"Authorization: Bearer {controller_process.admin_key}", "--exclude-path", "/api/v1/runtimes"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert "Network Error" not in out and "timed out" not in out, out[-4000:]
    # not_a_server_error lists each 5xx; the only one allowed is 503, the documented retryable refusal
    # (e.g. `node_unreachable`: rotating the keys of a node the fuzzer enrolled but never connected).
    assert set(re.findall(r"^\[(5\d\d)\] ", out, re.M)) <= {"503"}, out[-4000:]
    generated = re.search(r"(\d+) generated", out)
    assert generated is not None and int(generated.group(1)) >= 2000, out[-2000:]
    assert controller_process.proc is not None and controller_process.proc.poll() is None
    assert httpx.get(url + "/healthz", timeout=10).json() == {"status": "ok"}
