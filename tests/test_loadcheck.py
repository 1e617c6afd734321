"""``verify --load``'s loader: isolated from the workspace's folders, and strict about what it
compares (real QNN loads)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from test_verify import copy, good  # noqa: F401  (fixtures)

from epbuild.inspection.loadcheck import compare
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
