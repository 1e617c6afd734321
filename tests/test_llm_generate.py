"""Greedy generation in a child process and the token comparison of verify --generate
(epbuild/llm/generate.py): a crash or a missing onnxruntime-genai is a reason, never a
crash of epbuild; near ties are told apart from clear divergences."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from epbuild.llm.generate import (
    Generation,
    GenerationError,
    Verdict,
    compare,
    genai_installed,
    generate,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "llm"


def _gen(tokens: list[int], margins: list[float]) -> Generation:
    return Generation(tuple(tokens), tuple(margins), 1.0)


def test_compare_match() -> None:
    result = compare(_gen([1, 2, 3], [0.0] * 3), _gen([1, 2, 3], [0.5] * 3), 0.05)
    assert (result.verdict, result.matched, result.compared) == (Verdict.MATCH, 3, 3)
    assert result.describe() == "all 3 greedy tokens match the source"


def test_compare_near_tie_is_not_a_failure() -> None:
    result = compare(_gen([1, 9, 3], [0.5] * 3), _gen([1, 2, 3], [0.5, 0.02, 0.5]), 0.05)
    assert result.verdict is Verdict.NEAR_TIE and result.step == 1 and result.matched == 1
    assert "near tie at step 1: token 9 vs the source's 2 (source top-2 margin 0.020)" in (
        result.describe()
    )


def test_compare_clear_divergence() -> None:
    result = compare(_gen([1, 2, 7, 7], [0.5] * 4), _gen([1, 2, 3, 3], [0.5, 0.5, 0.4, 0.1]), 0.05)
    assert result.verdict is Verdict.DIVERGED
    assert result.to_json() == {
        "verdict": "diverged",
        "matched": 2,
        "compared": 4,
        "step": 2,
        "package_token": 7,
        "source_token": 3,
        "margin": 0.4,
    }


@pytest.mark.skipif(not genai_installed(), reason="pip install -e '.[genai]'")
def test_generate_on_cpu_is_deterministic() -> None:
    first = generate(FIXTURES / "llama", qnn=False, tokens=6, max_length=32)
    again = generate(FIXTURES / "llama", qnn=False, tokens=6, max_length=32)
    assert len(first.tokens) == 6 and first.tokens == again.tokens
    assert len(first.margins) == 6 and all(m >= 0 for m in first.margins)
    assert first.tokens_per_second > 0
    assert compare(first, again, 0.05).verdict is Verdict.MATCH


@pytest.mark.skipif(not genai_installed(), reason="pip install -e '.[genai]'")
def test_broken_model_is_a_reason(tmp_path: Path) -> None:
    folder = tmp_path / "llama"
    shutil.copytree(FIXTURES / "llama", folder)
    (folder / "model.onnx").write_bytes(b"not a model")
    with pytest.raises(GenerationError) as info:
        generate(folder, qnn=False, tokens=4, max_length=32)
    assert info.value.reason.startswith("generation failed (exit 1): ")


def _wrapper(tmp_path: Path, body: str) -> str:
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    return str(script)


def test_a_crash_is_a_reason(tmp_path: Path) -> None:
    python = _wrapper(tmp_path, "echo about to crash >&2; kill -SEGV $$")
    with pytest.raises(GenerationError) as info:
        generate(FIXTURES / "llama", qnn=True, tokens=4, max_length=32, python=python)
    assert "killed by SIGSEGV" in info.value.reason and "about to crash" in info.value.reason


def test_without_genai_says_how_to_install(tmp_path: Path) -> None:
    python = _wrapper(tmp_path, f'exec {sys.executable} -S "$@"')  # no site-packages
    with pytest.raises(GenerationError) as info:
        generate(FIXTURES / "llama", qnn=False, tokens=4, max_length=32, python=python)
    assert info.value.reason.startswith("onnxruntime-genai is not installed")
    assert 'pip install "epbuild[genai]"' in info.value.reason


# --- teacher forcing, token agreement, --timeout --------------------------------------------


def test_agreement_counts_every_step_and_names_the_first_difference() -> None:
    from epbuild.llm.agreement import token_agreement

    same = token_agreement(_gen([1, 2, 3, 4], [0.5] * 4), _gen([1, 2, 3, 4], [0.5] * 4))
    assert (same.agreed, same.compared, same.first_difference, same.matched) == (4, 4, None, 4)
    assert same.describe() == "4 of 4 greedy tokens agree with the source"
    one = token_agreement(_gen([1, 9, 3, 4], [0.5] * 4), _gen([1, 2, 3, 4], [0.5] * 4), 0.7)
    assert (one.agreed, one.first_difference, one.matched, one.share) == (3, 1, 1, 0.75)
    assert one.passes
    assert one.describe() == (
        "3 of 4 greedy tokens agree with the source (at least 70% needed); the first 1 match"
    )
    assert one.to_json() == {
        "agreed": 3,
        "compared": 4,
        "matched": 1,
        "first_difference": 1,
        "min_agreement": 0.7,
    }
    assert not token_agreement(
        _gen([1, 9, 9, 9], [0.5] * 4), _gen([1, 2, 3, 4], [0.5] * 4), 0.5
    ).passes


def test_junk_never_passes_whatever_the_limit() -> None:
    from epbuild.llm.agreement import token_agreement

    junk = token_agreement(_gen([7, 7, 7], [0.0] * 3), _gen([1, 2, 3], [0.5] * 3), 0.0)
    assert junk.agreed == 0 and not junk.passes
    assert not token_agreement(_gen([], []), _gen([], []), 0.0).passes  # nothing compared
    assert not token_agreement(_gen([1], [0.5]), _gen([1], [0.5])).passes  # no limit: compare's


def test_the_timeout_message_says_how_far_each_prompt_got() -> None:
    from epbuild.llm.generate import GenerationTimeout, read_progress

    said = "\n".join(
        [
            '{"event": "loaded"}',
            '{"event": "prompt", "index": 0, "prompt_tokens": 5, "of": 10}',
            *(f'{{"event": "token", "index": 0, "count": {n}}}' for n in range(1, 11)),
            '{"event": "done", "index": 0, "tokens": [1,2,3,4,5,6,7,8,9,10], "seconds": 1}',
            '{"event": "prompt", "index": 1, "prompt_tokens": 64, "of": 10}',
            '{"event": "token", "index": 1, "count": 3}',
            '{"event": "tok',  # cut off mid-line by the kill
        ]
    )
    loaded, progress = read_progress(said, [10, 10, 10])
    error = GenerationTimeout(600, loaded, progress)
    assert error.reason == (
        "generation did not finish within 600 s: prompt 1 of 3: done, 10 of 10 tokens; "
        "prompt 2 of 3: 3 of 10 tokens; prompt 3 of 3: not started, 0 of 10 tokens"
    )
    loaded, progress = read_progress(
        '{"event": "loaded"}\n{"event": "prompt", "index": 0, "prompt_tokens": 64, "of": 10}\n',
        [10],
    )
    assert GenerationTimeout(262.5, loaded, progress).reason == (
        "generation did not finish within 262.5 s: 0 of 10 tokens (reading its 64-token prompt)"
    )
    loaded, progress = read_progress("", [10, 4])
    assert GenerationTimeout(1, loaded, progress).reason == (
        "generation did not finish within 1 s: still loading the model, 0 of 14 tokens"
    )


def test_a_child_past_its_time_is_stopped_and_says_how_far_it_got(tmp_path: Path) -> None:
    """A stand-in child that reports one prompt read and two tokens, then hangs."""
    from epbuild.llm.generate import GenerationTimeout, generate_all

    lines = [
        '{"event": "loaded"}',
        '{"event": "prompt", "index": 0, "prompt_tokens": 4, "of": 6}',
        '{"event": "token", "index": 0, "count": 1}',
        '{"event": "token", "index": 0, "count": 2}',
    ]
    echo = "; ".join(f"echo '{line}'" for line in lines)
    python = _wrapper(tmp_path, f"{echo}; exec sleep 600")
    with pytest.raises(GenerationTimeout) as info:
        generate_all(
            FIXTURES / "llama",
            qnn=True,
            tokens=6,
            prompts=["Hi", "Ho"],
            max_length=32,
            timeout=2,
            python=python,
        )
    assert info.value.reason == (
        "generation did not finish within 2 s: prompt 1 of 2: 2 of 6 tokens; "
        "prompt 2 of 2: not started, 0 of 6 tokens"
    )


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        (None, 600.0),
        ("0", None),
        ("none", None),
        ("None", None),
        ("0.0", None),
        ("1.5", 1.5),
        ("1200", 1200.0),
    ],
)
def test_timeout_option_values(text: str | None, seconds: float | None) -> None:
    from epbuild.frontends.args import timeout

    assert timeout(text, "--timeout", 600.0) == seconds


@pytest.mark.parametrize("text", ["-1", "abc", "nan", "inf", "", "10s"])
def test_a_bad_timeout_names_the_option(text: str) -> None:
    from epbuild.errors import UserError
    from epbuild.frontends.args import timeout

    with pytest.raises(UserError) as info:
        timeout(text, "--timeout", 600.0)
    assert info.value.exit_code == 2
    assert str(info.value).startswith(f"--timeout {text!r} is not a number of seconds")
    assert "--timeout 0 for no limit" in (info.value.hint or "")


@pytest.mark.skipif(not genai_installed(), reason="pip install -e '.[genai]'")
def test_teacher_forcing_gives_the_models_own_choice_after_the_forced_text() -> None:
    """Forced on its own tokens, a model agrees at every step; forced on other text, each
    step is still its own greedy choice (step 0, before any forced token, is unchanged),
    and the run goes exactly as many steps as forced."""
    from epbuild.llm.generate import generate_all

    def run(forced: list[tuple[int, ...]] | None = None) -> Generation:
        (found,) = generate_all(
            FIXTURES / "llama", qnn=False, tokens=6, prompts=[DEFAULT], max_length=32, forced=forced
        )
        return found

    free = run()
    assert run([free.tokens]).tokens == free.tokens
    other = (free.tokens[0], *(t + 1 for t in free.tokens[1:4]))
    led = run([other])
    assert len(led.tokens) == 4 and led.tokens[:2] == free.tokens[:2]


DEFAULT = "The quick brown fox"
