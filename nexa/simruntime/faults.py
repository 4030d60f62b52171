"""Injected faults: what they are (`Faults`, from flags or a faults file) and the faults in force
now (`FaultsSource`, the faults file re-read when it changes)."""

from __future__ import annotations

import enum
import json
import logging
from typing import Final

import attrs

from nexa.container_spec import SIM_IMAGE_ENV
from nexa.errors import ConfigError

log = logging.getLogger(__name__)


class Phase(enum.StrEnum):
    """When an injected fault strikes: before the first byte of the response, or after some tokens."""

    BEFORE = "before"
    AFTER = "after"


class Garble(enum.StrEnum):
    """A 200 answer that is not what the API promises (faults file only): an HTML error page, JSON
    cut off halfway, JSON of the wrong shape (`choices`/`data` of non-objects, a stream event that
    is a list), or a `usage` with counts no runtime reports (2^64 and -1)."""

    HTML = "html"
    TRUNCATED = "truncated"
    SHAPE = "shape"
    USAGE = "usage"


#: The counts of a `usage` garble: beyond int64, and negative.
GARBLED_USAGE: Final = {"prompt_tokens": 2**64, "completion_tokens": -1, "total_tokens": 2**64}


@attrs.frozen(kw_only=True)
class Faults:
    """Injected faults. `fail` answers `status` (before) or cuts the stream off after `after_tokens`
    tokens (after; a unary answer fails before); `hang` stops sending, until the client goes away;
    `garble` answers 200 with a broken body (unary), or sends one broken event after `after_tokens`
    tokens and ends the stream (a `usage` garble: the usage event's counts instead).

    What `/metrics` reports (vLLM's names): `queue_depth` requests waiting
    (`vllm:num_requests_waiting`), `kv_cache_usage` 0..1 (`vllm:kv_cache_usage_perc`); with
    `metrics_fail` it answers 503 instead (inference is untouched). With `unhealthy`, `/health` answers
    503 (the node's probe then reports the replica Unhealthy; inference is untouched). With
    `sleep_fail` (sleep mode on), `POST /sleep` answers 500 and the engine stays awake. `slow_ms`
    answers slowly: that many more milliseconds before any output (a bad image's slow engine).

    Teaching (faults file only; for evaluation suites): `taught` maps a text to the answer a unary
    chat or completion gets when its prompt contains that text (the first such entry, in file
    order); `wrong` makes every answer useless instead: other words than the prompt's own, and
    embeddings that are random unit vectors (so a suite run against it fails).

    By image (faults file only): `images` maps a text to the faults of the runtimes whose image
    (`IMAGE_ENV`, which the node's process driver sets to the assignment's image) contains it,
    instead of the file's own (the first such entry, in file order): a bad runtime image next to
    a good one on the same node.

    By adapter (faults file only): `loras` maps a text to the faults of an inference request that
    names a loaded LoRA adapter whose path (on a node: its artifact's cache path, which holds its
    sha256) contains it, before `images`: a bad adapter version next to a good one."""

    fail: Phase | None = None
    hang: Phase | None = None
    status: int = 500
    after_tokens: int = 2
    garble: Garble | None = None
    queue_depth: int = 0
    kv_cache_usage: float = 0.0
    metrics_fail: bool = False
    unhealthy: bool = False
    taught: tuple[tuple[str, str], ...] = ()
    wrong: bool = False
    images: tuple[tuple[str, Faults], ...] = ()
    loras: tuple[tuple[str, Faults], ...] = ()
    #: With `--enable-sleep-mode`: `POST /sleep` answers 500 and the engine stays awake.
    sleep_fail: bool = False
    #: Milliseconds more before any output of an inference request (0: none).
    slow_ms: float = 0.0

    def for_image(self, image: str) -> Faults:
        """The faults of a runtime of `image`: its `images` entry's, else these."""
        return next((f for key, f in self.images if image and key in image), self)

    def for_lora(self, path: str) -> Faults | None:
        """The faults of a request naming the adapter loaded from `path`: its `loras` entry's, else None."""
        return next((f for key, f in self.loras if path and key in path), None)

    @classmethod
    def from_json(cls, data: object) -> Faults:
        """Parse a faults file's object; ConfigError naming every bad key."""
        if not isinstance(data, dict):
            raise ConfigError("a faults file holds one JSON object")
        known = (
            "fail",
            "hang",
            "status",
            "after_tokens",
            "garble",
            "queue_depth",
            "kv_cache_usage",
            "metrics_fail",
            "unhealthy",
            "taught",
            "wrong",
            "images",
            "loras",
            "sleep_fail",
            "slow_ms",
        )
        problems = [f"{key}: unknown key" for key in data if key not in known]
        phases: dict[str, Phase | None] = {}
        for key in ("fail", "hang"):
            value = data.get(key)
            if value is None or value in (Phase.BEFORE, Phase.AFTER):
                phases[key] = None if value is None else Phase(value)
            else:
                problems.append(f"{key}: must be 'before', 'after' or null")
        status = data.get("status", 500)
        if not isinstance(status, int) or isinstance(status, bool) or not 400 <= status <= 599:
            problems.append("status: must be an HTTP error status (400 to 599)")
        after_tokens = data.get("after_tokens", 2)
        if not isinstance(after_tokens, int) or isinstance(after_tokens, bool) or after_tokens < 0:
            problems.append("after_tokens: must be a whole number, 0 or more")
        garble = data.get("garble")
        if garble is not None and garble not in tuple(Garble):
            problems.append("garble: must be one of " + ", ".join(g.value for g in Garble) + " or null")
        queue_depth = data.get("queue_depth", 0)
        if not isinstance(queue_depth, int) or isinstance(queue_depth, bool) or not 0 <= queue_depth <= _MAX_QUEUE:
            problems.append(f"queue_depth: must be a whole number from 0 to {_MAX_QUEUE}")
        kv_cache_usage = data.get("kv_cache_usage", 0.0)
        if not _fraction(kv_cache_usage):
            problems.append("kv_cache_usage: must be a number from 0 to 1")
        slow_ms = data.get("slow_ms", 0)
        if not isinstance(slow_ms, int | float) or isinstance(slow_ms, bool) or not 0 <= slow_ms <= _MAX_SLOW_MS:
            problems.append(f"slow_ms: must be a number of milliseconds from 0 to {_MAX_SLOW_MS}")
        switches = {key: data.get(key, False) for key in ("metrics_fail", "unhealthy", "sleep_fail")}
        problems += [f"{key}: must be true or false" for key, on in switches.items() if not isinstance(on, bool)]
        taught = data.get("taught", {})
        problems += _teaching_problems(taught, data.get("wrong", False))
        images = _by_key("images", data.get("images", {}), problems)
        loras = _by_key("loras", data.get("loras", {}), problems)
        if problems:
            raise ConfigError("invalid faults: " + "; ".join(problems), problems=tuple(problems))
        return cls(
            fail=phases["fail"],
            hang=phases["hang"],
            status=status,
            after_tokens=after_tokens,
            garble=None if garble is None else Garble(garble),
            queue_depth=queue_depth,
            kv_cache_usage=float(kv_cache_usage),
            metrics_fail=switches["metrics_fail"],
            unhealthy=switches["unhealthy"],
            taught=tuple(taught.items()),
            wrong=data.get("wrong", False),
            images=tuple(images),
            loras=tuple(loras),
            sleep_fail=switches["sleep_fail"],
            slow_ms=float(slow_ms),
        )


def _by_key(name: str, entries: object, problems: list[str]) -> list[tuple[str, Faults]]:
    """The `images` or `loras` entries of a faults file (each parsed as a faults object of its own,
    with neither); what is wrong appended to `problems`."""
    found: list[tuple[str, Faults]] = []
    if not isinstance(entries, dict) or not all(isinstance(k, str) and k for k in entries):
        problems.append(f"{name}: an object of texts -> faults")
        return found
    for key, value in entries.items():
        if isinstance(value, dict) and ("images" in value or "loras" in value):
            problems.append(f"{name}.{key}: faults without images or loras of their own")
            continue
        try:
            found.append((key, Faults.from_json(value)))
        except ConfigError as exc:
            problems.append(f"{name}.{key}: {exc.message}")
    return found


def _teaching_problems(taught: object, wrong: object) -> list[str]:
    problems = []
    if not (
        isinstance(taught, dict)
        and len(taught) <= _MAX_TAUGHT
        and all(isinstance(v, str) and k and len(k) + len(v) <= _MAX_TAUGHT_CHARS for k, v in taught.items())
    ):
        problems.append(f"taught: an object of at most {_MAX_TAUGHT} texts -> answers ({_MAX_TAUGHT_CHARS} chars)")
    if not isinstance(wrong, bool):
        problems.append("wrong: must be true or false")
    return problems


#: The most entries of `taught`, and the longest text and answer together.
_MAX_TAUGHT: Final = 256
_MAX_TAUGHT_CHARS: Final = 4096
#: The longest queue a faults file may claim.
_MAX_QUEUE: Final = 1_000_000
#: The most `slow_ms` (ten minutes: longer is a hang, `hang`).
_MAX_SLOW_MS: Final = 600_000


def _fraction(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0.0 <= value <= 1.0


#: The environment variable that names a sim runtime's image (`Faults.images`).
IMAGE_ENV: Final = SIM_IMAGE_ENV
#: The most of a faults file read (a valid one is far smaller).
_FAULTS_FILE_MAX: Final = 64 * 1024


class FaultsSource:
    """The faults in force: the faults file's, read at every request and parsed again when its bytes
    changed (a file's mtime and size can stay the same across a quick rewrite: a tick is coarse);
    the flags' while it does not exist. A broken file counts as no faults until it is fixed (logged
    once per version). A sim runtime's file is a few bytes: the read costs microseconds."""

    def __init__(self, path: str, default: Faults, *, image: str = "") -> None:
        """`image`: this runtime's image; the file's `images` entry for it applies (`Faults.for_image`)."""
        self._image = image
        self._path = path
        self._default = default
        self._seen: bytes | None = None
        self._faults = default

    def current(self, lora_path: str = "") -> Faults:
        """The faults of a request now (`lora_path`: where the adapter it names was loaded from, if any)."""
        if not self._path:
            return self._default
        try:
            with open(self._path, "rb") as f:
                raw = f.read(_FAULTS_FILE_MAX)
        except FileNotFoundError:
            self._seen = None
            return self._default
        except OSError as exc:
            raw = repr(exc).encode()  # a version of its own: logged once, counts as no faults
        if raw != self._seen:
            self._seen = raw
            try:
                self._faults = Faults.from_json(json.loads(raw))
            except (ValueError, ConfigError) as exc:
                log.warning("ignoring the faults file until it is fixed: %s", exc)
                self._faults = Faults()
        by_lora = self._faults.for_lora(lora_path)
        return by_lora if by_lora is not None else self._faults.for_image(self._image)
