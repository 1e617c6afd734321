"""Open an epbuild-written ONNX Runtime model package with plain ONNX Runtime, as an app would.

    python examples/shipping/run_package.py examples/quickstart/dist

ONNX Runtime selects each component's variant for the QNN EP; the script then runs every
component that is a group of its own on random input. Members of a weight-sharing group
(``additional_metadata.epbuild.group_size`` > 1) are created in ``position`` order with the
variant's session options (``ep.share_ep_contexts = 1``) and destroyed in reverse: on the
device. An x86_64 host cannot load weight-shared QNN contexts, so there they are only
selected.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from typing import Any


def main(root: str) -> None:
    """Select every component's variant, then run what this host can load."""
    import numpy as np
    import onnxruntime as ort
    import onnxruntime_qnn

    with open(os.path.join(root, "manifest.json")) as f:
        components: dict[str, Any] = json.load(f)["components"]
    # Register the plugin under the name the variants declare ("ep"): ONNX Runtime selects a
    # variant only for an EP of exactly that name (QNNExecutionProvider unless the manifest's
    # [package] ep_names says otherwise).
    first = next(iter(next(iter(components.values()))["variants"].values()))
    ep = first["ep"]
    ort.register_execution_provider_library(ep, onnxruntime_qnn.get_library_path())
    so = ort.SessionOptions()
    # The EP needs its backend to be selected at all; the first variant's options name it.
    qnn = [d for d in ort.get_ep_devices() if d.ep_name == ep]
    so.add_provider_for_devices(qnn, first["executor_info"]["ort"]["provider_options"])
    options = ort.ModelPackageOptions(so)  # one per process (see docs/research/model-package.md)
    package = ort.ModelPackageContext(root)
    chosen = {name: package.select_component(name, options) for name in components}
    host_x86 = platform.machine().lower() in ("x86_64", "amd64")
    sessions = []  # created in order, destroyed in reverse
    for name, selected in chosen.items():
        meta = components[name].get("additional_metadata", {}).get("epbuild", {})
        print(f"{name}: variant {selected.get_selected_variant_name()}", end="", flush=True)
        if meta.get("share_weights") and host_x86:
            print(" (weight-shared: load it on the device)")
            continue
        sessions.append(selected.create_session())
        feeds = {
            i.name: np.random.default_rng(0).standard_normal(i.shape).astype(np.float32)
            for i in sessions[-1].get_inputs()
        }
        outputs = sessions[-1].run(None, feeds)
        print(f" ran on {sessions[-1].get_providers()[0]}: output {list(outputs[0].shape)}")
    while sessions:
        sessions.pop()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: the QNN EP can crash in it on x86_64


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "dist")
