"""Text a person reads: what a client, a node or a runtime chose, shown so that it cannot act on the
terminal or the page showing it. Pure: no I/O."""

from __future__ import annotations

import re
from typing import Final

#: What must never reach a terminal or a page raw: C0 controls but newline and tab (ESC starts the
#: sequences that move the cursor, recolour or retitle a terminal), DEL, C1 controls, and the
#: invisible and bidirectional formatting characters that make text read other than it is.
_UNSAFE: Final = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]")


def visible_text(text: str) -> str:
    """`text` with every character `_UNSAFE` names shown as its escape (`\\x1b`, `\\u202e`)."""
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)
