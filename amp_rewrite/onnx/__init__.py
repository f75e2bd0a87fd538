"""ONNX adapter: load into onnx_ir, view for the core, apply plans, validate, save."""
from amp_rewrite.onnx.api import RewriteResult, rewrite_onnx, rewrite_onnx_model

__all__ = ["RewriteResult", "rewrite_onnx", "rewrite_onnx_model"]
