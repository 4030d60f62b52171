"""Ed25519 signing keys, message signatures, the replay window, enrollment tokens and the controller
fingerprint they carry; the backup key and AES-256-GCM sealing of backups.

Sync and pure: no trio, no sockets. The only I/O is reading and writing key files through the
explicit `*_key_file` helpers. The only module that imports `cryptography` or `nacl`: Ed25519 is
PyNaCl's (libsodium), whose import costs a process about 2.5 MiB where `cryptography`'s costs about
9.5 (a 14 MB Rust extension mapped whole; `perf/node_memory.py`); so the node agent, which signs and
verifies but seals nothing, never imports `cryptography`. AES-GCM (the controller's backups) and
reading a PEM key in another form than the one `save_signing_key` writes still use it, imported
where they are used.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import math
import os
import secrets
import stat
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Final

import attrs
import nacl.exceptions
import nacl.signing

from nexa.contracts import codec
from nexa.errors import (
    BadSignature,
    ClockSkew,
    ConfigError,
    Conflict,
    ContractError,
    ControllerKeyMismatch,
    Replayed,
)

if TYPE_CHECKING:  # the controller's and the release tools' signed records: imported where they are built
    from nexa.contracts.api import AuditCheckpoint, SignedAuditCheckpoint
    from nexa.contracts.evidence import EvidenceManifest, EvidenceSigned, GateReport, ReportSignature, SimSummary
    from nexa.contracts.gateway import Receipt, SignedReceipt
    from nexa.contracts.qualification import Qualification, SignedQualification

log = logging.getLogger(__name__)

#: Raw sizes of an Ed25519 public key and signature.
PUBLIC_KEY_BYTES: Final = 32
SIGNATURE_BYTES: Final = 64
#: Hex digits of SHA-256 kept in a fingerprint (64 bits: enough to tell keys apart by eye).
FINGERPRINT_HEX: Final = 16
#: Every enrollment token starts with this, so scanners and people recognise a leaked one.
TOKEN_PREFIX: Final = "nxb_"  # noqa: S105 - a public prefix, not a secret
#: Random bytes in a token (256 bits).
TOKEN_BYTES: Final = 32
#: Default bound on |message time - our time| (seconds).
DEFAULT_MAX_SKEW_S: Final = 30.0


# --- keys -------------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class PublicKey:
    """An Ed25519 public key: the half that is pinned, enrolled and shared."""

    _key: nacl.signing.VerifyKey = attrs.field(repr=False)

    @classmethod
    def from_bytes(cls, raw: bytes) -> PublicKey:
        if len(raw) != PUBLIC_KEY_BYTES:
            raise ContractError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes, got {len(raw)}")
        return cls(nacl.signing.VerifyKey(raw))

    @classmethod
    def from_b64(cls, text: str) -> PublicKey:
        """Parse standard base64 (what `b64` writes); anything else is a ContractError."""
        try:
            raw = base64.b64decode(text.strip(), validate=True)
        except (binascii.Error, ValueError):
            raise ContractError("public key is not valid base64") from None
        return cls.from_bytes(raw)

    @property
    def raw(self) -> bytes:
        return bytes(self._key)

    def verifies(self, signature: bytes, message: bytes) -> bool:
        """Whether `signature` (64 raw bytes) is this key's over exactly `message`."""
        try:
            self._key.verify(message, signature)
        except nacl.exceptions.BadSignatureError:
            return False
        return True

    @property
    def b64(self) -> str:
        return base64.b64encode(self.raw).decode("ascii")

    @property
    def fingerprint(self) -> str:
        """Short SHA-256 hex of the raw key, for logs and the console (never the key itself)."""
        return hashlib.sha256(self.raw).hexdigest()[:FINGERPRINT_HEX]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PublicKey) and hmac.compare_digest(self.raw, other.raw)

    def __hash__(self) -> int:
        return hash(self.raw)

    def __repr__(self) -> str:
        return f"PublicKey(fingerprint={self.fingerprint!r})"


@attrs.frozen(eq=False)
class SigningKey:
    """An Ed25519 private key. Its repr shows the public fingerprint only."""

    _key: nacl.signing.SigningKey = attrs.field(repr=False)

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(nacl.signing.SigningKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> SigningKey:
        """The key of a 32-byte RFC 8032 seed (what PKCS#8 holds)."""
        return cls(nacl.signing.SigningKey(seed))

    @property
    def public(self) -> PublicKey:
        return PublicKey(self._key.verify_key)

    @property
    def seed(self) -> bytes:
        return bytes(self._key)

    def signature(self, message: bytes) -> bytes:
        """The 64-byte Ed25519 signature over `message`."""
        return self._key.sign(message).signature

    def __repr__(self) -> str:
        return f"SigningKey(fingerprint={self.public.fingerprint!r})"


def generate_signing_key() -> SigningKey:
    return SigningKey.generate()


def save_signing_key(key: SigningKey, path: Path, *, overwrite: bool = False) -> None:
    """Write the private key as unencrypted PKCS#8 PEM (RFC 8410's form, `_ED25519_PKCS8_DER`), mode
    0600, atomically."""
    text = base64.b64encode(_ED25519_PKCS8_DER + key.seed).decode("ascii")  # 64 characters: one line
    head, tail = (marker.decode("ascii") for marker in _PEM_PRIVATE_KEY)
    write_key_file(path, f"{head}\n{text}\n{tail}\n".encode("ascii"), private=True, overwrite=overwrite)


def load_signing_key(path: Path) -> SigningKey:
    """Read a key written by `save_signing_key`; refuses files others can read."""
    return signing_key_from_pem(read_key_file(path, private=True), source=str(path))


def signing_key_from_pem(pem: bytes, *, source: str) -> SigningKey:
    """The key in the PEM bytes `save_signing_key` writes; ConfigError naming `source` otherwise."""
    seed = _ed25519_pkcs8_seed(pem)
    if seed is not None:
        return SigningKey.from_seed(seed)
    from cryptography.hazmat.primitives import serialization  # only here: see `_ED25519_PKCS8_DER`
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError):
        raise ConfigError(f"{source} is not an unencrypted PEM private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{source} holds a {type(key).__name__}, not an Ed25519 key")
    return SigningKey.from_seed(key.private_bytes_raw())


#: The DER of an unencrypted PKCS#8 Ed25519 key (RFC 8410) up to its 32-byte seed: what
#: `save_signing_key` writes, always. A node agent reads its key at every start; taking the seed from
#: this exact form keeps `cryptography`'s serialization package (its SSH, RSA, DSA and EC modules,
#: about 1 MiB) out of the agent's memory (`perf/node_memory.py`). Any other PEM goes through
#: `load_pem_private_key`, as before.
_ED25519_PKCS8_DER: Final = bytes.fromhex("302e020100300506032b657004220420")
_PEM_PRIVATE_KEY: Final = (b"-----BEGIN PRIVATE KEY-----", b"-----END PRIVATE KEY-----")


def _ed25519_pkcs8_seed(pem: bytes) -> bytes | None:
    """The seed of `pem` when it is exactly an unencrypted PKCS#8 Ed25519 key in one PEM block."""
    lines = pem.strip().splitlines()
    if len(lines) < 3 or (lines[0].strip(), lines[-1].strip()) != _PEM_PRIVATE_KEY:
        return None
    try:
        der = base64.b64decode(b"".join(line.strip() for line in lines[1:-1]), validate=True)
    except (binascii.Error, ValueError):
        return None
    if len(der) != len(_ED25519_PKCS8_DER) + 32 or not der.startswith(_ED25519_PKCS8_DER):
        return None
    return der[len(_ED25519_PKCS8_DER) :]


# --- key files ----------------------------------------------------------------------------------


def write_key_file(path: Path, data: bytes, *, private: bool, overwrite: bool = False) -> None:
    """Write `data` to `path` atomically: temp file in the same directory, fsync, then rename.

    Private files are created 0600 from the start (never world-readable, not even briefly);
    public ones 0644. Without `overwrite`, an existing file is a Conflict and is left alone.
    """
    mode = 0o600 if private else 0o644
    directory = path.parent
    try:
        fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise ConfigError(f"cannot write key file {path}: {exc.strerror}") from None
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)  # mkstemp gives 0600; public files get 0644 here
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if overwrite:
            tmp.replace(path)
        else:
            # link() is atomic and fails if the target exists, unlike rename().
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise Conflict(f"key file {path} already exists; refusing to overwrite it") from None
        fsync_dir(directory)
    except OSError as exc:
        raise ConfigError(f"cannot write key file {path}: {exc.strerror}") from None
    finally:
        tmp.unlink(missing_ok=True)
    log.info("wrote %s key file %s", "private" if private else "public", path)


def read_key_file(path: Path, *, private: bool) -> bytes:
    """Read a key file. A private one must not be readable by group or others (like ssh)."""
    try:
        with path.open("rb") as fh:
            mode = os.fstat(fh.fileno()).st_mode
            if private and mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise ConfigError(
                    f"private key file {path} is accessible by other users "
                    f"(mode {stat.S_IMODE(mode):04o}); run chmod 600 on it"
                )
            return fh.read()
    except OSError as exc:
        raise ConfigError(f"cannot read key file {path}: {exc.strerror}") from None


def fsync_dir(directory: Path) -> None:
    """Make a rename or link in `directory` durable (the key files' and the node's own atomic writes)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- signatures ---------------------------------------------------------------------------------


def _signed_bytes(kind: bytes, body: bytes) -> bytes:
    return kind + b"\x00" + body


def sign(key: SigningKey, kind: bytes, body: bytes) -> bytes:
    """Sign exactly the bytes that are sent: `kind NUL body`."""
    if b"\x00" in kind:
        # The NUL separates kind from body; a NUL inside the kind would make them ambiguous.
        raise ValueError("a message kind must not contain NUL")
    return key.signature(_signed_bytes(kind, body))


def verify(pub: PublicKey, sig: bytes, kind: bytes, body: bytes) -> None:
    """Check `sig` over `kind NUL body`, or raise BadSignature. Call before parsing `body`."""
    kind_text = kind.decode("ascii", "replace")
    if b"\x00" in kind or len(sig) != SIGNATURE_BYTES:
        raise BadSignature(f"malformed signature on a {kind_text!r} message", kind=kind_text)
    if not pub.verifies(sig, _signed_bytes(kind, body)):
        raise BadSignature(f"signature on a {kind_text!r} message does not verify", kind=kind_text)


def sign_digest(key: SigningKey, sha256_hex: str) -> str:
    """A detached signature (base64) over the 32 raw bytes of a sha256 digest, e.g. a model artifact's."""
    return base64.b64encode(key.signature(bytes.fromhex(sha256_hex))).decode("ascii")


def verify_digest(pub: PublicKey, signature_b64: str, sha256_hex: str) -> None:
    """Check a `sign_digest` signature, or raise BadSignature (malformed base64 included)."""
    try:
        sig = base64.b64decode(signature_b64.strip(), validate=True)
        digest = bytes.fromhex(sha256_hex)
    except (binascii.Error, ValueError):
        raise BadSignature("the signature is not base64, or the digest is not hex", kind="digest") from None
    if len(sig) != SIGNATURE_BYTES or len(digest) != hashlib.sha256().digest_size:
        raise BadSignature("malformed signature over a digest", kind="digest")
    if not pub.verifies(sig, digest):
        raise BadSignature("the signature over the digest does not verify", kind="digest")


# --- receipts -----------------------------------------------------------------------------------

#: Domain separation: a receipt signature can never be mistaken for any other nexa signature.
RECEIPT_CONTEXT: Final = b"nexa.receipt.v1\x00"


def _receipt_bytes(receipt: Receipt) -> bytes:
    body = codec.wire.unstructure(receipt)
    if not body.get("adapter"):
        body.pop("adapter", None)  # a receipt without a LoRA adapter signs as receipts did before them
    return RECEIPT_CONTEXT + codec.canonical_json(body).encode()


def sign_receipt(key: SigningKey, receipt: Receipt) -> SignedReceipt:
    """Sign a receipt's canonical JSON (`codec.wire`); signature and public key in standard base64."""
    from nexa.contracts.gateway import SignedReceipt

    signature = key.signature(_receipt_bytes(receipt))
    return SignedReceipt(
        receipt=receipt,
        signature=base64.b64encode(signature).decode("ascii"),
        public_key=key.public.b64,
        key_id=key.public.fingerprint,
    )


def verify_receipt_among(keys: Mapping[str, PublicKey], signed: SignedReceipt) -> PublicKey:
    """Check a receipt against the one of `keys` (key id → the controller's current and retired
    keys) it names, by its `key_id` or, in a receipt from before key ids, by its embedded key's id.
    The key that verified it; BadSignature when none of `keys` has that id, or it does not verify."""
    wanted = signed.key_id
    if not wanted:
        try:
            wanted = PublicKey.from_b64(signed.public_key).fingerprint
        except ContractError:
            raise BadSignature("the receipt names no key", kind="receipt") from None
    pub = keys.get(wanted)
    if pub is None:
        raise BadSignature(
            f"the receipt was signed by key {wanted[:32]!r}, not one of the controller's", kind="receipt"
        )
    verify_receipt(pub, signed)
    return pub


def verify_receipt(pub: PublicKey, signed: SignedReceipt) -> None:
    """Check a signed receipt against the controller's published key, or raise BadSignature.

    The key embedded in the receipt is only a hint: it must equal `pub`, never replace it.
    """
    if not hmac.compare_digest(signed.public_key.strip().encode("ascii", "replace"), pub.b64.encode("ascii")):
        raise BadSignature("the receipt was signed by another key than the controller's", kind="receipt")
    try:
        sig = base64.b64decode(signed.signature.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise BadSignature("the receipt's signature is not base64", kind="receipt") from None
    if len(sig) != SIGNATURE_BYTES:
        raise BadSignature("malformed receipt signature", kind="receipt")
    if not pub.verifies(sig, _receipt_bytes(signed.receipt)):
        raise BadSignature("the receipt's signature does not verify (edited?)", kind="receipt")


# --- audit checkpoints --------------------------------------------------------------------------

#: Domain separation: an audit checkpoint signature is never valid as any other nexa signature.
AUDIT_HEAD_CONTEXT: Final = b"nexa.audit-head.v1\x00"


def _checkpoint_bytes(checkpoint: AuditCheckpoint) -> bytes:
    return AUDIT_HEAD_CONTEXT + codec.dumps(codec.api, checkpoint).encode()


def sign_audit_checkpoint(key: SigningKey, checkpoint: AuditCheckpoint) -> SignedAuditCheckpoint:
    """Sign the audit head (`nexa audit head`); signature and public key in standard base64."""
    from nexa.contracts.api import SignedAuditCheckpoint

    signature = key.signature(_checkpoint_bytes(checkpoint))
    return SignedAuditCheckpoint(
        checkpoint=checkpoint, signature=base64.b64encode(signature).decode("ascii"), public_key=key.public.b64
    )


def verify_audit_checkpoint(pub: PublicKey, signed: SignedAuditCheckpoint) -> None:
    """Check a signed checkpoint against the controller key the verifier trusts, or raise BadSignature.
    The key embedded in the checkpoint must equal `pub`, never replace it."""
    if not hmac.compare_digest(signed.public_key.strip().encode("ascii", "replace"), pub.b64.encode("ascii")):
        raise BadSignature("the checkpoint was signed by another key than the controller's", kind="audit-head")
    try:
        sig = base64.b64decode(signed.signature.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise BadSignature("the checkpoint's signature is not base64", kind="audit-head") from None
    if len(sig) != SIGNATURE_BYTES:
        raise BadSignature("malformed checkpoint signature", kind="audit-head")
    try:
        signed_bytes = _checkpoint_bytes(signed.checkpoint)
    except ValueError:  # a number canonical JSON cannot write (NaN, infinity): never signed by us
        raise BadSignature("the checkpoint holds a number no checkpoint has", kind="audit-head") from None
    if not pub.verifies(sig, signed_bytes):
        raise BadSignature("the checkpoint's signature does not verify (edited?)", kind="audit-head")


# --- release evidence ---------------------------------------------------------------------------

#: The kind an evidence manifest is signed with (`sign(key, EVIDENCE_KIND, evidence_body(manifest))`).
EVIDENCE_KIND: Final = b"nexa-evidence-v1"


def evidence_body(manifest: EvidenceManifest) -> bytes:
    """The bytes an evidence manifest's signature covers: its canonical JSON (API form), without
    `provenance` when it has none (as manifests signed before provenance existed were)."""
    data = codec.api.unstructure(manifest)
    if data.get("provenance") is None:
        data.pop("provenance", None)
    return codec.canonical_json(data).encode()


def _canonical_body(record: object) -> bytes:
    """The bytes a signed contract record's signature covers: its canonical JSON (API form)."""
    return codec.canonical_json(codec.api.unstructure(record)).encode()


def sign_evidence(key: SigningKey, manifest: EvidenceManifest) -> EvidenceSigned:
    """The controller's signature over a release-evidence manifest (`POST /api/v1/evidence`)."""
    from nexa.contracts.evidence import EvidenceSigned

    signature = sign(key, EVIDENCE_KIND, evidence_body(manifest))
    return EvidenceSigned(
        manifest=manifest, signature=base64.b64encode(signature).decode("ascii"), public_key=key.public.b64
    )


def verify_signed(signed: EvidenceSigned, trusted_public_key: str | None) -> list[str]:
    """What is wrong with a signed evidence manifest, offline; empty: its signature holds.

    `trusted_public_key` (base64, `public_key` of GET /api/v1/receipts/public-key) must be the key that signed
    it; None checks against the key the manifest carries, which proves integrity, not origin (the
    problem list says so only when the signature fails). Never raises for a hostile input.
    """
    return _signed_problems(
        signed.public_key,
        signed.signature,
        trusted_public_key,
        kind=EVIDENCE_KIND,
        body=lambda: evidence_body(signed.manifest),
        noun="manifest",
    )


def _signed_problems(
    public_key: str,
    signature: str,
    trusted_public_key: str | None,
    *,
    kind: bytes,
    body: Callable[[], bytes],
    noun: str,
) -> list[str]:
    """What is wrong with a detached signature (`sign(key, kind, body())`) over a `noun`, offline."""
    problems: list[str] = []
    try:
        embedded = PublicKey.from_b64(public_key)
    except ContractError:
        return [f"the {noun}'s public_key is not an Ed25519 public key in base64"]
    pub = embedded
    if trusted_public_key is not None:
        try:
            pub = PublicKey.from_b64(trusted_public_key)
        except ContractError:
            return ["the trusted public key is not an Ed25519 public key in base64"]
        if pub != embedded:
            problems.append(
                f"signed by key {embedded.fingerprint}, not the trusted key {pub.fingerprint}: "
                "check --public-key against `public_key` of GET /api/v1/receipts/public-key"
            )
    try:
        sig = base64.b64decode(signature.strip(), validate=True)
    except (binascii.Error, ValueError):
        return [*problems, "the signature is not base64"]
    try:
        verify(pub, sig, kind, body())
    except ValueError:  # a number canonical JSON cannot write (NaN, infinity): never signed by us
        problems.append(f"the {noun} holds a number no {noun} has")
    except BadSignature:
        problems.append(f"the signature does not verify: the {noun} was changed after it was signed")
    return problems


# --- signed sim summaries and gate reports ---------------------------------------------------

#: The kinds a sim summary (`nexa sim --sign-key`) and a gate report (`release-gate.sh --sign-key`) are signed with.
SIM_REPORT_KIND: Final = b"nexa-sim-report-v1"
GATE_REPORT_KIND: Final = b"nexa-gate-report-v1"


def _report_kind(report: SimSummary | GateReport) -> bytes:
    from nexa.contracts.evidence import SimSummary

    return SIM_REPORT_KIND if isinstance(report, SimSummary) else GATE_REPORT_KIND


def report_body(report: SimSummary | GateReport) -> bytes:
    """The bytes a report's signature covers: its canonical JSON (API form)."""
    return _canonical_body(report)


def sign_report(key: SigningKey, report: SimSummary | GateReport) -> ReportSignature:
    """A detached signature over a sim summary or gate report, by the release pipeline's key."""
    from nexa.contracts.evidence import ReportSignature

    signature = sign(key, _report_kind(report), report_body(report))
    return ReportSignature(public_key=key.public.b64, signature=base64.b64encode(signature).decode("ascii"))


def parse_report_signature(signed: ReportSignature) -> tuple[PublicKey, bytes]:
    """The key and raw signature of `signed`, or ContractError when either is malformed."""
    key = PublicKey.from_b64(signed.public_key)
    try:
        raw = base64.b64decode(signed.signature.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ContractError("the signature is not base64") from None
    if len(raw) != SIGNATURE_BYTES:
        raise ContractError(f"an Ed25519 signature is {SIGNATURE_BYTES} bytes, got {len(raw)}")
    return key, raw


def verify_report(signed: ReportSignature, report: SimSummary | GateReport) -> PublicKey:
    """The key whose signature over `report` holds (it proves integrity; whether that key is trusted
    is the caller's question). ContractError when malformed, BadSignature when it does not verify."""
    key, raw = parse_report_signature(signed)
    try:
        body = report_body(report)
    except ValueError:  # a number canonical JSON cannot write: never signed
        raise BadSignature("the report holds a number no signed report has", kind="report") from None
    verify(key, raw, _report_kind(report), body)
    return key


# --- runtime qualifications ---------------------------------------------------------------------

#: The kind a qualification record is signed with (`sign(key, QUALIFICATION_KIND, qualification_body(q))`).
QUALIFICATION_KIND: Final = b"nexa-qualification-v1"


def qualification_body(record: Qualification) -> bytes:
    """The bytes a qualification's signature covers: its canonical JSON (API form)."""
    return _canonical_body(record)


def sign_qualification(key: SigningKey, record: Qualification) -> SignedQualification:
    """The controller's signature over a runtime qualification (`nexa runtimes qualify`)."""
    from nexa.contracts.qualification import SignedQualification

    signature = sign(key, QUALIFICATION_KIND, qualification_body(record))
    return SignedQualification(
        qualification=record, signature=base64.b64encode(signature).decode("ascii"), public_key=key.public.b64
    )


def verify_qualification(signed: SignedQualification, trusted_public_key: str | None) -> list[str]:
    """What is wrong with a signed qualification, offline; empty: its signature holds (as
    `verify_signed`: None checks against the key it carries, proving integrity, not origin)."""
    return _signed_problems(
        signed.public_key,
        signed.signature,
        trusted_public_key,
        kind=QUALIFICATION_KIND,
        body=lambda: qualification_body(signed.qualification),
        noun="qualification",
    )


# --- replay window ------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ReplayWindow:
    """One peer's replay fence: the last sequence number accepted and the allowed clock skew.

    Immutable (urllib3 `Retry` style): `check` returns the window to keep if the message is
    accepted, and raises without changing anything if it is not.
    """

    #: Highest sequence number accepted so far; -1 before the first (sequences start at 0).
    last_seq: int = -1
    max_skew_s: float = DEFAULT_MAX_SKEW_S

    def check(self, seq: int, ts: float, now: float) -> ReplayWindow:
        if seq <= self.last_seq:
            raise Replayed(seq=seq, last_seq=self.last_seq)
        skew = abs(ts - now)
        # `not <=` so that a NaN timestamp is refused, not waved through.
        if not skew <= self.max_skew_s:
            raise ClockSkew(skew_s=skew if math.isfinite(skew) else math.inf, max_skew_s=self.max_skew_s)
        return attrs.evolve(self, last_seq=seq)


# --- enrollment tokens --------------------------------------------------------------------------


def new_enrollment_token() -> str:
    """A one-time bootstrap token: `nxb_` and 32 random bytes, URL-safe base64 without padding."""
    return TOKEN_PREFIX + secrets.token_urlsafe(TOKEN_BYTES)


def is_enrollment_token(text: str) -> bool:
    """Whether `text` has the shape of a token (prefix and length), not whether it is valid."""
    body = text.removeprefix(TOKEN_PREFIX)
    return text.startswith(TOKEN_PREFIX) and len(body) == _TOKEN_BODY_CHARS and all(c in _URLSAFE for c in body)


_TOKEN_BODY_CHARS: Final = len(base64.urlsafe_b64encode(bytes(TOKEN_BYTES)).rstrip(b"="))
_URLSAFE: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


# --- the controller's fingerprint: what a node pins at enrollment ---------------------------------

#: Joins a token's secret and the controller fingerprint it carries: `nxb_<secret>.<fingerprint>`.
#: Not in the URL-safe alphabet, so the split is unambiguous.
TOKEN_PIN_SEPARATOR: Final = "."  # noqa: S105 - a separator, not a secret
#: Hex digits of a controller fingerprint: the whole SHA-256 (a pin, not a label for the eye).
CONTROLLER_FINGERPRINT_HEX: Final = 64
#: Domain separation: the fingerprint hashes both public keys and nothing can be confused with it.
_CONTROLLER_FINGERPRINT_CONTEXT: Final = b"nexa.controller-keys.v1\x00"
_HEX: Final = frozenset("0123456789abcdef")


def controller_fingerprint(signing_public_b64: str, curve_public_z85: str) -> str:
    """SHA-256 (hex) over the controller's Ed25519 key (raw) and its CurveZMQ key (Z85 text).

    Both keys are covered: a node that pinned only the signing key could still be made to dial an
    impostor's channel. ContractError if the signing key is not an Ed25519 key in base64.
    """
    raw = PublicKey.from_b64(signing_public_b64).raw
    curve = curve_public_z85.strip().encode("ascii", "replace")
    return hashlib.sha256(_CONTROLLER_FINGERPRINT_CONTEXT + raw + b"\x00" + curve).hexdigest()


def parse_controller_fingerprint(text: str) -> str:
    """A fingerprint as an operator may type it (any case, `:` or spaces between groups, an optional
    `sha256:`), normalised to 64 lower-case hex digits; ContractError otherwise."""
    cleaned = text.strip().lower().removeprefix("sha256:").replace(":", "").replace(" ", "")
    if len(cleaned) != CONTROLLER_FINGERPRINT_HEX or not set(cleaned) <= _HEX:
        raise ContractError(f"a controller fingerprint is {CONTROLLER_FINGERPRINT_HEX} hex digits (SHA-256)")
    return cleaned


def pinned_enrollment_token(secret: str, fingerprint: str) -> str:
    """The token as `nexa tokens create` shows it: the secret, then the controller's fingerprint."""
    return secret + TOKEN_PIN_SEPARATOR + parse_controller_fingerprint(fingerprint)


def split_enrollment_token(text: str) -> tuple[str, str | None]:
    """(secret, fingerprint or None) of a token; only the secret is sent to the controller.
    ContractError when the part after the separator is not a fingerprint."""
    secret, sep, fingerprint = text.strip().partition(TOKEN_PIN_SEPARATOR)
    return secret, parse_controller_fingerprint(fingerprint) if sep else None


def check_controller_fingerprint(expected: str, signing_public_b64: str, curve_public_z85: str) -> None:
    """Raise ControllerKeyMismatch unless the keys have the `expected` fingerprint (constant time)."""
    want = parse_controller_fingerprint(expected)
    got = controller_fingerprint(signing_public_b64, curve_public_z85)
    if not hmac.compare_digest(want.encode("ascii"), got.encode("ascii")):
        raise ControllerKeyMismatch(expected=want, got=got)


def hash_token(token: str) -> str:
    """What the controller stores instead of a token: its SHA-256, hex."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def token_matches(token: str, stored_sha256: str) -> bool:
    """Constant-time comparison of a presented token against a stored hash."""
    return hmac.compare_digest(hash_token(token).encode("ascii"), stored_sha256.encode("ascii", "replace"))


# --- backups: the key and the sealed archive (nexa.control.operations.backup) ------------------------------

#: A backup key: 32 random bytes (AES-256), written as standard base64 (44 characters) or hex (64).
BACKUP_KEY_BYTES: Final = 32
#: AES-GCM's nonce: 96 random bits, new for every backup sealed.
BACKUP_NONCE_BYTES: Final = 12
#: Hex digits of a backup key's id: tells keys apart (wrong key vs damaged file), reveals nothing.
BACKUP_KEY_ID_HEX: Final = 16
_BACKUP_KEY_ID_CONTEXT: Final = b"nexa.backup-key-id.v1\x00"
#: The most bytes one AES-GCM call seals (cryptography's limit, 2 GiB - 1).
BACKUP_MAX_BYTES: Final = 2**31 - 1


def new_backup_key() -> str:
    """A new backup key, standard base64 of 32 random bytes (`nexa keygen --backup`)."""
    return base64.b64encode(secrets.token_bytes(BACKUP_KEY_BYTES)).decode("ascii")


def parse_backup_key(text: str, *, source: str) -> bytes:
    """The 32 bytes of a backup key written as base64 or hex; ConfigError naming `source` otherwise."""
    cleaned = text.strip()
    try:
        raw = (
            bytes.fromhex(cleaned) if len(cleaned) == 2 * BACKUP_KEY_BYTES else base64.b64decode(cleaned, validate=True)
        )
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != BACKUP_KEY_BYTES:
        raise ConfigError(
            f"{source} is not a backup key: it must hold {BACKUP_KEY_BYTES} bytes as base64 or hex;"
            " make one with `nexa keygen --backup --out FILE`"
        )
    return raw


def backup_key_id(key: bytes) -> str:
    """A short public id of a backup key (a hash, never the key), stored in each backup's header."""
    return hashlib.sha256(_BACKUP_KEY_ID_CONTEXT + key).hexdigest()[:BACKUP_KEY_ID_HEX]


def backup_nonce() -> bytes:
    """A fresh random 96-bit AES-GCM nonce (one per backup sealed)."""
    return secrets.token_bytes(BACKUP_NONCE_BYTES)


def seal(key: bytes, header: bytes, nonce: bytes, plaintext: bytes) -> bytes:
    """AES-256-GCM under `key` and `nonce` (`backup_nonce`, never reused), `header` as associated
    data: the ciphertext with its 16-byte tag."""
    if len(plaintext) > BACKUP_MAX_BYTES:
        raise ValueError(f"AES-GCM seals at most {BACKUP_MAX_BYTES} bytes at once")
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # the controller's alone (backups)

    return AESGCM(key).encrypt(nonce, plaintext, header)


def unseal(key: bytes, header: bytes, nonce: bytes, ciphertext: bytes) -> bytes | None:
    """The plaintext `seal` made, or None when key, header, nonce or ciphertext is not what was sealed."""
    from cryptography.exceptions import InvalidTag  # the controller's alone (backups)
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    try:
        return AESGCM(key).decrypt(nonce, ciphertext, header)
    except (InvalidTag, ValueError):
        return None
