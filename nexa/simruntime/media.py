"""Media endpoints as OpenAI's API reference (and vLLM's, which follows it) defines them, simulated:
`/v1/audio/transcriptions` and `/v1/audio/translations` (a multipart form with the audio `file`),
`/v1/audio/speech` (audio bytes, streamed in pieces), `/v1/images/generations` (JSON with `data`).

Every answer is computed from the request: a transcript names the upload's size and (for a WAV)
its length; speech is a WAV (or raw 16-bit PCM) tone as long as the input has characters (50 ms
each); an image is a 1x1 PNG. Only `wav` and `pcm` speech formats are made (no audio encoder here).
"""

from __future__ import annotations

import base64
import io
import json
import math
import struct
import time
import wave
import zlib
from typing import Any, Final

from werkzeug.http import parse_options_header
from werkzeug.sansio.multipart import NEED_DATA, Data, Epilogue, Field, File, MultipartDecoder

from nexa.simruntime.asgi import BadRequest

TRANSCRIPTIONS: Final = "/v1/audio/transcriptions"
TRANSLATIONS: Final = "/v1/audio/translations"
SPEECH: Final = "/v1/audio/speech"
IMAGES: Final = "/v1/images/generations"
PATHS: Final = frozenset({TRANSCRIPTIONS, TRANSLATIONS, SPEECH, IMAGES})
#: Speech: samples per second, and seconds of audio per input character.
RATE: Final = 16_000
SECONDS_PER_CHAR: Final = 0.05
#: Speech is sent in pieces of this many bytes (so a client sees it streamed).
PIECE_BYTES: Final = 8192
_SPEECH_TYPES: Final = {"wav": b"audio/wav", "pcm": b"audio/pcm"}


def transcript(path: str, content_type: str, body: bytes) -> tuple[bytes, bytes]:
    """A transcription or translation of a form's `file`: (content type, body)."""
    fields, audio = _form(content_type, body)
    if not fields.get("model"):
        raise BadRequest("model is required", param="model")
    seconds = _wav_seconds(audio)
    task = "translate" if path == TRANSLATIONS else "transcribe"
    text = f"sim {task} of {len(audio)} bytes"
    fmt = fields.get("response_format", "json")
    if fmt in ("text", "srt", "vtt"):
        if fmt == "vtt":
            return b"text/vtt", f"WEBVTT\n\n00:00:00.000 --> 00:00:01.000\n{text}\n".encode()
        return b"text/plain; charset=utf-8", text.encode()
    if fmt == "verbose_json":
        answer: dict[str, Any] = {"task": task, "language": fields.get("language", "english"), "text": text}
        answer |= {"duration": seconds, "segments": []}
    elif fmt == "json":
        answer = {"text": text, "usage": {"type": "duration", "seconds": math.ceil(seconds)}}
    else:
        raise BadRequest("response_format: json, verbose_json, text, srt or vtt", param="response_format")
    return b"application/json", json.dumps(answer).encode()


def speech(body: bytes) -> tuple[bytes, list[bytes]]:
    """Speech for a JSON request: (content type, the audio in pieces)."""
    req = _json(body)
    text = req.get("input")
    if not isinstance(text, str) or not text:
        raise BadRequest("input: the text to speak", param="input")
    if not isinstance(req.get("voice"), str | dict):
        raise BadRequest("voice is required", param="voice")
    fmt = req.get("response_format", "mp3")
    if fmt not in _SPEECH_TYPES:
        raise BadRequest("response_format: the simulator makes wav and pcm only", param="response_format")
    frames = int(len(text) * SECONDS_PER_CHAR * RATE)
    pcm = b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * 440 * i / RATE))) for i in range(frames))
    data = pcm if fmt == "pcm" else _wav(pcm)
    return _SPEECH_TYPES[fmt], [data[i : i + PIECE_BYTES] for i in range(0, len(data), PIECE_BYTES)]


def images(body: bytes) -> bytes:
    """Images for a JSON request: OpenAI's answer with `n` 1x1 PNGs."""
    req = _json(body)
    if not isinstance(req.get("prompt"), str) or not req["prompt"]:
        raise BadRequest("prompt is required", param="prompt")
    n = req.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 10:
        raise BadRequest("n: 1 to 10", param="n")
    png = base64.b64encode(_png()).decode()
    item = {"url": "data:image/png;base64," + png} if req.get("response_format") == "url" else {"b64_json": png}
    return json.dumps({"created": int(time.time()), "data": [item] * n}).encode()


def _form(content_type: str, body: bytes) -> tuple[dict[str, str], bytes]:
    mime, options = parse_options_header(content_type)
    if mime != "multipart/form-data" or not options.get("boundary"):
        raise BadRequest("send multipart/form-data", param="file")
    decoder = MultipartDecoder(options["boundary"].encode())
    decoder.receive_data(body)
    decoder.receive_data(None)
    fields: dict[str, str] = {}
    audio: bytes | None = None
    name, part, is_file = "", bytearray(), False
    while True:
        try:
            event = decoder.next_event()
        except ValueError:
            raise BadRequest("a malformed form", param="file") from None
        if event is NEED_DATA or isinstance(event, Epilogue):
            break
        if isinstance(event, File | Field):
            name, part, is_file = event.name, bytearray(), isinstance(event, File)
        elif isinstance(event, Data):
            part += event.data
            if not event.more_data:
                if is_file and name == "file":
                    audio = bytes(part)
                else:
                    fields[name] = part.decode("utf-8", "replace")
    if not audio:
        raise BadRequest("file is required", param="file")
    return fields, audio


def _wav_seconds(audio: bytes) -> float:
    try:
        with wave.open(io.BytesIO(audio)) as wav:
            return round(float(wav.getnframes()) / float(wav.getframerate()), 3)
    except (wave.Error, EOFError, ValueError, ZeroDivisionError):
        return 0.0


def _wav(pcm: bytes) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(RATE)
        wav.writeframes(pcm)
    return out.getvalue()


def _png() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)  # 1x1, 8-bit RGB
    pixels = zlib.compress(b"\x00\x40\x80\xc0")  # filter byte, then one RGB pixel
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def _json(body: bytes) -> dict[str, Any]:
    try:
        req = json.loads(body)
    except ValueError:
        raise BadRequest("the body is not JSON") from None
    if not isinstance(req, dict):
        raise BadRequest("the body must be a JSON object")
    return req
