"""The node's on-disk identity and fence in its state directory. Sync; the agent runs it in a thread.

Files (every one written atomically: temp file, fsync, rename, fsync of the directory):

* `node.key`         Ed25519 signing key (0600): signs heartbeats and acks
* `curve.key/.pub`   Curve25519 key pair (0600/0644): the CurveZMQ channel identity
* `enrollment.json`  node id, the controller's pinned keys (and, after it rotated them, its
                     previous signing key until the overlap ends) and the channel endpoint (0600)
* `fence.json`       the highest accepted (epoch, generation), its lease and assignments, and the
                     signed set itself, the node's proof of that epoch to a restored controller (0600)
* `keys.next/`       a key rotation not yet confirmed by the controller: `node.key`, `curve.key/.pub`
                     (made whole in a temp directory, then renamed; see `prepare_rotation`)
* `channels.json`    with several controllers (`NodeConfig.controllers`): where each listed endpoint's
                     channel dials now, once a controller key rotation moved it (0600)

Private keys never leave this directory; only their public halves go into an EnrollRequest.
"""

from __future__ import annotations

import base64
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final

import attrs

from nexa import security
from nexa.channel import links
from nexa.contracts import codec, wire
from nexa.errors import ConfigError, ContractError

if TYPE_CHECKING:  # `nexa node enroll`'s request and answer: the running agent never needs them
    from nexa.contracts.api import EnrollRequest, EnrollResponse

log = logging.getLogger(__name__)

SIGNING_KEY_FILE: Final = "node.key"
#: `curve.key` (secret) and `curve.pub` (public), as `links.save_curve_keypair` names them.
CURVE_KEY_NAME: Final = "curve"
ENROLLMENT_FILE: Final = "enrollment.json"
FENCE_FILE: Final = "fence.json"
CHANNELS_FILE: Final = "channels.json"
#: The directory of the keys a rotation is moving to, until the controller confirmed them.
NEXT_KEYS_DIR: Final = "keys.next"

NOT_ENROLLED: Final = "this node is not enrolled: run `nexa node enroll --controller URL --token TOKEN`"


@attrs.frozen(kw_only=True)
class EnrollmentRecord:
    """What `enrollment.json` holds: the answer of the controller that enrolled this node."""

    node_id: str
    #: Ed25519 public key of the controller (base64 of the raw 32 bytes): verifies assignments.
    controller_signing_public_key: str
    #: Curve25519 public key of the controller's channel (Z85).
    controller_curve_public_key: str
    channel_endpoint: str
    labels: dict[str, str] = attrs.field(factory=dict)
    enrolled_at: float = 0.0
    #: The controller's HTTP URL as given to `nexa node enroll` (`nexa node doctor` checks it);
    #: empty in records written before it was kept.
    controller_url: str = ""
    #: After the controller rotated its keys (`wire.ControllerKeysAnnounced`): the signing key it
    #: had before, still accepted until `previous_controller_key_until` (Unix seconds). The new
    #: Curve key and endpoint it announced replace `controller_curve_public_key` and
    #: `channel_endpoint` (the node redials them); from a controller that named no endpoint, the
    #: Curve key is only kept here.
    previous_controller_signing_public_key: str = ""
    previous_controller_key_until: float = 0.0
    next_controller_curve_public_key: str = ""


@attrs.frozen(kw_only=True)
class NodeIdentity:
    """Everything the agent needs to open its channel and check its controller."""

    node_id: str
    signing_key: security.SigningKey
    curve: links.CurveKeyPair
    controller_signing_public: security.PublicKey
    controller_curve_public: str
    channel_endpoint: str
    #: Every controller key messages may be signed with and until when (Unix seconds), current first.
    controller_keys: tuple[tuple[security.PublicKey, float], ...] = ()


@attrs.frozen(kw_only=True)
class Fence:
    """The newest assignment set this node accepted. (0, 0) with no assignments: none yet.

    Kept on disk so that a restarted agent still refuses anything older than what it acted on.
    """

    epoch: int = 0
    generation: int = 0
    #: Wall-clock time (Unix seconds) after which the accepted set is no longer renewed.
    lease_expires_at: float = 0.0
    assignments: list[wire.Assignment] = attrs.field(factory=list)
    #: The set as it came (its body) and the controller's signature over it (base64): the node's
    #: proof of this (epoch, generation) in hello and heartbeats. "" in fences from before, and
    #: for a set over `wire.MAX_PROOF_BYTES`.
    signed_body: str = ""
    signature: str = ""

    @property
    def accepted_any(self) -> bool:
        return (self.epoch, self.generation) != (0, 0)

    def with_proof(self, frames: Sequence[bytes]) -> Fence:
        """This fence with the signed message it was accepted from (`[kind, body, signature]`)
        as its proof, when the body is small enough to send (else without one)."""
        if len(frames) != 3 or len(frames[1]) > wire.MAX_PROOF_BYTES:
            return attrs.evolve(self, signed_body="", signature="")
        body = frames[1].decode("utf-8")
        return attrs.evolve(self, signed_body=body, signature=base64.b64encode(frames[2]).decode("ascii"))


# --- keys and enrollment ------------------------------------------------------------------------


def is_enrolled(state_dir: Path) -> bool:
    return (state_dir / ENROLLMENT_FILE).exists()


def create_keys(state_dir: Path) -> tuple[security.SigningKey, links.CurveKeyPair]:
    """Generate and store a new signing key and Curve key pair.

    Refuses (ConfigError) when the node is enrolled: its keys are what the controller knows it
    by. Keys left over from an enrollment that never completed are replaced.
    """
    _ensure_dir(state_dir)
    _refuse_if_enrolled(state_dir)
    signing_key = security.generate_signing_key()
    curve = links.generate_curve_keypair()
    security.save_signing_key(signing_key, state_dir / SIGNING_KEY_FILE, overwrite=True)
    links.save_curve_keypair(curve, state_dir, name=CURVE_KEY_NAME, overwrite=True)
    return signing_key, curve


def _refuse_if_enrolled(state_dir: Path) -> None:
    if is_enrolled(state_dir):
        raise ConfigError(
            f"this node is already enrolled (state directory {state_dir}); refusing to replace its keys. "
            "To enroll it again, revoke it on the controller and remove the state directory first"
        )


def _load_keys(state_dir: Path) -> tuple[security.SigningKey, links.CurveKeyPair]:
    return (
        security.load_signing_key(state_dir / SIGNING_KEY_FILE),
        links.load_curve_keypair(state_dir, name=CURVE_KEY_NAME),
    )


def enroll_request(state_dir: Path, token: str, hostname: str, agent_version: str) -> EnrollRequest:
    """The body of `POST /api/v1/enroll`: the token's secret and this node's public keys (the
    controller fingerprint a token carries stays here: see `expected_fingerprint`).

    Keys already in `state_dir` (from an enrollment that did not complete) are reused; missing
    ones are created. An enrolled node is refused, as in `create_keys`.
    """
    _refuse_if_enrolled(state_dir)
    secret, _ = _split_token(token)
    have_keys = (state_dir / SIGNING_KEY_FILE).exists() and (state_dir / f"{CURVE_KEY_NAME}.key").exists()
    signing_key, curve = _load_keys(state_dir) if have_keys else create_keys(state_dir)
    from nexa.contracts.api import EnrollRequest

    return EnrollRequest(
        token=secret,
        hostname=hostname,
        signing_public_key=signing_key.public.b64,
        curve_public_key=curve.public,
        agent_version=agent_version,
    )


def _split_token(token: str) -> tuple[str, str | None]:
    try:
        return security.split_enrollment_token(token)
    except ContractError as exc:
        raise ConfigError(f"the enrollment token's fingerprint part is malformed: {exc.message}") from None


def expected_fingerprint(token: str, flag: str | None = None) -> str | None:
    """The controller fingerprint to pin: the one the token carries (`nxb_<secret>.<fingerprint>`)
    and/or `--controller-fingerprint`. ConfigError when either is malformed or they disagree;
    None when neither gives one.
    """
    _, carried = _split_token(token)
    given: str | None = None
    if flag:
        try:
            given = security.parse_controller_fingerprint(flag)
        except ContractError as exc:
            raise ConfigError(f"--controller-fingerprint: {exc.message}") from None
    if carried is not None and given is not None and carried != given:
        raise ConfigError("--controller-fingerprint differs from the fingerprint the enrollment token carries")
    return carried or given


def save_enrollment(state_dir: Path, resp: EnrollResponse, *, pin: str | None = None, controller_url: str = "") -> None:
    """Pin the controller's keys and store the node id (mode 0600). Checks the keys parse first.

    With `pin` (a controller fingerprint, see `expected_fingerprint`), keys with another fingerprint
    are refused with ControllerKeyMismatch and nothing is written. Without it the keys are trusted
    as they came (only for callers that got them over a channel they already trust).
    """
    try:
        security.PublicKey.from_b64(resp.controller_signing_public_key)
        links.check_curve_key(resp.controller_curve_public_key)
    except ContractError as exc:
        raise ConfigError(f"the controller's enrollment answer is unusable: {exc.message}") from None
    if pin is not None:
        security.check_controller_fingerprint(pin, resp.controller_signing_public_key, resp.controller_curve_public_key)
    record = EnrollmentRecord(
        node_id=resp.node_id,
        controller_signing_public_key=resp.controller_signing_public_key,
        controller_curve_public_key=resp.controller_curve_public_key,
        channel_endpoint=resp.channel_endpoint,
        labels=dict(resp.labels),
        enrolled_at=time.time(),
        controller_url=controller_url,
    )
    _ensure_dir(state_dir)
    atomic_write(state_dir / ENROLLMENT_FILE, codec.dumps(codec.store, record).encode("utf-8"))
    log.info("enrolled as node %s", resp.node_id)


def load_enrollment(state_dir: Path) -> EnrollmentRecord:
    """Read `enrollment.json`; ConfigError (with the `nexa node enroll` hint) when absent."""
    raw = _read(state_dir / ENROLLMENT_FILE)
    if raw is None:
        raise ConfigError(NOT_ENROLLED)
    try:
        return codec.loads(codec.store, raw, EnrollmentRecord)
    except ContractError as exc:
        raise ConfigError(f"{state_dir / ENROLLMENT_FILE} is damaged: {exc.message}") from None


def load_identity(state_dir: Path) -> NodeIdentity:
    """The enrolled identity: keys, node id and the pinned controller keys. Raises ConfigError."""
    record = load_enrollment(state_dir)
    signing_key, curve = _load_keys(state_dir)
    try:
        controller_signing_public = security.PublicKey.from_b64(record.controller_signing_public_key)
        controller_curve_public = links.check_curve_key(record.controller_curve_public_key)
        keys = controller_keys(record)
    except ContractError as exc:
        raise ConfigError(f"{state_dir / ENROLLMENT_FILE} is damaged: {exc.message}") from None
    return NodeIdentity(
        node_id=record.node_id,
        signing_key=signing_key,
        curve=curve,
        controller_signing_public=controller_signing_public,
        controller_curve_public=controller_curve_public,
        channel_endpoint=record.channel_endpoint,
        controller_keys=keys,
    )


def controller_keys(record: EnrollmentRecord) -> tuple[tuple[security.PublicKey, float], ...]:
    """The controller keys a record pins, current first, each with until when it is accepted."""
    keys: tuple[tuple[security.PublicKey, float], ...] = (
        (security.PublicKey.from_b64(record.controller_signing_public_key), math.inf),
    )
    if record.previous_controller_signing_public_key:
        previous = security.PublicKey.from_b64(record.previous_controller_signing_public_key)
        keys += ((previous, record.previous_controller_key_until),)
    return keys


def pin_controller_keys(state_dir: Path, announced: wire.ControllerKeysAnnounced) -> EnrollmentRecord:
    """Pin the controller's new signing key, its current one kept until `announced.overlap_until`
    (written atomically before the node acts on it). ContractError when the announcement does not
    replace the key pinned now, or names its new key by another id; nothing is written then."""
    record = load_enrollment(state_dir)
    current = security.PublicKey.from_b64(record.controller_signing_public_key)
    new = security.PublicKey.from_b64(announced.signing_public_key)
    links.check_curve_key(announced.curve_public_key)
    if new == current:
        return record  # told again (each hello within the overlap)
    if announced.previous_key_id != current.fingerprint or announced.key_id != new.fingerprint:
        raise ContractError("the controller's new keys do not follow the key this node pins")
    record = attrs.evolve(
        record,
        controller_signing_public_key=new.b64,
        previous_controller_signing_public_key=current.b64,
        previous_controller_key_until=announced.overlap_until,
        next_controller_curve_public_key=announced.curve_public_key,
    )
    if announced.channel_endpoint:
        record = attrs.evolve(
            record,
            controller_curve_public_key=announced.curve_public_key,
            channel_endpoint=announced.channel_endpoint,
            next_controller_curve_public_key="",
        )
    atomic_write(state_dir / ENROLLMENT_FILE, codec.dumps(codec.store, record).encode("utf-8"))
    log.info(
        "pinned the controller's new key %s; key %s accepted until the overlap ends",
        new.fingerprint,
        current.fingerprint,
    )
    return record


# --- key rotation -------------------------------------------------------------------------------
#
# The node keeps its keys until the controller confirmed the new ones (`KeysRotated`), and the
# controller accepts either until the node's first message signed with the new ones, so a crash
# at any step leaves a node that can connect: before the promotion it still has (and the controller
# still admits) the old keys; once promotion began, the controller has confirmed the new ones.


@attrs.frozen(kw_only=True)
class PendingKeys:
    """The keys a rotation moves to. Their secrets never appear in a repr."""

    signing_key: security.SigningKey
    curve: links.CurveKeyPair


def load_pending_keys(state_dir: Path) -> PendingKeys | None:
    """The keys of a rotation not yet promoted, or None. Raises ConfigError for damaged files."""
    directory = state_dir / NEXT_KEYS_DIR
    if not directory.is_dir():
        return None
    return PendingKeys(
        signing_key=security.load_signing_key(directory / SIGNING_KEY_FILE),
        curve=links.load_curve_keypair(directory, name=CURVE_KEY_NAME),
    )


def prepare_rotation(state_dir: Path) -> PendingKeys:
    """The keys to rotate to: those of a rotation already under way, else new ones.

    New keys are written whole into a temp directory (0700, each file 0600/0644, fsync'd) and
    renamed to `keys.next` in one step, so a crash leaves either no pending keys or all of them.
    Refuses (ConfigError) a node that is not enrolled: it has no keys to rotate.
    """
    load_enrollment(state_dir)
    pending = load_pending_keys(state_dir)
    if pending is not None:
        return pending
    pending = PendingKeys(signing_key=security.generate_signing_key(), curve=links.generate_curve_keypair())
    try:
        tmp = Path(tempfile.mkdtemp(dir=state_dir, prefix=f".{NEXT_KEYS_DIR}.", suffix=".tmp"))  # mode 0700
    except OSError as exc:
        raise ConfigError(f"cannot write the new keys in {state_dir}: {exc.strerror}") from None
    try:
        security.save_signing_key(pending.signing_key, tmp / SIGNING_KEY_FILE)
        links.save_curve_keypair(pending.curve, tmp, name=CURVE_KEY_NAME)
        tmp.rename(state_dir / NEXT_KEYS_DIR)
        security.fsync_dir(state_dir)
    except OSError as exc:
        raise ConfigError(f"cannot write the new keys in {state_dir}: {exc.strerror}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("new node keys made; they take effect once the controller confirms them")
    return pending


def promote_pending_keys(state_dir: Path, pending: PendingKeys) -> None:
    """Make `pending` this node's keys (the controller confirmed them), then drop `keys.next`.

    Each file is replaced atomically; a crash in between is finished by `resume_rotation`.
    """
    links.save_curve_keypair(pending.curve, state_dir, name=CURVE_KEY_NAME, overwrite=True)
    security.save_signing_key(pending.signing_key, state_dir / SIGNING_KEY_FILE, overwrite=True)
    discard_pending_keys(state_dir)
    log.info("the node's new keys are in force")


def discard_pending_keys(state_dir: Path) -> None:
    """Remove `keys.next` (promoted, or refused by the controller)."""
    try:
        shutil.rmtree(state_dir / NEXT_KEYS_DIR)
        security.fsync_dir(state_dir)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot remove {state_dir / NEXT_KEYS_DIR}: {exc.strerror}") from None


def resume_rotation(state_dir: Path) -> PendingKeys | None:
    """At start, before the keys are loaded: finish a promotion a crash cut short (one of the
    node's keys already is a pending one, so the controller had confirmed them), and return the
    pending keys still to be confirmed (None when no rotation is under way)."""
    pending = load_pending_keys(state_dir)
    if pending is None:
        return None
    signing_key, curve = _load_keys(state_dir)
    if signing_key.public == pending.signing_key.public or curve.public == pending.curve.public:
        promote_pending_keys(state_dir, pending)
        return None
    return pending


# --- the channels to several controllers --------------------------------------------------------


@attrs.frozen(kw_only=True)
class ChannelTarget:
    """What one listed controller's channel dials: its endpoint and Curve key now."""

    endpoint: str
    curve_public_key: str


@attrs.frozen(kw_only=True)
class _ChannelsRecord:
    #: The endpoint as `NodeConfig.controllers` lists it → what its channel dials now.
    channels: dict[str, ChannelTarget] = attrs.field(factory=dict)


def load_channel_targets(state_dir: Path) -> dict[str, ChannelTarget]:
    """Where the listed controllers' channels moved (`save_channel_targets`); empty when none did.

    A damaged file is a ConfigError: dialling the listed endpoints instead could reach a Curve key the
    controllers have retired, which marks the node for re-enrollment.
    """
    path = state_dir / CHANNELS_FILE
    raw = _read(path)
    if raw is None:
        return {}
    try:
        record = codec.loads(codec.store, raw, _ChannelsRecord)
        for target in record.channels.values():
            links.check_curve_key(target.curve_public_key)
    except ContractError as exc:
        raise ConfigError(
            f"{path} is damaged ({exc.message}): restore it, or delete it to dial the endpoints node.toml lists"
        ) from None
    return dict(record.channels)


def save_channel_targets(state_dir: Path, targets: dict[str, ChannelTarget]) -> None:
    """Store what every listed controller's channel dials (written before the node redials one)."""
    record = _ChannelsRecord(channels=dict(targets))
    atomic_write(state_dir / CHANNELS_FILE, codec.dumps(codec.store, record).encode("utf-8"))


# --- the fence ----------------------------------------------------------------------------------


def load_fence(state_dir: Path) -> Fence:
    """The accepted fence, or the empty one if nothing was ever accepted.

    A damaged file is a ConfigError, never "nothing accepted": that would let an older set in.
    """
    raw = _read(state_dir / FENCE_FILE)
    if raw is None:
        return Fence()
    # The wire converter: the assignments are kept exactly as they were received and verified
    # (their free-form `spec` needs the wire converter's pass-through for JSON values).
    try:
        return codec.loads(codec.wire, raw, Fence)
    except ContractError as exc:
        raise ConfigError(f"{state_dir / FENCE_FILE} is damaged: {exc.message}") from None


def save_fence(state_dir: Path, fence: Fence) -> None:
    """Store the fence durably: when this returns, a crash cannot lose it."""
    atomic_write(state_dir / FENCE_FILE, codec.dumps(codec.wire, fence).encode("utf-8"))


# --- files --------------------------------------------------------------------------------------


def atomic_write(path: Path, data: bytes) -> None:
    """Replace `path` with `data` (mode 0600): temp file, fsync, rename, fsync of the directory.

    Readers see the old file or the new one, never a mix, and after a crash the new one is
    there once this has returned.
    """
    directory = path.parent
    try:
        fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror}") from None
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(path)
        security.fsync_dir(directory)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror}") from None
    finally:
        tmp.unlink(missing_ok=True)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None


def _ensure_dir(state_dir: Path) -> None:
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create the state directory {state_dir}: {exc.strerror}") from None
