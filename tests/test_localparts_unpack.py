"""`nexa.localparts.cmake.unpack`: PEP 706's data filter where the Python has it, and the same
refusals where it does not (Debian 12's python3 is 3.11.2, before the filters: a fresh Debian 12
machine's llama.cpp and whisper.cpp builds failed on `extractall(filter=...)`)."""

from __future__ import annotations

import contextlib
import io
import tarfile
from pathlib import Path

import pytest

from nexa.localparts.cmake import unpack


def _archive(path: Path, *entries: tarfile.TarInfo) -> Path:
    with tarfile.open(path, "w") as archive:
        for entry in entries:
            data = b"x" if entry.isfile() else None
            if data is not None:
                entry.size = len(data)
            archive.addfile(entry, io.BytesIO(data) if data is not None else None)
    return path


def _entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


@pytest.fixture(params=["filter", "no-filter"])
def python(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "no-filter":
        monkeypatch.delattr(tarfile, "data_filter")  # as on Python 3.11.2
    return str(request.param)


def test_files_directories_and_inner_links_are_unpacked(tmp_path: Path, python: str) -> None:
    tar = _archive(
        tmp_path / "ok.tar",
        _entry("src", tarfile.DIRTYPE),
        _entry("src/a.c"),
        _entry("src/b.c", tarfile.SYMTYPE, "a.c"),
        _entry("src/c.c", tarfile.LNKTYPE, "src/a.c"),
    )
    with tarfile.open(tar) as archive:
        unpack(archive, tmp_path / "out")
    assert (tmp_path / "out/src/a.c").read_bytes() == b"x"
    assert (tmp_path / "out/src/b.c").resolve() == (tmp_path / "out/src/a.c").resolve()
    assert (tmp_path / "out/src/c.c").read_bytes() == b"x"
    with tarfile.open(tar) as archive:  # only the members asked for
        unpack(archive, tmp_path / "some", [m for m in archive.getmembers() if m.name == "src/a.c"])
    assert [p.name for p in (tmp_path / "some/src").iterdir()] == ["a.c"]


@pytest.mark.parametrize(
    "bad",
    [
        _entry("../evil"),
        _entry("link", tarfile.SYMTYPE, "/etc/passwd"),
        _entry("link", tarfile.SYMTYPE, "../../outside"),
        _entry("hard", tarfile.LNKTYPE, "../outside"),
        _entry("dev", tarfile.CHRTYPE),
    ],
    ids=["dotdot", "absolute-link", "link-out", "hardlink-out", "device"],
)
def test_a_member_that_would_leave_the_destination_or_is_a_device_refuses_the_archive(
    tmp_path: Path, python: str, bad: tarfile.TarInfo
) -> None:
    tar = _archive(tmp_path / "bad.tar", _entry("fine"), bad)
    with tarfile.open(tar) as archive, pytest.raises(tarfile.TarError):
        unpack(archive, tmp_path / "out")
    assert not (tmp_path / "evil").exists() and not (tmp_path / "outside").exists()


def test_an_absolute_member_never_lands_outside_the_destination(tmp_path: Path, python: str) -> None:
    """The data filter strips the leading `/` (it lands under `dest`); without it the archive is refused."""
    tar = _archive(tmp_path / "abs.tar", _entry(f"{tmp_path}/escaped"))
    with tarfile.open(tar) as archive, contextlib.suppress(tarfile.TarError):
        unpack(archive, tmp_path / "out")
    assert not (tmp_path / "escaped").exists()
    assert (tmp_path / "out" / str(tmp_path).lstrip("/") / "escaped").exists() == (python == "filter")
