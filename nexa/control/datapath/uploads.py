"""Media uploads: reading a `multipart/form-data` request (werkzeug's sans-I/O `MultipartDecoder`,
the parser quart's own form handling uses) and writing the one a runtime gets.

A form is read from the request body already held in memory (bounded by `gateway.max_upload_bytes`,
never written to disk) into its text fields and one file. What is not a well-formed form of that
shape is a `ContractError` naming what to send instead. No payload is logged.
"""

from __future__ import annotations

import re
import secrets
from typing import Final

from werkzeug.http import parse_options_header
from werkzeug.sansio.multipart import NEED_DATA, Data, Epilogue, Field, File, MultipartDecoder

from nexa.control.datapath.calls import Upload
from nexa.errors import ContractError

#: Most parts a form may have (OpenAI's transcription form has about a dozen fields).
MAX_PARTS: Final = 64
#: Longest text field value (characters): a prompt, a language, a format.
MAX_FIELD_CHARS: Final = 16 * 1024
_FORM: Final = "multipart/form-data"
#: What a boundary may hold (RFC 2046 §5.1.1): 1 to 70 of these characters.
_BOUNDARY: Final = re.compile(r"[0-9A-Za-z'()+_,./:=? -]{0,69}[0-9A-Za-z'()+_,./:=?-]")


def form_boundary(content_type: str | None) -> bytes:
    """The boundary of a `multipart/form-data` content type; a ContractError for any other type."""
    mime, options = parse_options_header(content_type or "")
    boundary = options.get("boundary", "")
    if mime != _FORM or not _BOUNDARY.fullmatch(boundary):
        raise ContractError(
            f"Content-Type: {_FORM} with a boundary (an upload: the file and its fields as a form)",
            problems=("(content-type): not multipart/form-data",),
        )
    return boundary.encode("ascii")


def read_form(body: bytes, boundary: bytes, *, file_field: str) -> tuple[dict[str, str], Upload]:  # noqa: PLR0912
    """The text fields and the one file (part `file_field`) of a form; a ContractError for a body
    that is not a whole form (truncated, malformed), a repeated or missing file, a field that is not
    UTF-8 text or too long, or too many parts."""
    decoder = MultipartDecoder(boundary, max_parts=MAX_PARTS)
    decoder.receive_data(body)
    decoder.receive_data(None)
    fields: dict[str, str] = {}
    upload: Upload | None = None
    name = ""
    part: bytearray | None = None
    file: File | None = None
    while True:
        try:
            event = decoder.next_event()
        except ValueError:  # werkzeug: "Unexpected end of form data", a malformed part
            raise _bad("the form ends before its closing boundary (truncated?) or a part is malformed") from None
        except Exception:  # its limits (too many parts) raise its own HTTP errors
            raise _bad(f"at most {MAX_PARTS} parts") from None
        if event is NEED_DATA or isinstance(event, Epilogue):
            break
        if isinstance(event, File | Field):
            name, part = event.name, bytearray()
            file = event if isinstance(event, File) else None
        elif isinstance(event, Data) and part is not None:
            part += event.data
            if event.more_data:
                continue
            if name == file_field:
                if file is None:
                    raise _bad(f"part {file_field!r} is the file: give it a filename")
                if upload is not None:
                    raise _bad(f"one file only (part {file_field!r} is repeated)")
                kind = file.headers.get("content-type", "application/octet-stream")
                upload = Upload(field=name, filename=file.filename, content_type=kind, data=bytes(part))
            else:
                fields[name] = _text(name, bytes(part))
            part = None
    if not isinstance(event, Epilogue):
        raise _bad("the form ends before its closing boundary (truncated?)")
    if upload is None or not upload.data:
        raise _bad(f"the audio file: a non-empty part named {file_field!r} with a filename")
    return fields, upload


def write_form(fields: dict[str, str], upload: Upload) -> tuple[bytes, str]:
    """A form of `fields` and the file: its body and its content type (a fresh boundary)."""
    boundary = "nexa-" + secrets.token_hex(16)
    out = bytearray()
    for name, value in fields.items():
        out += f'--{boundary}\r\nContent-Disposition: form-data; name="{_quoted(name)}"\r\n\r\n'.encode()
        out += value.encode() + b"\r\n"
    out += (
        f'--{boundary}\r\nContent-Disposition: form-data; name="{_quoted(upload.field)}";'
        f' filename="{_quoted(upload.filename)}"\r\nContent-Type: {_header_value(upload.content_type)}\r\n\r\n'
    ).encode()
    out += upload.data + f"\r\n--{boundary}--\r\n".encode()
    return bytes(out), f"{_FORM}; boundary={boundary}"


def _text(name: str, raw: bytes) -> str:
    try:
        value = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _bad(f"field {name!r}: UTF-8 text") from None
    if len(value) > MAX_FIELD_CHARS:
        raise _bad(f"field {name!r}: at most {MAX_FIELD_CHARS} characters")
    return value


def _quoted(value: str) -> str:
    """A name or filename inside a quoted Content-Disposition parameter (as browsers write them,
    WHATWG HTML §4.10.21.8: CR, LF and the quote percent-encoded)."""
    return value.replace("\r", "%0D").replace("\n", "%0A").replace('"', "%22")


def _header_value(value: str) -> str:
    return value if value.isascii() and value.isprintable() else "application/octet-stream"


def _bad(what: str) -> ContractError:
    return ContractError(f"invalid form: {what}", problems=(f"(form): {what}",))
