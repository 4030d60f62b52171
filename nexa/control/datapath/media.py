"""The media routes of the OpenAI API: speech to text (`/v1/audio/transcriptions`, `/v1/audio/translations`),
text to speech (`/v1/audio/speech`) and image generation (`/v1/images/generations`).

Each becomes one `calls.Work` run through `Gateway.call` like a chat completion: the same key,
tenant, quota, admission, routing, failover, metering and receipts. An upload is a
`multipart/form-data` body read in memory up to `gateway.max_upload_bytes` (never written to disk),
checked (`uploads.read_form`) and sent to the node in the request's `infer` frame as a form again,
with the served model's name. Speech comes back as the runtime's audio bytes, passed on as each
chunk arrives (the node's relay sends them as it reads them), never parsed.

Metered in the units that fit (`MEDIA_UNITS`): seconds of audio (a WAV upload's own length, else
what the runtime reports: `duration` of `verbose_json`, or `usage.seconds`), characters of the
speech's input, images asked for. No payload is logged or kept.
"""

from __future__ import annotations

import io
import math
import wave
from typing import TYPE_CHECKING, Any, Final

import attrs

from nexa.contracts.gateway import Api, Capability, model_problem
from nexa.control.datapath import uploads
from nexa.errors import ContractError, FieldNotSupported

if TYPE_CHECKING:
    from nexa.control.datapath.calls import Upload
    from nexa.control.datapath.inference import InferenceApp, _Exchange

#: The media routes, by path.
CAPABILITY_BY_PATH: Final = {
    c.path: c for c in (Capability.TRANSCRIPTION, Capability.TRANSLATION, Capability.SPEECH, Capability.IMAGE)
}
#: The routes whose body is an upload (bounded by `gateway.max_upload_bytes`, not `http.max_body_bytes`).
UPLOAD_PATHS: Final = frozenset({Capability.TRANSCRIPTION.path, Capability.TRANSLATION.path})
#: `response_format` of a transcription or translation (OpenAI's API reference); the JSON ones first.
TEXT_FORMATS: Final = ("json", "verbose_json", "text", "srt", "vtt")
#: `response_format` of speech, and the media type its audio is answered with.
AUDIO_FORMATS: Final = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
#: Longest speech input (characters), as OpenAI's API reference bounds it.
MAX_SPEECH_CHARS: Final = 4096
#: Most images one request may ask for (OpenAI: 1 to 10).
MAX_IMAGES: Final = 10
#: The longest audio a request is metered for (a day): a WAV header claiming more is refused.
MAX_AUDIO_S: Final = 86_400.0
_TEXT_TYPES: Final = {"text": b"text/plain; charset=utf-8", "srt": b"text/plain; charset=utf-8", "vtt": b"text/vtt"}


@attrs.frozen(kw_only=True)
class MediaRequest:
    """A media request as checked: what the gateway runs, and what it is metered for up front."""

    capability: Capability
    model: str
    body: dict[str, Any]
    upload: Upload | None = None
    #: Its use in the capability's unit, when known from the request (None: from the answer).
    units: float | None = None


def upload_limit(path: str, max_upload_bytes: int, max_body_bytes: int) -> int:
    """The body size a request to `path` may have."""
    return max_upload_bytes if path in UPLOAD_PATHS else max_body_bytes


def parse(capability: Capability, content_type: str | None, body: bytes) -> MediaRequest:
    """The request of a media route, checked: a ContractError (or FieldNotSupported) names what is wrong."""
    if capability in (Capability.TRANSCRIPTION, Capability.TRANSLATION):
        return _transcription(capability, content_type, body)
    fields = _json(body)
    model = _model(fields.pop("model", None))
    if capability is Capability.SPEECH:
        return _speech(model, fields)
    return _image(model, fields)


def _transcription(capability: Capability, content_type: str | None, body: bytes) -> MediaRequest:
    fields, upload = uploads.read_form(body, uploads.form_boundary(content_type), file_field="file")
    model = _model(fields.pop("model", None))
    if fields.get("stream", "false").lower() not in ("false", "0"):
        raise FieldNotSupported("stream: transcriptions are answered whole here; leave stream out", field="stream")
    fields.pop("stream", None)
    fmt = fields.get("response_format", "json")
    if fmt not in TEXT_FORMATS:
        raise ContractError(f"response_format: one of {', '.join(TEXT_FORMATS)}", problems=("response_format",))
    return MediaRequest(capability=capability, model=model, body=fields, upload=upload, units=wav_seconds(upload.data))


def _speech(model: str, fields: dict[str, Any]) -> MediaRequest:
    text = fields.get("input")
    if not isinstance(text, str) or not 1 <= len(text) <= MAX_SPEECH_CHARS:
        raise ContractError(f"input: the text to speak, 1 to {MAX_SPEECH_CHARS} characters", problems=("input",))
    if not isinstance(fields.get("voice"), str | dict):
        raise ContractError("voice: the voice to speak with (a name)", problems=("voice",))
    fmt = fields.get("response_format", "mp3")
    if fmt not in AUDIO_FORMATS:
        raise ContractError(f"response_format: one of {', '.join(AUDIO_FORMATS)}", problems=("response_format",))
    if fields.get("stream_format", "audio") != "audio":
        raise FieldNotSupported("stream_format: only audio (the bytes, as they come)", field="stream_format")
    speed = fields.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, int | float) or not 0.25 <= speed <= 4.0:
        raise ContractError("speed: a number from 0.25 to 4.0", problems=("speed",))
    return MediaRequest(capability=Capability.SPEECH, model=model, body=fields, units=float(len(text)))


def _image(model: str, fields: dict[str, Any]) -> MediaRequest:
    prompt = fields.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ContractError("prompt: a description of the image", problems=("prompt",))
    n = fields.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_IMAGES:
        raise ContractError(f"n: an integer from 1 to {MAX_IMAGES}", problems=("n",))
    if fields.get("stream", False) is not False:
        raise FieldNotSupported("stream: images are answered whole here; leave stream out", field="stream")
    fields.pop("stream", None)
    return MediaRequest(capability=Capability.IMAGE, model=model, body=fields, units=float(n))


def wav_seconds(data: bytes) -> float | None:
    """The length of a WAV file in seconds (from its header and data size); None for another format."""
    try:
        with wave.open(io.BytesIO(data)) as wav:
            frames, rate = wav.getnframes(), wav.getframerate()
    except (wave.Error, EOFError, ValueError):
        return None
    seconds = frames / rate if rate > 0 else 0.0
    if not 0.0 <= seconds <= MAX_AUDIO_S:
        raise ContractError(f"file: a WAV file of at most {MAX_AUDIO_S:g} s", problems=("file",))
    return seconds


def answered_seconds(answer: dict[str, Any] | None) -> float:
    """Seconds of audio a transcription's answer reports (`duration` of verbose_json, or OpenAI's
    `usage: {type: duration, seconds}`); 0 when it reports none or nothing usable."""
    if not answer:
        return 0.0
    usage = answer.get("usage")
    for value in (answer.get("duration"), usage.get("seconds") if isinstance(usage, dict) else None):
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if number and math.isfinite(value) and 0 <= value <= MAX_AUDIO_S:  # type: ignore[arg-type,operator]
            return float(value)  # type: ignore[arg-type]
    return 0.0


async def serve(app: InferenceApp, x: _Exchange, capability: Capability) -> int:
    """Run a media request through the gateway and answer it (the status answered)."""
    req = parse(capability, x.header("content-type"), await x.body())
    work = attrs.evolve(
        app._work(x, Api.OPENAI, capability, req.model, req.body, stream=False, include_usage=False),
        upload=req.upload,
    )
    call = x.call = app._gateway.call(work)
    call.progress.units = req.units or 0.0
    async with call as answer:
        if capability is Capability.SPEECH:
            fmt = str(req.body.get("response_format", "mp3"))
            await x.start_stream(200, content_type=AUDIO_FORMATS[fmt].encode())
            async for chunk in answer:
                await x.chunk(chunk)
            if answer.error is not None:
                raise answer.error  # cut short: the response is left unfinished, so the client sees it broke
            await x.chunk(b"", more=False)
            return 200
        body = await answer.read_all()
        if answer.error is not None:
            raise answer.error
        if req.units is None:
            call.progress.units = answered_seconds(answer.answer)
        fmt = str(req.body.get("response_format", "json"))
        return await x.raw(200, body, _TEXT_TYPES.get(fmt, b"application/json"))


def _json(raw: bytes) -> dict[str, Any]:
    from nexa.control.datapath.inference import _json_object  # it imports this module

    return _json_object(raw)


def _model(model: object) -> str:
    problem = model_problem(model)
    if problem is not None or not isinstance(model, str):
        raise ContractError(problem or "model: required", problems=(problem or "model: required",))
    return model
