"""``dataclass``, ``field``, ``fields``, ``replace`` and ``asdict``: those of ``dataclasses``,
made here without importing it, and without compiling anything per class.

The standard decorator writes each method it adds as source text and compiles it
(``exec``), and the module imports ``inspect`` (with ``ast``, ``dis`` and ``tokenize``): for
the forty dataclasses a restore imports, that was a fifth of the command. Here a class's
``__init__`` is the code of a template, compiled once per shape (how many parameters, which
have a default factory, frozen or not, a ``__post_init__`` or not) and given the class's
field and parameter names (``CodeType.replace``): the same bytecode the standard decorator
compiles, so an instance costs the same. It is made when first looked up (the first
instance, ``inspect.signature``): 22 of the 53 classes a restore imports make none. A
frozen class's ``__setattr__``/``__delattr__``, ``__repr__``, ``__eq__`` and ``__hash__``
are closures that do what the generated ones do:
the same text (``Name(a=1, b='x')``, ``...`` for a recursive one), the compared fields
compared as tuples when the other object is of the very same class (else
``NotImplemented``), the hash of the hashed fields' tuple for a frozen class and none for
a mutable one, ``dataclasses.FrozenInstanceError`` on assigning to a frozen instance; a
method the class defines itself is kept.

The standard module's view of such a class (``__dataclass_fields__``,
``__dataclass_params__``) is made when first asked for, so ``dataclasses.fields``,
``replace``, ``asdict`` and ``is_dataclass`` work on it as on any dataclass. A shape not
made here (``order``, ``slots``, ``kw_only``, ``unsafe_hash``, ``init=False``, an
``InitVar``) gets the standard decorator, as does an option it does not know. Type
checkers and the API docs see the ``dataclasses`` functions themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if not TYPE_CHECKING:
    import sys
    from _thread import get_ident
    from abc import update_abstractmethods
    from enum import Enum
    from operator import attrgetter
    from types import CellType, FunctionType, MappingProxyType

    class _Sentinel:
        __slots__ = ("_text",)

        def __init__(self, text):
            self._text = text

        def __repr__(self):
            return self._text

    _MISSING = _Sentinel("MISSING")
    _HAS_DEFAULT_FACTORY = _Sentinel("<factory>")  # a parameter's default: call the factory
    _NO_METADATA = MappingProxyType({})
    _STANDARD_OPTIONS = {  # the standard decorator's other options, and their defaults
        "init": True,
        "order": False,
        "unsafe_hash": False,
        "match_args": True,
        "kw_only": False,
        "slots": False,
        "weakref_slot": False,
    }
    _ATOMIC = frozenset({type(None), bool, int, float, complex, str, bytes, type, range})

    class _Field:
        """One field of a class made here: what ``dataclasses.Field`` says of it."""

        __slots__ = (
            "_classvar",
            "compare",
            "default",
            "default_factory",
            "hash",
            "init",
            "kw_only",
            "metadata",
            "name",
            "repr",
            "type",
        )

        def __init__(self, default, default_factory, init, repr, hash, compare, metadata, kw_only):
            self.name = None
            self.type = None
            self.default = default
            self.default_factory = default_factory
            self.init = init
            self.repr = repr
            self.hash = hash
            self.compare = compare
            self.metadata = _NO_METADATA if metadata is None else MappingProxyType(metadata)
            self.kw_only = kw_only
            self._classvar = False

        def __repr__(self):
            return (
                f"Field(name={self.name!r},type={self.type!r},default={self.default!r},"
                f"default_factory={self.default_factory!r},init={self.init!r},"
                f"repr={self.repr!r},hash={self.hash!r},compare={self.compare!r},"
                f"metadata={self.metadata!r},kw_only={self.kw_only!r})"
            )

        def __set_name__(self, owner, name):
            set_name = getattr(type(self.default), "__set_name__", None)
            if set_name:
                set_name(self.default, owner, name)

    class _Made:
        """What a class made here is: its fields (inherited ones first), its pseudo-fields
        (``ClassVar``), and its options."""

        __slots__ = ("classvars", "cls", "eq", "fields", "frozen", "repr")

        def __init__(self, cls, fields, classvars, frozen, repr, eq):
            self.cls = cls
            self.fields = fields
            self.classvars = classvars
            self.frozen = frozen
            self.repr = repr
            self.eq = eq

    def field(
        *,
        default=_MISSING,
        default_factory=_MISSING,
        init=True,
        repr=True,
        hash=None,
        compare=True,
        metadata=None,
        kw_only=_MISSING,
    ):
        """``dataclasses.field``."""
        if default is not _MISSING and default_factory is not _MISSING:
            raise ValueError("cannot specify both default and default_factory")
        return _Field(default, default_factory, init, repr, hash, compare, metadata, kw_only)

    def dataclass(cls=None, /, **options):
        """``dataclasses.dataclass`` (same options)."""

        def wrap(cls):
            return _dataclass(cls, options)

        return wrap if cls is None else wrap(cls)

    def fields(class_or_instance):
        """``dataclasses.fields``."""
        cls = class_or_instance
        made = _made(cls if isinstance(cls, type) else type(cls))
        if made is None:
            return _standard().fields(class_or_instance)
        return made.fields

    def replace(obj, /, **changes):
        """``dataclasses.replace``."""
        made = None if isinstance(obj, type) else _made(type(obj))
        if made is None:
            return _standard().replace(obj, **changes)
        for f in made.fields:
            if f.name not in changes:
                changes[f.name] = getattr(obj, f.name)
        return obj.__class__(**changes)

    def asdict(obj, *, dict_factory=dict):
        """``dataclasses.asdict``."""
        if isinstance(obj, type) or _made(type(obj)) is None:
            return _standard().asdict(obj, dict_factory=dict_factory)
        return _asdict(obj, dict_factory)

    def _asdict(obj, dict_factory):
        cls = type(obj)
        if cls in _ATOMIC or isinstance(obj, Enum):  # what deepcopy gives back as it is
            return obj
        made = _made(cls)
        if made is not None:
            return dict_factory(
                [(f.name, _asdict(getattr(obj, f.name), dict_factory)) for f in made.fields]
            )
        if hasattr(cls, "__dataclass_fields__"):
            return _standard().asdict(obj, dict_factory=dict_factory)
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
            return cls(*[_asdict(v, dict_factory) for v in obj])
        if isinstance(obj, (list, tuple)):
            return cls(_asdict(v, dict_factory) for v in obj)
        if isinstance(obj, dict):
            if hasattr(cls, "default_factory"):  # a defaultdict
                out = cls(obj.default_factory)
                for k, v in obj.items():
                    out[_asdict(k, dict_factory)] = _asdict(v, dict_factory)
                return out
            return cls((_asdict(k, dict_factory), _asdict(v, dict_factory)) for k, v in obj.items())
        return _standard_copy().deepcopy(obj)

    def _standard():
        """The ``dataclasses`` module, for what is not made here (imported when first
        needed: a restore never needs it)."""
        import dataclasses

        return dataclasses

    def _standard_copy():
        import copy

        return copy

    def _made(cls):
        """The ``_Made`` of the nearest dataclass in ``cls``'s MRO, if it was made here."""
        for b in cls.__mro__:
            d = b.__dict__
            if "__epbuild_dataclass__" in d:
                return d["__epbuild_dataclass__"]
            if "__dataclass_fields__" in d:
                return None
        return None

    def _dataclass(cls, options):
        frozen = options.pop("frozen", False)
        repr_wanted = options.pop("repr", True)
        eq_wanted = options.pop("eq", True)
        if any(_STANDARD_OPTIONS.get(k, _MISSING) != v for k, v in options.items()):
            return _made_by_standard(cls, frozen, repr_wanted, eq_wanted, options)
        found = _fields(cls, frozen)
        if found is None:
            return _made_by_standard(cls, frozen, repr_wanted, eq_wanted, options)
        all_fields, own = found
        regular = tuple(f for f in all_fields.values() if not f._classvar)
        classvars = tuple(f for f in all_fields.values() if f._classvar)
        for f in own:  # a field() in the class body leaves its default, or nothing
            if isinstance(cls.__dict__.get(f.name), _Field):
                if f.default is _MISSING:
                    delattr(cls, f.name)
                else:
                    setattr(cls, f.name, f.default)
        cls.__epbuild_dataclass__ = _Made(cls, regular, classvars, frozen, repr_wanted, eq_wanted)
        cls.__dataclass_fields__ = _StandardView(cls, "__dataclass_fields__")
        cls.__dataclass_params__ = _StandardView(cls, "__dataclass_params__")
        own_dict = cls.__dict__
        if "__init__" not in own_dict:
            cls.__init__ = _LazyInit(cls, regular, frozen, hasattr(cls, "__post_init__"))
        names = [f.name for f in regular]
        if repr_wanted and "__repr__" not in own_dict:
            _add(cls, "__repr__", _repr_fn([f.name for f in regular if f.repr]))
        _equality(cls, regular, frozen, eq_wanted)
        if frozen:
            for name, fn in _frozen_fns(cls, frozenset(names)):
                if name in own_dict:
                    raise TypeError(f"Cannot overwrite attribute {name} in class {cls.__name__}")
                _add(cls, name, fn)
        if not cls.__doc__:
            cls.__doc__ = _signature_text(cls, regular)
        if "__match_args__" not in own_dict:
            cls.__match_args__ = tuple(names)
        update_abstractmethods(cls)
        return cls

    def _made_by_standard(cls, frozen, repr_wanted, eq_wanted, options):
        dataclasses = _standard()
        for name, value in list(cls.__dict__.items()):
            if isinstance(value, _Field):  # field() in the class body: the standard one's
                setattr(cls, name, _to_standard(dataclasses, value))
        return dataclasses.dataclass(cls, frozen=frozen, repr=repr_wanted, eq=eq_wanted, **options)

    def _to_standard(dataclasses, f):
        """A field made here as ``dataclasses.field`` makes it."""
        options = {} if f.metadata is _NO_METADATA else {"metadata": f.metadata}
        for name in ("default", "default_factory", "kw_only"):
            if getattr(f, name) is not _MISSING:
                options[name] = getattr(f, name)
        return dataclasses.field(
            init=f.init, repr=f.repr, hash=f.hash, compare=f.compare, **options
        )

    def _fields(cls, frozen):
        """({name: Field}, the class's own fields) as the standard decorator collects them,
        with its checks; None for a shape made by the standard decorator."""
        inherited = _inherited(cls, frozen)
        if inherited is None:
            return None
        all_fields = dict(inherited)
        own_dict = cls.__dict__
        annotations = own_dict.get("__annotations__", {})
        module = sys.modules.get(cls.__module__)
        namespace = module.__dict__ if module is not None else {}
        own = []
        for name, annotation in annotations.items():
            f = _own_field(cls, name, annotation, namespace)
            if f is None:
                return None
            own.append(f)
            all_fields[name] = f
        for name, value in own_dict.items():
            if isinstance(value, _Field) and name not in annotations:
                raise TypeError(f"{name!r} is a field but has no type annotation")
        seen_default = False
        for f in all_fields.values():
            if f._classvar:
                continue
            if f.default is not _MISSING or f.default_factory is not _MISSING:
                seen_default = True
            elif seen_default:
                raise TypeError(f"non-default argument {f.name!r} follows default argument")
        return all_fields, own

    def _inherited(cls, frozen):
        """{name: Field} of the dataclasses ``cls`` derives from, checked for frozen and
        not mixed; None if one of them has a shape not made here."""
        found = {}
        any_frozen_base, all_frozen_bases = False, None
        for b in cls.__mro__[-1:0:-1]:
            d = b.__dict__
            if "__epbuild_dataclass__" in d:
                made = d["__epbuild_dataclass__"]
                base_fields, base_frozen = (*made.fields, *made.classvars), made.frozen
            elif isinstance(d.get("__dataclass_fields__"), dict):  # the standard decorator's
                base_fields = _from_standard(d["__dataclass_fields__"])
                if base_fields is None:
                    return None
                base_frozen = d["__dataclass_params__"].frozen
            else:
                continue
            for f in base_fields:
                found[f.name] = f
            all_frozen_bases = base_frozen and all_frozen_bases is not False
            any_frozen_base = any_frozen_base or base_frozen
        if all_frozen_bases is not None:
            if any_frozen_base and not frozen:
                raise TypeError("cannot inherit non-frozen dataclass from a frozen one")
            if not all_frozen_bases and frozen:
                raise TypeError("cannot inherit frozen dataclass from a non-frozen one")
        return found

    def _own_field(cls, name, annotation, namespace):
        """The field an annotation of the class body makes (a ``ClassVar`` a pseudo-field),
        or None for one made by the standard decorator."""
        kind = _kind(annotation, namespace)
        if kind is None:
            return None
        default = getattr(cls, name, _MISSING)
        if isinstance(default, _Field):
            f = default
        elif _is_standard_field(default):
            f = _field_from(default)
        else:
            if type(default).__name__ == "member_descriptor":  # a slot, not a default
                default = _MISSING
            f = _Field(default, _MISSING, True, True, None, True, None, _MISSING)
        if kind == "classvar":
            if f.default_factory is not _MISSING:
                return None  # the standard decorator says what is wrong
            f._classvar = True
        elif f.init is not True or f.kw_only is True:
            return None
        elif f.default is not _MISSING and f.default.__class__.__hash__ is None:
            raise ValueError(
                f"mutable default {type(f.default)} for field {name} is not allowed:"
                " use default_factory"
            )
        f.name, f.type = name, annotation
        return f

    def _kind(annotation, namespace):
        """``field``, ``classvar``, or None for an ``InitVar`` or ``KW_ONLY`` (the standard
        decorator's): as the standard decorator reads a string annotation, by the name it
        starts with, looked up in the class's module."""
        typing = sys.modules.get("typing")
        if not isinstance(annotation, str):
            if typing is not None and (
                annotation is typing.ClassVar
                or getattr(annotation, "__origin__", None) is typing.ClassVar
            ):
                return "classvar"
            if type(annotation).__module__ == "dataclasses":  # InitVar, KW_ONLY
                return None
            return "field"
        if (
            "ClassVar" not in annotation
            and "InitVar" not in annotation
            and ("KW_ONLY" not in annotation)
        ):
            return "field"
        head = annotation.split("[", 1)[0].strip()
        module_name, _, name = head.rpartition(".")
        module_name = module_name.strip()
        if module_name and "." in module_name:
            return "field"
        if module_name:
            module = namespace.get(module_name)
            if module is None:
                return "field"
            found = getattr(module, name.strip(), None)
        else:
            found = namespace.get(name.strip())
        if typing is not None and found is typing.ClassVar:
            return "classvar"
        if getattr(found, "__module__", None) == "dataclasses" or (
            type(found).__module__ == "dataclasses"
        ):
            return None
        return "field"

    def _is_standard_field(obj):
        dataclasses = sys.modules.get("dataclasses")
        return dataclasses is not None and isinstance(obj, dataclasses.Field)

    def _field_from(std):
        """A ``dataclasses.Field`` as made here."""
        missing = sys.modules["dataclasses"].MISSING
        return _Field(
            _MISSING if std.default is missing else std.default,
            _MISSING if std.default_factory is missing else std.default_factory,
            std.init,
            std.repr,
            std.hash,
            std.compare,
            std.metadata or None,
            _MISSING if std.kw_only is missing else std.kw_only,
        )

    def _from_standard(std_fields):
        """The fields of a class made by the standard decorator, as made here; None if one
        is an ``InitVar``."""
        out = []
        for std in std_fields.values():
            kind = getattr(std._field_type, "name", "")
            if kind not in ("_FIELD", "_FIELD_CLASSVAR") or (
                kind == "_FIELD" and (std.init is not True or std.kw_only is True)
            ):
                return None
            f = _field_from(std)
            f.name, f.type, f._classvar = std.name, std.type, kind == "_FIELD_CLASSVAR"
            out.append(f)
        return out

    class _StandardView:
        """``__dataclass_fields__`` or ``__dataclass_params__`` of a class made here: what the
        standard decorator would have set, made when first read (by ``dataclasses``, which
        is then imported) and set on the class in its place."""

        __slots__ = ("cls", "name")

        def __init__(self, cls, name):
            self.cls = cls
            self.name = name

        def __get__(self, obj, owner=None):
            cls = self.cls
            made = cls.__dict__["__epbuild_dataclass__"]
            dataclasses = _standard()
            shadow = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
            annotations = shadow["__annotations__"] = {}
            for f in (*made.fields, *made.classvars):
                annotations[f.name] = f.type
                if not f._classvar:
                    shadow[f.name] = _to_standard(dataclasses, f)
                elif f.default is not _MISSING:
                    shadow[f.name] = f.default
            options = {"frozen": made.frozen, "repr": made.repr, "eq": made.eq}
            view = dataclasses.dataclass(type(cls.__name__, (), shadow), **options)
            cls.__dataclass_fields__ = view.__dataclass_fields__
            cls.__dataclass_params__ = view.__dataclass_params__
            return getattr(cls, self.name)

    # __init__: the code of a template per shape, given the class's names.
    _TEMPLATES = {}

    class _LazyInit:
        """A class's ``__init__`` until it is first looked up (its first instance,
        ``inspect.signature``, ``super().__init__``): then made (``_init``), set on the
        class in its place and returned. Many classes a command imports never make an
        instance, and compiling a shape's template is most of what making a class costs."""

        __slots__ = ("cls", "frozen", "post_init", "regular")

        def __init__(self, cls, regular, frozen, post_init):
            self.cls = cls
            self.regular = regular
            self.frozen = frozen
            self.post_init = post_init  # as the class had it when made, like the standard

        def __get__(self, obj, owner=None):
            cls = self.cls
            fn = cls.__dict__.get("__init__")
            if fn is self:  # not made yet (by another thread, say)
                fn = _init(cls, self.regular, self.frozen, self.post_init)
                _add(cls, "__init__", fn)
            return fn if obj is None else fn.__get__(obj, owner)

    def _init(cls, regular, frozen, post_init):
        factories = tuple(f.default_factory is not _MISSING for f in regular)
        code = _template(len(regular), frozen, factories, post_init)
        names = [f.name for f in regular]
        self_name = "__dataclass_self__" if "self" in names else "self"
        renamed = {f"__dataclass_field_{i}__": name for i, name in enumerate(names)}
        code = code.replace(
            co_varnames=(self_name, *names, *code.co_varnames[len(names) + 1 :]),
            co_names=tuple(renamed.get(n, n) for n in code.co_names),
            co_consts=tuple(renamed.get(c, c) if type(c) is str else c for c in code.co_consts),
        )
        values = {
            "__dataclass_builtins_object__": object,
            "__dataclass_HAS_DEFAULT_FACTORY__": _HAS_DEFAULT_FACTORY,
        }
        for i, f in enumerate(regular):
            if factories[i]:
                values[f"__dataclass_dflt_{i}__"] = f.default_factory
        defaults = tuple(
            _HAS_DEFAULT_FACTORY if f.default_factory is not _MISSING else f.default
            for f in regular
            if f.default is not _MISSING or f.default_factory is not _MISSING
        )
        module = sys.modules.get(cls.__module__)
        fn = FunctionType(
            code,
            module.__dict__ if module is not None else {},
            "__init__",
            defaults or None,
            tuple(CellType(values[name]) for name in code.co_freevars),
        )
        fn.__annotations__ = {**{f.name: f.type for f in regular}, "return": None}
        return fn

    def _template(count, frozen, factories, post_init):
        """The code of ``__init__`` for a shape, compiled the first time it is asked for:
        the text the standard decorator writes, with placeholder names."""
        key = count, frozen, factories, post_init
        code = _TEMPLATES.get(key)
        if code is not None:
            return code
        free = ["__dataclass_builtins_object__", "__dataclass_HAS_DEFAULT_FACTORY__"]
        params, body = [], []
        for i in range(count):
            name = value = f"__dataclass_field_{i}__"  # the parameter's and the field's
            if factories[i]:
                factory = f"__dataclass_dflt_{i}__"
                free.append(factory)
                value = f"{factory}() if {name} is __dataclass_HAS_DEFAULT_FACTORY__ else {name}"
            params.append(name)
            if frozen:
                body.append(f"  __dataclass_builtins_object__.__setattr__(self,{name!r},{value})")
            else:
                body.append(f"  self.{name}={value}")
        if post_init:
            body.append("  self.__post_init__()")
        text = (
            f"def __create_fn__({', '.join(free)}):\n"
            f" def __init__({', '.join(['self', *params])}):\n"
            + ("\n".join(body) or "  pass")
            + "\n return __init__\n"
        )
        namespace = {}
        exec(text, {}, namespace)
        (code,) = (
            c
            for c in namespace["__create_fn__"].__code__.co_consts
            if type(c) is type(_template.__code__)
        )
        _TEMPLATES[key] = code
        return code

    def _add(cls, name, fn):
        fn.__qualname__ = f"{cls.__qualname__}.{name}"
        if fn.__name__ != name:
            fn.__name__ = name
        setattr(cls, name, fn)

    def _signature_text(cls, regular):
        """The doc of a class without one: its name and ``__init__``'s parameters, as the
        standard decorator writes them (with ``inspect.signature``)."""
        params = []
        for f in regular:
            text = f"{f.name}: {_annotation_text(f.type)}"
            if f.default_factory is not _MISSING:
                text += " = <factory>"
            elif f.default is not _MISSING:
                text += f" = {f.default!r}"
            params.append(text)
        return f"{cls.__name__}({', '.join(params)})"

    def _annotation_text(annotation):
        if isinstance(annotation, type):
            if annotation.__module__ == "builtins":
                return annotation.__qualname__
            return f"{annotation.__module__}.{annotation.__qualname__}"
        return repr(annotation).replace("typing.", "")

    def _frozen_fns(cls, names):
        """A frozen class's ``__setattr__`` and ``__delattr__``."""

        def __setattr__(self, name, value):
            if type(self) is cls or name in names:
                raise _standard().FrozenInstanceError(f"cannot assign to field {name!r}")
            super(cls, self).__setattr__(name, value)

        def __delattr__(self, name):
            if type(self) is cls or name in names:
                raise _standard().FrozenInstanceError(f"cannot delete field {name!r}")
            super(cls, self).__delattr__(name)

        return ("__setattr__", __setattr__), ("__delattr__", __delattr__)

    def _equality(cls, regular, frozen, eq_wanted):
        """``__eq__`` and ``__hash__`` by the standard decorator's table (for ``eq``
        without ``unsafe_hash``)."""
        if not eq_wanted:
            return
        own = cls.__dict__
        own_hash = own.get("__hash__", _MISSING)  # None: Python's, for an own __eq__
        explicit_hash = own_hash is not _MISSING and not (own_hash is None and "__eq__" in own)
        if "__eq__" not in own:
            _add(cls, "__eq__", _eq_fn(_getter([f.name for f in regular if f.compare])))
        if not explicit_hash:
            hashed = [f.name for f in regular if (f.compare if f.hash is None else f.hash)]
            if frozen:
                _add(cls, "__hash__", _hash_fn(_getter(hashed)))
            else:
                cls.__hash__ = None

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


if TYPE_CHECKING:  # after the definitions: what type checkers and the API docs see
    from dataclasses import asdict as asdict
    from dataclasses import dataclass as dataclass
    from dataclasses import field as field
    from dataclasses import fields as fields
    from dataclasses import replace as replace
