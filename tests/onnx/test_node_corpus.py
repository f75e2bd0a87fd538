"""amp_rewrite.rewrite_onnx over ONNX's operator tests (the FP32 baseline of the corpus).

Every node test with a float32 tensor whose FP32 model onnxruntime reproduces is converted
to fp16 and bf16; the result must pass the full checker and match the test's expected
outputs (per-dtype tolerance) under onnxruntime and under the reference evaluator, which
computes each op in its declared dtype. At least 99% of the cases must be valid.

bf16: onnxruntime's CPU provider has no bf16 kernel for most ops (MatMul, Add, Mul, Sqrt, ...);
a case it answers NOT_IMPLEMENTED says nothing about the conversion, so for bf16 the ORT check
counts only the cases ORT can run, while the checker and the reference evaluator judge all.
About a minute on 2 cores; ``python -m benchmarks compare corpus`` runs the same with the peers.
"""
from __future__ import annotations

import pytest

from benchmarks import peers
from tests.models import corpus

pytestmark = pytest.mark.slow  # ONNX's whole node-test corpus

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


def ort_lacks_kernel(result: dict) -> bool:
    failure = result.get("failure") or ""
    return failure.startswith("ort:") and "NOT_IMPLEMENTED" in failure


def test_rewrite_onnx_node_corpus_fp16(cases, amp_rewrite_converter):
    results = [corpus.run_converter(case, amp_rewrite_converter, "float16") for case in cases]
    summary = corpus.summarize(results)
    print(_report("float16", results))
    assert summary["ort_valid"] >= MIN_VALID, _report("float16", results)
    assert summary["reference_valid"] >= MIN_VALID, _report("float16", results)
    assert summary["valid"] >= MIN_VALID, _report("float16", results)


def test_rewrite_onnx_node_corpus_bf16(cases, amp_rewrite_converter):
    results = [corpus.run_converter(case, amp_rewrite_converter, "bfloat16") for case in cases]
    summary = corpus.summarize(results)
    print(_report("bfloat16", results))
    runnable = [r for r in results if not ort_lacks_kernel(r)]
    assert len(runnable) > 0.5 * len(results)  # the exemption must not swallow the corpus
    assert summary["checker_valid"] >= MIN_VALID, _report("bfloat16", results)
    assert summary["reference_valid"] >= MIN_VALID, _report("bfloat16", results)
    assert corpus.summarize(runnable)["valid"] >= MIN_VALID, _report("bfloat16", runnable)
