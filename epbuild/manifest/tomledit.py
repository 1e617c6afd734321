"""Layout-keeping edits of a tomlkit document: what ``epbuild add`` and ``init --from`` change
goes in beside the user's text, never reformatting it.

tomlkit keeps comments, blank lines and key order of what it parsed; two things need help.
A new ``[family.name]`` table would land after the comments that introduce the *next*
table (tomlkit files them as the previous table's tail), so that tail moves below the new
table. And new values are rendered in the spacing ``epbuild init`` writes
(``{ a = 1 }``, one table per header), by parsing TOML text rather than building items.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epbuild.errors import ManifestError

if TYPE_CHECKING:
    from tomlkit import TOMLDocument
    from tomlkit.container import Container
    from tomlkit.items import AoT, Array, Item, Table


def parse_document(file: Path, text: str) -> TOMLDocument:
    """The tomlkit document of a manifest; invalid TOML is a ``ManifestError`` with a line."""
    import tomlkit
    from tomlkit.exceptions import ParseError, TOMLKitError

    try:
        return tomlkit.parse(text)
    except ParseError as exc:
        message = str(exc).split(" at line ")[0]
        raise ManifestError(f"invalid TOML: {message}", file=str(file), line=exc.line) from exc
    except (TOMLKitError, RecursionError) as exc:  # e.g. a key defined twice
        raise ManifestError(f"invalid TOML: {exc}", file=str(file)) from exc


def render_key(name: str) -> str:
    """``name`` as a TOML key: bare when it can be, else quoted."""
    import tomlkit

    return tomlkit.key(name).as_string().strip()


def render_value(value: Any) -> str:
    """A scalar, a list of scalars or a flat mapping as TOML text (``{ a = 1, b = "x" }``)."""
    import tomlkit

    if isinstance(value, Mapping):
        if not value:
            return "{}"
        items = ", ".join(f"{render_key(k)} = {render_value(v)}" for k, v in value.items())
        return "{ " + items + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(render_value(v) for v in value) + "]"
    return str(tomlkit.item(value).as_string())


def table_text(family: str, name: str, values: Mapping[str, Any], comment: str | None) -> str:
    """``[family.name]`` (with an end-of-line ``comment``) and one ``key = value`` per line."""
    header = f"[{family}.{render_key(name)}]"
    if comment:
        header += f"  # {comment}"
    return "\n".join([header, *(f"{render_key(k)} = {render_value(v)}" for k, v in values.items())])


def add_table(
    doc: TOMLDocument,
    family: str,
    name: str,
    values: Mapping[str, Any],
    comment: str | None = None,
) -> bool:
    """Add ``[family.name]`` after the family's last table, above the comments that
    introduce whatever follows it; a new family goes at the end of the document; a family
    written as an inline table gets an inline entry.

    Returns False, changing nothing, where the family is written in a form a table cannot
    be placed in (top-level dotted keys, tables spread over the file): the caller appends
    ``table_text`` at the end of the file instead, which TOML allows for those forms.
    """
    import tomlkit
    from tomlkit.items import InlineTable, Table

    fragment = parse_document(Path("<new>"), table_text(family, name, values, comment) + "\n")
    new = fragment[family][name]
    parent = doc.get(family)
    if parent is None:
        last_keyed = [v for k, v in doc.body if k is not None]
        end = _last_table(last_keyed[-1]) if last_keyed else None
        _ensure_blank_line(end.value if end is not None else doc)
        doc.append(family, fragment[family])
        return True
    if isinstance(parent, InlineTable):
        parent[name] = tomlkit.parse(f"v = {render_value(values)}")["v"]
        return True
    dotted = any(k is not None and k.key == family and k.is_dotted() for k, _ in doc.body)
    last = _last_table(parent)
    if dotted or not isinstance(parent, Table):
        return False
    if last is None:
        parent[name] = new
        return True
    at_end = _is_last(doc, parent)
    tail = _intro_of_next(last, at_end=at_end)
    _ensure_blank_line(last.value)
    parent.append(name, new)
    if not at_end:
        _ensure_blank_line(new.value)
        new.value.body.extend(tail)
    return True


def append_unique(array: Array | AoT, values: Iterable[Any]) -> list[Any]:
    """Append each value the array lacks (in its own layout); returns those appended."""
    added = []
    for value in values:
        if value not in array:
            array.append(value)
            added.append(value)
    return added


def _last_table(parent: Item) -> Table | None:
    """The table whose body ends where ``parent`` ends in the file (``parent`` itself
    when it is a plain table), or None when that is not a table."""
    from tomlkit.items import Table

    if not isinstance(parent, Table):
        return None
    if not parent.is_super_table():
        return parent
    tables = [v for k, v in parent.value.body if k is not None and isinstance(v, Table)]
    return _last_table(tables[-1]) if tables else None


def _is_last(doc: TOMLDocument, parent: Item) -> bool:
    """Whether ``parent`` is the document's last keyed item (nothing follows its tables)."""
    keyed = [v for k, v in doc.body if k is not None]
    return bool(keyed) and keyed[-1] is parent


def _intro_of_next(table: Table, *, at_end: bool) -> list[tuple[None, Item]]:
    """Remove and return the comments at the end of ``table`` that belong to the next
    table: those after its last blank line (none at the end of the document, where the
    trailing comments are the table's own, e.g. commented-out keys)."""
    from tomlkit.items import Comment, Whitespace

    body = table.value.body
    start = len(body)
    while (
        start
        and body[start - 1][0] is None
        and isinstance(body[start - 1][1], (Comment, Whitespace))
    ):
        start -= 1
    if at_end or start == len(body):
        return []
    blanks = [i for i in range(start, len(body)) if isinstance(body[i][1], Whitespace)]
    cut = blanks[-1] + 1 if blanks else start
    moved = [(None, item) for _, item in body[cut:]]
    del body[cut:]
    return moved


def _ensure_blank_line(container: Container) -> None:
    """End a container's text with a blank line (before a table added after it)."""
    from tomlkit.items import Whitespace

    text = container.as_string()
    if text and not text.endswith("\n\n"):
        container.body.append((None, Whitespace("\n" if text.endswith("\n") else "\n\n")))
