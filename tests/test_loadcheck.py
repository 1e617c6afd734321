"""``verify --load``'s loader: isolated from the workspace's folders, and strict about what it
compares (real QNN loads)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import onnx
import pytest
from test_verify import copy, good  # noqa: F401  (fixtures)

from epbuild.inspection.loadcheck import answer, compare
from epbuild.inspection.verify import LoadOutcome, verify_outputs


def test_a_folder_in_the_workspace_does_not_shadow_a_package(copy: Path) -> None:  # noqa: F811
    (copy / "numpy").mkdir()
    (copy / "numpy" / "__init__.py").write_text("raise ImportError('the workspace numpy')\n")
    (check,) = verify_outputs(copy, selectors=["single"], load=True).loads
    assert check.outcome is LoadOutcome.PASSED, check.message


def test_a_ctx_model_with_fewer_outputs_than_its_source_fails(copy: Path) -> None:  # noqa: F811
    source = copy / "m/c.onnx"
    model = onnx.load(str(source))
    model.graph.output.append(onnx.helper.make_tensor_value_info("h", onnx.TensorProto.FLOAT, None))
    onnx.save(model, str(source))
    (check,) = verify_outputs(copy, selectors=["single"], load=True).loads
    assert check.outcome is LoadOutcome.FAILED
    assert check.message == "the ctx model has 1 output(s), its source model 2"


def test_compare_refuses_unequal_output_counts() -> None:
    with pytest.raises(ValueError, match="1 output"):
        compare([[1.0]], [[1.0], [2.0]])


def test_a_file_the_loader_cannot_read_is_named_from_the_workspace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file gone under a loader (a QDQ model's data removed by hand) is a line naming it
    relative to the workspace it runs in, not a Python exception's repr."""
    gone = tmp_path / "quantized" / "part1.onnx.data"

    def check(job: dict[str, object]) -> dict[str, object]:
        with open(gone, "rb"):
            return {"outcome": "ok"}

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps({"provider": None})))
    answer(check)
    result = json.loads(capsys.readouterr().out)
    assert result["outcome"] == "failed"
    assert result["message"] == "quantized/part1.onnx.data: No such file or directory"
