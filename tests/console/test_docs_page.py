"""The console's Docs pages against a real controller: the manual (`nexa/docs`) listed and each topic
rendered to HTML, readable before signing in (like the API's description), with the navigation once
signed in; links stay inside the console; an unknown topic is a 404 naming the topics; in Chromium,
reading it fetches nothing from anywhere but the controller."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
import trio

from nexa import docs
from nexa.control.console.docs import render, slug
from tests.conftest import Controller
from tests.support.console import sign_in, signed_in_page

# ---- pure: rendering ----------------------------------------------------------------------------------


def test_every_topic_renders_with_heading_ids_and_only_console_links() -> None:
    for name in docs.TOPICS:
        html = render(name)
        assert html.startswith(f'<h1 id="{slug(docs.topic(name).title)}">'), name
        for href in re.findall(r'href="([^"]*)"', html):
            assert href.startswith(("/console/docs/", "#")), f"{name}: {href}"
        assert "<img" not in html and "<script" not in html and 'src="' not in html, name
    assert 'href="/console/docs/nodes#nodes"' in render("files")  # `nodes.md#nodes` in the markdown
    assert '<h2 id="several-controllers-on-postgresql">' in render("operations")


def test_headings_get_githubs_slugs() -> None:
    assert slug("Check a node: `nexa node doctor`") == "check-a-node-nexa-node-doctor"
    assert slug("Release evidence: sim, bench, evidence and the release gate") == (
        "release-evidence-sim-bench-evidence-and-the-release-gate"
    )


# ---- HTTP: a real controller ------------------------------------------------------------------------


async def test_the_docs_are_public_and_get_the_navigation_once_signed_in(controller: Controller) -> None:
    async with httpx.AsyncClient(base_url=controller.url, timeout=10) as http:
        login = await http.get("/console/login")
        assert 'href="/console/docs"' in login.text
        listing = await http.get("/console/docs")
        assert listing.status_code == 200 and listing.headers["content-type"].startswith("text/html")
        for t in docs.topics():
            assert f'<a href="/console/docs/{t.name}" id="doc-{t.name}">' in listing.text, t.name
        topic_list = listing.text.split('<ul id="doc-topics"', 1)[1].split("</ul>", 1)[0]
        assert "`" not in topic_list  # the summaries' markdown is rendered, not shown raw
        assert ": <code>GET /metrics</code>, the fleet's series" in listing.text
        assert 'aria-label="Primary"' not in listing.text and 'href="/console/login"' in listing.text
        page = await http.get("/console/docs/config")
        assert page.status_code == 200
        assert render("config") in page.text and "<title>Configuration · nexa</title>" in page.text
        assert "<code>max_body_bytes</code> = <code>1048576</code>" in page.text

        assert (await sign_in(http, controller.admin_key)).status_code == 303
        signed_in = (await http.get("/console/docs/nodes")).text
        assert 'aria-label="Primary"' in signed_in
        assert '<a href="/console/docs" aria-current="page">Docs</a>' in signed_in
        assert 'href="/console/overview"' in signed_in
        overview = (await http.get("/console/overview")).text
        assert '<a href="/console/docs">Docs</a>' in overview  # the last link of every page's navigation


async def test_an_unknown_topic_is_a_404_naming_the_topics(controller: Controller) -> None:
    async with httpx.AsyncClient(base_url=controller.url, timeout=10) as http:
        for bad in ("nope", "Config", "commands.md", "__init__"):
            refused = await http.get(f"/console/docs/{bad}")
            assert refused.status_code == 404, bad
            assert "the topics are commands, install" in refused.text, bad
        assert (await http.get("/console/docs/..%2FREADME")).status_code == 404  # no route: a path is no topic


# ---- in Chromium ------------------------------------------------------------------------------------


def _browse(controller: Controller) -> list[str]:
    from playwright.sync_api import expect

    with signed_in_page(controller.url, controller.admin_key) as page:
        requested: list[str] = []
        page.on("request", lambda request: requested.append(request.url))
        page.get_by_role("navigation", name="Primary").get_by_role("link", name="Docs").click()
        expect(page.locator("h1")).to_have_text("Docs")
        page.locator("#doc-files").click()
        expect(page.locator("h1")).to_have_text("File formats")
        # A link to another topic's heading opens that page at the heading.
        page.locator("article.doc a[href='/console/docs/nodes#nodes']").first.click()
        expect(page).to_have_url(re.compile(r"/console/docs/nodes#nodes$"))
        expect(page.locator("h1#nodes")).to_have_text("Nodes")
        primary = page.get_by_role("navigation", name="Primary")
        expect(primary.get_by_role("link", name="Docs")).to_have_attribute("aria-current", "page")
        return requested


@pytest.mark.slow  # about 4.5 s: a Chromium start
async def test_reading_the_docs_in_chromium_stays_on_the_controller(controller: Controller) -> None:
    requested: Any = await trio.to_thread.run_sync(_browse, controller)
    assert requested, "the browser made no request"
    outside = [url for url in requested if not url.startswith(controller.url)]
    assert outside == [], outside
