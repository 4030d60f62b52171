"""`nexa docs [TOPIC]`: the manual that ships with nexa (`nexa.docs`), printed as markdown, offline."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Final

from nexa import docs
from nexa.errors import NotFound

EXIT_OK: Final = 0
EXIT_USAGE: Final = 2


def add_commands(sub: Any) -> None:
    s = sub.add_parser(
        "docs",
        help="the manual: list its topics, or print one (the console serves it too, under Docs)",
        description="Print the nexa manual, which ships with nexa: without TOPIC, one line per topic; with"
        " one, that topic as markdown. The console serves the same pages at /console/docs.",
    )
    s.add_argument("topic", nargs="?", metavar="TOPIC", help=f"one of: {', '.join(docs.TOPICS)}")
    s.set_defaults(handler=_docs)


def listing() -> str:
    """One line per topic: its name, as `nexa docs TOPIC` takes it, and what it covers."""
    width = max(len(name) for name in docs.TOPICS)
    return "".join(f"  {t.name:<{width}}  {t.summary}\n" for t in docs.topics())


def _docs(args: argparse.Namespace) -> int:
    if args.topic is None:
        print("The nexa manual. Print a topic with: nexa docs TOPIC\n")
        print(listing(), end="")
        return EXIT_OK
    try:
        found = docs.topic(args.topic)
    except NotFound:
        print(f"nexa: no topic {args.topic!r} in the manual; type one of these: nexa docs TOPIC\n", file=sys.stderr)
        print(listing(), end="", file=sys.stderr)
        return EXIT_USAGE
    print(found.text, end="")
    return EXIT_OK
