"""whisper.cpp's `whisper-server` (examples/server/server.cpp; checked against v1.8.5, the whisper.cpp the
pywhispercpp 1.5.1 sdist vendors, which tests/e2e/test_whisper_server.py builds and runs): a media
runtime, speech to text.

From its own source (its argument loop and `whisper_params`/`server_params` defaults):
`-m/--model FNAME` (a ggml `.bin` model file), `--host` (127.0.0.1 by default), `--port` (8080),
`--inference-path PATH` (the one path it transcribes at, `/inference` by default; nexa sets
`/v1/audio/transcriptions`, so the gateway's form goes to it unchanged), `-t/--threads` (min(4, cores)),
`-p/--processors`, `-l/--language` (`en` by default, `auto` detects it), `-tr/--translate`,
`-ng/--no-gpu`, `-fa/--flash-attn` and `-nfa/--no-flash-attn` (flash attention is on by default),
`--convert` (any audio format, through the ffmpeg program in the image). `POST <inference path>`
takes a multipart form (each field read as a form part): `file` (400 without it; 16 kHz WAV unless
`--convert`), `response_format` (`json` → `{"text"}`, `verbose_json` with `duration` in seconds and
`segments`, `text` (sent as `text/html`), `srt`, `vtt`), `language`, `temperature`, `prompt`,
`translate` — what OpenAI's transcription form sends; it ignores `model`. It loads the model before it
binds its port, so `GET /health` answers 200 `{"status":"ok"}` from its first connection (503
`loading model` only while `POST /load` swaps the model in: a path nexa never relays). It has no
metrics endpoint, no served-name flag and no other OpenAI path: translations (`-tr`, or the form's
`translate`) come through the same path, so only transcriptions are routed here.
"""

from __future__ import annotations

from typing import Final

from nexa.adapters.base import Adapter, Metrics, Option, Style
from nexa.contracts.capabilities import Capability
from nexa.contracts.node import RuntimeKind

#: The path nexa has whisper-server transcribe at: OpenAI's, which the node's relay calls.
INFERENCE_PATH: Final = "/v1/audio/transcriptions"

WHISPER_SERVER: Final = Adapter(
    kind=RuntimeKind.WHISPERCPP,
    name="whisper-server",
    program=("whisper-server",),
    model_flag="--model",
    served_name_flag=None,
    host_flag="--host",
    port_flag="--port",
    fixed=("--inference-path", INFERENCE_PATH),
    needs_gpu=False,
    options={
        "threads": Option(flag="--threads", type=int, minimum=1, help="CPU threads per request"),
        "processors": Option(flag="--processors", type=int, minimum=1, help="processors per request"),
        "language": Option(flag="--language", type=str, help="spoken language (en by default; auto: detect it)"),
        "convert": Option(flag="--convert", type=bool, style=Style.SWITCH, help="any audio, via ffmpeg in the image"),
        "no_gpu": Option(flag="--no-gpu", type=bool, style=Style.SWITCH, help="do not use a GPU"),
        "flash_attn": Option(
            flag="--flash-attn", type=bool, style=Style.SWITCH, help="flash attention (on by default)"
        ),
        "no_flash_attn": Option(flag="--no-flash-attn", type=bool, style=Style.SWITCH, help="no flash attention"),
    },
    refused_flags={
        "--inference-path": "nexa serves transcriptions at OpenAI's path",
        "--request-path": "nexa serves transcriptions at OpenAI's path",
        "--public": "the runtime serves no files",
        "-m": "nexa gives the mounted model's path",
        "--translate": "translate per request (the form's `translate`), not for every request",
        "-tr": "translate per request (the form's `translate`), not for every request",
    },
    readiness_path="/health",
    probe_tool="curl",
    # No metrics endpoint: routing counts the gateway's own requests in flight.
    metrics=Metrics(path=None),
    capabilities=frozenset({Capability.TRANSCRIPTION}),
    stream_usage=False,
)
