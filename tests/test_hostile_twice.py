"""Writing commands beside another command on the same workspace, and killed mid-way: every
verdict stays true (verify, status, exit 0) and nothing half-written is left in a user's
folder. (Two builds: tests/test_concurrency.py; two of one command: tests/test_two_at_once.py;
kills of a build: tests/test_crash.py.)"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import Workspace
from modelgen import matmul_model

from epbuild.inspection import verify as verify_module
from epbuild.state.journal import load_state


def test_verify_beside_a_build_that_replaces_the_outputs_finds_nothing_wrong(
    simple_built: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build that recompiles an action after verify read the journal and before it hashed
    the files: the new outputs are checked against the new record, not reported damaged."""
    ws = simple_built
    ws.model("models/c.onnx", matmul_model(77))
    opened = verify_module.open_workspace

    def open_then_rebuild(*args: Any, **kw: Any) -> Any:
        found = opened(*args, **kw)  # the journal as it was: single/htp/c's old record
        ws.cli("build", check=True)  # another process recompiles single/htp/c meanwhile
        return found

    monkeypatch.setattr(verify_module, "open_workspace", open_then_rebuild)
    result = verify_module.verify_outputs(ws.root)
    assert result.ok, result.lines()
    state = load_state(str(ws.root / ".epbuild" / "state.jsonl"))
    assert not state.damaged, state.damaged
    assert (ws.root / "build" / "single" / "htp" / "c_ctx.onnx").is_file()

