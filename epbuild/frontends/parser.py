"""The ``epbuild`` command line's grammar: :func:`build_parser` and one function per command.

One vocabulary: a concept is spelled the same way in every command that takes it (the
target group ``-g/--group GROUP``, a provider's name ``-p/--provider NAME``, where a
command writes ``-o/--out``, ``-j/--jobs N``, the cache flags, ``--lock-timeout SECONDS``,
``--json``); ``tests/test_cli_vocabulary.py`` holds the table. A former spelling stays
working, hidden from ``--help``, and leaves a one-line deprecation note (:class:`Renamed`).
Standard library only: imported on the no-op fast path.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias

from epbuild._names import (
    ACTIVATION_TYPES,
    CALIBRATION_METHODS,
    GENERATE_TIMEOUT,
    WEIGHT_TYPES,
)
from epbuild._version import __version__
from epbuild.docsite import page_url
from epbuild.errors import UsageError
from epbuild.frontends.render import terminal_columns

if TYPE_CHECKING:
    _Commands: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

JSON_HELP = "print one JSON document on stdout (a failure too: ok false, error)"
OPTION_HELP = (
    "a provider option (repeatable; default: none); VALUE is written as an integer or boolean "
    "when it reads as one (75, true), else as a string; quote it to force a string "
    "(htp_arch='\"75\"')"
)
DEFAULT_PROMPT = "The quick brown fox"
"""``verify --generate``'s prompt (``epbuild.llm.generate.DEFAULT_PROMPT``, which the
standard-library-only parser cannot import; a test holds them equal)."""


class Parser(argparse.ArgumentParser):
    """argparse's parser; with ``raise_usage_errors`` (``main`` sets it) its complaints are
    raised (``UsageError``) rather than printed with an exit, so that ``main`` reports them
    like any other mistake (``--json`` too). Otherwise argparse's usual ``SystemExit(2)``."""

    raise_usage_errors = False

    def error(self, message: str) -> NoReturn:
        if not self.raise_usage_errors:
            super().error(message)
        raise UsageError(message, usage=self.format_usage(), prog=self.prog)

    def _get_formatter(self) -> argparse.HelpFormatter:
        """argparse's formatter, given the terminal's width as ``shutil.get_terminal_size``
        finds it (``render.terminal_columns``) rather than importing ``shutil`` for it: every
        ``add_argument`` makes one, on every start."""
        width = terminal_columns() - 2
        return self.formatter_class(prog=self.prog, width=width)  # type: ignore[call-arg]


class _Formatter(argparse.HelpFormatter):
    """argparse's help layout, but the closing ``docs: URL`` line is never wrapped (a URL
    broken over two lines cannot be followed)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("docs: "):
            return indent + text
        return super()._fill_text(text, width, indent)


class Renamed(argparse.Action):
    """A former spelling of an option (hidden from ``--help``): stores, or appends, like
    the option it became, and leaves a note in ``namespace.deprecated``."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str,
        *,
        now: str,
        append: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.now = now
        self.append = append

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        note = f"{option_string} is deprecated: write {self.now} (it does the same)"
        notes = list(getattr(namespace, "deprecated", None) or [])
        namespace.deprecated = [*notes, note] if note not in notes else notes
        if self.append:
            values = [*(getattr(namespace, self.dest, None) or []), values]
        setattr(namespace, self.dest, values)


SELECTOR_HELP = "a group, group/provider or action id (default: every action)"


def selectors(p: argparse.ArgumentParser, text: str = SELECTOR_HELP) -> None:
    p.add_argument("selectors", nargs="*", metavar="SELECTOR", help=text)


def flag(p: argparse.ArgumentParser, *names: str, text: str) -> None:
    """An option that takes no value and sets ``True`` where given."""
    p.add_argument(*names, action="store_true", help=text)


def json_flag(p: argparse.ArgumentParser, text: str = JSON_HELP) -> None:
    flag(p, "--json", text=text)


JOBS_DEFAULT = "default: [workspace] jobs, else the number of CPUs"


def jobs(p: argparse.ArgumentParser, text: str = f"compiles at once ({JOBS_DEFAULT})") -> None:
    p.add_argument("-j", "--jobs", type=int, metavar="N", help=text)


def lock_timeout(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lock-timeout",
        type=float,
        metavar="SECONDS",
        help="give up (exit 3) after waiting this long for another epbuild's lock (default: "
        "wait as long as it takes, saying whom it waits for)",
    )


def cache_location(p: argparse.ArgumentParser, text: str | None = None) -> None:
    p.add_argument(
        "--cache",
        metavar="DIR|URL",
        help=text or CACHE_HELP,
    )


CACHE_HELP = (
    "the cache: a directory or an fsspec URL (s3://bucket/prefix) (default: EPBUILD_CACHE, "
    "else [workspace] cache, else the per-user cache directory)"
)
OPTION_ENV = {
    "--cache": "EPBUILD_CACHE",
    "--no-cache": "EPBUILD_CACHE=off",
    "--locked": "EPBUILD_LOCKED=1",
    "--debug": "EPBUILD_DEBUG=1",
}
"""The environment variable each option has (the option wins): every ``--help`` and the
command reference say it (``_document``)."""


def cache_flags(p: argparse.ArgumentParser) -> None:
    cache_location(p)
    flag(p, "--no-cache", text="neither restore nor store")


def out(p: argparse.ArgumentParser, metavar: str, text: str, *, required: bool = False) -> None:
    p.add_argument("-o", "--out", metavar=metavar, help=text, required=required)


def provider_options(p: argparse.ArgumentParser) -> None:
    """``--option KEY=VALUE`` (repeatable): a provider's options, as ``add provider`` and
    ``add target`` take them."""
    p.add_argument("--option", action="append", metavar="KEY=VALUE", help=OPTION_HELP)


def group(p: argparse.ArgumentParser, text: str, *, append: bool = False) -> None:
    if append:
        p.add_argument("-g", "--group", metavar="GROUP", help=text, action="append", default=[])
    else:
        p.add_argument("-g", "--group", metavar="GROUP", help=text)


def provider(p: argparse.ArgumentParser, text: str, *, append: bool = False) -> None:
    if append:
        p.add_argument("-p", "--provider", metavar="NAME", help=text, action="append", default=[])
    else:
        p.add_argument("-p", "--provider", metavar="NAME", help=text)


def build_parser(
    *, raise_usage_errors: bool = False, argv: Sequence[str] | None = None
) -> argparse.ArgumentParser:
    """Global options, then one sub-parser per command (in ``--help`` order).
    ``raise_usage_errors``: a bad command line raises ``UsageError`` (else argparse's
    message and ``SystemExit(2)``). ``argv``: the command line it will parse; when that
    plainly names its command, only that command's sub-parser is made (the same parse,
    without making the other dozen: a small build's startup)."""
    p = Parser(prog="epbuild", description="Build ONNX Runtime EPContext models incrementally.")
    p.add_argument(
        "-C", dest="directory", default=".", metavar="DIR", help="run as if started in DIR"
    )
    p.add_argument(
        "-f", "--file", dest="manifest", metavar="FILE", help="manifest file (default epbuild.toml)"
    )
    p.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback an error came from",
    )
    p.add_argument("--version", action="version", version=f"epbuild {__version__}")
    sub: _Commands = p.add_subparsers(  # type: ignore[assignment]  # its parsers are Parser
        dest="command", metavar="COMMAND"
    )
    sub.required = True
    named = None if argv is None else _command_in(argv)
    for add in _IN_HELP_ORDER:
        if named is None or add.__name__ == f"_{named}":
            add(sub)
    _document(p, "epbuild", raise_usage_errors)
    return p


DOCS_PAGE = "reference/cli.md"
"""The docs page each command's ``--help`` sends the reader to (its section, by the
``epbuild X`` title), on the site (``epbuild.docsite``)."""


def _document(p: argparse.ArgumentParser, title: str, raising: bool) -> None:
    """Every ``--help`` says in one line what the command does and ends with its docs page;
    every parser raises usage errors or not, as asked."""
    if isinstance(p, Parser):
        p.raise_usage_errors = raising
    anchor = title.replace(" ", "-") if " " in title else ""
    p.epilog = f"docs: {page_url(DOCS_PAGE, anchor)}"
    p.formatter_class = _Formatter
    for action in p._actions:
        env = next((OPTION_ENV[o] for o in action.option_strings if o in OPTION_ENV), None)
        if env and action.help and env.split("=")[0] not in action.help:
            action.help += f" (environment: {env})"
        if isinstance(action, argparse._SubParsersAction):
            helps = {c.dest: c.help for c in action._choices_actions}
            for name, child in action.choices.items():
                child.description = child.description or helps.get(name)
                _document(child, f"{title} {name}", raising)


def _build(sub: _Commands) -> None:
    b = sub.add_parser("build", help="compile stale actions")
    selectors(b)
    jobs(b)
    flag(b, "-k", "--keep-going", text="continue after failures")
    flag(b, "-n", "--dry-run", text="show what would be built")
    json_flag(b)
    lock_timeout(b)
    cache_flags(b)
    flag(b, "--cache-only", text="restore from the cache or fail (exit 1): never compile")
    flag(b, "--cache-push", text="also write compiled actions to the remote cache (--cache URL)")
    b.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="memory local compiles may use at once, e.g. 8G (default: [workspace] "
        "memory_budget, else 3/4 of the memory available when the build starts)",
    )
    b.add_argument(
        "--trace",
        metavar="FILE",
        help="also write the timeline as Chrome trace JSON (default: no trace file)",
    )
    flag(
        b,
        "--numerics",
        text="then compare each built model's outputs with its source's (verify --numerics)",
    )
    flag(b, "--locked", text="refuse (exit 2) when an environment differs from epbuild.lock")
    b.add_argument(
        "--executor",
        choices=("local", "dask"),
        help="where actions run (default: [workspace] executor, else local)",
    )
    b.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="Dask scheduler, tcp://HOST:PORT (default: [workspace] scheduler; "
        "--executor dask needs one)",
    )


def _report(sub: _Commands) -> None:
    r = sub.add_parser("report", help="per-action report of the last builds (HTML page)")
    selectors(r)
    out(r, "FILE", "the HTML page to write (self-contained: timeline + table); required")
    r.add_argument("--html", dest="out", action=Renamed, now="-o/--out", metavar="FILE")
    json_flag(r)


def _status(sub: _Commands) -> None:
    s = sub.add_parser("status", help="list actions as up to date or stale, with reasons")
    selectors(s)
    json_flag(s)
    lock_timeout(s)
    cache_flags(s)
    detail = "EPContext coverage, CPU fallback, sizes, time, memory (takes no cache flags)"
    flag(s, "--detail", text=detail)
    s.add_argument(
        "--graph",
        choices=("mermaid", "dot"),
        help="print the build graph (actions, what each depends on, up to date or stale) "
        "as a Mermaid flowchart or a Graphviz DOT digraph (default: the list, no graph)",
    )


def _verify(sub: _Commands) -> None:
    v = sub.add_parser("verify", help="check built outputs (schema, paths, digests)")
    selectors(v)
    json_flag(v)
    lock_timeout(v)
    flag(v, "--load", text="also run each model vs the CPU EP")
    jobs(v, f"--load: models run at once ({JOBS_DEFAULT})")
    flag(
        v,
        "--numerics",
        text="compare each model's outputs with its source's (figures per output, tolerances "
        "from the manifest; recorded: a second run with nothing changed runs nothing)",
    )
    flag(
        v,
        "--generate",
        text="LLM packages: generate greedy tokens through the provider (onnxruntime-genai) "
        "and compare them with the CPU source's, step by step",
    )
    v.add_argument(
        "--tokens", type=int, default=10, metavar="N", help="--generate: tokens (default 10)"
    )
    v.add_argument(
        "--prompt",
        metavar="TEXT",
        help=f"--generate: the prompt (default {DEFAULT_PROMPT!r})",
    )
    v.add_argument(
        "--timeout",
        metavar="SECONDS",
        help="--generate: give up on a generation (one package's or its source's, every "
        f"prompt) after this long, saying how far it got (default {GENERATE_TIMEOUT:g}; 0 or "
        "none: no limit; an LLM on the emulated HTP can take minutes per prompt window)",
    )


def _package(sub: _Commands) -> None:
    k = sub.add_parser("package", help="write built outputs as an ONNX Runtime model package")
    selectors(k)
    out(k, "DIR", "package directory (default: [package] out_dir; one of the two is needed)")
    flag(k, "--build", text="build stale actions first")
    jobs(k, f"with --build: compiles at once ({JOBS_DEFAULT})")
    flag(k, "-k", "--keep-going", text="with --build: as build -k")
    cache_flags(k)
    flag(k, "--hash", text="re-hash every output first")
    json_flag(k)
    flag(
        k,
        "--force",
        text="replace the package directory even if it holds files the package does not list "
        "(they are deleted)",
    )
    lock_timeout(k)


def _clean(sub: _Commands) -> None:
    c = sub.add_parser("clean", help="remove built outputs and their records")
    selectors(c)
    json_flag(c)
    lock_timeout(c)
    flag(
        c,
        "--orphaned",
        text="remove only outputs no current action owns: those of actions no longer in the "
        "manifest (a binary left by switching share_weights) and those a changed [workspace] "
        "out_dir or state_dir left behind; forget their records",
    )


def _cache(sub: _Commands) -> None:
    k = sub.add_parser("cache", help="the action cache: key, export, import, prune, verify")
    ks = k.add_subparsers(dest="cache_command", metavar="CACHE_COMMAND")
    ks.required = True
    key = ks.add_parser("key", help="print a short key that changes when any action key does")
    selectors(key)
    exp = ks.add_parser("export", help="write the entries this manifest needs to one archive")
    exp.add_argument("file", metavar="ARCHIVE", help="archive to write (.tar, or .tar.gz)")
    selectors(exp)
    imp = ks.add_parser("import", help="add an exported archive to the local cache")
    imp.add_argument("file", metavar="ARCHIVE", help="archive to read")
    prn = ks.add_parser("prune", help="evict least-recently-used entries")
    prn.add_argument(
        "--max-size", required=True, metavar="SIZE", help="the size to prune to, e.g. 10G, 500M"
    )
    ver = ks.add_parser("verify", help="re-hash every cached object; discard damaged entries")
    for cmd in (exp, imp, prn, ver):
        cache_location(cmd)
    for cmd in (key, exp, imp, prn, ver):
        json_flag(cmd)
        lock_timeout(cmd)


def _watch(sub: _Commands) -> None:
    w = sub.add_parser("watch", help="rebuild affected actions whenever their inputs change")
    selectors(w)
    jobs(w)
    w.add_argument(
        "--debounce",
        type=float,
        default=0.3,
        metavar="SECONDS",
        help="quiet time before a burst of changes is built (default 0.3)",
    )
    flag(w, "--poll", text="poll instead of inotify (network file systems)")
    json_flag(w, "one JSON document per cycle, one line each, on stdout")
    lock_timeout(w)
    cache_flags(w)


def _init(sub: _Commands) -> None:
    i = sub.add_parser("init", help="write a commented starter epbuild.toml")
    i.add_argument(
        "--from",
        dest="source",
        metavar="DIR",
        help="list the models found under DIR; models sharing an external-data file "
        "become one weight-sharing group, the others one group per directory (default: "
        "the commented starter manifest, listing models/*.onnx)",
    )
    json_flag(i)
    lock_timeout(i)
    i.add_argument(
        "--target",
        metavar="TARGET",
        help="with --from: the first target, a SoC epbuild knows, e.g. snapdragon-8-gen-3 "
        "(list: 'epbuild add target --list'; default: htp-v73, the Snapdragon X Elite)",
    )


def _add(sub: _Commands) -> None:
    a = sub.add_parser(
        "add",
        help="add models, providers, targets or LLMs to epbuild.toml "
        "(comments and layout kept; checked before writing)",
    )
    kinds = a.add_subparsers(dest="add_command", metavar="WHAT")
    kinds.required = True
    for add in (_add_model, _add_provider, _add_target, _add_llm, _add_quantization):
        add(kinds)
    for kind in kinds.choices.values():
        json_flag(kind)
        lock_timeout(kind)


def _add_model(kinds: _Commands) -> None:
    m = kinds.add_parser("model", help="add models to a group (created when missing)")
    m.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="model files or globs, relative to the current directory (or -C DIR)",
    )
    group(m, "the group (default: the only one)")
    provider(
        m,
        "provider to build the group for (repeatable; a new group defaults to the only provider)",
        append=True,
    )
    m.add_argument(
        "--share-weights",
        action=argparse.BooleanOptionalAction,
        help="set share_weights = true for a new group or the group given",
    )
    m.add_argument(
        "--quantize",
        metavar="NAME",
        help="quantize the group's models with [quantization.NAME] before they compile "
        "(default: as the manifest says; a new group compiles its models as they are)",
    )


def _add_provider(kinds: _Commands) -> None:
    p = kinds.add_parser("provider", help="define a named provider configuration")
    p.add_argument("name", metavar="NAME", help="the provider's name")
    p.add_argument("--ep", required=True, help="adapter: qnn, openvino, tensorrt, plugin, ...")
    provider_options(p)
    flag(p, "--replace", text="overwrite an existing provider")
    tc = p.add_mutually_exclusive_group()
    tc.add_argument(
        "--requirement",
        action="append",
        metavar="REQ",
        help="compile in a toolchain epbuild makes with these pip requirements (repeatable), "
        "e.g. onnxruntime-openvino==1.24.1 (default: compile in epbuild's own environment)",
    )
    tc.add_argument(
        "--python",
        metavar="PATH",
        help="compile in this interpreter's environment (default: epbuild's own)",
    )


def _add_target(kinds: _Commands) -> None:
    t = kinds.add_parser(
        "target",
        help="build groups for one more target: a known SoC, or --ep and --option",
        description="Define a provider for TARGET and add it to groups' providers lists. "
        "TARGET is a Qualcomm SoC epbuild knows (its htp_arch and soc_model; --list shows "
        "them) or the name of a provider described with --ep and --option.",
    )
    t.add_argument(
        "target", nargs="?", metavar="TARGET", help="a known SoC, or a new provider's name"
    )
    flag(t, "--list", text="list the SoCs epbuild knows")
    group(t, "group to add it to (repeatable; default: every group)", append=True)
    t.add_argument("--to", dest="group", action=Renamed, now="-g/--group", append=True)
    provider(t, "the provider's name (default: TARGET)")
    t.add_argument("--name", dest="provider", action=Renamed, now="-p/--provider")
    t.add_argument(
        "--ep",
        help="adapter (default: qnn for a known SoC; needed for any other TARGET)",
    )
    provider_options(t)
    flag(t, "--replace", text="overwrite a different provider of that name")


def _add_llm(kinds: _Commands) -> None:
    m = kinds.add_parser("llm", help="add an onnxruntime-genai model folder as [llms.NAME]")
    m.add_argument("name", metavar="NAME", help="the LLM's name")
    m.add_argument("source", metavar="SOURCE", help="the folder holding genai_config.json")
    provider(m, "provider to build it for (repeatable; default: the only one)", append=True)
    m.add_argument(
        "--context-length",
        type=int,
        metavar="N",
        help="static KV-cache length (default 1024, or the model's limit where lower)",
    )
    m.add_argument(
        "--window-size",
        type=int,
        metavar="N",
        help="prompt window (prefill) length (default 64, or the context length where lower)",
    )
    m.add_argument(
        "--share-weights",
        action=argparse.BooleanOptionalAction,
        help="one binary for both graphs (the default), or one per graph (--no-share-weights)",
    )


def _add_quantization(kinds: _Commands) -> None:
    q = kinds.add_parser(
        "quantization",
        help="add a [quantization.NAME] recipe (calibration samples, types), or change one",
    )
    q.add_argument("name", metavar="NAME", help="the recipe's name, e.g. w8a16")
    q.add_argument(
        "--calibration",
        action="append",
        metavar="PATH",
        help=".npz/.npy samples, ONNX test-data folders or globs (repeatable; required for a "
        "new recipe; default: an existing recipe's kept)",
    )
    q.add_argument(
        "--validation",
        action="append",
        metavar="PATH",
        help="samples verify --numerics compares on (repeatable; default: the calibration samples)",
    )
    q.add_argument(
        "--activations", choices=ACTIVATION_TYPES, help="activation type (default uint8)"
    )
    q.add_argument("--weights", choices=WEIGHT_TYPES, help="weight type (default uint8)")
    q.add_argument(
        "--per-channel", action=argparse.BooleanOptionalAction, help="per-channel weights"
    )
    q.add_argument(
        "--method", choices=CALIBRATION_METHODS, help="calibration method (default minmax)"
    )
    q.add_argument(
        "--exclude",
        action="append",
        metavar="NODE",
        help="keep this node in float (repeatable; default: none)",
    )


def _toolchains(sub: _Commands) -> None:
    t = sub.add_parser(
        "toolchains",
        help="the environments made for providers' toolchains (per user); --prune",
    )
    flag(
        t,
        "--prune",
        text="remove the environments the current manifest does not use (all, without one) "
        "and other epbuild versions' worker copies; they are made again when needed",
    )
    json_flag(t)


def _lock(sub: _Commands) -> None:
    k = sub.add_parser(
        "lock",
        help="pin the environments providers compile in to epbuild.lock (for --locked builds)",
    )
    flag(
        k,
        "--check",
        text="write nothing; exit 1 when epbuild.lock is missing or out of date with the manifest",
    )
    json_flag(k)
    lock_timeout(k)


SCHEMA_LINE = "#:schema ./epbuild.schema.json"
"""The first line of an ``epbuild.toml`` that makes a TOML editor (taplo: Even Better TOML,
tombi) check it against ``epbuild schema``'s output saved beside it."""


def _schema(sub: _Commands) -> None:
    s = sub.add_parser(
        "schema",
        help="print the manifest's JSON Schema, for a TOML editor's checks and completion",
        description="Print the JSON Schema of epbuild.toml (this version's) on stdout. Save it "
        "beside the manifest (epbuild schema > epbuild.schema.json) and make the manifest's "
        f"first line '{SCHEMA_LINE}': editors built on taplo (Even Better TOML) or tombi "
        "then check every key as you type.",
    )
    json_flag(s, "print one JSON document: the schema under 'schema', the editor line")


def _command_in(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names after global options written out in full (``-C DIR``,
    ``-CDIR``, ``-f FILE``, ``--file FILE``, ``--file=FILE``, ``--debug``); None when
    anything else comes first (``--help``, an abbreviation, no command): the whole parser
    then parses it."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word in ("-C", "-f", "--file"):
            i += 2
        elif word == "--debug" or word.startswith(("-C", "--file=")) or word[:2] == "-f":
            i += 1
        else:
            return word if word in COMMAND_NAMES else None
    return None


_IN_HELP_ORDER = (
    _init,
    _add,
    _build,
    _report,
    _status,
    _verify,
    _clean,
    _package,
    _cache,
    _toolchains,
    _watch,
    _lock,
    _schema,
)
COMMAND_NAMES = frozenset(add.__name__[1:] for add in _IN_HELP_ORDER)
"""Each command's name: its function's (``_build`` adds ``build``)."""
