"""nexa.security: Ed25519 keys and files, signatures, the replay window, enrollment tokens. Plain sync tests."""

from __future__ import annotations

import base64
import math
import stat
from pathlib import Path

import attrs
import pytest

from nexa import security
from nexa.contracts import codec
from nexa.contracts.domain import KeyId, TenantId
from nexa.contracts.gateway import Capability, Receipt, WorkloadState
from nexa.errors import AuthError, BadSignature, ClockSkew, ConfigError, Conflict, ContractError, Replayed

# --- keys ---------------------------------------------------------------------------------------


def test_public_key_round_trips_through_raw_and_base64() -> None:
    pub = security.generate_signing_key().public
    assert len(pub.raw) == 32
    assert security.PublicKey.from_bytes(pub.raw) == pub
    assert security.PublicKey.from_b64(pub.b64) == pub
    assert base64.b64decode(pub.b64) == pub.raw


def test_distinct_keys_have_distinct_short_fingerprints() -> None:
    a, b = security.generate_signing_key().public, security.generate_signing_key().public
    assert a != b
    assert len(a.fingerprint) == 16
    assert int(a.fingerprint, 16) >= 0  # hex
    assert a.fingerprint != b.fingerprint
    assert security.PublicKey.from_b64(a.b64).fingerprint == a.fingerprint


@pytest.mark.parametrize("text", ["not base64!", base64.b64encode(b"short").decode(), ""])
def test_malformed_public_key_is_a_contract_error(text: str) -> None:
    with pytest.raises(ContractError):
        security.PublicKey.from_b64(text)


def test_private_key_never_shows_in_repr() -> None:
    key = security.generate_signing_key()
    assert key.public.fingerprint in repr(key)
    assert "PRIVATE" not in repr(key)
    assert key.public.b64 not in repr(key.public)


def test_saved_key_is_0600_and_loads_back(tmp_path: Path) -> None:
    key = security.generate_signing_key()
    path = tmp_path / "node.key"
    security.save_signing_key(key, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert security.load_signing_key(path).public == key.public
    assert [p.name for p in tmp_path.iterdir()] == ["node.key"]  # no temp file left behind


def test_saving_over_an_existing_key_needs_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    first, second = security.generate_signing_key(), security.generate_signing_key()
    security.save_signing_key(first, path)
    with pytest.raises(Conflict):
        security.save_signing_key(second, path)
    assert security.load_signing_key(path).public == first.public
    security.save_signing_key(second, path, overwrite=True)
    assert security.load_signing_key(path).public == second.public
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["node.key"]


def test_loading_a_key_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    security.save_signing_key(security.generate_signing_key(), path)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        security.load_signing_key(path)


def test_loading_a_missing_or_garbage_key_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        security.load_signing_key(tmp_path / "absent.key")
    garbage = tmp_path / "garbage.key"
    security.write_key_file(garbage, b"hello", private=True)
    with pytest.raises(ConfigError, match="not an unencrypted PEM"):
        security.load_signing_key(garbage)


def test_a_pem_key_reads_as_cryptography_reads_it_in_every_form(tmp_path: Path) -> None:
    """The seed of the PKCS#8 form `save_signing_key` writes is read without cryptography's loader
    (`_ED25519_PKCS8_DER`); any other form still goes through it: the same key either way, and a
    key of another kind or a damaged one is still a ConfigError. cryptography writes the PEM here,
    and checks the signatures PyNaCl makes: the same Ed25519 (RFC 8032) both ways."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ec import SECP256R1, generate_private_key
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

    key = security.generate_signing_key()
    theirs = Ed25519PrivateKey.from_private_bytes(key.seed)
    pem = theirs.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    assert security._ed25519_pkcs8_seed(pem) == key.seed
    assert security.signing_key_from_pem(pem, source="k").public == key.public
    assert theirs.public_key().public_bytes_raw() == key.public.raw
    # What nexa writes is byte for byte what cryptography writes for the same key.
    security.save_signing_key(key, tmp_path / "k.pem")
    assert (tmp_path / "k.pem").read_bytes() == pem
    # Each checks the other's signatures.
    Ed25519PublicKey.from_public_bytes(key.public.raw).verify(key.signature(b"m"), b"m")
    assert key.public.verifies(theirs.sign(b"m"), b"m")
    assert not key.public.verifies(theirs.sign(b"m"), b"n")
    # The OpenSSH form of the same key is neither the fast path's nor a PEM the loader reads.
    openssh = theirs.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    assert security._ed25519_pkcs8_seed(openssh) is None
    with pytest.raises(ConfigError, match="not an unencrypted PEM"):
        security.signing_key_from_pem(openssh, source="k")
    # Line endings and surrounding blank lines do not matter to either path.
    assert security.signing_key_from_pem(b"\n" + pem.replace(b"\n", b"\r\n"), source="k").public == key.public
    ec = generate_private_key(SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    assert security._ed25519_pkcs8_seed(ec) is None
    with pytest.raises(ConfigError, match="not an Ed25519 key"):
        security.signing_key_from_pem(ec, source="k")
    damaged = pem.replace(pem.splitlines()[1][:8], b"AAAAAAAA")
    assert security._ed25519_pkcs8_seed(damaged) is None
    with pytest.raises(ConfigError, match="not an unencrypted PEM"):
        security.signing_key_from_pem(damaged, source="k")
    signed = security.sign(security.signing_key_from_pem(pem, source="k"), b"kind", b"body")
    security.verify(key.public, signed, b"kind", b"body")


def test_public_key_files_are_world_readable(tmp_path: Path) -> None:
    path = tmp_path / "controller.pub"
    security.write_key_file(path, b"abc\n", private=False)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert security.read_key_file(path, private=False) == b"abc\n"


# --- signatures ---------------------------------------------------------------------------------


def test_signature_verifies_over_kind_and_body() -> None:
    key = security.generate_signing_key()
    sig = security.sign(key, b"heartbeat", b'{"seq":1}')
    assert len(sig) == 64
    security.verify(key.public, sig, b"heartbeat", b'{"seq":1}')  # no exception


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        (b"heartbeat", b'{"seq":2}'),  # tampered body
        (b"ack", b'{"seq":1}'),  # same body, another kind
        (b"heartbeat\x00{", b'"seq":1}'),  # moving bytes across the separator
    ],
)
def test_tampering_with_kind_or_body_breaks_the_signature(kind: bytes, body: bytes) -> None:
    key = security.generate_signing_key()
    sig = security.sign(key, b"heartbeat", b'{"seq":1}')
    with pytest.raises(BadSignature) as info:
        security.verify(key.public, sig, kind, body)
    assert isinstance(info.value, AuthError)
    assert info.value.code == "bad_signature"


def test_another_keys_signature_is_rejected() -> None:
    signer, other = security.generate_signing_key(), security.generate_signing_key()
    sig = security.sign(other, b"hello", b"{}")
    with pytest.raises(BadSignature):
        security.verify(signer.public, sig, b"hello", b"{}")


@pytest.mark.parametrize("sig", [b"", b"\x00" * 63, b"\x00" * 65, b"\x00" * 64])
def test_malformed_signatures_are_rejected(sig: bytes) -> None:
    with pytest.raises(BadSignature):
        security.verify(security.generate_signing_key().public, sig, b"hello", b"{}")


def test_a_kind_with_nul_cannot_be_signed() -> None:
    with pytest.raises(ValueError, match="NUL"):
        security.sign(security.generate_signing_key(), b"he\x00llo", b"{}")


# --- replay window ------------------------------------------------------------------------------


def test_window_accepts_increasing_sequences_and_is_immutable() -> None:
    w0 = security.ReplayWindow(max_skew_s=5.0)
    w1 = w0.check(0, ts=100.0, now=100.0)
    w2 = w1.check(7, ts=104.0, now=100.0)  # gaps are fine; only order matters
    assert (w0.last_seq, w1.last_seq, w2.last_seq) == (-1, 0, 7)
    assert w2.max_skew_s == 5.0


@pytest.mark.parametrize("seq", [7, 6, 0, -1])
def test_window_rejects_a_sequence_at_or_below_the_last(seq: int) -> None:
    w = security.ReplayWindow(last_seq=7)
    with pytest.raises(Replayed) as info:
        w.check(seq, ts=0.0, now=0.0)
    assert (info.value.seq, info.value.last_seq) == (seq, 7)
    assert w.last_seq == 7  # unchanged


@pytest.mark.parametrize("ts", [100.0 - 5.001, 100.0 + 5.001, math.nan, math.inf])
def test_window_rejects_timestamps_outside_the_skew(ts: float) -> None:
    w = security.ReplayWindow(max_skew_s=5.0)
    with pytest.raises(ClockSkew) as info:
        w.check(1, ts=ts, now=100.0)
    assert info.value.skew_s > 5.0
    assert info.value.max_skew_s == 5.0


def test_window_accepts_the_skew_bound_itself() -> None:
    w = security.ReplayWindow(max_skew_s=5.0)
    assert w.check(1, ts=95.0, now=100.0).check(2, ts=105.0, now=100.0).last_seq == 2


def test_a_rejected_timestamp_does_not_consume_the_sequence() -> None:
    w = security.ReplayWindow(max_skew_s=1.0)
    with pytest.raises(ClockSkew):
        w.check(3, ts=50.0, now=100.0)
    assert w.check(3, ts=100.0, now=100.0).last_seq == 3


# --- enrollment tokens --------------------------------------------------------------------------


def test_token_has_prefix_and_256_random_bits() -> None:
    token = security.new_enrollment_token()
    assert token.startswith("nxb_")
    body = token.removeprefix("nxb_")
    assert len(base64.urlsafe_b64decode(body + "=")) == 32
    assert security.is_enrollment_token(token)
    assert len({security.new_enrollment_token() for _ in range(100)}) == 100


@pytest.mark.parametrize(
    "text", ["", "nxb_", "nxb_short", "xxx_" + "A" * 43, "nxb_" + "A" * 42 + "!", "nxk_" + "A" * 43]
)
def test_not_token_shaped(text: str) -> None:
    assert not security.is_enrollment_token(text)


def test_token_is_stored_as_its_hash_and_compared() -> None:
    token = security.new_enrollment_token()
    stored = security.hash_token(token)
    assert len(stored) == 64
    assert token not in stored
    assert security.token_matches(token, stored)
    assert not security.token_matches(security.new_enrollment_token(), stored)
    assert not security.token_matches(token, stored.upper())
    assert not security.token_matches(token, "")


# --- receipts -----------------------------------------------------------------------------------


def _receipt() -> Receipt:
    return Receipt(
        receipt_id="rcpt_1",
        workload_id="w1",
        idempotency_key_sha256="0" * 64,
        tenant=TenantId("acme"),
        key_id=KeyId("k1"),
        capability=Capability.CHAT,
        alias="chat",
        model="llama",
        model_version="1",
        deployment="chat-prod",
        node_id="n1",
        state=WorkloadState.SUCCEEDED,
        error=None,
        prompt_tokens=3,
        completion_tokens=4,
        queue_ms=0.5,
        ttft_ms=None,
        duration_ms=12.0,
        accepted_at=1.0,
        finished_at=2.0,
        controller_epoch=7,
    )


def test_a_signed_receipt_verifies_with_the_controller_key() -> None:
    key = security.generate_signing_key()
    signed = security.sign_receipt(key, _receipt())
    assert signed.public_key == key.public.b64
    assert len(base64.b64decode(signed.signature)) == 64
    security.verify_receipt(key.public, signed)
    # The signature covers the canonical JSON under its own context: it is no other kind of signature.
    # A receipt no LoRA adapter served signs without the `adapter` key, as receipts did before adapters.
    fields = codec.wire.unstructure(signed.receipt)
    assert fields.pop("adapter") == ""
    body = codec.canonical_json(fields).encode()
    security.verify(key.public, base64.b64decode(signed.signature), b"nexa.receipt.v1", body)
    with_adapter = security.sign_receipt(key, attrs.evolve(_receipt(), adapter="tiny-poet:a1"))
    security.verify_receipt(key.public, with_adapter)


@pytest.mark.parametrize(
    "change",
    [
        {"completion_tokens": 400},
        {"state": WorkloadState.FAILED},
        {"tenant": TenantId("other")},
        {"ttft_ms": 1.0},
        {"adapter": "tiny-poet:a1"},
    ],
)
def test_an_edited_receipt_does_not_verify(change: dict[str, object]) -> None:
    key = security.generate_signing_key()
    signed = security.sign_receipt(key, _receipt())
    edited = attrs.evolve(signed, receipt=attrs.evolve(signed.receipt, **change))
    with pytest.raises(BadSignature) as bad:
        security.verify_receipt(key.public, edited)
    assert bad.value.kind == "receipt"


def test_a_receipt_signed_by_another_key_does_not_verify_even_if_it_names_that_key() -> None:
    ours, theirs = security.generate_signing_key(), security.generate_signing_key()
    forged = security.sign_receipt(theirs, _receipt())
    with pytest.raises(BadSignature, match="another key"):
        security.verify_receipt(ours.public, forged)
    # Claiming our key while signed with theirs does not help either.
    with pytest.raises(BadSignature):
        security.verify_receipt(ours.public, attrs.evolve(forged, public_key=ours.public.b64))


@pytest.mark.parametrize("signature", ["not base64!", base64.b64encode(b"short").decode(), ""])
def test_a_malformed_receipt_signature_is_bad(signature: str) -> None:
    key = security.generate_signing_key()
    signed = attrs.evolve(security.sign_receipt(key, _receipt()), signature=signature)
    with pytest.raises(BadSignature):
        security.verify_receipt(key.public, signed)
