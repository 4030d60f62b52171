"""The manual that ships with nexa: one markdown file per topic beside this module, read as package
data (`importlib.resources`), so the one-file binary carries it too.

`nexa docs [TOPIC]` prints it and the console serves it rendered (`control.console.docs`): GPU fleets
are often air-gapped, so nothing here links outside the manual. A topic file starts with its title
(`# Title`), then a one-line summary, then its text; `tests/test_docs.py` checks that every command,
config key, API route, metric and shipped alert is named in it.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Final

import attrs

from nexa.errors import NotFound

#: The topics in reading order (each is `<name>.md` here).
TOPICS: Final = (
    "commands",
    "install",
    "config",
    "files",
    "nodes",
    "runtimes",
    "models",
    "deployments",
    "inference",
    "api",
    "operations",
    "metrics",
    "console",
    "security",
    "evidence",
    "development",
)


@attrs.frozen
class Topic:
    name: str
    title: str
    #: One line: what the topic covers.
    summary: str
    text: str


@functools.cache
def topic(name: str) -> Topic:
    """The topic `name`; an unknown name is `NotFound`, its message listing the topics."""
    if name not in TOPICS:
        raise NotFound(f"no topic {name!r} in the manual; the topics are {', '.join(TOPICS)} (run: nexa docs TOPIC)")
    text = resources.files(__name__).joinpath(f"{name}.md").read_text(encoding="utf-8")
    head, _, rest = text.partition("\n\n")
    summary, _, _ = rest.partition("\n\n")
    return Topic(name=name, title=head.removeprefix("# ").strip(), summary=" ".join(summary.split()), text=text)


def topics() -> tuple[Topic, ...]:
    return tuple(topic(name) for name in TOPICS)
