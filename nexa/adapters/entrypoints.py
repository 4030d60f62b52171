"""Which container entrypoint makes an adapter's command exactly the process a replica runs,
whatever the image's own entrypoint (read from its config at registration). Pure: no I/O.

The vLLM image has `ENTRYPOINT ["vllm", "serve"]`, llama.cpp's server image
`ENTRYPOINT ["/app/llama-server"]`, NVIDIA's NGC images `/opt/nvidia/nvidia_entrypoint.sh`: a
command given as the container's command alone would run after them (`vllm serve vllm serve …`).
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from typing import Final

import attrs

from nexa.contracts.models import ImageConfig

#: Image entrypoints that only prepare the environment and `exec` their arguments: they stay in
#: front of the adapter's command (every other entrypoint is replaced by the adapter's program).
#: NVIDIA's NGC images (vLLM, SGLang, TensorRT-LLM, PyTorch) have `/opt/nvidia/nvidia_entrypoint.sh`;
#: tini and dumb-init are init processes that run their arguments as their child.
EXEC_WRAPPERS: Final = frozenset(
    {
        ("/opt/nvidia/nvidia_entrypoint.sh",),
        ("/usr/bin/tini", "--"),
        ("/tini", "--"),
        ("tini", "--"),
        ("/usr/bin/dumb-init", "--"),
        ("dumb-init", "--"),
    }
)


@attrs.frozen(kw_only=True)
class Entrypoint:
    """How a command is given to a container: its entrypoint and its command (`entrypoint + command`
    is the process), and why."""

    entrypoint: list[str]
    command: list[str]
    #: `wrapper` (the image's exec wrapper stays in front), `program` (the command's program as the
    #: image names it in its entrypoint), `set` (the command's program, set over the image's
    #: entrypoint, or where it has none), `unknown` (no image config was read at registration).
    how: str


def entrypoint_for(command: Sequence[str], config: ImageConfig | None) -> Entrypoint:
    """The container entrypoint that makes `command` (a program and its arguments) exactly the
    process, whatever `config` (the image's config for the node's platform; None: unknown) says.

    An entrypoint in `EXEC_WRAPPERS` stays, with the whole command after it. Otherwise the
    command's program is the entrypoint and the rest its command: a bare program name that the
    image's entrypoint names by path (llama.cpp's `/app/llama-server`, which is not on PATH) takes
    that path; any other bare name is looked up on the image's PATH by the container engine.
    """
    if not command:
        return Entrypoint(entrypoint=[], command=[], how="set")
    image_entry = tuple(config.entrypoint) if config is not None else ()
    if image_entry in EXEC_WRAPPERS:
        return Entrypoint(entrypoint=list(image_entry), command=list(command), how="wrapper")
    program, how = command[0], "set" if config is not None else "unknown"
    if "/" not in program and image_entry and posixpath.basename(image_entry[0]) == program:
        program, how = image_entry[0], "program"
    return Entrypoint(entrypoint=[program], command=list(command[1:]), how=how)


def program_of(entrypoint: Sequence[str], command: Sequence[str]) -> str:
    """The program a container runs with `entrypoint` and `command`: the first word, or the word after
    an image's exec wrapper (NVIDIA's); "" for none (the image's own entrypoint runs then)."""
    if command and tuple(entrypoint) in EXEC_WRAPPERS:
        return command[0]
    process = [*entrypoint, *command]
    return process[0] if process else ""
