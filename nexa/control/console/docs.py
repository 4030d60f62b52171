"""Docs: the manual that ships with nexa (`nexa.docs`, what `nexa docs` prints), rendered to HTML
and served offline: a page listing the topics (`/console/docs`) and one page per topic.

The pages are public, like `GET /api/v1/openapi.json`: the manual is the text the binary and the
repository carry, holds no state of this fleet, and whoever installs a node needs it before they
have a key. Signed in, the page has the navigation (Docs is its last link); signed out, a link to
sign in. The text is rendered here with markdown-it-py, without raw HTML or images; a link to
another topic (`nodes.md#nodes`) becomes its console page, an anchor stays, and any other link is
shown as text, so a page never points outside the console.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any, Final

from markdown_it import MarkdownIt
from markdown_it.renderer import RendererHTML
from markdown_it.token import Token
from markdown_it.utils import EnvType, OptionsDict
from quart import Blueprint, Response, render_template

from nexa import docs
from nexa.control.console.pages import Console, html_response

#: A link to a topic of the manual, with an optional anchor.
_TOPIC_LINK: Final = re.compile(r"(?P<topic>[a-z]+)\.md(?P<anchor>#[a-z0-9_-]*)?")


def register(bp: Blueprint, console: Console) -> None:
    async def page(template: str, title: str, **ctx: Any) -> Response:
        found = console.lookup()
        session = found[1] if found else None
        if session is None or session.key_id is None:
            html = await render_template(f"console/{template}", session=None, views=[], view="docs", title=title, **ctx)
            return html_response(html)
        return await console.page(session, "docs", template, title=title, **ctx)

    @bp.get("/console/docs")
    @console.handler
    async def topics() -> Any:
        listed = [(t, summary(t.name)) for t in docs.topics()]
        return await page("docs.html", "Docs", topics=listed)

    @bp.get("/console/docs/<name>")
    @console.handler
    async def topic(name: str) -> Any:
        found = docs.topic(name)  # NotFound: a 404 page naming the topics
        return await page("doc.html", found.title, topic=found, body=render(name))


@functools.cache
def render(name: str) -> str:
    """The topic `name` as HTML (the template marks it safe: markdown-it escapes all text, and raw
    HTML is off): headings carry ids (GitHub's slugs), links stay in the console."""
    html: str = _markdown().render(docs.topic(name).text, {"slugs": {}})
    return html


@functools.cache
def summary(name: str) -> str:
    """The topic's one-line summary as inline HTML (its `code` spans rendered)."""
    html: str = _markdown().renderInline(docs.topic(name).summary)
    return html


def slug(text: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _markdown() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False}).enable("table").disable("image")
    md.add_render_rule("heading_open", _heading_open)
    md.add_render_rule("link_open", _link_open)
    return md


def _heading_open(self: RendererHTML, tokens: Sequence[Token], idx: int, options: OptionsDict, env: EnvType) -> str:
    base = slug(tokens[idx + 1].content)
    seen: dict[str, int] = env["slugs"]
    count = seen.get(base, 0)
    seen[base] = count + 1
    tokens[idx].attrSet("id", base if count == 0 else f"{base}-{count}")
    return self.renderToken(tokens, idx, options, env)


def _link_open(self: RendererHTML, tokens: Sequence[Token], idx: int, options: OptionsDict, env: EnvType) -> str:
    token = tokens[idx]
    href = str(token.attrGet("href") or "")
    match = _TOPIC_LINK.fullmatch(href)
    if match and match["topic"] in docs.TOPICS:
        token.attrSet("href", f"/console/docs/{match['topic']}{match['anchor'] or ''}")
    elif not href.startswith("#"):
        del token.attrs["href"]  # not a page of the manual: shown as text
    return self.renderToken(tokens, idx, options, env)
