"""ONNX graphs: structural names ↔ initializers, and export of a fused checkpoint."""
