"""shipping: ONNX Runtime model packages of built outputs (``epbuild package``)."""
