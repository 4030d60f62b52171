"""The manual that ships with nexa (`nexa/docs/*.md`, `nexa docs`) and the README, its front page.

Coverage: every command and subcommand of the parser, every config key (with its default, as the
schema has it), every route of the OpenAPI document, every metric the controller exports and every
shipped alert is named in the manual; a new one that is not fails here, naming where to add it.
The README starts with the two commands, links every topic, and points nowhere outside the
repository. `nexa docs` lists, prints, and refuses an unknown topic with exit 2.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nexa import config, docs
from nexa.cli.entry import parser
from nexa.control.console.docs import slug
from nexa.control.http import openapi
from nexa.errors import NotFound
from tests.support.metrics import exported_series

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "nexa" / "docs"
#: How the README has always started: `bash .ci/dev run` and `bash .ci/dev test`, unchanged.
README_HEAD = """# LunaNexa (`nexa`)

```sh
bash .ci/dev run     # set up, then run a local cluster (controller + 4 sim nodes, a model deployed, console)
bash .ci/dev test    # set up, then run every quality gate and the whole test suite (what CI runs)
```
"""
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s)`'\"<>]+", re.IGNORECASE)
_LOOPBACK = re.compile(r"^[a-z]+://(127\.[0-9.]+|localhost|\[::1\])(:[0-9*]+)?(/|$)", re.IGNORECASE)


def manual() -> str:
    return "\n".join(t.text for t in docs.topics())


# ---- coverage -----------------------------------------------------------------------------------


def _commands(p: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name)
                yield from _commands(sub, (*path, name))


def test_every_command_and_subcommand_is_in_the_manual() -> None:
    commands = [" ".join(("nexa", *c)) for c in _commands(parser())]
    assert len(commands) > 90 and "nexa node enroll" in commands and "nexa docs" in commands
    text = manual()
    missing = [c for c in commands if not re.search(rf"`{re.escape(c)}(`| )", text)]
    assert missing == [], f"add these to nexa/docs/commands.md (Every command): {missing}"


def _leaves(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def documented_keys(text: str, heading: str) -> dict[str, str]:
    """`section.key` → its default as written, from one part (`## heading`) of config.md's Every key."""
    part = text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    keys: dict[str, str] = {}
    section = ""
    for line in part.splitlines():
        if line.startswith("### "):
            found = re.fullmatch(r"### `\[([\w.]+)\]`", line)
            section = found.group(1) + "." if found else ""
        elif found_key := re.match(r"- `(\w+)` = (unset|`(.*?)`):", line):
            keys[section + found_key.group(1)] = found_key.group(3) if found_key.group(3) is not None else "unset"
    return keys


@pytest.mark.parametrize(
    ("heading", "cls"),
    [("Controller: `control.toml`", config.ControlConfig), ("Node: `node.toml`", config.NodeConfig)],
)
def test_every_config_key_is_in_the_manual_with_its_default(heading: str, cls: type[Any]) -> None:
    shown = documented_keys(docs.topic("config").text, heading)
    defaults = _leaves(config.unstructure_config(cls()))
    missing = sorted(set(defaults) - set(shown))
    assert missing == [], (
        f"add to nexa/docs/config.md under {heading}, in its section, a line such as "
        f"- `{missing[0].rpartition('.')[2]}` = `<default as TOML>`: <what it does> (unset when it has none)"
    )
    assert sorted(set(shown) - set(defaults)) == [], "config.md names keys the schema does not have"
    for key, default in defaults.items():
        if default is None:
            assert shown[key] == "unset", key
        else:
            assert tomllib.loads(f"v = {shown[key]}")["v"] == default, f"config.md: {key} = {shown[key]}"


def test_the_config_coverage_check_sees_a_missing_key_and_a_wrong_default() -> None:
    text = docs.topic("config").text
    assert '- `listen` = `"127.0.0.1:8470"`:' in text
    shown = documented_keys(
        text.replace('- `listen` = `"127.0.0.1:8470"`:', '- `listen` = `"0.0.0.0:1"`:'), "Controller: `control.toml`"
    )
    assert shown["http.listen"] == '"0.0.0.0:1"'
    dropped = documented_keys(text.replace("- `max_body_bytes`", "- max_body_bytes"), "Controller: `control.toml`")
    assert "http.max_body_bytes" not in dropped


def test_every_api_route_is_in_the_manual() -> None:
    routes = [
        f"{method.upper()} {path}"
        for path, operations in openapi.document()["paths"].items()
        for method in operations
        if method in {"get", "post", "put", "delete", "patch"}
    ]
    assert len(routes) > 80 and "GET /api/v1/openapi.json" in routes
    text = manual()
    missing = [r for r in routes if f"`{r}`" not in text]
    assert missing == [], f"add these to nexa/docs/api.md (Every route): {missing}"


def test_every_metric_is_in_the_manual() -> None:
    """By the name Prometheus scrapes: a counter as `x_total`; a histogram by its family name."""
    series = exported_series()
    histograms = {s.removesuffix("_bucket") for s in series if s.endswith("_bucket")}
    names = {
        s
        for s in series
        if not any(s == f"{h}{suffix}" for h in histograms for suffix in ("_bucket", "_sum", "_count"))
    }
    names |= histograms
    assert len(names) > 60 and "nexa_gateway_overhead_seconds" in names and "nexa_backup_failures_total" in names
    text = manual()
    missing = sorted(n for n in names if not re.search(rf"(?<!\w){re.escape(n)}(?!\w)", text))
    assert missing == [], f"add these to nexa/docs/metrics.md (Every metric): {missing}"


def test_every_shipped_alert_is_in_the_manual() -> None:
    alerts = re.findall(r"^\s*- alert: (\w+)", (ROOT / "units" / "nexa-alerts.yml").read_text(), re.MULTILINE)
    assert len(alerts) >= 14 and "NexaBackupStale" in alerts
    text = docs.topic("metrics").text
    assert [a for a in alerts if f"`{a}`" not in text] == [], "add them to nexa/docs/metrics.md (Every alert)"


# ---- the manual and the README --------------------------------------------------------------------


def test_every_topic_file_is_a_topic_with_a_title_and_a_summary() -> None:
    assert sorted(p.stem for p in DOCS.glob("*.md")) == sorted(docs.TOPICS)
    for t in docs.topics():
        assert t.text.startswith(f"# {t.title}\n\n"), t.name
        assert 20 < len(t.summary) < 200 and "\n" not in t.summary, t.name


def test_the_manual_links_only_to_its_own_topics_and_headings() -> None:
    for t in docs.topics():
        headings = {slug(h) for h in re.findall(r"^#{1,6} (.+)$", _prose(t.text), re.MULTILINE)}
        for target in _LINK.findall(t.text):
            page, _, anchor = target.partition("#")
            assert page == "" or page.removesuffix(".md") in docs.TOPICS, f"{t.name}: link to {target}"
            if anchor:
                other = docs.topic(page.removesuffix(".md")).text if page else t.text
                assert anchor in {slug(h) for h in re.findall(r"^#{1,6} (.+)$", _prose(other), re.MULTILINE)} | (
                    headings if not page else set()
                ), f"{t.name}: no heading for {target}"


def _prose(text: str) -> str:
    """The text outside fenced code blocks (whose `#` lines are shell comments, not headings)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def test_the_readme_starts_with_the_two_commands() -> None:
    assert README.read_text(encoding="utf-8").startswith(README_HEAD)


def test_the_readme_links_every_topic_and_nexa_docs() -> None:
    text = README.read_text(encoding="utf-8")
    for name in docs.TOPICS:
        assert f"](nexa/docs/{name}.md)" in text and f"`nexa docs {name}`" in text, name
    assert "`nexa docs`" in text and "from openai import OpenAI" in text


def test_no_readme_line_points_outside_the_repository() -> None:
    for number, line in enumerate(README.read_text(encoding="utf-8").splitlines(), 1):
        for target in _LINK.findall(line):
            assert "://" not in target and not target.startswith(("/", "..")), f"README.md:{number}: {target}"
            assert (ROOT / target.partition("#")[0]).exists(), f"README.md:{number}: {target} is not in the repository"
        for url in _URL.findall(line):
            assert _LOOPBACK.match(url), f"README.md:{number}: {url} is outside the repository"
        assert "../" not in line, f"README.md:{number}: a path outside the repository"


def test_an_unknown_topic_is_not_found_naming_the_topics() -> None:
    with pytest.raises(NotFound) as caught:
        docs.topic("../README")
    assert "commands" in caught.value.message and "nexa docs TOPIC" in caught.value.message


# ---- `nexa docs` ---------------------------------------------------------------------------------------


def _nexa(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nexa", *argv], capture_output=True, text=True, timeout=60, check=False
    )


def test_nexa_docs_lists_the_topics_one_line_each() -> None:
    proc = _nexa("docs")
    assert proc.returncode == 0, proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines() if line.startswith("  ")]
    assert [words[0] for words in lines] == list(docs.TOPICS)
    assert "nexa docs TOPIC" in proc.stdout


def test_nexa_docs_topic_prints_that_topic() -> None:
    proc = _nexa("docs", "config")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == docs.topic("config").text
    assert "- `max_body_bytes` = `1048576`:" in proc.stdout


def test_nexa_docs_with_an_unknown_topic_exits_2_with_the_list() -> None:
    proc = _nexa("docs", "nope")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "no topic 'nope'" in proc.stderr and "nexa docs TOPIC" in proc.stderr
    assert all(f"  {name} " in proc.stderr for name in docs.TOPICS)


def test_nexa_docs_help_names_the_topics() -> None:
    proc = _nexa("docs", "--help")
    assert proc.returncode == 0
    assert "TOPIC" in proc.stdout and "/console/docs" in proc.stdout and "operations" in proc.stdout
