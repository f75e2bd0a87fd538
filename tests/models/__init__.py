"""Models and inputs the tests build, shared with the benchmarks (docs/design.md §13).

``zoo`` (real ``transformers`` architectures with random weights, and their ONNX exports),
``decoders`` (KV-cache decode-step and prefill exports), ``corpus`` (ONNX's backend node-test
corpus and its judgement of a conversion), ``hot`` (zoo variants with hot FFN activations),
``control_flow`` (an If-heavy VAD-like ONNX model), ``fuzz`` (seeded mutations of ONNX models
for the CLI) and ``measure`` (conversion counts and error metrics for torch graphs).

Tests import them as ``from tests.models import zoo``; ``benchmarks/`` imports them the same
way (both run from a checkout). The product (``amp_rewrite``) never imports them
(tests/test_layout.py).
"""
