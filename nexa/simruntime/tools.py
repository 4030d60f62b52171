"""Tool calls in the sim runtime, as OpenAI-compatible servers make them (vLLM with
`--enable-auto-tool-choice`): a chat request that offers `tools` (and does not say `tool_choice:
"none"`) is answered with one call of the tool `tool_choice` names, else of the first, unless its
last message is a tool result, which is answered with text. The arguments are made from the tool's
JSON Schema: each property gets a fixed value of its type, so tests know what to expect."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from nexa.simruntime.asgi import BadRequest

#: The value each JSON Schema type gets in a sim tool call's arguments.
VALUES: Final[dict[str, Any]] = {"string": "sim", "integer": 1, "number": 1.5, "boolean": True, "array": []}


def tool_call(payload: Mapping[str, Any]) -> tuple[str, str] | None:
    """The (name, arguments as JSON text) of the tool call that answers a chat request, or None."""
    tools = payload.get("tools")
    choice = payload.get("tool_choice", "auto")
    messages = payload.get("messages") or []
    if not tools or choice == "none":
        return None
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools
    ):
        raise BadRequest("tools must be a list of function tools", param="tools")
    if isinstance(messages[-1], dict) and messages[-1].get("role") == "tool":
        return None
    functions = {t["function"].get("name"): t["function"] for t in tools}
    name = next(iter(functions))
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in functions:
            raise BadRequest("tool_choice names a tool that is not offered", param="tool_choice")
    if not isinstance(name, str):
        raise BadRequest("a tool's function has no name", param="tools")
    schema = functions[name].get("parameters") or {}
    properties = schema.get("properties") if isinstance(schema, dict) else None
    args = {
        key: VALUES.get(str(prop.get("type")) if isinstance(prop, dict) else "")
        for key, prop in (properties or {}).items()
    }
    return name, json.dumps(args)


def message(call: tuple[str, str], serial: int) -> dict[str, Any]:
    """The assistant message of a unary answer that calls the tool."""
    return {"role": "assistant", "content": None, "tool_calls": [_call(call, serial, call[1])]}


def deltas(call: tuple[str, str], serial: int) -> list[dict[str, Any]]:
    """The stream's deltas of the call: its id and name with no arguments, then the arguments in two pieces."""
    half = len(call[1]) // 2
    first = _call(call, serial, "") | {"index": 0}
    pieces = [{"index": 0, "function": {"arguments": part}} for part in (call[1][:half], call[1][half:])]
    return [{"tool_calls": [first]}, *({"tool_calls": [p]} for p in pieces)]


def _call(call: tuple[str, str], serial: int, arguments: str) -> dict[str, Any]:
    return {"id": f"call_sim{serial}", "type": "function", "function": {"name": call[0], "arguments": arguments}}
