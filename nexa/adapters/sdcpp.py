"""stable-diffusion.cpp's `sd-server` (examples/server/; checked against leejet/stable-diffusion.cpp
at 97d2990807fe6d558e395f8764198d7c7e7b411c, 2026-08-19, the image `ghcr.io/leejet/stable-diffusion.cpp`
is built from): a media runtime, text to image.

Its image (docker/Dockerfile; docker/Dockerfile.cuda the same on nvidia/cuda's Ubuntu runtime) is Ubuntu
24.04 with libgomp1 added and the build's bin/ at `/sd.cpp/bin`, neither on PATH; `/sd-server` is a
`#!/bin/sh` wrapper that `exec`s `/sd.cpp/bin/sd-server "$@"`, and `ENTRYPOINT ["/sd-cli"]` is the
command-line tool's, so the server runs with `--entrypoint "/sd-server"` (docs/docker.md, "Run server"):
nexa gives that path as the program, which replaces the image's entrypoint. The image has no curl and
no Python, but Ubuntu's bash and coreutils: the probe is bash's `/dev/tcp` (`base.bash_probe`).

From its own source (main.cpp `parse_args`, examples/server/runtime.cpp `SDSvrParams::get_options`
lines 189-216, examples/common/common.cpp `SDContextParams::get_options` from line 333 and
`SDGenerationParams::get_options` from line 922): `--listen-ip` (`-l`, 127.0.0.1 by default),
`--listen-port` (1234), `-m/--model` (a full model: src/model_loader.cpp `init_from_file` reads a
directory as diffusers and a file by its content, GGUF magic, safetensors header or torch zip, so
the mounted `/models/model` needs no extension),
`-t/--threads` (-1: the physical cores; common.cpp 511-515, 720-721), `--vae` (a separate VAE file,
given here as a file of the model's manifest), `--offload-to-cpu`, `--mmap`,
`--fa`, `--diffusion-fa`, `--vae-tiling`, and the default generation settings a request starts from:
`-W/--width`, `-H/--height` (512 each unless set; a request's `size` replaces them), `--steps` (20),
`--cfg-scale` (7.0), `--sampling-method`, `--scheduler`, `-s/--seed` (42; below 0 random). Its parser
takes exact flag names only (common.cpp `parse_options`: no prefixes, no `--flag=value`).

main.cpp builds the model context (`new_sd_ctx`, exiting 1 when it fails) before `svr.listen`, so its
port opens only once the model is loaded: `GET /v1/models` (routes_openai.cpp, a fixed
`{"data": [{"id": "sd-cpp-local", …}]}`) answers 200 from the first connection, and is the readiness
path (`GET /`, the web UI, may be a whole embedded page). `POST /v1/images/generations`
(routes_openai.cpp `build_openai_generation_request` and its route, lines 257-329) reads a JSON body's
`prompt` (400 `{"error": "prompt required"}` without it), `n` (its images, at least 1), `size`
(`WxH`), `output_format` (`png` by default, `jpeg`, `webp`) and `output_compression`; it ignores
`model` and `response_format`, and answers `{"created", "data": [{"b64_json": …}], "output_format"}`
(base64 always: no URLs), 400 `{"error": …}` for a bad request, 500 when generation fails. Requests run
one at a time (one lock on the model's context). No metrics endpoint, no served-name flag; it also
serves `/v1/images/edits`, `/sdapi/v1/…` (AUTOMATIC1111's API) and `/sdcpp/v1/…`, which nexa does not
route.
"""

from __future__ import annotations

from typing import Final

from nexa.adapters.base import Adapter, Metrics, Option, Style
from nexa.contracts.capabilities import Capability
from nexa.contracts.node import RuntimeKind

#: The server's program in its published image (docs/docker.md: `--entrypoint "/sd-server"`).
SD_SERVER_PROGRAM: Final = "/sd-server"
_REACHES_OUT: Final = "the runtime reaches no other host"
_OUTSIDE_MODEL: Final = "a file outside the signed model; register it as part of the model's manifest"

SD_SERVER: Final = Adapter(
    kind=RuntimeKind.SDCPP,
    name="sd-server",
    program=(SD_SERVER_PROGRAM,),
    model_flag="--model",
    served_name_flag=None,
    host_flag="--listen-ip",
    port_flag="--listen-port",
    needs_gpu=False,
    options={
        "threads": Option(flag="--threads", type=int, minimum=1, help="CPU threads (the physical cores by default)"),
        "offload_to_cpu": Option(
            flag="--offload-to-cpu", type=bool, style=Style.SWITCH, help="weights in RAM, moved to VRAM when needed"
        ),
        "mmap": Option(flag="--mmap", type=bool, style=Style.SWITCH, help="memory-map the model"),
        "flash_attn": Option(flag="--fa", type=bool, style=Style.SWITCH, help="flash attention"),
        "diffusion_fa": Option(
            flag="--diffusion-fa", type=bool, style=Style.SWITCH, help="flash attention in the diffusion model only"
        ),
        "vae_tiling": Option(flag="--vae-tiling", type=bool, style=Style.SWITCH, help="decode in tiles (less memory)"),
        "vae": Option(
            flag="--vae", type=str, style=Style.MODEL_FILE, help="a VAE file of the model's directory (model file)"
        ),
        "width": Option(flag="--width", type=int, minimum=64, maximum=8192, help="default image width (512)"),
        "height": Option(flag="--height", type=int, minimum=64, maximum=8192, help="default image height (512)"),
        "steps": Option(flag="--steps", type=int, minimum=1, maximum=1000, help="sampling steps (20)"),
        "cfg_scale": Option(flag="--cfg-scale", type=float, minimum=0.0, maximum=100.0, help="guidance scale (7.0)"),
        "sampling_method": Option(
            flag="--sampling-method", type=str, help="sampler (euler_a by default; euler for Flux/SD3)"
        ),
        "scheduler": Option(flag="--scheduler", type=str, help="sigma scheduler (model-specific by default)"),
        "seed": Option(flag="--seed", type=int, help="seed (42; below 0: random)"),
    },
    refused_flags={
        "-m": "nexa gives the mounted model's path",
        "-l": "nexa binds the runtime to the node's runtime address",
        "-t": "a typed setting: give settings.threads instead",
        "-W": "a typed setting: give settings.width instead",
        "-H": "a typed setting: give settings.height instead",
        "-s": "a typed setting: give settings.seed instead",
        "--serve-html-path": "the runtime serves no files",
        "--rpc-servers": _REACHES_OUT,
        "--diffusion-model": "nexa gives the mounted model's path",
        "--lora-model-dir": _OUTSIDE_MODEL,
        "--embd-dir": _OUTSIDE_MODEL,
        "--hires-upscalers-dir": _OUTSIDE_MODEL,
        "--upscale-model": _OUTSIDE_MODEL,
        "--photo-maker": _OUTSIDE_MODEL,
        "--control-net": _OUTSIDE_MODEL,
    },
    readiness_path="/v1/models",
    probe_tool="bash",
    # No metrics endpoint: routing counts the gateway's own requests in flight.
    metrics=Metrics(path=None),
    capabilities=frozenset({Capability.IMAGE}),
    stream_usage=False,
)
