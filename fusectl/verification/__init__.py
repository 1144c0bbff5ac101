"""Verification: compare arrays with tolerances, run models on onnxruntime, report."""
