"""The controller's keys in the state directory's `keys/`: the current Ed25519 signing key and
CurveZMQ key pair, and every key rotated away from (`nexa keys rotate-controller`, `KeyRotation`).
The file functions are sync (run in a thread). Never logs or returns a private key.

Files, flat in `keys/` (a backup, `control.operations.backup`, takes every file there); each written
atomically (`security.write_key_file`), private ones 0600:

* `controller-signing.pem`, `controller-curve.key/.pub`      the current keys
* `retired-<id>-signing.pem`  a signing key rotated away from, named by its id
  (`PublicKey.fingerprint`), kept only through its overlap (it signs the announcement of its
  successor) and deleted at the switch; receipts and audit checkpoints it signed still verify
  against its public half in keyring.json
* `keyring.json`  the retired keys: ids, public halves, when retired, until when nodes accept them;
  which of the channel's two endpoints serves the current Curve key (`slot`) and its public half
* `controller-curve-next.key/.pub`  the Curve key a rotation made and announced to the nodes,
  served on the other endpoint from the rotation on; at the overlap's end it becomes the current
  one (`switch_curve`) and the endpoint of the old one refuses every node
* `retired-<id>-curve.key/.pub`  the Curve key served with the signing key `<id>`, once switched
  away from: its endpoint still does the Curve handshake, to refuse (and mark) who dials it; only
  the newest one is served, so the private halves of older ones are deleted
* `next-signing.pem`  a rotation under way: written before the current files change, so a crash at
  any step is finished at the next start
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Final

import attrs
import trio

from nexa import security
from nexa.channel import links
from nexa.channel.links import CurveKeyPair
from nexa.contracts import codec
from nexa.contracts.api import ControllerKey, ControllerKeysRotated
from nexa.contracts.domain import SYSTEM, Actor
from nexa.control.access.accounts import Accounts
from nexa.errors import ConfigError, Conflict, ContractError, ControllersRunning, Unavailable
from nexa.security import PublicKey, SigningKey

log = logging.getLogger(__name__)

SIGNING_FILE: Final = "controller-signing.pem"
CURVE_NAME: Final = "controller-curve"
KEYRING_FILE: Final = "keyring.json"
CURVE_NEXT_NAME: Final = "controller-curve-next"
_NEXT_SIGNING: Final = "next-signing.pem"


@attrs.frozen(kw_only=True)
class RetiredKey:
    """A key pair the controller rotated away from (public halves; the private ones stay in files)."""

    key_id: str
    signing_public_key: str
    curve_public_key: str
    retired_at: float
    #: Until when (Unix seconds) nodes accept it beside the key that replaced it.
    overlap_until: float


@attrs.frozen(kw_only=True)
class _Keyring:
    retired: list[RetiredKey] = attrs.field(factory=list)
    #: The endpoint (`ChannelConfig.endpoints`) that serves `controller-curve`; the other serves
    #: the next key during an overlap. The two swap at each switch.
    slot: int = attrs.field(default=0, validator=attrs.validators.in_((0, 1)))
    #: The public half of `controller-curve` once a switch made it current ("" before any): the
    #: switch's commit point.
    curve_public_key: str = ""


@attrs.frozen(kw_only=True)
class ControllerKeys:
    """The controller's Ed25519 key (signs sets, receipts, audit heads, backups) and CurveZMQ
    server key pair, and the keys it rotated away from, newest first."""

    signing: SigningKey
    curve: CurveKeyPair
    retired: tuple[RetiredKey, ...] = ()
    #: The endpoint serving `curve` (0 `[channel] listen`, 1 `rotation_listen`).
    slot: int = 0
    #: The Curve key a rotation announced, served on the other endpoint until the switch.
    next_curve: CurveKeyPair | None = None
    #: Without a next key: the Curve key the last switch retired (its endpoint refuses everyone).
    retired_curve: CurveKeyPair | None = None

    @property
    def next_curve_public(self) -> str:
        """The public half of `next_curve` (Z85); "" when no rotation waits for its switch."""
        return self.next_curve.public if self.next_curve is not None else ""

    @property
    def newest_curve(self) -> CurveKeyPair:
        """The Curve key new nodes are given: the next one from the rotation on."""
        return self.next_curve or self.curve

    @property
    def newest_slot(self) -> int:
        return 1 - self.slot if self.next_curve is not None else self.slot

    @property
    def key_id(self) -> str:
        return self.signing.public.fingerprint

    @property
    def previous(self) -> RetiredKey | None:
        """The key this one replaced, or None before any rotation."""
        return self.retired[0] if self.retired else None

    def verifying_keys(self) -> dict[str, PublicKey]:
        """Key id → public key, current and retired: what a receipt may be signed with."""
        keys = {r.key_id: PublicKey.from_b64(r.signing_public_key) for r in self.retired}
        return {self.key_id: self.signing.public, **keys}

    def listed(self) -> list[ControllerKey]:
        """Current first, then retired, newest first (`GET /api/v1/receipts/public-key`)."""
        current = ControllerKey(key_id=self.key_id, public_key=self.signing.public.b64)
        return [current] + [
            ControllerKey(key_id=r.key_id, public_key=r.signing_public_key, retired_at=r.retired_at)
            for r in self.retired
        ]


def load_or_create_keys(directory: Path, *, overlap_s: float = 86400.0) -> ControllerKeys:
    """Read the controller's keys, creating them on the first start; finishes a rotation a crash
    cut short (`overlap_s` dates its overlap from now if it had not been recorded)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    signing_path = directory / SIGNING_FILE
    if not signing_path.exists():
        security.save_signing_key(security.generate_signing_key(), signing_path)
    if not (directory / f"{CURVE_NAME}.key").exists():
        links.save_curve_keypair(links.generate_curve_keypair(), directory, name=CURVE_NAME)
    if (directory / _NEXT_SIGNING).exists():
        _finish_rotation(directory, time.time(), overlap_s)
    _finish_switch(directory)
    keys = _load(directory)
    if keys.next_curve is None:  # no overlap under way: no retired private key is needed any more
        _drop_retired_private(directory, _read_keyring(directory))
    if keys.next_curve is not None and keys.previous is not None and keys.previous.overlap_until <= time.time():
        return switch_curve(directory)  # the overlap ended while the controller was stopped
    return keys


def rotate(directory: Path, *, now: float, overlap_s: float, curve: CurveKeyPair | None = None) -> ControllerKeys:
    """A new signing key becomes current; the current one is retired (kept on disk), accepted by
    nodes until `now + overlap_s`. A new Curve key (`curve`, or one made here) is kept to be
    announced. The keys as they are now on disk."""
    next_curve = curve if curve is not None else links.generate_curve_keypair()
    links.save_curve_keypair(next_curve, directory, name=CURVE_NEXT_NAME, overwrite=True)
    security.save_signing_key(security.generate_signing_key(), directory / _NEXT_SIGNING, overwrite=True)
    _finish_rotation(directory, now, overlap_s)
    keys = _load(directory)
    log.info("controller keys rotated: key %s is current", keys.key_id)
    return keys


def _finish_rotation(directory: Path, now: float, overlap_s: float) -> None:
    new_signing = security.load_signing_key(directory / _NEXT_SIGNING)
    current = security.load_signing_key(directory / SIGNING_FILE)
    keyring = _read_keyring(directory)
    if current.public != new_signing.public and all(r.key_id != current.public.fingerprint for r in keyring.retired):
        # Retire the current key first: until this is on disk, the current file is untouched.
        served = links.load_curve_keypair(directory, name=CURVE_NAME)
        key_id = current.public.fingerprint
        security.save_signing_key(current, directory / f"retired-{key_id}-signing.pem", overwrite=True)
        entry = RetiredKey(
            key_id=key_id,
            signing_public_key=current.public.b64,
            curve_public_key=served.public,
            retired_at=now,
            overlap_until=now + overlap_s,
        )
        _write_keyring(directory, attrs.evolve(keyring, retired=[entry, *keyring.retired]))
    security.save_signing_key(new_signing, directory / SIGNING_FILE, overwrite=True)
    (directory / _NEXT_SIGNING).unlink()
    security.fsync_dir(directory)


def switch_curve(directory: Path) -> ControllerKeys:
    """A rotation's overlap has ended: its Curve key becomes the current one, served on the other
    endpoint; the one it replaces is kept (`retired-<id>-curve`). keyring.json is written first,
    so a crash at any step is finished at the next start (`_finish_switch`). The keys now."""
    keyring = _read_keyring(directory)
    if (directory / f"{CURVE_NEXT_NAME}.key").exists():
        new = links.load_curve_keypair(directory, name=CURVE_NEXT_NAME)
        if keyring.curve_public_key != new.public:
            current = links.load_curve_keypair(directory, name=CURVE_NAME)
            for r in keyring.retired:
                if r.curve_public_key == current.public:
                    links.save_curve_keypair(current, directory, name=_retired_curve(r.key_id), overwrite=True)
                    break
            _write_keyring(directory, attrs.evolve(keyring, slot=1 - keyring.slot, curve_public_key=new.public))
        _finish_switch(directory)
        log.info("controller Curve key switched: the channel serves the announced key only")
    return _load(directory)


def _finish_switch(directory: Path) -> None:
    """Once keyring.json names the switched-to key: make `controller-curve` it, drop the next files."""
    keyring, nxt = _read_keyring(directory), directory / f"{CURVE_NEXT_NAME}.key"
    if not keyring.curve_public_key or not nxt.exists():
        return
    new = links.load_curve_keypair(directory, name=CURVE_NEXT_NAME)
    if new.public != keyring.curve_public_key:
        return  # a later rotation's next key: not switched to yet
    links.save_curve_keypair(new, directory, name=CURVE_NAME, overwrite=True)
    nxt.unlink()
    (directory / f"{CURVE_NEXT_NAME}.pub").unlink(missing_ok=True)
    _drop_retired_private(directory, keyring)
    security.fsync_dir(directory)


def _drop_retired_private(directory: Path, keyring: _Keyring) -> None:
    """Delete the private halves no longer used once an overlap ended: every retired signing key
    (its successor is announced; what it signed verifies with its public half) and every retired
    Curve key but the newest (the one whose endpoint still refuses the nodes that dial it)."""
    for i, r in enumerate(keyring.retired):
        (directory / f"retired-{r.key_id}-signing.pem").unlink(missing_ok=True)
        if i > 0:
            (directory / f"{_retired_curve(r.key_id)}.key").unlink(missing_ok=True)


def _retired_curve(key_id: str) -> str:
    return f"retired-{key_id}-curve"


def _write_keyring(directory: Path, keyring: _Keyring) -> None:
    security.write_key_file(
        directory / KEYRING_FILE, codec.dumps(codec.store, keyring).encode(), private=False, overwrite=True
    )


def _read_keyring(directory: Path) -> _Keyring:
    path = directory / KEYRING_FILE
    if not path.exists():
        return _Keyring()
    try:
        return codec.loads(codec.store, security.read_key_file(path, private=False), _Keyring)
    except ContractError as exc:
        raise ConfigError(f"{path} is damaged: {exc.message}") from None


def _load(directory: Path) -> ControllerKeys:
    keyring = _read_keyring(directory)
    nxt = (
        links.load_curve_keypair(directory, name=CURVE_NEXT_NAME)
        if (directory / f"{CURVE_NEXT_NAME}.key").exists()
        else None
    )
    old = _retired_curve(keyring.retired[0].key_id) if keyring.retired else ""
    return ControllerKeys(
        signing=security.load_signing_key(directory / SIGNING_FILE),
        curve=links.load_curve_keypair(directory, name=CURVE_NAME),
        retired=tuple(keyring.retired),
        slot=keyring.slot,
        next_curve=nxt,
        retired_curve=(
            links.load_curve_keypair(directory, name=old)
            if nxt is None and old and (directory / f"{old}.key").exists()
            else None
        ),
    )


def retired_signing_key(directory: Path, key_id: str) -> SigningKey:
    """The private half of a retired key (it signs the announcement of its successor)."""
    return security.load_signing_key(directory / f"retired-{key_id}-signing.pem")


class KeyRotation:
    """`nexa keys rotate-controller`: one rotation at a time. Its new Curve key is served first
    (`serve_next_curve`: a channel endpoint that cannot be bound refuses it with nothing changed), then
    the keys are written to disk, announced to the nodes (signed with the key they pin), put in
    force for every signer (`on_rotated`) and audited.
    `run` switches the channel's Curve key when the overlap ends (`switch_curve`, then `switch`).

    On a shared store (`others`: the other controllers running on it) a rotation is refused while
    any runs (ControllersRunning): it writes this host's keys directory only, which the others
    must then be given before they start again (`store.check_keys_fingerprint` takes the rotated
    keys in place of those they replace)."""

    def __init__(
        self,
        directory: Path,
        keys: ControllerKeys,
        *,
        overlap_s: float,
        accounts: Accounts,
        announce: Callable[[ControllerKeys, SigningKey, float], Awaitable[int]],
        serve_next_curve: Callable[[CurveKeyPair], Awaitable[None]] | None = None,
        on_rotated: Sequence[Callable[[ControllerKeys], None]] = (),
        lock: trio.Lock | None = None,
        switch: Callable[[ControllerKeys], Awaitable[None]] | None = None,
        others: Callable[[], Awaitable[list[str]]] | None = None,
        others_gone_after_s: float = 0.0,
    ) -> None:
        """`others` (a shared store only): the other controllers running on it now;
        `others_gone_after_s`: how long after its last row a stopped one still counts as running."""
        self.keys = keys
        self._others, self._others_gone_after_s = others, others_gone_after_s
        self._switch = switch
        self._rotated = trio.Event()
        self._directory, self._overlap_s = directory, overlap_s
        self._accounts, self._announce, self._on_rotated = accounts, announce, on_rotated
        self._serve_next_curve = serve_next_curve
        #: One rotation at a time; the backups' lock where there are backups (`Backups.lock`): a
        #: backup is never made between the key files changing and its signer taking the new key.
        self._lock = lock if lock is not None else trio.Lock()

    async def rotate(self, actor: Actor) -> ControllerKeysRotated:
        async with self._lock:
            if self._others is not None and (others := await self._others()):
                raise ControllersRunning(others=others, wait_s=self._others_gone_after_s)
            if self.keys.next_curve is not None and (prev := self.keys.previous) is not None:
                raise Conflict(
                    f"the last rotation's overlap runs until {prev.overlap_until:.0f} (Unix time): its Curve key "
                    "switch comes first. Rotate again after it ([nodes] key_overlap_s)"
                )
            previous, curve = self.keys.signing, links.generate_curve_keypair()
            if self._serve_next_curve is not None:
                await self._serve_next_curve(curve)
            now = time.time()
            keys = await trio.to_thread.run_sync(
                partial(rotate, self._directory, now=now, overlap_s=self._overlap_s, curve=curve)
            )
            until = now + self._overlap_s
            told = await self._announce(keys, previous, until)
            self.keys = keys
            for listener in self._on_rotated:
                listener(keys)
            self._rotated.set()
            self._rotated = trio.Event()
            await self._accounts.record(
                actor,
                "controller.keys_rotated",
                f"controller/keys/{keys.key_id}",
                detail=f"previous key {previous.public.fingerprint}, accepted by nodes until {until:.0f}; "
                f"announced to {told} nodes",
            )
            return ControllerKeysRotated(
                key_id=keys.key_id,
                previous_key_id=previous.public.fingerprint,
                signing_public_key=keys.signing.public.b64,
                curve_public_key=keys.next_curve_public,
                overlap_until=until,
                announced_to=told,
                controller_fingerprint=security.controller_fingerprint(
                    keys.signing.public.b64, keys.newest_curve.public
                ),
            )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """At each rotation's overlap end, switch the channel to its Curve key (audited)."""
        task_status.started()
        while True:
            keys, rotated = self.keys, self._rotated
            if keys.next_curve is None or keys.previous is None:
                await rotated.wait()
                continue
            await trio.sleep(max(0.0, keys.previous.overlap_until - time.time()))
            async with self._lock:
                keys = await trio.to_thread.run_sync(switch_curve, self._directory)
                if self._switch is not None:
                    await self._switch(keys)
                self.keys = keys
                for listener in self._on_rotated:
                    listener(keys)
            await self._accounts.record(
                SYSTEM,
                "controller.curve_switched",
                f"controller/keys/{keys.key_id}",
                detail=f"the node channel serves Curve key {keys.curve.public[:8]}… only; its old key is refused",
            )

    @staticmethod
    def of(rotation: KeyRotation | None) -> KeyRotation:
        """`rotation`, or Unavailable where the controller runs without one (a test's app)."""
        if rotation is None:
            raise Unavailable("this controller does not rotate its keys")
        return rotation
