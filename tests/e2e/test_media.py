"""Speech and images end to end: the official `openai` SDK against a controller, real `nexa node`
agents and their `sim` runtimes, which serve `/v1/audio/transcriptions`, `/v1/audio/translations`,
`/v1/audio/speech` and `/v1/images/generations` as OpenAI's API reference defines them
(`nexa/simruntime/media.py`). Uploads cross the node channel as forms, speech comes back as audio
bytes through it, and each call is metered in its own unit (`control/datapath/media.py`)."""

from __future__ import annotations

import base64
import io
import wave
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from tests.realparts import BuiltImages, S3Store
from tests.support.api import in_thread
from tests.support.cluster import SimCluster, gateway_cluster, sdk, usage_rows

pytestmark = pytest.mark.slow

Json = dict[str, Any]
#: `gateway.max_upload_bytes` of these tests' controller (the default is 15 MiB).
UPLOAD_LIMIT = 1 << 20


@pytest.fixture
async def cluster(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> AsyncIterator[SimCluster]:
    """The e2e `cluster` (two sim replicas of `chat`), its uploads bounded by UPLOAD_LIMIT."""
    async with gateway_cluster(nursery, tmp_path, s3_store, test_images, max_upload_bytes=UPLOAD_LIMIT) as c:
        await c.deploy("chat-a", replicas=2)
        yield c


def a_wav(seconds: float, rate: int = 16_000) -> bytes:
    """A silent mono 16-bit WAV of `seconds` (what a client uploads: its length is metered)."""
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(b"\x00\x00" * int(seconds * rate))
    return out.getvalue()


async def test_transcription_translation_speech_and_images_through_the_sdk_are_metered_in_their_units(
    cluster: SimCluster, tmp_path: Path
) -> None:
    client = sdk(cluster)
    audio = a_wav(2.5)
    spoken = tmp_path / "speech.wav"

    def scenario() -> None:
        heard = client.audio.transcriptions.create(model="chat", file=("hello.wav", audio, "audio/wav"))
        assert heard.text == f"sim transcribe of {len(audio)} bytes"
        plain = client.audio.transcriptions.create(
            model="chat", file=("hello.wav", audio, "audio/wav"), response_format="text"
        )
        assert plain == f"sim transcribe of {len(audio)} bytes"
        # OpenAI's SDK marks the endpoint deprecated (whisper-1 only there); vLLM serves it.
        with pytest.warns(DeprecationWarning, match="deprecated"):
            english = client.audio.translations.create(model="chat", file=("hej.wav", audio, "audio/wav"))
        assert english.text == f"sim translate of {len(audio)} bytes"

        text = "hello from nexa"
        with client.audio.speech.with_streaming_response.create(
            model="chat", voice="alloy", input=text, response_format="wav"
        ) as response:
            assert response.headers["content-type"] == "audio/wav"
            response.stream_to_file(spoken)
        with wave.open(str(spoken)) as wav:
            assert wav.getframerate() == 16_000
            assert wav.getnframes() == int(len(text) * 0.05 * 16_000)  # the sim's 50 ms a character

        images = client.images.generate(model="chat", prompt="a red square", n=2)
        assert len(images.data) == 2
        png = base64.b64decode(images.data[0].b64_json or "")
        assert png.startswith(b"\x89PNG\r\n\x1a\n")

    await in_thread(scenario)
    [row] = await usage_rows(cluster, tenant="acme")
    assert row["requests"] == 5 and row["errors"] == 0
    assert row["audio_seconds"] == pytest.approx(3 * 2.5)
    assert row["speech_characters"] == len("hello from nexa")
    assert row["images"] == 2
    assert row["prompt_tokens"] == 0 and row["completion_tokens"] == 0


async def test_bad_uploads_are_typed_4xx_nothing_runs_and_the_controller_serves_on(cluster: SimCluster) -> None:
    client = sdk(cluster)
    url = cluster.base_url + "/audio/transcriptions"
    auth = {"Authorization": f"Bearer {cluster.inference_key}"}
    form = b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nchat\r\n'
    form += b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n' + a_wav(0.1)
    whole = form + b"\r\n--b--\r\n"

    # Over gateway.max_upload_bytes (sync: answered before it is all read).
    too_big = {"file": ("a.wav", b"\x00" * (2 * UPLOAD_LIMIT))}
    big = await in_thread(lambda: httpx.post(url, headers=auth, files=too_big, data={"model": "chat"}, timeout=30))
    assert big.status_code == 413 and big.json()["error"]["code"] == "payload_too_large"
    async with httpx.AsyncClient(timeout=30) as http:
        # Not a form.
        wrong = await http.post(url, headers=auth | {"content-type": "application/json"}, content=b'{"model":"chat"}')
        assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "invalid_request"
        assert "multipart/form-data" in wrong.json()["error"]["message"]
        # A form cut off before its closing boundary.
        cut = await http.post(url, headers=auth | {"content-type": "multipart/form-data; boundary=b"}, content=form)
        assert cut.status_code == 400 and "truncated" in cut.json()["error"]["message"]
        # No file part.
        nofile = await http.post(url, headers=auth, data={"model": "chat"}, files={"other": ("x", b"1")})
        assert nofile.status_code == 400 and "'file'" in nofile.json()["error"]["message"]
        # The whole form is served.
        served = await http.post(url, headers=auth | {"content-type": "multipart/form-data; boundary=b"}, content=whole)
        assert served.status_code == 200, served.text

    def scenario() -> None:
        with pytest.raises(openai.BadRequestError) as refused:
            client.audio.speech.create(model="chat", voice="alloy", input="")
        assert refused.value.status_code == 400
        with pytest.raises(openai.BadRequestError):
            client.images.generate(model="chat", prompt="x", n=11)
        with pytest.raises(openai.NotFoundError):
            client.audio.transcriptions.create(model="nope", file=("a.wav", a_wav(0.1), "audio/wav"))

    await in_thread(scenario)
    # Only what reached the gateway's pipeline is metered: the served form and the unknown model.
    rows = await usage_rows(cluster, tenant="acme")
    assert sum(r["requests"] for r in rows) == 2
    assert sum(r["errors"] for r in rows) == 1
    # Audio seconds only for the served form: the unknown model's upload ran on no runtime.
    assert sum(r["audio_seconds"] for r in rows) == pytest.approx(0.1)


async def test_media_quotas_count_in_their_units_and_refuse_in_openai_shape(cluster: SimCluster) -> None:
    async with cluster.client() as http:
        limits = {"audio_seconds_per_day": 4, "images_per_day": 2, "speech_characters_per_day": 100}
        assert (await http.put("/api/v1/quotas/acme", json=limits)).status_code == 200
    client = sdk(cluster)
    audio = a_wav(2.5)

    def scenario() -> None:
        client.images.generate(model="chat", prompt="one", n=2)
        with pytest.raises(openai.RateLimitError) as refused:
            client.images.generate(model="chat", prompt="two")
        assert refused.value.code == "quota_exceeded" and "images per day" in refused.value.message
        # Admitted while the day's use is below the limit (2.5 s, then 5 s): then refused.
        for _ in range(2):
            client.audio.transcriptions.create(model="chat", file=("a.wav", audio, "audio/wav"))
        with pytest.raises(openai.RateLimitError):
            client.audio.transcriptions.create(model="chat", file=("a.wav", audio, "audio/wav"))
        # Speech is not refused by the other units' limits.
        client.audio.speech.create(model="chat", voice="alloy", input="ok", response_format="pcm").read()

    await in_thread(scenario)
    async with cluster.client() as http:
        use = (await http.get("/api/v1/quotas/acme")).json()["use"]
    assert use["images_today"] == 2 and use["audio_seconds_today"] == pytest.approx(5.0)
    assert use["speech_characters_today"] == 2


async def test_a_media_failure_before_the_first_byte_is_retried_on_the_other_replica(cluster: SimCluster) -> None:
    failing, healthy = cluster.nodes
    failing.set_faults(fail="before", status=500)
    client = sdk(cluster)
    audio = a_wav(0.5)

    def scenario() -> None:
        for _ in range(4):  # no prompt prefix: the router spreads them over both replicas
            assert client.audio.transcriptions.create(model="chat", file=("a.wav", audio, "audio/wav")).text
            speech = client.audio.speech.create(model="chat", voice="alloy", input="hi", response_format="pcm")
            assert len(speech.read()) == int(2 * 0.05 * 16_000) * 2
            assert client.images.generate(model="chat", prompt="x").data

    await in_thread(scenario)
    assert any(e["event"] == "failed" for e in failing.journal())
    assert not any(e["event"] == "failed" for e in healthy.journal())
    rows = await usage_rows(cluster, tenant="acme")
    assert sum(r["errors"] for r in rows) == 0 and sum(r["requests"] for r in rows) == 12
