"""whisper.cpp's own C++ `whisper-server`, a real media runtime, end to end through real podman on CPU
(issue 35, its last point).

The image (`whisper_server_image`) is built here: the server compiled from the whisper.cpp source that
the pywhispercpp sdist vendors (cached in `cache_dir()`), laid out as whisper.cpp's published image
(`/app/build/bin` on PATH, `ENTRYPOINT ["bash", "-c"]`). It is registered as a `whispercpp` runtime by
digest; the model is a tiny random-weight Whisper model made here in whisper.cpp's ggml format
(`tiny_whisper`), uploaded to the run's S3 store and governed like any other (licence, verification,
evaluation, approval, alias). It is deployed on an enrolled `nexa node` agent; the official `openai`
SDK sends whisper.cpp's own sample speech (`samples/jfk.wav`, 11 s) to the controller, which relays it
to the node and on to whisper-server: real inference, whose transcript is gibberish (random weights),
so the test asserts the shapes and the metering, not the words.
"""

from __future__ import annotations

import json
import wave
from pathlib import Path

import openai
import pytest
import trio

from tests.conftest import Controller
from tests.realparts import PodmanService, S3Store
from tests.support.api import Json, in_thread, ok
from tests.support.realmodel import MIB, Node, cli, ready_on, register_model, runtime_logs, wait_for

pytestmark = pytest.mark.slow

RUNTIME = "whisper-server"


def deployment(name: str, alias: str) -> Json:
    return {
        "name": name,
        "runtime": RUNTIME,
        "alias": alias,
        "replicas": 1,
        "resources": {"accelerators": 0, "memory_bytes": 512 * MIB, "cpus": 1.0},
        "options": {"port": 18900, "settings": {"threads": 1}},
    }


def wav_seconds(path: Path) -> float:
    with wave.open(str(path)) as wav:
        return wav.getnframes() / wav.getframerate()


async def test_whisper_server_transcribes_a_governed_model_through_nexa_and_meters_the_audio_seconds(
    whisper_cluster: tuple[Controller, list[Node]],
    s3_store: S3Store,
    whisper_server_image: str,
    tiny_whisper: Path,
    whisper_sample: Path,
    podman_service: PodmanService,
) -> None:
    controller, _nodes = whisper_cluster
    argv = ["runtimes", "register", RUNTIME, "--kind", "whispercpp", "--version", "1.8.5", "--image"]
    await trio.to_thread.run_sync(cli, controller, *argv, whisper_server_image)
    shown = await trio.to_thread.run_sync(cli, controller, "runtimes", "show", RUNTIME)
    assert "entrypoint bash -c;" in shown and "workdir /app;" in shown, shown
    await register_model(controller, s3_store, "tiny-whisper", tiny_whisper, fmt="ggml")
    async with controller.client() as http:
        await ok(http.post("/api/v1/tenants", json={"id": "acme"}), 201)
        key = (await ok(http.post("/api/v1/keys", json={"role": "inference", "tenant": "acme"}), 201))["key"]
        await ok(http.post("/api/v1/deployments", json=deployment("asr", "tiny-whisper")), 201)
        placement = await ok(http.get("/api/v1/deployments/asr/placement"))
    # The image's `bash -c` entrypoint is no exec wrapper: the adapter's program is set over it, found on
    # the image's PATH (/app/build/bin), with the mounted model and OpenAI's path to transcribe at.
    process = placement["process"]
    assert process[:3] == ["whisper-server", "--model", "/models/model"], process
    at = process.index("--inference-path")
    assert process[at + 1] == "/v1/audio/transcriptions" and "--threads" in process, process
    await wait_for(lambda: ready_on(controller, "asr"), "asr Ready")

    audio = await trio.to_thread.run_sync(whisper_sample.read_bytes)
    client = openai.OpenAI(base_url=controller.url + "/v1", api_key=key, max_retries=0, timeout=120)
    try:

        def transcribe() -> None:
            heard = client.audio.transcriptions.create(
                model="tiny-whisper", file=("jfk.wav", audio, "audio/wav"), language="en"
            )
            assert isinstance(heard.text, str), heard
            plain = client.audio.transcriptions.create(
                model="tiny-whisper", file=("jfk.wav", audio, "audio/wav"), response_format="text"
            )
            assert isinstance(plain, str), plain
            verbose = client.audio.transcriptions.create(
                model="tiny-whisper", file=("jfk.wav", audio, "audio/wav"), response_format="verbose_json"
            )
            assert verbose.duration == pytest.approx(wav_seconds(whisper_sample), abs=0.01), verbose
            assert isinstance(verbose.text, str)

        def translate() -> None:
            # whisper-server translates only through its one path (the form's `translate`): nexa routes
            # OpenAI's translations to no whisper.cpp replica, and says so before any runtime sees it.
            with pytest.warns(DeprecationWarning, match="deprecated"), pytest.raises(openai.NotFoundError) as refused:
                client.audio.translations.create(model="tiny-whisper", file=("jfk.wav", audio, "audio/wav"))
            body = refused.value.body
            assert isinstance(body, dict) and body.get("code") == "api_not_served", body

        try:
            await in_thread(transcribe)
        except openai.OpenAIError:
            pytest.fail(runtime_logs(podman_service))
        await in_thread(translate)
    finally:
        client.close()

    # Metered in seconds of audio: the WAV's own length, once per transcription served (three), as
    # `nexa usage` shows it; the refused translation ran nowhere.
    report = json.loads(await trio.to_thread.run_sync(cli, controller, "usage", "--tenant", "acme", "--json"))
    rows = report["rows"]  # the tenant's: its requests were these
    assert sum(r["audio_seconds"] for r in rows) == pytest.approx(3 * wav_seconds(whisper_sample), abs=0.05), rows
    assert sum(r["requests"] - r["errors"] for r in rows) == 3, rows
    assert all(r["prompt_tokens"] == 0 and r["completion_tokens"] == 0 for r in rows), rows
