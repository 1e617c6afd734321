"""``epbuild._dataclass.dataclass`` behaves as ``dataclasses.dataclass``: the same repr, equality
and hashing for every shape of class the package uses (and a few it does not), side by side;
and every module of the package takes its decorator from there, but those of the API
reference's classes."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from collections.abc import Callable
from operator import attrgetter
from pathlib import Path
from typing import Any, ClassVar

import pytest

from epbuild._dataclass import asdict, dataclass, field, fields, replace

PACKAGE = Path(__file__).resolve().parent.parent / "epbuild"


def text(obj: object) -> str:
    """``repr(obj)`` with its class's name and any address left out."""
    return re.sub(r" at 0x[0-9a-f]+", "", repr(obj).replace(type(obj).__qualname__, "C"))


def both(body: Callable[[Callable[..., Any]], type]) -> tuple[type, type]:
    """The class ``body`` makes, once with each decorator."""
    return body(dataclasses.dataclass), body(dataclass)


def plain(deco: Callable[..., Any]) -> type:
    @deco
    class Plain:
        a: int
        b: str = "x"
        c: list[int] = dataclasses.field(default_factory=list)

    return Plain


def frozen(deco: Callable[..., Any]) -> type:
    @deco(frozen=True)
    class Frozen:
        a: int
        b: tuple[int, ...] = ()
        hidden: str = dataclasses.field(default="h", repr=False)
        ignored: int = dataclasses.field(default=0, compare=False)
        unhashed: int = dataclasses.field(default=0, hash=False)
        only_hashed: int = dataclasses.field(default=0, compare=False, hash=True)
        kind: ClassVar[str] = "k"

    return Frozen


def one_field(deco: Callable[..., Any]) -> type:
    @deco(frozen=True)
    class One:
        x: float

    return One


def no_field(deco: Callable[..., Any]) -> type:
    @deco(frozen=True)
    class Empty:
        pass

    return Empty


def own_methods(deco: Callable[..., Any]) -> type:
    @deco(frozen=True)
    class Own:
        a: int

        def __repr__(self) -> str:
            return "own"

        def __eq__(self, other: object) -> bool:
            return True

        def __hash__(self) -> int:
            return 7

    return Own


def own_eq_only(deco: Callable[..., Any]) -> type:
    @deco(frozen=True)
    class OwnEq:
        a: int

        def __eq__(self, other: object) -> bool:
            return isinstance(other, OwnEq)

    return OwnEq


def off(deco: Callable[..., Any]) -> type:
    @deco(repr=False, eq=False)
    class Off:
        a: int

    return Off


def family(deco: Callable[..., Any]) -> type:
    @deco(frozen=True)
    class Base:
        a: int

    @deco(frozen=True)
    class Child(Base):
        b: int = 2

    return Child


def recursive(deco: Callable[..., Any]) -> type:
    @deco
    class Node:
        value: int
        children: list[Any] = dataclasses.field(default_factory=list)

    return Node


@pytest.mark.parametrize(
    ("shape", "args"),
    [
        (plain, [(1,), (1, "y", [2]), (2,)]),
        (frozen, [(1,), (1, (2,), "z", 5, 6, 7), (1, (), "h", 9), (1, (), "h", 0, 4), (2,)]),
        (one_field, [(1.0,), (float("nan"),), (2.0,)]),
        (no_field, [()]),
        (own_methods, [(1,), (2,)]),
        (own_eq_only, [(1,), (2,)]),
        (off, [(1,), (2,)]),
        (family, [(1,), (1, 3), (2, 2)]),
    ],
)
def test_same_repr_equality_and_hash(
    shape: Callable[..., type], args: list[tuple[Any, ...]]
) -> None:
    std, ours = both(shape)
    assert std.__name__ == ours.__name__
    assert (std.__hash__ is None) == (ours.__hash__ is None)
    made = [(std(*a), ours(*a)) for a in args]
    for s, o in made:
        assert text(s) == text(o)
        assert (s == s) == (o == o)
        assert (s == "other") == (o == "other")
        if std.__hash__ not in (None, object.__hash__):
            assert hash(s) == hash(o)
        assert dataclasses.asdict(s) == dataclasses.asdict(o)
        assert (dataclasses.replace(s) == s) == (dataclasses.replace(o) == o)
    for s1, o1 in made:
        for s2, o2 in made:
            assert (s1 == s2) == (o1 == o2)
            assert (s1 != s2) == (o1 != o2)


def test_frozen_stays_frozen() -> None:
    std, ours = both(frozen)
    for obj in (std(1), ours(1)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            obj.a = 2


def test_a_subclass_instance_is_not_equal() -> None:
    ours = dataclass(frozen=True)(type("A", (), {"__annotations__": {"a": "int"}}))
    sub = dataclass(frozen=True)(type("B", (ours,), {}))
    assert ours(1) != sub(1)
    assert ours(1).__eq__(sub(1)) is NotImplemented


def test_a_recursive_repr_says_so() -> None:
    std, ours = both(recursive)
    s, o = std(1), ours(1)
    s.children.append(s)
    o.children.append(o)
    assert text(s) == text(o)
    assert "..." in repr(o)


def test_methods_are_named_for_their_class() -> None:
    _, ours = both(frozen)
    assert ours.__repr__.__qualname__ == f"{ours.__qualname__}.__repr__"
    assert ours.__eq__.__name__ == "__eq__"


def documented_modules() -> set[Path]:
    """The files that define a class of the API reference (``docs/reference/python.md``):
    mkdocstrings labels a class a dataclass, with its fields' signature, only when the
    standard decorator makes it."""
    text = (PACKAGE.parent / "docs" / "reference" / "python.md").read_text()
    found = set()
    for path in re.findall(r"^::: (epbuild\.[\w.]+)$", text, re.M):
        module, name = path.rsplit(".", 1)
        obj = getattr(importlib.import_module(module), name)
        if isinstance(obj, type):
            found.add(Path(inspect.getfile(obj)).resolve())
    return found


def test_every_module_takes_the_decorator_from_here() -> None:
    """``dataclasses.dataclass`` compiles the methods made in ``_dataclass`` for each class;
    only the API reference's classes keep it (``documented_modules``)."""
    documented = documented_modules()
    assert PACKAGE / "results.py" in documented
    wrong = []
    for path in sorted(set(PACKAGE.rglob("*.py")) - {PACKAGE / "_dataclass.py"}):
        tree = ast.parse(path.read_text(), str(path))
        standard = any(
            isinstance(node, ast.ImportFrom)
            and node.module == "dataclasses"
            and any(a.name == "dataclass" for a in node.names)
            for node in ast.walk(tree)
        ) or any(
            isinstance(node, ast.Attribute)
            and node.attr == "dataclass"
            and isinstance(node.value, ast.Name)
            and node.value.id == "dataclasses"
            for node in ast.walk(tree)
        )
        if standard and path not in documented:
            wrong.append(str(path.relative_to(PACKAGE)))
    assert wrong == [], "use epbuild._dataclass.dataclass in:\n" + "\n".join(wrong)


@pytest.mark.parametrize("shape", [plain, frozen, one_field, no_field, family, recursive])
def test_same_init_signature_and_doc(shape: Callable[..., type]) -> None:
    std, ours = both(shape)
    assert str(inspect.signature(std)) == str(inspect.signature(ours))
    assert std.__init__.__annotations__ == ours.__init__.__annotations__
    assert std.__init__.__qualname__ == ours.__init__.__qualname__
    assert std.__doc__ == ours.__doc__
    assert std.__match_args__ == ours.__match_args__
    assert std.__dataclass_params__.__repr__() == ours.__dataclass_params__.__repr__()
    described = attrgetter("name", "type", "default", "repr", "compare", "hash")
    assert [described(f) for f in dataclasses.fields(std)] == [
        described(f) for f in dataclasses.fields(ours)
    ]
    assert dataclasses.is_dataclass(ours) and dataclasses.is_dataclass(ours.__mro__[0])


def shapes_of_init(deco: Callable[..., Any], fld: Callable[..., Any]) -> list[type]:
    @deco
    class Factories:
        a: int
        b: list[int] = fld(default_factory=list)
        c: str = "c"
        d: dict[str, int] = fld(default_factory=dict)

    @deco(frozen=True)
    class Self:
        self: int
        other: tuple[int, ...] = fld(default_factory=tuple)

    @deco
    class Post:
        a: int
        doubled: int = 0

        def __post_init__(self) -> None:
            self.doubled = self.a * 2

    @deco(frozen=True)
    class Hidden:
        a: int
        b: bytes = fld(default=b"", repr=False, compare=False)

    return [Factories, Self, Post, Hidden]


def test_init_does_what_the_standard_one_does() -> None:
    std = shapes_of_init(dataclasses.dataclass, dataclasses.field)
    ours = shapes_of_init(dataclass, field)
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [((1,), {}), ((1, [2]), {"c": "x"})]
    calls += [((), {"a": 3, "d": {"k": 1}}), ((), {"self": 1}), ((1, (2,)), {}), ((), {})]
    calls += [((1, 2, 3, 4, 5), {}), ((1,), {"a": 1}), ((1,), {"nope": 1}), ((1, b"x"), {})]
    for s, o in zip(std, ours, strict=True):
        assert str(inspect.signature(s)) == str(inspect.signature(o))
        for args, kwargs in calls:
            try:
                expected = text(s(*args, **kwargs))
            except TypeError as e:
                with pytest.raises(TypeError) as got:
                    o(*args, **kwargs)
                assert str(got.value) == str(e)
            else:
                assert text(o(*args, **kwargs)) == expected
    first, second = ours[0](1), ours[0](1)
    assert first.b is not second.b  # a new list per instance
    assert ours[2](4).doubled == 8
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot delete field 'self'"):
        del ours[1](1).self


def test_the_functions_here_and_the_standard_ones_agree() -> None:
    std = shapes_of_init(dataclasses.dataclass, dataclasses.field)
    ours = shapes_of_init(dataclass, field)
    for s, o in zip(std, ours, strict=True):
        s1, o1 = s(1), o(1)
        assert [f.name for f in fields(o1)] == [f.name for f in dataclasses.fields(s1)]
        assert [f.name for f in fields(s1)] == [f.name for f in dataclasses.fields(s1)]
        assert asdict(o1) == dataclasses.asdict(o1) == dataclasses.asdict(s1) == asdict(s1)
        assert text(replace(o1)) == text(dataclasses.replace(o1)) == text(replace(s1))
        name = fields(o1)[0].name
        assert text(replace(o1, **{name: 5})) == text(dataclasses.replace(s1, **{name: 5}))
    nested = ours[0](1, [ours[3](2)], d={"k": ours[1](3)})
    assert asdict(nested) == dataclasses.asdict(nested)
    assert asdict(nested)["b"][0] == {"a": 2, "b": b""}
    with pytest.raises(TypeError):
        replace(1)
    with pytest.raises(TypeError):
        fields(int)


def test_inheriting_across_the_two_decorators() -> None:
    @dataclasses.dataclass(frozen=True)
    class StdBase:
        a: int
        b: str = "b"

    @dataclass(frozen=True)
    class OursChild(StdBase):
        c: int = 3

    @dataclass(frozen=True)
    class OursBase:
        a: int
        b: list[int] = field(default_factory=list, compare=False)

    @dataclasses.dataclass(frozen=True)
    class StdChild(OursBase):
        c: int = 3

    for cls in (OursChild, StdChild):
        assert list(inspect.signature(cls).parameters) == ["a", "b", "c"]
        assert [f.name for f in dataclasses.fields(cls)] == ["a", "b", "c"]
        assert cls(1).c == 3
    assert OursChild(1) == OursChild(1, "b", 3) != OursChild(2)
    assert StdChild(1, [1]) == StdChild(1, [2])  # b is not compared


def test_shapes_left_to_the_standard_decorator() -> None:
    @dataclass(order=True, frozen=True)
    class Ordered:
        a: int

    @dataclass
    class KeywordOnly:
        a: int
        b: int = field(default=0, kw_only=True)

    @dataclass
    class WithInitVar:
        a: int
        scale: dataclasses.InitVar[int] = 1

        def __post_init__(self, scale: int) -> None:
            self.a *= scale

    @dataclass
    class NotInInit:
        a: int
        b: int = field(default=7, init=False)

    assert Ordered(1) < Ordered(2)
    assert str(inspect.signature(KeywordOnly)) == "(a: 'int', *, b: 'int' = 0) -> None"
    assert WithInitVar(2, 3).a == 6
    assert NotInInit(1).b == 7
    assert repr(NotInInit(1)).endswith("NotInInit(a=1, b=7)")


def test_the_standard_decorators_errors() -> None:
    def mutable(deco: Callable[..., Any], fld: Callable[..., Any]) -> None:
        @deco
        class Mutable:
            a: list[int] = []

    def order(deco: Callable[..., Any], fld: Callable[..., Any]) -> None:
        @deco
        class Order:
            a: int = 0
            b: int

    def unannotated(deco: Callable[..., Any], fld: Callable[..., Any]) -> None:
        @deco
        class Unannotated:
            a = fld(default=1)

    def thawed(deco: Callable[..., Any], fld: Callable[..., Any]) -> None:
        @deco(frozen=True)
        class Base:
            a: int

        @deco
        class Child(Base):
            b: int = 0

    def own_setattr(deco: Callable[..., Any], fld: Callable[..., Any]) -> None:
        @deco(frozen=True)
        class Own:
            a: int

            def __setattr__(self, name: str, value: Any) -> None:
                pass

    def both_defaults(deco: Callable[..., Any], fld: Callable[..., Any]) -> None:
        fld(default=1, default_factory=list)

    for body in (mutable, order, unannotated, thawed, own_setattr, both_defaults):
        with pytest.raises((TypeError, ValueError)) as std:
            body(dataclasses.dataclass, dataclasses.field)
        with pytest.raises(std.type, match=re.escape(str(std.value))):
            body(dataclass, field)


def test_init_is_made_when_first_looked_up() -> None:
    """A class's ``__init__`` is compiled on first use, not when the class is made; the
    first lookup may come through a subclass, an instance or ``inspect``."""
    from epbuild import _dataclass

    @dataclass(frozen=True)
    class Base:
        a: int
        b: int
        c: int
        d: int
        e: int
        f: int
        g: int
        h: int
        i: int
        j: int
        k: int
        m: int
        n: int
        o: int
        p: int
        q: int
        r: int
        s: int
        t: int
        u: int
        v: int
        w: int
        x: list[int] = field(default_factory=list)

    class Sub(Base):
        def __init__(self) -> None:
            super().__init__(*range(22))

    def made() -> bool:
        return any(key[0] == 23 and key[1] for key in _dataclass._TEMPLATES)

    assert not made() and not callable(Base.__dict__["__init__"])
    assert Sub().x == [] and Sub().w == 21
    assert made() and Base.__dict__["__init__"] is Base.__init__
    assert str(inspect.signature(Base)).startswith("(a: 'int', b: 'int'")
    assert Base(*range(22), x=[1]) == Base(*range(22), x=[1])
