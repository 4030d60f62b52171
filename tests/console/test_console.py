"""The operator console: HTTP-level checks (sessions, cookie flags, CSRF, bundled libraries) against a
real controller, and a walk through every view in Debian's real headless Chromium (Playwright's sync
API, driven from one worker thread) against a controller with four `sim` nodes.

Screenshots of every view are saved under the test's tmp dir; when `CI_ARTIFACTS` is set they are
copied to `$CI_ARTIFACTS/console/` as well.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
import trio

from tests.conftest import Controller
from tests.realparts import BuiltImages, S3Store
from tests.support.api import assert_envelope, ok
from tests.support.cluster import SimCluster, sim_cluster
from tests.support.console import CHROMIUM, CHROMIUM_ARGS, csrf, sign_in
from tests.support.models import bring_to, registry_config

T = TypeVar("T")
#: A change must show without a reload within this many seconds (issue: two).
LIVE_MS = 2000


# ---- HTTP level: a real controller, no browser ------------------------------------------------------


async def test_vendor_libraries_are_bundled_and_served(controller: Controller) -> None:
    # CI must fail when builds/console/vendor.sh did not run: the controller only warns.
    async with httpx.AsyncClient(base_url=controller.url) as http:
        for name in ("vendor/htmx.min.js", "vendor/uPlot.iife.min.js", "vendor/uPlot.min.css", "console.js"):
            resp = await http.get(f"/console/static/{name}")
            assert resp.status_code == 200, f"{name} is missing: run builds/console/vendor.sh"
            assert len(resp.content) > 100
        assert (await http.get("/console/static/../api.py")).status_code == 404


@pytest.mark.slow
async def test_the_request_charts_have_history_before_any_page_was_open(controller: Controller) -> None:
    """The controller samples for the charts from its start, not only while a console page is open."""
    await trio.sleep(3.5)
    async with httpx.AsyncClient(base_url=controller.url) as http:
        assert (await sign_in(http, controller.admin_key)).status_code in {200, 303}
        series = (await http.get("/console/requests/series")).json()
    assert len(series["t"]) >= 3  # one point per second since the start, though nobody looked


async def test_session_cookie_flags_and_sign_out(controller: Controller) -> None:
    async with httpx.AsyncClient(base_url=controller.url) as http:
        assert (await http.get("/console/nodes")).headers["location"] == "/console/login"
        resp = await sign_in(http, controller.admin_key)
        assert resp.status_code == 303
        cookie = resp.headers["set-cookie"]
        assert "HttpOnly" in cookie
        assert "SameSite=Strict" in cookie
        assert "Path=/" in cookie
        assert re.search(r"Max-Age=\d+", cookie)
        assert "Secure" not in cookie  # plain http here; https requests get Secure
        assert controller.admin_key not in cookie
        page = await http.get("/console/nodes")
        assert page.status_code == 200
        assert "No node has enrolled yet" in page.text
        out = await http.post("/console/logout", data={"csrf_token": csrf(page.text)})
        assert out.status_code == 303
        assert (await http.get("/console/nodes")).headers["location"] == "/console/login"
    async with controller.client() as api:
        actions = [e["action"] for e in (await ok(api.get("/api/v1/audit")))["events"]]
    assert "console.sign_in" in actions
    assert "console.sign_out" in actions


async def test_a_post_without_the_csrf_token_is_refused_and_changes_nothing(controller: Controller) -> None:
    async with httpx.AsyncClient(base_url=controller.url) as http:
        await sign_in(http, controller.admin_key)
        for data in ({"role": "audit"}, {"role": "audit", "csrf_token": "not-the-token"}):
            resp = await http.post("/console/keys", data=data)
            assert resp.status_code == 403
            assert "did not come from this console" in resp.text
        keys = await http.get("/console/keys")
        # With the token the same form works (and the new key is shown once).
        created = await http.post("/console/keys", data={"role": "audit", "csrf_token": csrf(keys.text)})
        assert created.status_code == 200
        assert "shown once" in created.text
    async with controller.client() as api:
        roles = [k["role"] for k in (await ok(api.get("/api/v1/keys")))["keys"]]
    assert roles.count("audit") == 1


async def test_per_adapter_quotas_are_set_shown_and_checked_by_the_api_and_the_console(controller: Controller) -> None:
    """`adapter_tokens_per_day` through the real API and the console form: set, shown with its use,
    and bad input refused with 400 naming the key, changing nothing."""
    async with controller.client() as api:
        await ok(api.post("/api/v1/tenants", json={"id": "acme"}), 201)
        body = {"tokens_per_day": 9000, "adapter_tokens_per_day": {"ner": 5000, "tone": 0}}
        view = await ok(api.put("/api/v1/quotas/acme", json=body))
        assert view["limits"]["adapter_tokens_per_day"] == {"ner": 5000, "tone": 0}
        assert view["use"]["adapter_tokens_today"] == {"ner": 0, "tone": 0}
        for bad, names in (
            ({"Ner:2": 5}, "adapter_tokens_per_day['Ner:2']"),
            ({"ner": -1}, "adapter_tokens_per_day['ner']: an integer >= 0"),
            ({"ner": "many"}, "adapter_tokens_per_day['ner']: expected an integer"),
            ({f"a{i}": 1 for i in range(257)}, "at most 256 adapters"),
        ):
            err = assert_envelope(
                await api.put("/api/v1/quotas/acme", json={"adapter_tokens_per_day": bad}), 400, "invalid_request"
            )
            assert names in str(err["message"]), err
        shown = await ok(api.get("/api/v1/quotas/acme"))
        assert shown["limits"] == view["limits"]
    async with httpx.AsyncClient(base_url=controller.url) as http:
        await sign_in(http, controller.admin_key)
        page = (await http.get("/console/keys")).text
        assert 'value="ner=5000, tone=0"' in page and "ner 0 of 5000, tone 0 of 0" in page
        form = {"csrf_token": csrf(page), "tokens_per_day": "9000", "adapter_tokens_per_day": "ner=7000 poet=10"}
        assert (await http.post("/console/quotas/acme", data=form)).status_code in {200, 303}
        for bad in ("ner", "ner=1, ner=2", "Ner=5", "ner=\u00b2"):  # a superscript two is a digit, not a count
            refused = await http.post("/console/quotas/acme", data=form | {"adapter_tokens_per_day": bad})
            assert refused.status_code == 400, (bad, refused.status_code)
            assert "adapter_tokens_per_day" in refused.text
    async with controller.client() as api:
        shown = await ok(api.get("/api/v1/quotas/acme"))
    assert shown["limits"]["adapter_tokens_per_day"] == {"ner": 7000, "poet": 10}


async def test_a_revoked_keys_session_ends_at_once(controller: Controller) -> None:
    async with controller.client() as api:
        created = await ok(api.post("/api/v1/keys", json={"role": "operator"}), 201)
    async with httpx.AsyncClient(base_url=controller.url) as http:
        await sign_in(http, created["key"])
        assert (await http.get("/console/nodes")).status_code == 200
        async with controller.client() as api:
            await ok(api.delete(f"/api/v1/keys/{created['info']['id']}"))
        assert (await http.get("/console/nodes")).headers["location"] == "/console/login"


async def test_roles_without_console_views_cannotsign_in(controller: Controller) -> None:
    async with controller.client() as api:
        await ok(api.post("/api/v1/tenants", json={"id": "acme"}), 201)
        created = await ok(api.post("/api/v1/keys", json={"role": "inference", "tenant": "acme"}), 201)
    async with httpx.AsyncClient(base_url=controller.url) as http:
        resp = await sign_in(http, created["key"])
        assert resp.status_code == 403
        assert "no console views" in resp.text
        assert (await sign_in(http, "nxk_000000000000_" + "A" * 43)).status_code == 401


# ---- in Chromium, against four sim nodes ------------------------------------------------------------


class _Shots:
    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path / "screenshots"
        self.dir.mkdir()
        self.saved: list[Path] = []

    def take(self, page: Any, name: str) -> None:
        path = self.dir / f"{name}.png"
        page.screenshot(path=str(path), full_page=True)
        self.saved.append(path)

    def publish(self) -> None:
        target = os.environ.get("CI_ARTIFACTS")
        if target:
            out = Path(target) / "console"
            out.mkdir(parents=True, exist_ok=True)
            for path in self.saved:
                shutil.copy2(path, out / path.name)


def _browse(cluster: SimCluster, shots: _Shots, audit_key: str, trio_call: Callable[..., Any]) -> None:
    """The whole browser walk, in one worker thread (Playwright's sync objects belong to their thread)."""
    from playwright.sync_api import expect, sync_playwright

    base = cluster.controller.url
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(base_url=base, viewport={"width": 1280, "height": 900})
            page = context.new_page()
            page.set_default_timeout(15_000)

            # Sign in; the key is typed once and is nowhere in the browser afterwards.
            page.goto("/console/")
            expect(page).to_have_url(re.compile(r"/console/login$"))
            shots.take(page, "login")
            page.get_by_label("API key").fill(cluster.controller.admin_key)
            page.get_by_role("button", name="Sign in").click()
            expect(page).to_have_url(re.compile(r"/console/overview$"))
            cookie = next(c for c in context.cookies() if c["name"] == "nexa_console")
            assert cookie["httpOnly"] is True
            assert cookie["sameSite"] == "Strict"
            assert cookie["secure"] is False  # plain http on loopback
            assert cookie["expires"] > time.time()
            assert cluster.controller.admin_key not in cookie["value"]
            expect(page.locator("#nodes-total")).to_have_text("4")
            shots.take(page, "overview")

            # Nodes: four, Ready; drain one and watch it change without a reload.
            page.get_by_role("link", name="Nodes").click()
            rows = page.locator("#nodes-table tbody tr")
            expect(rows).to_have_count(4)
            expect(page.locator("#nodes-table [data-state=Ready]")).to_have_count(4)
            # Each node's fabric has its cell (sim nodes read this host's sysfs: no RDMA devices here).
            expect(page.locator("#nodes-table thead th")).to_contain_text(["Fabric"])
            expect(page.locator("#nodes-table td[data-fabric]")).to_have_count(4)
            shots.take(page, "nodes")
            page.locator("#drain-sim-2").click()
            expect(page.locator(".scope")).to_contain_text("Node sim-2")
            shots.take(page, "confirm-drain")
            page.get_by_role("button", name="Confirm drain").click()
            expect(page.locator("#node-sim-2 [data-state]")).to_have_text("Draining", timeout=LIVE_MS)
            expect(page.get_by_role("status").first).to_contain_text("sim-2 is now Draining")
            # A change made elsewhere (the API) shows live, too.
            trio_call(_api_post, cluster, "/api/v1/nodes/sim-3/cordon")
            expect(page.locator("#node-sim-3 [data-state]")).to_have_text("Cordoned", timeout=LIVE_MS)
            trio_call(_api_post, cluster, "/api/v1/nodes/sim-3/uncordon")
            expect(page.locator("#node-sim-3 [data-state]")).to_have_text("Ready", timeout=LIVE_MS)

            # Deployments: a replica becoming Ready shows live; the placement table explains.
            page.get_by_role("link", name="Deployments").click()
            expect(page.locator("#live")).to_contain_text("Nothing is deployed")
            trio_call(cluster.deploy, "chat-a", replicas=1, wait=False)
            expect(page.locator("#deployment-chat-a")).to_be_visible(timeout=LIVE_MS)
            expect(page.locator("#deployment-chat-a [data-state=Ready]")).to_have_count(1, timeout=30_000)
            trio_call(cluster.wait_ready, "chat-a", 1)
            shots.take(page, "deployments")
            page.get_by_role("link", name="chat-a").click()
            expect(page.locator("#placement-table tbody tr")).to_have_count(4)
            shots.take(page, "deployment-placement")

            # Models: approve an evaluated version, then promote the alias to it.
            page.get_by_role("link", name="Models").click()
            expect(page.locator("#model-tiny-v2 [data-state]")).to_have_text("Evaluated")
            page.locator("#approve-tiny-v2").click()
            expect(page.locator("#model-tiny-v2 [data-state]")).to_have_text("Approved")
            page.locator("#alias-tiny-v2").fill("chat")
            page.locator("#promote-tiny-v2").click()
            expect(page.get_by_role("status").first).to_contain_text("Alias chat now points at tiny v2")
            expect(page.locator("#alias-row-chat")).to_contain_text("tiny v2")
            shots.take(page, "models")
            alias = trio_call(_api_get, cluster, "/api/v1/aliases/chat")
            assert alias["alias"]["target"] == {"model": "tiny", "version": "v2"}

            # Requests: an inference request through the official SDK shows up in the usage table.
            page.get_by_role("link", name="Requests").click()
            expect(page.locator("#live")).to_contain_text("No request has finished")
            client = openai.OpenAI(base_url=cluster.base_url, api_key=cluster.inference_key, max_retries=0, timeout=30)
            try:
                answer = _chat(client)
            finally:
                client.close()
            assert answer.usage is not None
            row = page.locator("#usage-table tbody tr", has_text="acme")
            expect(row).to_have_count(1, timeout=LIVE_MS + 1000)
            expect(row).to_contain_text(str(answer.usage.completion_tokens))
            expect(page.locator("#chart-rate .uplot")).to_have_count(1)
            shots.take(page, "requests")

            # Audit: the drain was recorded with the signed-in key; the chain verifies.
            page.get_by_role("link", name="Audit").click()
            page.get_by_label("Action").fill("node.drain")
            page.get_by_role("button", name="Filter").click()
            drain = page.locator("#audit-table tbody tr")
            expect(drain).to_have_count(1)
            admin_id = cluster.controller.admin_key.split("_")[1]
            expect(drain).to_contain_text(admin_id)
            expect(drain).to_contain_text("node/sim-2")
            page.get_by_role("button", name="Verify the chain").click()
            expect(page.locator("#verdict")).to_contain_text("The audit chain is intact")
            shots.take(page, "audit")

            # Keys and quotas: a new key is shown once; quotas can be set.
            page.get_by_role("link", name="Keys and quotas").click()
            page.get_by_label("Role").select_option("monitoring")
            page.locator("#create-key").click()
            expect(page.locator("#new-key")).to_have_value(re.compile(r"^nxk_"))
            page.get_by_label(re.compile("^Requests per minute")).fill("600")
            page.locator("#save-quota-acme").click()
            expect(page.get_by_role("status").first).to_contain_text("Quotas of acme saved")
            expect(page.get_by_label(re.compile("^Requests per minute"))).to_have_value("600")
            shots.take(page, "keys")
            page.reload()
            expect(page.locator("#new-key")).to_have_count(0)  # shown once only

            # Keyboard: the skip link is the first stop and its focus is visible.
            page.keyboard.press("Tab")
            skip = page.get_by_role("link", name="Skip to content")
            expect(skip).to_be_focused()
            assert skip.evaluate("e => getComputedStyle(e).outlineStyle") != "none"

            # A narrow screen.
            page.set_viewport_size({"width": 390, "height": 844})
            page.get_by_role("link", name="Nodes").click()
            expect(rows).to_have_count(4)
            shots.take(page, "nodes-narrow")
            page.set_viewport_size({"width": 1280, "height": 900})

            # Sign out and be refused.
            page.get_by_role("button", name="Sign out").click()
            expect(page).to_have_url(re.compile(r"/console/login$"))
            page.goto("/console/nodes")
            expect(page).to_have_url(re.compile(r"/console/login$"))
            refused = context.request.get("/console/events/nodes", max_redirects=0)
            assert refused.status == 401
            context.close()

            # An audit-role viewer sees its views only and is offered no admin actions.
            viewer = browser.new_context(base_url=base)
            vp = viewer.new_page()
            vp.goto("/console/login")
            vp.get_by_label("API key").fill(audit_key)
            vp.get_by_role("button", name="Sign in").click()
            expect(vp).to_have_url(re.compile(r"/console/requests$"))
            nav = [
                t.strip() for t in vp.get_by_role("navigation", name="Primary").get_by_role("link").all_inner_texts()
            ]
            assert nav == ["Requests", "Audit", "Docs"]  # the views its role may see, then the manual
            vp.get_by_role("link", name="Audit").click()
            expect(vp.get_by_role("button", name="Verify the chain")).to_be_visible()
            shots.take(vp, "audit-viewer")
            assert vp.request.get("/console/keys").status == 403
            assert vp.request.get("/console/nodes/sim-1/drain").status == 403
            viewer.close()
        finally:
            browser.close()


def _chat(client: openai.OpenAI) -> Any:
    """One chat completion; the alias just moved, so wait (bounded) while the deployment rolls to it."""
    deadline = time.monotonic() + 40
    while True:
        try:
            return client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}])
        except openai.APIStatusError as exc:
            if exc.status_code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


async def _api_post(cluster: SimCluster, path: str) -> Any:
    async with cluster.client() as http:
        return await ok(http.post(path))


async def _api_get(cluster: SimCluster, path: str) -> Any:
    async with cluster.client() as http:
        return await ok(http.get(path))


@pytest.mark.slow
async def test_console_in_chromium(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    assert await trio.Path(CHROMIUM).exists(), "Debian's chromium is required (apt-get install chromium)"
    async with sim_cluster(nursery, tmp_path, registry_config(tmp_path, s3_store), s3_store, test_images, nodes=4) as c:
        async with c.client() as http:
            await bring_to(http, s3_store, "tiny", "v2", "Evaluated")
            audit_key = (await ok(http.post("/api/v1/keys", json={"role": "audit"}), 201))["key"]
        shots = _Shots(tmp_path)

        def trio_call(fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
            return trio.from_thread.run(lambda: fn(*args, **kwargs))

        try:
            await trio.to_thread.run_sync(_browse, c, shots, audit_key, trio_call)
        finally:
            shots.publish()
        names = {p.stem for p in shots.saved}
        assert {"overview", "nodes", "models", "deployments", "requests", "audit", "keys", "nodes-narrow"} <= names
        async with c.client() as http:
            events = (
                await ok(http.get("/api/v1/audit", params={"action": "model.approve", "target": "model/tiny/v2"}))
            )["events"]
        assert [e["actor_key_id"] for e in events] == [c.controller.admin_key.split("_")[1]]
