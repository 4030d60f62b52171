"""whisper.cpp's `whisper-server` (examples/server/server.cpp, v1.9): a media runtime, speech to text.

From its own source and `--help`: `-m/--model FNAME` (a ggml `.bin` model file), `--host`,
`--port`, `--inference-path PATH` (the one path it transcribes at, `/inference` by default; nexa
sets `/v1/audio/transcriptions`, so the gateway's form goes to it unchanged), `-t/--threads`,
`-l/--language`, `-tr/--translate`, `-ng/--no-gpu`, `--convert` (any audio format, through
ffmpeg in the image). `POST <inference path>` takes a multipart form: `file` (16 kHz WAV unless
`--convert`), `response_format` (`json` → `{"text"}`, `verbose_json` with `duration`, `text`,
`srt`, `vtt`), `language`, `temperature`, `prompt`, `translate` — what OpenAI's transcription form
sends; it ignores `model`. `GET /health` answers 200 `{"status":"ok"}` once the model is loaded (503
before). It has no metrics endpoint, no served-name flag and no other OpenAI path: translations
(`-tr`, or the form's `translate`) come through the same path, so only transcriptions are routed here.
"""

from __future__ import annotations

from typing import Final

from nexa.adapters.base import Adapter, Metrics, Option, Style
from nexa.contracts.gateway import Capability
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
        "language": Option(flag="--language", type=str, help="spoken language (auto: detect it)"),
        "convert": Option(flag="--convert", type=bool, style=Style.SWITCH, help="any audio, via ffmpeg in the image"),
        "no_gpu": Option(flag="--no-gpu", type=bool, style=Style.SWITCH, help="do not use a GPU"),
        "flash_attn": Option(flag="--flash-attn", type=bool, style=Style.SWITCH, help="flash attention"),
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
