"""Docs that cannot rot: every snippet of the docs site, the README and the examples' READMEs
is checked against the code.

- ```toml: loaded by epbuild's manifest loader in a scratch workspace holding the models it
  names (tiny generated ones), unless marked. Markers, an HTML comment on the line before the
  fence: ``<!-- snippet: toml-only -->`` (TOML that is not a manifest: only parsed),
  ``<!-- snippet: error MESSAGE -->`` (a deliberate mistake: loading must fail with MESSAGE).
- ```sh / ```bash / ```yaml ``run:`` lines: each ``epbuild ...`` command parses with the CLI's
  parser (no unknown command or option).
- ```json: parses.
- ``<!-- snippet: file PATH -->``: the block is byte for byte the repository file PATH.

The getting-started and CI commands run for real in the one slow test at the end.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import modelgen
import numpy as np
import pytest

from epbuild._names import tomllib
from epbuild.errors import EpbuildError
from epbuild.manifest.init import STARTER
from epbuild.manifest.load import load_manifest
from epbuild.providers.qnn import WELL_KNOWN_TARGETS, chip_of, pairing_problem

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted(
    [
        *(ROOT / "docs").rglob("*.md"),
        ROOT / "README.md",
        *(ROOT / "examples").glob("*/README.md"),
    ]
)
LLM_FIXTURE = ROOT / "tests" / "fixtures" / "llm" / "llama"
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)
_MARK = re.compile(r"<!-- snippet: (.*?) -->\s*\Z")


@dataclass(frozen=True)
class Snippet:
    file: Path
    line: int
    lang: str
    text: str
    mark: str

    @property
    def where(self) -> str:
        return f"{self.file.relative_to(ROOT)}:{self.line}"


def _snippets(lang: set[str]) -> list[Snippet]:
    found = []
    for file in DOCS:
        text = file.read_text(encoding="utf-8")
        for m in _FENCE.finditer(text):
            if m.group(1) not in lang:
                continue
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = _MARK.search(before + "\n")
            line = text.count("\n", 0, m.start()) + 1
            found.append(Snippet(file, line, m.group(1), m.group(2), mark.group(1) if mark else ""))
    return found


def _ids(snippets: list[Snippet]) -> list[str]:
    return [s.where for s in snippets]


TOML = _snippets({"toml"})
SHELL = _snippets({"sh", "bash", "shell", "yaml"})
JSON = _snippets({"json"})
FILES = [s for s in _snippets({"toml", "yaml", "sh", "text", "json", "python"}) if s.mark]


def test_the_docs_have_snippets_of_each_kind() -> None:
    assert len(TOML) >= 15 and len(SHELL) >= 15 and JSON
    assert any(s.mark.startswith("error ") for s in TOML)


# --- TOML --------------------------------------------------------------------------------


def _model_paths(data: dict[str, object]) -> list[str]:
    paths: list[str] = []
    groups = data.get("groups", {})
    assert isinstance(groups, dict)
    for group in groups.values():
        for entry in group.get("models", []):
            path = entry["path"] if isinstance(entry, dict) else entry
            paths.append(re.sub(r"[*?]", "a", path))
    return paths


def _workspace(root: Path, data: dict[str, object]) -> None:
    """The files a manifest names: tiny models, an LLM folder, numerics samples, prompts."""
    for rel in _model_paths(data):
        path = root / rel
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            modelgen.save(modelgen.matmul_model(seed=len(rel)), path)
    llms = data.get("llms", {})
    assert isinstance(llms, dict)
    for llm in llms.values():
        if not (root / llm["source"]).exists():
            shutil.copytree(LLM_FIXTURE, root / llm["source"])
    samples = root / "samples"
    samples.mkdir(exist_ok=True)
    np.savez(samples / "a.npz", x=np.zeros((1, 32), dtype=np.float32))
    recipes = data.get("quantization", {})  # calibration and validation samples
    assert isinstance(recipes, dict)
    for recipe in recipes.values():
        for key in ("calibration", "validation"):
            for rel in [recipe[key]] if isinstance(recipe.get(key), str) else recipe.get(key, []):
                path = root / re.sub(r"[*?]", "a", rel)
                path.parent.mkdir(parents=True, exist_ok=True)
                if path.suffix == ".txt":  # an LLM's calibration: text prompts
                    path.write_text("The quick brown fox\n", encoding="utf-8")
                else:
                    np.savez(path, x=np.zeros((1, 32), dtype=np.float32))


@pytest.mark.parametrize("snippet", TOML, ids=_ids(TOML))
def test_toml_snippet_loads(snippet: Snippet, tmp_path: Path) -> None:
    data = tomllib.loads(snippet.text)
    if snippet.mark == "toml-only":
        return
    manifest = tmp_path / "epbuild.toml"
    manifest.write_text(snippet.text, encoding="utf-8")
    _workspace(tmp_path, data)
    if snippet.mark.startswith("error "):
        expected = snippet.mark.removeprefix("error ").strip('"')
        with pytest.raises(EpbuildError) as info:
            load_manifest(manifest)
        assert expected in str(info.value), f"{snippet.where}: {info.value}"
        return
    assert not snippet.mark, f"{snippet.where}: unknown marker {snippet.mark!r}"
    try:
        load_manifest(manifest)
    except EpbuildError as exc:
        pytest.fail(f"{snippet.where}: the manifest loader refuses it: {exc} ({exc.hint})")


# --- shell -------------------------------------------------------------------------------


def _commands(snippet: Snippet) -> list[list[str]]:
    """The argument lists of every ``epbuild`` command in a shell or workflow snippet."""
    lines = snippet.text.splitlines()
    if snippet.lang == "yaml":
        lines = [m.group(1) for x in lines if (m := re.match(r"\s*-?\s*run:\s*(.*)", x))]
    commands = []
    for line in lines:
        for inner in re.findall(r"\$\(([^)]*)\)", line):
            commands.extend(_segments(inner))
        commands.extend(_segments(re.sub(r"\$\([^)]*\)", "X", line)))
    return commands


def _segments(line: str) -> list[list[str]]:
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        return []
    out, current = [], []
    for token in [*tokens, "&&"]:
        if token in ("&&", "||", ";", "|", ">", ">>", "2>&1"):
            while current and re.fullmatch(r"[A-Z_]+=.*", current[0]):
                current.pop(0)
            if current and os.path.basename(current[0]) == "epbuild":
                out.append(current[1:])
            current = []
        elif current and current[-1] in (">", ">>"):
            continue
        else:
            current.append(token)
    return out


_PARSER_SNIPPETS = [s for s in SHELL if _commands(s)]


def _parser():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_reference
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return gen_reference.build_parser()


@pytest.mark.parametrize("snippet", _PARSER_SNIPPETS, ids=_ids(_PARSER_SNIPPETS))
def test_shell_snippet_commands_parse(snippet: Snippet) -> None:
    parser = _parser()
    for args in _commands(snippet):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"{snippet.where}: epbuild {shlex.join(args)}: {err.getvalue().strip()}")


def test_no_install_command_puts_flavours_that_clash_in_one_environment() -> None:
    """``onnxruntime-gpu`` (the ``tensorrt`` extra) replaces the ``onnxruntime`` module that
    ``onnxruntime-qnn`` plugs into: no command installs both."""
    installs = [
        (s.where, set(m.group(1).split(",")))
        for s in SHELL
        for m in re.finditer(r"pip install[^\n]*?\.\[([\w,-]+)\]", s.text)
    ]
    assert len(installs) >= 3
    for where, extras in installs:
        assert not {"qnn", "tensorrt"} <= extras, where


def test_the_command_finder_finds_commands() -> None:
    """The shell check sees through env prefixes, paths, $(...) and &&."""
    snippet = Snippet(
        ROOT,
        0,
        "sh",
        'EPBUILD_LOCKED=1 .venv/bin/epbuild build -j 2 && echo "k=$(epbuild cache key)" '
        "> out # epbuild nonsense\ncd epbuild\n",
        "",
    )
    assert _commands(snippet) == [["cache", "key"], ["build", "-j", "2"]]
    yaml = Snippet(ROOT, 0, "yaml", "  - run: epbuild verify --load\n# epbuild x\n", "")
    assert _commands(yaml) == [["verify", "--load"]]


def test_a_misspelt_option_in_a_snippet_fails_the_check() -> None:
    bad = Snippet(ROOT, 0, "sh", "epbuild build --jobz 2\n", "")
    with pytest.raises(pytest.fail.Exception, match="--jobz"):
        test_shell_snippet_commands_parse(bad)


# --- QNN targets agree with the chip table ------------------------------------------------

_MANIFESTS = sorted((ROOT / "examples").rglob("*.toml"))
_HEADER = re.compile(r"^\s*\[")
_CHIPS = {
    t.title.split(" (")[0].removeprefix("Snapdragon "): t for t in WELL_KNOWN_TARGETS.values()
}
_PARTS = {t.title.split("(")[-1].rstrip(")").lower(): t for t in WELL_KNOWN_TARGETS.values()}
_CHIP = re.compile(
    r"(?<![\w+])("
    + "|".join(re.escape(n) for n in sorted([*_CHIPS, *_PARTS], key=len, reverse=True))
    + r")(?![\w+])",
    re.I,
)
_OPTION_PAIR = re.compile(r"htp_arch=\D?(\d+)\D?\s+--option\s+soc_model=\D?(\d+)")


def _chips_named(comment: str) -> set[str]:
    """The soc_model of every chip of the table a comment names (marketing or part name)."""
    found = set()
    for name in _CHIP.findall(comment):
        chip = _PARTS.get(name.lower()) or next(
            t for n, t in _CHIPS.items() if n.lower() == name.lower()
        )
        found.add(chip.soc_model)
    return found


def _comment(line: str) -> str:
    """The comment of a TOML line (a ``#`` inside a string is not one)."""
    code = re.sub(r'"[^"]*"', '""', line)
    return code.split("#", 1)[1] if "#" in code else ""


def _targets(body: str, key: str) -> list[str]:
    m = re.search(key + r'\s*=\s*"([\d, ]+)"', body)
    return [x.strip() for x in m.group(1).split(",")] if m else []


def target_problems(text: str) -> list[str]:
    """What in a manifest's text the chip table contradicts: an htp_arch paired with another
    chip's soc_model; a comment in a table naming a chip whose soc_model is not the
    table's, or outside any table naming a chip no table of the text targets; an "HTP vNN"
    comment on a table with another htp_arch."""
    sections: list[list[str]] = [[]]
    for line in text.splitlines():
        if _HEADER.match(line) and sections[-1]:
            sections.append([])
        sections[-1].append(line)
    problems: list[str] = []
    every_soc: set[str] = set()
    loose: list[tuple[str, set[str]]] = []
    for lines in sections:
        where, body = lines[0].strip(), "\n".join(lines)
        comments = " ".join(_comment(x) for x in lines)
        archs, socs = _targets(body, "htp_arch"), _targets(body, "soc_model")
        for arch, soc in zip(archs, socs, strict=False):
            if problem := pairing_problem(arch, soc):
                problems.append(f"{where}: {problem}")
        named = _chips_named(comments)
        if not socs:
            loose += [(where, named)] if named else []
            continue
        every_soc |= set(socs)
        for soc in sorted(named - set(socs), key=int):
            problems.append(f"{where}: a comment names the {_title(soc)} (soc_model {soc}); "
                            f"the table sets soc_model {','.join(socs)}")  # fmt: skip
        for arch in sorted(set(re.findall(r"HTP v(\d+)", comments)) - set(archs or [])):
            problems.append(f"{where}: a comment says HTP v{arch}, htp_arch is {archs}")
    for where, named in loose:
        for soc in sorted(named - every_soc, key=int) if every_soc else []:
            problems.append(f"{where}: a comment names the {_title(soc)} (soc_model {soc}), "
                            "which no table here targets")  # fmt: skip
    return problems


def _title(soc: str) -> str:
    chip = chip_of(soc)
    assert chip is not None
    return chip.title


@pytest.mark.parametrize(
    "source",
    [*TOML, *_MANIFESTS],
    ids=[*_ids(TOML), *(str(p.relative_to(ROOT)) for p in _MANIFESTS)],
)
def test_targets_agree_with_the_chip_table(source: Snippet | Path) -> None:
    if isinstance(source, Path):
        text, where = source.read_text(encoding="utf-8"), str(source.relative_to(ROOT))
    else:
        text, where = source.text, source.where
        if source.mark.startswith("error "):
            return  # a deliberate mistake, which the loader must refuse (above)
    assert target_problems(text) == [], where


def test_the_starter_manifest_and_every_option_pair_agree_with_the_chip_table() -> None:
    """init's starter manifest, and each ``--option htp_arch=N --option soc_model=M`` in the
    docs, the examples and epbuild's own hints."""
    assert target_problems(STARTER) == []
    files = [*DOCS, *(ROOT / "epbuild").rglob("*.py"), *(ROOT / "examples").rglob("*.md")]
    pairs = [
        (f.relative_to(ROOT), arch, soc)
        for f in files
        for arch, soc in _OPTION_PAIR.findall(f.read_text(encoding="utf-8"))
    ]
    assert len(pairs) >= 3
    for where, arch, soc in pairs:
        assert pairing_problem(arch, soc) is None, (where, pairing_problem(arch, soc))


def test_the_target_page_lists_every_chip_epbuild_knows() -> None:
    page = (ROOT / "docs" / "guides" / "targets.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `([\w-]+)` \| (.+?) \| (\d+) \| (\d+) \|$", page, re.M))
    table = {(n, t.title, t.htp_arch, t.soc_model) for n, t in WELL_KNOWN_TARGETS.items()}
    assert rows == table, "docs/guides/targets.md: the chip table differs from WELL_KNOWN_TARGETS"


def test_the_target_check_finds_what_the_examples_once_said() -> None:
    """The pairings and comments this check was written for, as they were."""
    wrong_pair = (
        "[providers.htp-v75]                    # e.g. Snapdragon 8 Gen 3\n"
        'ep = "qnn"\noptions = { htp_arch = "75", soc_model = "69" }\n'
    )
    pairing, comment = target_problems(wrong_pair)
    assert "Snapdragon 8 Elite" in pairing and "HTP v79" in pairing
    assert "Snapdragon 8 Gen 3" in comment and "soc_model 57" in comment
    wrong_comment = (
        "[providers.htp-v73]  # a compile target: Snapdragon 8 Gen 2 / X Elite class\n"
        'ep = "qnn"\noptions = { htp_arch = "73", soc_model = "60" }\n'
    )
    (problem,) = target_problems(wrong_comment)
    assert "Snapdragon 8 Gen 2" in problem and "soc_model 43" in problem
    assert target_problems(wrong_comment.replace("8 Gen 2 / ", "")) == []
    part = '[providers.x]  # SM8650\noptions = { htp_arch = "73", soc_model = "60" }\n'
    assert len(target_problems(part)) == 1
    arch = '[providers.x]  # HTP v75\noptions = { htp_arch = "73", soc_model = "60" }\n'
    assert len(target_problems(arch)) == 1
    loose = '# for the 8 Elite\n[providers.x]\noptions = { htp_arch = "73", soc_model = "60" }\n'
    assert len(target_problems(loose)) == 1
    assert _OPTION_PAIR.findall("--option htp_arch=75 --option soc_model=69") == [("75", "69")]


# --- JSON and whole files ----------------------------------------------------------------


@pytest.mark.parametrize("snippet", JSON, ids=_ids(JSON))
def test_json_snippet_parses(snippet: Snippet) -> None:
    json.loads(snippet.text)


@pytest.mark.parametrize("snippet", FILES, ids=_ids(FILES))
def test_file_snippet_is_the_file(snippet: Snippet) -> None:
    kind, _, path = snippet.mark.partition(" ")
    if kind != "file":
        return
    assert (ROOT / path).read_text(encoding="utf-8") == snippet.text, (
        f"{snippet.where} differs from {path}: copy the file into the page again"
    )


def test_the_ci_guide_holds_the_whole_workflow() -> None:
    files = [s.mark for s in FILES if s.file.name == "ci.md"]
    assert "file examples/ci/github-actions.yml" in files


# --- hints point at sections that exist ---------------------------------------------------


def _anchors(page: Path) -> set[str]:
    text = page.read_text(encoding="utf-8")
    return set(re.findall(r"\{#([\w-]+)\}", text))


_PAGE_URL = re.compile(r"""page_url\(\s*['"]([\w/-]+\.md)['"](?:,\s*['"]([\w-]+)['"])?\)""")


def test_every_docs_link_in_a_hint_names_a_section_that_exists() -> None:
    """Hints and --help name the site's pages (``page_url``), never a path in the
    repository (a pip user has none): each page and anchor exists."""
    links, repo_paths = [], []
    for path in (ROOT / "epbuild").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        links += _PAGE_URL.findall(text)
        tree = ast.parse(text)
        docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}  # docstrings
        for node in ast.walk(tree):  # the other string literals: what a user may read
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if id(node) in docs:
                    continue
                if re.search(r"(?<![\w.])(docs|schemas)/[\w/-]+\.(md|json)", node.value):
                    repo_paths.append((path.name, node.value[:80]))
    assert len(links) >= 8
    for page, anchor in links:
        assert (ROOT / "docs" / page).is_file(), page
        if anchor:
            headings = _anchors(ROOT / "docs" / page)
            headings |= set(
                re.findall(r"^#+ `(epbuild[^`]*)`", (ROOT / "docs" / page).read_text(), re.M)
            )
            assert anchor in {h.replace(" ", "-") for h in headings}, f"{page}#{anchor}"
    assert repo_paths == []


def test_the_site_address_is_the_one_hints_use() -> None:
    from epbuild.docsite import SITE_URL, page_url

    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert re.search(r"^site_url: (\S+)$", config, re.M).group(1) == SITE_URL  # type: ignore[union-attr]
    assert page_url("troubleshooting.md", "lock-waits") == SITE_URL + "troubleshooting/#lock-waits"
    assert page_url("reference/cli.md") == SITE_URL + "reference/cli/"
    assert page_url("index.md") == SITE_URL


def test_qnn_mem_alloc_gets_a_hint_to_the_troubleshooting_page() -> None:
    from types import SimpleNamespace

    from epbuild.executors.worker import ort_failure

    job = SimpleNamespace(compile=SimpleNamespace(disable_cpu_ep_fallback=False))
    exc = RuntimeError(
        "[ONNXRuntimeError] : 11 : EP_FAIL : Failed to finalize QNN graph. Error: "
        "QNN_COMMON_ERROR_MEM_ALLOC"
    )
    failure = ort_failure(job, "models/llm.onnx", exc)  # type: ignore[arg-type]
    assert failure.hint is not None and "troubleshooting/#qnn-mem-alloc" in failure.hint
    assert ort_failure(job, "m.onnx", RuntimeError("other")).hint is None  # type: ignore[arg-type]


# --- the getting-started and CI commands, for real ----------------------------------------


def _epbuild(cwd: Path, *args: str, env: dict[str, str]) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "epbuild", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"epbuild {' '.join(args)}: {proc.stdout}{proc.stderr}"
    return proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_getting_started_and_the_ci_sequence_run(tmp_path: Path) -> None:
    """docs/getting-started.md (first build, no-op, a second target) and the CI guide's
    local sequence (lock, build into a cache, export, import elsewhere, --cache-only)."""
    ws = tmp_path / "quickstart"
    shutil.copytree(ROOT / "examples" / "quickstart", ws, ignore=shutil.ignore_patterns("build"))
    env = {**os.environ, "EPBUILD_CACHE": str(tmp_path / "user-cache"), "PYTHONPATH": str(ROOT)}
    env.pop("EPBUILD_LOCKED", None)
    assert "2 compiled" in _epbuild(ws, "build", env=env)
    assert "2 up to date" in _epbuild(ws, "build", env=env)
    assert sorted(p.name for p in (ws / "build" / "llm" / "htp-v73").iterdir()) == [
        "decode_ctx.onnx",
        "prefill_ctx.onnx",
        "prefill_ctx_qnn.bin",
    ]
    _epbuild(ws, "add", "target", "snapdragon-8-elite", env=env)
    assert "never built" in _epbuild(ws, "status", env=env)
    assert "2 compiled, 2 up to date" in _epbuild(ws, "build", env=env)
    # The CI guide's sequence, as the workflow runs it.
    _epbuild(ws, "lock", env=env)
    _epbuild(ws, "lock", "--check", env=env)
    key = _epbuild(ws, "cache", "key", env=env).strip()
    assert key
    _epbuild(ws, "clean", env=env)
    _epbuild(ws, "build", "--cache", ".epbuild-ci-cache", env={**env, "EPBUILD_LOCKED": "1"})
    _epbuild(ws, "cache", "prune", "--max-size", "5G", "--cache", ".epbuild-ci-cache", env=env)
    _epbuild(ws, "cache", "export", "epcontext-cache.tar", "--cache", ".epbuild-ci-cache", env=env)
    _epbuild(ws, "clean", env=env)
    _epbuild(ws, "cache", "import", "epcontext-cache.tar", "--cache", ".ci-2", env=env)
    out = _epbuild(ws, "build", "--cache-only", "--cache", ".ci-2", env=env)
    assert "4 restored" in out
    _epbuild(ws, "verify", env=env)
    # examples/quickstart/README.md: its commands, as written (-C the copy instead).
    readme = next(x for x in SHELL if x.file == ROOT / "examples" / "quickstart" / "README.md")
    commands = _commands(readme)
    assert len(commands) >= 5
    for args in commands:
        assert args[:2] == ["-C", "examples/quickstart"], args
        _epbuild(ws, *args[2:], env=env)
    assert (ws / "dist" / "epbuild-package.json").is_file()
    # The Python blocks of the getting-started page and the shipping guide, run for real.
    _run_python_snippets(ws, ROOT / "docs" / "getting-started.md", env)
    x = "import numpy as np\nx = np.zeros((1, 32), dtype=np.float32)\n"
    _run_python_snippets(ws, ROOT / "docs" / "guides" / "shipping.md", env, setup=x)


PYTHON = _snippets({"python"})


@pytest.mark.parametrize("snippet", PYTHON, ids=_ids(PYTHON))
def test_python_snippet_parses_and_names_what_exists(snippet: Snippet) -> None:
    """Every Python block is valid Python, what it imports is installed, and each
    ``epbuild.NAME`` it uses is something ``epbuild`` exports."""
    import ast
    import importlib.util

    import epbuild

    tree = ast.parse(snippet.text, filename=snippet.where)
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            if not name.startswith("acme"):  # the adapter snippet is the package it names
                assert importlib.util.find_spec(name) is not None, (snippet.where, name)
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "epbuild"
        ):
            assert hasattr(epbuild, node.attr), (snippet.where, f"epbuild.{node.attr}")


_SIGNATURE = re.compile(r"`epbuild\.(\w+)\(([^`]*)\)`")


def test_a_signature_in_the_docs_gives_the_real_defaults() -> None:
    """``epbuild.NAME(a, b, k=None, c="x")`` in a page: each keyword exists, and where the
    mention is a signature (some keyword ``=None``) each literal is the real default."""
    import ast
    import inspect

    import epbuild

    seen = 0
    for page in DOCS:
        for name, args in _SIGNATURE.findall(page.read_text(encoding="utf-8")):
            params = inspect.signature(getattr(epbuild, name)).parameters
            pairs = [a.strip().split("=", 1) for a in args.split(",") if "=" in a]
            signature = any(v.strip() == "None" for _, v in pairs)
            for key, value in pairs:
                assert key.strip() in params, (page.name, name, key)
                if signature and value.strip() != "...":
                    default = params[key.strip()].default
                    assert ast.literal_eval(value.strip()) == default, (page.name, name, key)
                    seen += 1
    assert seen >= 3


def _reason_heads() -> set[str]:
    """The fixed words each stale reason of ``planning/keys.py`` and
    ``planning/staleness.py`` starts with (up to its first value): the strings appended to
    ``reasons``/``problems``, in list literals and comprehensions, returned by a
    ``*_reason`` function, and the labels of the option and setting sections."""
    heads: set[str] = set()
    for module in ("keys.py", "staleness.py"):
        tree = ast.parse((ROOT / "epbuild" / "planning" / module).read_text(encoding="utf-8"))
        texts: list[ast.expr] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                if node.func.attr == "append" and getattr(owner, "id", "") in (
                    "reasons",
                    "problems",
                ):
                    texts += node.args
            elif isinstance(node, ast.List):
                texts += node.elts
            elif isinstance(node, ast.ListComp):
                texts.append(node.elt)
            elif isinstance(node, ast.FunctionDef) and "reason" in node.name:
                texts += [r.value for r in ast.walk(node) if isinstance(r, ast.Return) and r.value]
            elif isinstance(node, ast.Tuple) and len(node.elts) == 2:
                key, label = node.elts
                if isinstance(key, ast.Constant) and str(key.value).endswith(
                    ("_options", "settings", "group", "toolchain")
                ):
                    texts.append(label)
        for text in texts:
            first = text.values[0] if isinstance(text, ast.JoinedStr) else text
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                heads.add(first.value.strip())
    return {h for h in heads if h and not h.startswith("(")}


def test_the_reasons_table_has_every_reason_the_code_gives() -> None:
    """docs/guides/manifest.md "Why is an action stale?": a reason added to the code
    without a row (as key changed, model order changed and option file changed once
    were) fails here."""
    page = (ROOT / "docs" / "guides" / "manifest.md").read_text(encoding="utf-8")
    table = page.split("The reasons you will meet:", 1)[1].split("\n\n", 2)[1]
    shown = [c for row in table.splitlines() for c in re.findall(r"`([^`]+)`", row.split("|")[1])]
    heads = _reason_heads()
    assert {"key changed", "model order changed", "option file", "never built"} <= heads
    missing = [h for h in sorted(heads) if not any(c.startswith(h) for c in shown)]
    assert missing == [], "add a row for these reasons"


def _run_python_snippets(ws: Path, page: Path, env: dict[str, str], setup: str = "") -> None:
    """Run each of a page's Python blocks in a fresh interpreter in ``ws`` (as a user's
    script would: one process, paths relative to the project)."""
    for snippet in (s for s in PYTHON if s.file == page):
        code = setup + snippet.text.replace('"examples/quickstart"', repr(str(ws)))
        proc = subprocess.run([sys.executable, "-c", code], cwd=ws, env=env,
                              capture_output=True, text=True, timeout=240)  # fmt: skip
        assert proc.returncode == 0, f"{snippet.where}:\n{proc.stderr[-3000:]}"


_NOT_FOR_READERS = re.compile(
    r"(?<![\w.<])/(opt|work|home|root|mnt)/\w"  # a path of the machine the page was written on
    r"|\bissues? #?\d+|\(#\d+\)"  # an issue number of the team's tracker
    r"|\bdev box\b|<scratch>",
    re.I,
)


def test_no_page_names_a_machine_path_or_an_issue_number() -> None:
    """The docs are for readers outside the team: no build machine's paths, no tracker
    numbers, no "dev box"."""
    found = [
        f"{page.relative_to(ROOT)}:{n}: {m.group(0)}"
        for page in DOCS
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if (m := _NOT_FOR_READERS.search(line))
    ]
    assert found == []
    assert _NOT_FOR_READERS.search("extra-index-url = file:///opt/pypi/simple")
    assert _NOT_FOR_READERS.search("Research for issue #13") and _NOT_FOR_READERS.search("(#13)")


def test_the_python_api_page_documents_every_exported_name() -> None:
    """docs/reference/python.md renders (mkdocstrings) each name ``epbuild`` exports."""
    import epbuild

    page = (ROOT / "docs" / "reference" / "python.md").read_text(encoding="utf-8")
    shown = {line.rsplit(".", 1)[-1] for line in re.findall(r"^::: (\S+)$", page, re.M)}
    assert set(epbuild.__all__) - {"__version__"} == shown


def test_the_changelog_has_the_current_version_and_the_format_versions() -> None:
    from epbuild._version import __version__
    from epbuild.frontends.render import SCHEMA_VERSION
    from epbuild.planning.keys import FORMAT_VERSION

    log = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert "## [Unreleased]" in log and f"## [{__version__}]" in log
    assert f"output format ({FORMAT_VERSION})" in log
    assert f"JSON `schema_version` ({SCHEMA_VERSION})" in log


def test_every_docs_page_is_in_the_site_nav() -> None:
    """``mkdocs build --strict`` refuses a page outside the nav; say so in the inner loop."""
    nav = set(re.findall(r":\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert pages - nav == set(), "add these pages to mkdocs.yml's nav"
    assert nav - pages == set(), "the nav names pages that do not exist"
