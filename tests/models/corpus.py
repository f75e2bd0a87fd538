"""Node-test corpus: run any FP32 -> FP16/BF16 converter over ONNX's own operator tests.

``onnx.backend.test.case.node.collect_testcases()`` builds, in memory, one small model per
operator test together with its inputs and expected outputs. :func:`collect_float_cases`
keeps the ones that hold a float32 tensor and that onnxruntime (CPU) reproduces in FP32:
that is the baseline a converted model must still match. :func:`evaluate` checks one
converted model three ways (checker, onnxruntime, ``onnx.reference.ReferenceEvaluator``).
The reference evaluator computes every op in its declared dtype, so it sees the fp16
overflow that onnxruntime-CPU hides by running many fp16 ops in fp32.

The oracle is the test case's expected output, which no converter computed.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto

from amp_rewrite.errors import UsageError

logger = logging.getLogger(__name__)

ConvertFn = Callable[[onnx.ModelProto, str], onnx.ModelProto]

FLOAT_TYPES = frozenset(
    {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}
)
LOW_TYPES = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
_DTYPE_ALIASES = {
    "fp16": "float16", "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"
}


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """An element passes when |actual - expected| <= atol * scale + rtol * |expected| + floor.

    ``scale`` is the largest finite |expected| of that output: rounding errors of sums and
    products grow with the size of the terms, not with the (possibly cancelled) result.
    ``floor`` covers outputs that are all (near) zero.
    """

    rtol: float
    atol: float
    floor: float


# In units of the format's unit roundoff u (fp16 2**-11, bf16 2**-8): rtol ~20 u, atol ~8 u
# of the largest element. Rounding the inputs alone costs 1 u; recurrent ops (GRU) and
# normalisations accumulate several more. float32 is the FP32 baseline, close to the
# backend tests' own rtol=1e-3.
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(rtol=1e-3, atol=1e-5, floor=1e-7),
    "float16": Tolerance(rtol=1e-2, atol=4e-3, floor=1e-5),
    "bfloat16": Tolerance(rtol=8e-2, atol=3.2e-2, floor=1e-5),
}


def canonical_dtype(dtype: str) -> str:
    """'fp16'/'float16' -> 'float16', 'bf16'/'bfloat16' -> 'bfloat16'."""
    try:
        return _DTYPE_ALIASES[dtype]
    except KeyError:
        raise UsageError(
            f"unknown low-precision dtype {dtype!r}; use float16 or bfloat16"
        ) from None


@dataclasses.dataclass(frozen=True)
class Case:
    """One operator test: FP32 model, feeds by input name, expected outputs."""

    name: str
    model: onnx.ModelProto
    feeds: dict[str, Any]
    expected: tuple[Any, ...]
    reference_runs: bool  # ReferenceEvaluator reproduces ``expected`` on the FP32 model

    def model_copy(self) -> onnx.ModelProto:
        """A private copy: several converters edit the model they are given in place."""
        copy = onnx.ModelProto()
        copy.CopyFrom(self.model)
        return copy


@dataclasses.dataclass(frozen=True)
class Corpus:
    cases: tuple[Case, ...]
    total: int  # node test cases collected
    float_cases: int  # ... holding a float32 tensor
    excluded: dict[str, str]  # float case -> why its FP32 model is not in the baseline


@dataclasses.dataclass(frozen=True)
class Comparison:
    ok: bool
    reason: str | None
    max_abs: float
    max_rel: float  # max |actual - expected| / largest |expected|, over float outputs


# ---------------------------------------------------------------- model inspection


def iter_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """The graph and every subgraph (If/Loop/Scan bodies), depth first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from iter_graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from iter_graphs(sub)


def _type_elem_types(tp: onnx.TypeProto) -> Iterator[int]:
    kind = tp.WhichOneof("value")
    if kind == "tensor_type":
        yield tp.tensor_type.elem_type
    elif kind == "sparse_tensor_type":
        yield tp.sparse_tensor_type.elem_type
    elif kind == "sequence_type":
        yield from _type_elem_types(tp.sequence_type.elem_type)
    elif kind == "optional_type":
        yield from _type_elem_types(tp.optional_type.elem_type)
    elif kind == "map_type":
        yield from _type_elem_types(tp.map_type.value_type)


def _attr_elem_types(attr: onnx.AttributeProto) -> Iterator[int]:
    if attr.type == onnx.AttributeProto.TENSOR:
        yield attr.t.data_type
    elif attr.type == onnx.AttributeProto.TENSORS:
        yield from (t.data_type for t in attr.tensors)
    elif attr.type == onnx.AttributeProto.SPARSE_TENSOR:
        yield attr.sparse_tensor.values.data_type
    elif attr.type in (onnx.AttributeProto.FLOAT, onnx.AttributeProto.FLOATS) and attr.name in (
        "value_float",
        "value_floats",
    ):
        yield TensorProto.FLOAT  # Constant(value_float=...) makes a float32 tensor


def _graph_elem_types(graph: onnx.GraphProto) -> Iterator[int]:
    for vi in (*graph.input, *graph.output, *graph.value_info):
        yield from _type_elem_types(vi.type)
    yield from (init.data_type for init in graph.initializer)
    yield from (sp.values.data_type for sp in graph.sparse_initializer)
    for node in graph.node:
        for attr in node.attribute:
            yield from _attr_elem_types(attr)


def infer_types(model: onnx.ModelProto) -> onnx.ModelProto:
    """Shape/type inference where it works; the model unchanged where it does not."""
    try:
        return onnx.shape_inference.infer_shapes(model)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, RuntimeError) as e:
        logger.debug("shape inference failed: %s", e)
        return model


def has_float32(model: onnx.ModelProto) -> bool:
    """True if any input, output, initializer, constant or inferred value is float32."""
    inferred = infer_types(model)
    return any(
        t == TensorProto.FLOAT for g in iter_graphs(inferred.graph) for t in _graph_elem_types(g)
    )


def count_casts(model: onnx.ModelProto) -> int:
    """Cast/CastLike nodes in the graph and all its subgraphs."""
    return sum(
        node.op_type in ("Cast", "CastLike") and node.domain in ("", "ai.onnx")
        for g in iter_graphs(model.graph)
        for node in g.node
    )


def _static_numel(tp: onnx.TypeProto) -> int | None:
    if tp.WhichOneof("value") != "tensor_type" or not tp.tensor_type.HasField("shape"):
        return None
    dims = tp.tensor_type.shape.dim
    if not all(d.HasField("dim_value") for d in dims):
        return None
    return math.prod(d.dim_value for d in dims)


def low_precision_share(model: onnx.ModelProto, dtype: str) -> tuple[float | None, float | None]:
    """Share of float values held in ``dtype``: (by count, by elements where shapes are static).

    Values are initializers and outputs of nodes other than casts (a cast's output is the
    price of a decision, not a decision), in all graphs. None when the model has none.
    """
    low = LOW_TYPES[canonical_dtype(dtype)]
    inferred = infer_types(model)
    types: dict[str, onnx.TypeProto] = {}
    for g in iter_graphs(inferred.graph):
        for vi in (*g.input, *g.output, *g.value_info):
            types[vi.name] = vi.type
    values: list[tuple[int, int | None]] = []  # (elem_type, numel)
    for g in iter_graphs(inferred.graph):
        values += [(t.data_type, math.prod(t.dims)) for t in g.initializer]
        for node in g.node:
            if node.op_type in ("Cast", "CastLike"):
                continue
            for name in node.output:
                tp = types.get(name)
                if name and tp is not None and tp.WhichOneof("value") == "tensor_type":
                    values.append((tp.tensor_type.elem_type, _static_numel(tp)))
    floats = [(t, n) for t, n in values if t in FLOAT_TYPES]
    if not floats:
        return None, None
    by_count = sum(t == low for t, _ in floats) / len(floats)
    sized = [(t, n) for t, n in floats if n is not None]
    total = sum(n for _, n in sized)
    by_elems = sum(n for t, n in sized if t == low) / total if total else None
    return by_count, by_elems


# ---------------------------------------------------------------- running models


def first_line(error: BaseException) -> str:
    """``Type: first line of the message``: enough to group failures, short enough to list."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".strip()


def _fresh(feeds: dict[str, Any], names: set[str]) -> dict[str, Any]:
    # Copies: some kernels (ReferenceEvaluator's training-mode BatchNormalization) write into
    # their inputs, which would corrupt the case for the next run.
    return {k: copy.deepcopy(v) for k, v in feeds.items() if k in names}


def run_ort(model: onnx.ModelProto, feeds: dict[str, Any]) -> list[Any]:
    """Run on onnxruntime's CPU provider, one thread (the models are tiny)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4  # failures surface as exceptions; no log spam
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    run_options = ort.RunOptions()
    run_options.log_severity_level = 4
    names = {i.name for i in session.get_inputs()}
    return session.run(None, _fresh(feeds, names), run_options)


def run_reference(model: onnx.ModelProto, feeds: dict[str, Any]) -> list[Any]:
    """Run ``onnx.reference.ReferenceEvaluator``: every op in its declared dtype."""
    from onnx.reference import ReferenceEvaluator

    evaluator = ReferenceEvaluator(model)
    names = set(evaluator.input_names)
    with np.errstate(all="ignore"):
        return list(evaluator.run(None, _fresh(feeds, names)))


# ---------------------------------------------------------------- comparing outputs


def _is_float(array: np.ndarray) -> bool:
    return array.dtype.kind == "f" or array.dtype.name == "bfloat16"


def _compare_array(
    expected: np.ndarray, actual: Any, tol: Tolerance, check_dtype: bool
) -> Comparison:
    if not isinstance(actual, np.ndarray):
        return Comparison(False, f"got {type(actual).__name__}, expected an array", 0.0, 0.0)
    if actual.shape != expected.shape:
        return Comparison(False, f"shape {actual.shape} != {expected.shape}", 0.0, 0.0)
    if check_dtype and actual.dtype != expected.dtype:
        return Comparison(False, f"dtype {actual.dtype} != {expected.dtype}", 0.0, 0.0)
    if not _is_float(expected):
        same = np.array_equal(actual, expected)
        return Comparison(same, None if same else "non-float output differs", 0.0, 0.0)
    e = expected.astype(np.float64)
    a = actual.astype(np.float64)
    finite = np.isfinite(e)
    # Where FP32 gave NaN or +-Inf the converted model must give the same, and nowhere else.
    special_ok = np.array_equal(np.isnan(a), np.isnan(e)) and np.array_equal(
        a[np.isinf(e)], e[np.isinf(e)]
    )
    if not special_ok or not np.isfinite(a[finite]).all():
        return Comparison(False, "NaN/Inf where the expected output has none", math.inf, math.inf)
    if not finite.any():
        return Comparison(True, None, 0.0, 0.0)
    err = np.abs(a[finite] - e[finite])
    scale = float(np.abs(e[finite]).max())
    allowed = tol.atol * scale + tol.rtol * np.abs(e[finite]) + tol.floor
    max_abs = float(err.max())
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    if (err <= allowed).all():
        return Comparison(True, None, max_abs, max_rel)
    worst = int(np.argmax(err - allowed))
    reason = (
        f"|err| {err[worst]:.3g} > allowed {allowed[worst]:.3g} "
        f"(expected {e[finite][worst]:.6g}, max rel err {max_rel:.3g})"
    )
    return Comparison(False, reason, max_abs, max_rel)


def compare_outputs(
    expected: Sequence[Any], actual: Sequence[Any], tol: Tolerance, check_dtype: bool = True
) -> Comparison:
    """Compare output lists (arrays, sequences of arrays, None for empty optionals).

    ``check_dtype=False`` compares values only (the reference evaluator returns some outputs
    in the wrong dtype, e.g. LayerNormalization's Mean in X's type instead of U).
    """
    if len(actual) != len(expected):
        return Comparison(False, f"{len(actual)} outputs, expected {len(expected)}", 0.0, 0.0)
    max_abs = max_rel = 0.0
    for i, (e, a) in enumerate(zip(expected, actual)):
        if isinstance(e, (list, tuple)):
            ok = isinstance(a, (list, tuple))
            result = (
                compare_outputs(e, a, tol, check_dtype)
                if ok
                else Comparison(False, "not a sequence", 0.0, 0.0)
            )
        elif e is None:
            result = Comparison(a is None, None if a is None else "expected no value", 0.0, 0.0)
        else:
            result = _compare_array(np.asarray(e), a, tol, check_dtype)
        max_abs, max_rel = max(max_abs, result.max_abs), max(max_rel, result.max_rel)
        if not result.ok:
            return Comparison(False, f"output {i}: {result.reason}", max_abs, max_rel)
    return Comparison(True, None, max_abs, max_rel)


# ---------------------------------------------------------------- building the corpus


@functools.lru_cache(maxsize=1)
def _node_testcases() -> tuple[Any, ...]:
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")  # the generators overflow on purpose (Cast tests)
        return tuple(collect_testcases())


def _to_value(item: Any) -> Any:
    if isinstance(item, onnx.TensorProto):
        return onnx.numpy_helper.to_array(item)
    if isinstance(item, (list, tuple)):
        return [_to_value(x) for x in item]
    return item


def _feeds(model: onnx.ModelProto, inputs: Sequence[Any]) -> dict[str, Any]:
    initializers = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in initializers]
    return {name: _to_value(x) for name, x in zip(names, inputs)}


def _checker_error(model: onnx.ModelProto) -> str | None:
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as e:  # checker and strict shape-inference errors both mean "invalid"
        return first_line(e)
    return None


def baseline_case(
    name: str, model: onnx.ModelProto, feeds: dict[str, Any], expected: Sequence[Any]
) -> Case | str:
    """The Case if the FP32 model passes the checker and ORT reproduces ``expected``, else why not.

    Also records whether the reference evaluator reproduces it (else no reference check).
    """
    expected = tuple(expected)
    checker_error = _checker_error(model)
    if checker_error:  # no converter can be asked to turn an invalid model into a valid one
        return f"FP32 model fails the checker: {checker_error}"
    try:
        got = run_ort(model, feeds)
    except Exception as e:  # any ORT failure just excludes the case from the baseline
        return f"ORT cannot run the FP32 model: {first_line(e)}"
    result = compare_outputs(expected, got, TOLERANCES["float32"])
    if not result.ok:
        return f"ORT FP32 output differs from expected: {result.reason}"
    try:
        reference = run_reference(model, feeds)
    except Exception:  # the reference evaluator lacks this op/dtype: no reference check
        return Case(name, model, feeds, expected, reference_runs=False)
    reference_runs = compare_outputs(expected, reference, TOLERANCES["float32"]).ok
    return Case(name, model, feeds, expected, reference_runs)


@functools.lru_cache(maxsize=1)
def build_corpus() -> Corpus:
    """All node test cases with a float32 tensor that are valid and ORT reproduces in FP32."""
    cases: list[Case] = []
    excluded: dict[str, str] = {}
    all_cases = _node_testcases()
    float_cases = 0
    for tc in all_cases:
        if tc.model is None or not tc.data_sets or not has_float32(tc.model):
            continue
        float_cases += 1
        inputs, outputs = tc.data_sets[0]
        feeds, expected = _feeds(tc.model, inputs), [_to_value(x) for x in outputs]
        outcome = baseline_case(tc.name, tc.model, feeds, expected)
        if isinstance(outcome, Case):
            cases.append(outcome)
        else:
            excluded[tc.name] = outcome
    logger.info(
        "corpus: %d cases, %d float, %d in baseline", len(all_cases), float_cases, len(cases)
    )
    return Corpus(tuple(cases), len(all_cases), float_cases, excluded)


def collect_float_cases() -> list[Case]:
    """The FP32 baseline set (see :func:`build_corpus`)."""
    return list(build_corpus().cases)


# ---------------------------------------------------------------- evaluating a conversion


def _ort_check(case: Case, model: onnx.ModelProto, tol: Tolerance) -> Comparison:
    try:
        got = run_ort(model, case.feeds)
    except Exception as e:  # a converted model ORT rejects is a failed conversion
        return Comparison(False, first_line(e), math.nan, math.nan)
    return compare_outputs(case.expected, got, tol)


def _reference_check(
    case: Case, model: onnx.ModelProto, tol: Tolerance, checker_ok: bool
) -> tuple[Comparison | None, str | None]:
    """(comparison or None if not applicable, why not applicable)."""
    if not case.reference_runs:
        return None, "reference evaluator cannot reproduce the FP32 model"
    try:
        got = run_reference(model, case.feeds)
    except Exception as e:
        # On a model the checker accepts this is the evaluator lacking a low-precision
        # kernel (e.g. Det in fp16), not a fault of the conversion.
        if checker_ok:
            return None, f"reference evaluator cannot run the converted model: {first_line(e)}"
        return Comparison(False, first_line(e), math.nan, math.nan), None
    return compare_outputs(case.expected, got, tol, check_dtype=False), None


def evaluate(case: Case, converted: onnx.ModelProto, dtype: str) -> dict[str, Any]:
    """Check one converted model: checker, ORT vs expected, ReferenceEvaluator vs expected.

    ``reference_ok`` is None (and ``reference_skipped`` says why) when the reference
    evaluator cannot run the FP32 model or, for a checker-valid model, the converted one;
    such a case says nothing about the conversion. ORT also checks output dtypes.
    """
    dtype = canonical_dtype(dtype)
    tol = TOLERANCES[dtype]
    checker_error = _checker_error(converted)
    ort = _ort_check(case, converted, tol)
    ref, ref_skipped = _reference_check(case, converted, tol, checker_error is None)
    share_count, share_elems = low_precision_share(converted, dtype)
    failures = [
        f"{stage}: {reason}"
        for stage, failed, reason in (
            ("checker", checker_error is not None, checker_error),
            ("ort", not ort.ok, ort.reason),
            ("reference", ref is not None and not ref.ok, ref and ref.reason),
        )
        if failed
    ]
    return {
        "valid": not failures,
        "failure": failures[0] if failures else None,
        "checker_ok": checker_error is None,
        "ort_ok": ort.ok,
        "reference_ok": None if ref is None else ref.ok,
        "reference_skipped": ref_skipped,
        "ort_max_abs": ort.max_abs,
        "ort_max_rel": ort.max_rel,
        "reference_max_abs": None if ref is None else ref.max_abs,
        "reference_max_rel": None if ref is None else ref.max_rel,
        "casts": count_casts(converted),
        "low_share_count": share_count,
        "low_share_elems": share_elems,
    }


def _convert_timed(
    convert: ConvertFn, model: onnx.ModelProto, dtype: str
) -> tuple[onnx.ModelProto, float]:
    # A converter that runs in a worker process times itself there (peers.Peer.convert_timed),
    # so that shipping the model between processes is not billed to it.
    timed = getattr(convert, "convert_timed", None)
    if timed is not None:
        return timed(model, dtype)
    start = time.perf_counter()
    converted = convert(model, dtype)
    return converted, time.perf_counter() - start


def run_converter(case: Case, convert: ConvertFn, dtype: str) -> dict[str, Any]:
    """Convert a private copy of the case's model, time it, and :func:`evaluate` the result."""
    dtype = canonical_dtype(dtype)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # peers warn per clamped constant: noise here
            converted, seconds = _convert_timed(convert, case.model_copy(), dtype)
    except Exception as e:  # a converter that raises is a result to report, not a crash
        return {"case": case.name, "dtype": dtype, "converted": False,
                "seconds": time.perf_counter() - start, "valid": False,
                "failure": f"convert: {first_line(e)}"}
    result = {"case": case.name, "dtype": dtype, "converted": True, "seconds": seconds}
    result.update(evaluate(case, converted, dtype))
    return result


# ---------------------------------------------------------------- summarising a run


def _rate(flags: Sequence[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def _case_rel_error(result: dict[str, Any]) -> float | None:
    errors = [result.get(k) for k in ("ort_max_rel", "reference_max_rel")]
    errors = [e for e in errors if e is not None and not math.isnan(e)]
    return max(errors) if errors else None


def summarize(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Aggregate :func:`run_converter` results of one converter and dtype.

    Rates are over all cases (a conversion that raised fails every check), except
    ``reference_valid`` which is over the cases the reference evaluator could judge.
    """
    converted = [r for r in results if r["converted"]]
    judged = [r for r in results if r.get("reference_ok") is not None or not r["converted"]]
    rel = [e for e in map(_case_rel_error, converted) if e is not None]
    shares = [r["low_share_count"] for r in converted if r.get("low_share_count") is not None]
    elem_shares = [r["low_share_elems"] for r in converted if r.get("low_share_elems") is not None]
    return {
        "cases": len(results),
        "converted": _rate([r["converted"] for r in results]),
        "checker_valid": _rate([bool(r.get("checker_ok")) for r in results]),
        "ort_valid": _rate([bool(r.get("ort_ok")) for r in results]),
        "reference_valid": _rate([bool(r.get("reference_ok")) for r in judged]),
        "reference_not_applicable": len(results) - len(judged),
        "valid": _rate([r["valid"] for r in results]),
        "median_rel_err": float(np.median(rel)) if rel else None,
        "max_rel_err": max(rel) if rel else None,
        "casts": sum(r["casts"] for r in converted),
        "mean_low_share": float(np.mean(shares)) if shares else None,
        "mean_low_share_elems": float(np.mean(elem_shares)) if elem_shares else None,
        "seconds": sum(r["seconds"] for r in results),
    }


def failures(results: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """(case, first failure reason) for every invalid result."""
    return [(r["case"], r["failure"] or "?") for r in results if not r["valid"]]
