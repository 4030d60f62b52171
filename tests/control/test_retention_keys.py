"""Retention's keys and sealed objects (`control.datapath.retention`): the `[retention] key_file` format and
its refusals, each tenant's data key wrapped by it, and payloads sealed to their object key."""

from __future__ import annotations

import base64
import secrets
from pathlib import Path

import pytest

from nexa import config
from nexa.config import ControlConfig
from nexa.control.datapath.retention import (
    MAGIC,
    load_retention_key,
    open_payload,
    seal_payload,
    unwrap_data_key,
    wrap_data_key,
)
from nexa.errors import ConfigError


def key_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "retention.key"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_key_file_holds_32_bytes_as_base64_or_hex(tmp_path: Path) -> None:
    raw = secrets.token_bytes(32)
    assert load_retention_key(str(key_file(tmp_path, base64.b64encode(raw).decode() + "\n"))) == raw
    assert load_retention_key(str(key_file(tmp_path, raw.hex()))) == raw


@pytest.mark.parametrize("text", ["", "short", base64.b64encode(b"x" * 16).decode(), "z" * 64])
def test_a_bad_key_file_is_refused_saying_how_to_make_one(tmp_path: Path, text: str) -> None:
    path = key_file(tmp_path, text)
    with pytest.raises(ConfigError, match="is not a retention key") as info:
        load_retention_key(str(path))
    assert "nexa keygen --backup --out FILE" in str(info.value)


def test_a_key_file_others_may_read_is_refused(tmp_path: Path) -> None:
    path = key_file(tmp_path, base64.b64encode(secrets.token_bytes(32)).decode(), mode=0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_retention_key(str(path))


def test_a_missing_key_file_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read key file"):
        load_retention_key(str(tmp_path / "absent.key"))


def test_a_key_file_without_a_bucket_and_store_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "control.toml"
    path.write_text('[retention]\nkey_file = "/etc/nexa/retention.key"\n')
    with pytest.raises(ConfigError, match=r"retention.*bucket"):
        config.load(path, ControlConfig)
    path.write_text(
        '[artifacts]\ns3_endpoint = "http://127.0.0.1:8333"\n'
        '[retention]\nkey_file = "/etc/nexa/retention.key"\nbucket = "kept"\nprefix = "p/"\n'
    )
    cfg = config.load(path, ControlConfig)
    assert (cfg.retention.bucket, cfg.retention.prefix) == ("kept", "p/")


def test_a_data_key_opens_only_with_its_master_key_and_tenant() -> None:
    master, other = secrets.token_bytes(32), secrets.token_bytes(32)
    data_key = secrets.token_bytes(32)
    wrapped = wrap_data_key(master, "acme", data_key)
    assert data_key not in base64.b64decode(wrapped)
    assert unwrap_data_key(master, "acme", wrapped) == data_key
    assert unwrap_data_key(other, "acme", wrapped) is None
    assert unwrap_data_key(master, "beta", wrapped) is None  # moved to another tenant: refused
    assert unwrap_data_key(master, "acme", "not base64!") is None


def test_a_sealed_payload_holds_no_plaintext_and_opens_only_under_its_object_key() -> None:
    data_key = secrets.token_bytes(32)
    plaintext = b'{"request": "canary-7f3a", "answer": "..."}'
    blob = seal_payload(data_key, "retained/acme/ret_1", plaintext)
    assert blob.startswith(MAGIC) and b"canary" not in blob
    assert open_payload(data_key, "retained/acme/ret_1", blob) == plaintext
    assert open_payload(data_key, "retained/beta/ret_1", blob) is None  # copied under another name
    assert open_payload(secrets.token_bytes(32), "retained/acme/ret_1", blob) is None
    assert open_payload(data_key, "retained/acme/ret_1", blob[:-1] + bytes([blob[-1] ^ 1])) is None
