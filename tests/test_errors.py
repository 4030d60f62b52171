"""`nexa.errors`: the tree its docstring draws is the tree its classes form, and the package re-exports
every class its family modules define."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import attrs

from nexa import errors
from nexa.control.http.common import STATUS

# "  + NotFound (also LookupError) [not_found, HTTP 404]: no such record"
_LINE = re.compile(
    r"^(?P<indent> *)[*+\-·] (?P<name>\w+)(?: \(also (?P<also>[\w, ]+)\))?(?: \[(?P<tags>[^\]]+)\])?(?:: .+)?$"
)
_BULLET = re.compile(r"^ *[*+\-·] ")


@attrs.frozen
class _Drawn:
    name: str
    parent: str | None
    also: tuple[str, ...]
    code: str | None
    status: int | None


def _drawn_tree(doc: str | None = errors.__doc__) -> list[_Drawn]:
    """Each bullet line of the module docstring, with its parent read from the indentation."""
    assert doc is not None
    drawn: list[_Drawn] = []
    path: list[str] = []
    for line in doc.splitlines():
        if not _BULLET.match(line):
            continue
        m = _LINE.match(line)
        assert m is not None, f"a tree line that does not parse: {line!r}"
        depth, odd = divmod(len(m["indent"]), 2)
        assert not odd and depth <= len(path), f"misindented: {line!r}"
        del path[depth:]
        tags = m["tags"].split(", ") if m["tags"] else []
        statuses = [int(t.removeprefix("HTTP ")) for t in tags if t.startswith("HTTP ")]
        codes = [t for t in tags if not t.startswith("HTTP ")]
        assert len(statuses) <= 1 and len(codes) <= 1, f"tags: {line!r}"
        also = tuple(m["also"].split(", ")) if m["also"] else ()
        parent = path[-1] if path else None
        drawn.append(_Drawn(m["name"], parent, also, codes[0] if codes else None, statuses[0] if statuses else None))
        path.append(m["name"])
    return drawn


def _ours(cls: type) -> bool:
    """Defined in one of the package's family modules (`nexa.errors.base`, …)."""
    return cls.__module__.startswith(errors.__name__ + ".")


def _defined() -> dict[str, type[BaseException]]:
    return {
        name: cls
        for name, cls in inspect.getmembers(errors, inspect.isclass)
        if _ours(cls) and issubclass(cls, BaseException)
    }


def _actual(cls: type[BaseException]) -> _Drawn:
    ours = [b for b in cls.__bases__ if _ours(b)]
    also = tuple(b.__name__ for b in cls.__bases__ if b not in ours and b is not Exception)
    code = cls.__dict__.get("code")
    return _Drawn(
        cls.__name__,
        ours[0].__name__ if ours else None,
        also,
        code if isinstance(code, str) else None,
        STATUS.get(cls) if issubclass(cls, errors.NexaError) else None,
    )


def test_the_docstring_draws_every_class_once_and_nothing_else() -> None:
    names = [d.name for d in _drawn_tree()]
    assert len(names) == len(set(names)), "a class drawn twice"
    assert sorted(names) == sorted(_defined())


def test_the_package_re_exports_every_class_of_its_modules() -> None:
    """`from nexa.errors import X` is the one way in: a class added to a family module but not to
    the package's imports would be missing from it (and from the drawn tree's check)."""
    modules = [importlib.import_module(m.name) for m in pkgutil.iter_modules(errors.__path__, errors.__name__ + ".")]
    assert len(modules) > 1
    for module in modules:
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__:
                assert getattr(errors, name, None) is cls, f"{module.__name__}.{name} is not re-exported by nexa.errors"


def test_each_class_sits_under_its_parent_with_its_own_code_and_status() -> None:
    defined = _defined()
    for drawn in _drawn_tree():
        assert drawn == _actual(defined[drawn.name])


def _mismatches(doc: str) -> list[str]:
    defined = _defined()
    drawn = _drawn_tree(doc)
    wrong = [d.name for d in drawn if d.name not in defined or d != _actual(defined[d.name])]
    return wrong + sorted(set(defined) - {d.name for d in drawn})


def test_a_stale_tree_is_caught() -> None:
    """The check itself: a class moved, recoded, given another status, or left out is named."""
    doc = errors.__doc__
    assert doc is not None
    assert _mismatches(doc) == []
    line = "    - ModelNotServed [model_not_found]: no alias or model by that name is being served\n"
    assert line in doc
    assert _mismatches(doc.replace(line, "")) == ["ModelNotServed"]
    moved = doc.replace(line, "").replace("\n  + Conflict [", "\n  + " + line.strip()[2:] + "\n  + Conflict [")
    assert _mismatches(moved) == ["ModelNotServed"]
    assert _mismatches(doc.replace("[conflict, HTTP 409]", "[conflict, HTTP 400]")) == ["Conflict"]
    assert _mismatches(doc.replace("[model_not_found]", "[not_found]")) == ["ModelNotServed"]
