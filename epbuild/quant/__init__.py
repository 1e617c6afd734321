"""Quantization in a worker: sample feeds, calibration and QDQ models through ONNX Runtime."""
