"""``dataclass``: ``dataclasses.dataclass``, with the ``__repr__``, ``__eq__`` and ``__hash__``
of every class made here from plain closures instead of compiled per class.

The standard decorator writes each method it adds as source text and compiles it (``exec``):
half the methods of a frozen class are these three, and compiling them was a sixth of a
one-model restore (the command imports some forty dataclasses). These do what the generated
ones do: the same text (``Name(a=1, b='x')``, ``...`` for a recursive one), the compared
fields compared as tuples when the other object is of the very same class (else
``NotImplemented``), the hash of the hashed fields' tuple for a frozen class and none for
a mutable one, and a method the class defines itself is kept. ``__init__`` and a frozen
class's ``__setattr__``/``__delattr__`` are the standard decorator's. What differs:
``__dataclass_params__`` says ``repr=False, eq=False``, and the methods' code is shared.
Type checkers and the API docs see ``dataclasses.dataclass`` itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if not TYPE_CHECKING:
    import dataclasses
    from _thread import get_ident
    from operator import attrgetter

    def dataclass(cls=None, /, **options):
        """``dataclasses.dataclass`` (same options), its repr, eq and hash made here."""

        def wrap(cls):
            return _dataclass(cls, options)

        return wrap if cls is None else wrap(cls)

    def _dataclass(cls, options):
        repr_wanted = options.pop("repr", True)
        eq_wanted = options.pop("eq", True)
        if options.get("order") or options.get("unsafe_hash") or options.get("slots"):
            return dataclasses.dataclass(cls, repr=repr_wanted, eq=eq_wanted, **options)
        own = cls.__dict__
        own_hash = own.get("__hash__", dataclasses.MISSING)  # None: Python's, for an own __eq__
        explicit_hash = own_hash is not dataclasses.MISSING and not (
            own_hash is None and "__eq__" in own
        )
        keep_repr, keep_eq = "__repr__" in own, "__eq__" in own
        cls = dataclasses.dataclass(cls, repr=False, eq=False, **options)
        fields = dataclasses.fields(cls)
        if repr_wanted and not keep_repr:
            _add(cls, "__repr__", _repr_fn([f.name for f in fields if f.repr]))
        if eq_wanted:
            if not keep_eq:
                _add(cls, "__eq__", _eq_fn(_getter([f.name for f in fields if f.compare])))
            if not explicit_hash:  # dataclasses' table, for eq without unsafe_hash
                hashed = [f.name for f in fields if (f.compare if f.hash is None else f.hash)]
                cls.__hash__ = _hash_fn(_getter(hashed)) if options.get("frozen") else None
        return cls

    def _add(cls, name, fn):
        fn.__name__ = name
        fn.__qualname__ = f"{cls.__qualname__}.{name}"
        setattr(cls, name, fn)

    def _getter(names):
        """The tuple of the named attributes of an object."""
        if len(names) > 1:
            return attrgetter(*names)
        if names:
            one = attrgetter(names[0])
            return lambda obj: (one(obj),)
        return lambda obj: ()

    def _repr_fn(names):
        running = set()

        def __repr__(self):
            key = id(self), get_ident()
            if key in running:
                return "..."
            running.add(key)
            try:
                inner = ", ".join(f"{name}={getattr(self, name)!r}" for name in names)
            finally:
                running.discard(key)
            return f"{self.__class__.__qualname__}({inner})"

        return __repr__

    def _eq_fn(values):
        def __eq__(self, other):
            if other.__class__ is self.__class__:
                return values(self) == values(other)
            return NotImplemented

        return __eq__

    def _hash_fn(values):
        def __hash__(self):
            return hash(values(self))

        return __hash__


if TYPE_CHECKING:  # after the definition: what type checkers and the API docs see
    from dataclasses import dataclass as dataclass
