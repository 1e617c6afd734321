"""Copy the nine ONNX "light" CNNs shipped inside the onnx wheel into models/.

They are real architectures (ResNet50, VGG19, DenseNet121, ...) whose weights are generated
by ConstantOfShape nodes, so the files are tiny but the compiles take 0.3-12 s each.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def light_models() -> list[Path]:
    """The light CNNs inside the installed onnx package."""
    import importlib.util

    spec = importlib.util.find_spec("onnx")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("onnx is not installed: pip install onnx")
    light = Path(next(iter(spec.submodule_search_locations))) / "backend/test/data/light"
    return sorted(light.glob("light_*.onnx"))


def main(target: Path = Path(__file__).parent / "models") -> int:
    models = light_models()
    if not models:
        print("no light models found in the onnx wheel", file=sys.stderr)
        return 1
    target.mkdir(exist_ok=True)
    for src in models:
        dest = target / src.name.removeprefix("light_")
        if not dest.exists() or dest.read_bytes() != src.read_bytes():
            shutil.copyfile(src, dest)
    print(f"{len(models)} models in {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
