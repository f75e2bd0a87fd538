"""amp_rewrite.rewrite_onnx over ONNX's operator tests (the FP32 baseline of the corpus).

Every node test with a float32 tensor whose FP32 model onnxruntime reproduces is converted
to fp16 and bf16; the result must pass the full checker and match the test's expected
outputs (per-dtype tolerance) under onnxruntime and under the reference evaluator, which
computes each op in its declared dtype. At least 99% of the cases must be valid.
About a minute on 2 cores; tools/onnx_node_corpus.py runs the same with the peers.
"""
from __future__ import annotations

import pytest

from amp_rewrite.onnx import corpus, peers

MIN_VALID = 0.99


@pytest.fixture(scope="module")
def cases() -> list[corpus.Case]:
    return corpus.collect_float_cases()


@pytest.fixture(scope="module")
def amp_rewrite_converter() -> peers.Peer:
    reason = peers.AMP_REWRITE.unavailable_reason()
    if reason:
        pytest.fail(f"cannot run the corpus: {reason}", pytrace=False)
    return peers.AMP_REWRITE


def _report(dtype: str, results: list[dict]) -> str:
    summary = corpus.summarize(results)
    lines = [f"{dtype}: " + ", ".join(f"{k}={v}" for k, v in summary.items())]
    lines += [f"  {case}: {reason}" for case, reason in corpus.failures(results)]
    return "\n".join(lines)


def test_corpus_baseline_is_large(cases):
    # Guards the denominator: a harness that silently dropped most cases would pass below.
    assert len(cases) > 1000
    assert sum(c.reference_runs for c in cases) > 0.95 * len(cases)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rewrite_onnx_node_corpus(dtype, cases, amp_rewrite_converter):
    results = [corpus.run_converter(case, amp_rewrite_converter, dtype) for case in cases]
    summary = corpus.summarize(results)
    print(_report(dtype, results))
    assert summary["ort_valid"] >= MIN_VALID, _report(dtype, results)
    assert summary["reference_valid"] >= MIN_VALID, _report(dtype, results)
    assert summary["valid"] >= MIN_VALID, _report(dtype, results)
