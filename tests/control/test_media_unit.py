"""The media routes' pure parts: reading and writing upload forms (`control/datapath/uploads.py`) and
checking media requests and their metered units (`control/datapath/media.py`). End to end through
the SDK, nodes and runtimes: tests/e2e/test_media.py."""

from __future__ import annotations

import io
import wave

import pytest

from nexa.contracts.gateway import Capability
from nexa.control.datapath import media, uploads
from nexa.control.datapath.calls import Upload
from nexa.errors import ContractError, FieldNotSupported

FORM = "multipart/form-data; boundary=b"


def wav(seconds: float, rate: int = 8000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\x00\x00" * int(seconds * rate))
    return out.getvalue()


def part(name: str, value: bytes, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return f"--b\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n"


def test_a_written_form_reads_back_with_its_fields_and_file() -> None:
    upload = Upload(field="file", filename='we"ird\r\n.wav', content_type="audio/wav", data=wav(0.5))
    body, content_type = uploads.write_form({"model": "whisper", "language": "sv"}, upload)
    fields, back = uploads.read_form(body, uploads.form_boundary(content_type), file_field="file")
    assert fields == {"model": "whisper", "language": "sv"}
    assert back.data == upload.data and back.content_type == "audio/wav"
    # Written as browsers write it (no header injection); the parser decodes the quote back.
    assert back.filename == 'we"ird%0D%0A.wav'


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (part("model", b"m") + part("file", b"RIFF", "a.wav"), "truncated"),
        (part("model", b"m") + b"--b--\r\n", "non-empty part named 'file'"),
        (part("file", b"RIFF", "a.wav") + part("file", b"RIFF", "b.wav") + b"--b--\r\n", "repeated"),
        (part("file", b"RIFF") + b"--b--\r\n", "give it a filename"),
        (part("file", b"RIFF", "a.wav") + part("model", b"\xff\xfe") + b"--b--\r\n", "UTF-8"),
        (part("file", b"RIFF", "a.wav") + part("prompt", b"x" * 20_000) + b"--b--\r\n", "at most"),
        (
            "".join(f'--b\r\nContent-Disposition: form-data; name="f{i}"\r\n\r\nx\r\n' for i in range(70)).encode(),
            "parts",
        ),
        (b"not a form at all", "truncated"),
    ],
)
def test_a_bad_form_is_a_contract_error_naming_what_is_wrong(body: bytes, problem: str) -> None:
    with pytest.raises(ContractError) as refused:
        uploads.read_form(body, b"b", file_field="file")
    assert problem in refused.value.message


@pytest.mark.parametrize(
    "content_type", [None, "application/json", "multipart/form-data", 'multipart/form-data; boundary="a\x01"']
)
def test_an_upload_must_be_a_form_with_a_boundary(content_type: str | None) -> None:
    with pytest.raises(ContractError, match="multipart/form-data"):
        uploads.form_boundary(content_type)


def test_a_transcription_is_metered_by_its_wav_length_or_by_the_runtime() -> None:
    body = part("model", b"whisper") + part("file", wav(1.5), "a.wav") + b"--b--\r\n"
    req = media.parse(Capability.TRANSCRIPTION, FORM, body)
    assert req.model == "whisper" and req.units == pytest.approx(1.5) and "model" not in req.body
    other = part("model", b"whisper") + part("file", b"ID3 not a wav", "a.mp3") + b"--b--\r\n"
    assert media.parse(Capability.TRANSLATION, FORM, other).units is None  # from the answer then
    assert media.answered_seconds({"text": "x", "duration": 3.25}) == 3.25
    assert media.answered_seconds({"text": "x", "usage": {"type": "duration", "seconds": 4}}) == 4.0
    for bad in ({"duration": float("nan")}, {"duration": -1}, {"duration": True}, {"duration": 1e12}, None):
        assert media.answered_seconds(bad) == 0.0
    streamed = part("model", b"whisper") + part("stream", b"true") + part("file", wav(0.1), "a.wav") + b"--b--\r\n"
    with pytest.raises(FieldNotSupported):
        media.parse(Capability.TRANSCRIPTION, FORM, streamed)
    odd = part("model", b"whisper") + part("response_format", b"xml") + part("file", wav(0.1), "a.wav") + b"--b--\r\n"
    with pytest.raises(ContractError, match="response_format"):
        media.parse(Capability.TRANSCRIPTION, FORM, odd)


def test_speech_and_images_are_checked_and_metered_in_characters_and_images() -> None:
    speech = media.parse(Capability.SPEECH, "application/json", b'{"model":"tts","input":"hello","voice":"alloy"}')
    assert speech.units == 5.0 and speech.body == {"input": "hello", "voice": "alloy"}
    images = media.parse(Capability.IMAGE, "application/json", b'{"model":"img","prompt":"a cat","n":3}')
    assert images.units == 3.0
    for body, field in (
        (b'{"model":"tts","input":"","voice":"alloy"}', "input"),
        (b'{"model":"tts","input":"hi"}', "voice"),
        (b'{"model":"tts","input":"hi","voice":"a","response_format":"ogg"}', "response_format"),
        (b'{"model":"tts","input":"hi","voice":"a","speed":9}', "speed"),
        (b'{"input":"hi","voice":"a"}', "model"),
    ):
        with pytest.raises(ContractError) as refused:
            media.parse(Capability.SPEECH, "application/json", body)
        assert field in refused.value.message
    with pytest.raises(FieldNotSupported):
        media.parse(
            Capability.SPEECH, "application/json", b'{"model":"t","input":"hi","voice":"a","stream_format":"sse"}'
        )
    for body in (b'{"model":"img","prompt":"x","n":11}', b'{"model":"img","prompt":""}', b"[1]", b"{"):
        with pytest.raises(ContractError):
            media.parse(Capability.IMAGE, "application/json", body)
