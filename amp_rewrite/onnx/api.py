"""Python entry points of the ONNX path (the CLI calls the same functions)."""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_ir as ir

from amp_rewrite.core import LowDtype
from amp_rewrite.core.precision import MIXED
from amp_rewrite.core.report import Report, explain
from amp_rewrite.errors import ModelError, OutputCheckError, first_line
from amp_rewrite.onnx import repair, save, versions
from amp_rewrite.onnx.load import LoadedModel, LoadInfo, Source, load_model, parse_bytes, release
from amp_rewrite.core import options as core_options
from amp_rewrite.onnx.options import RewriteOptions
from amp_rewrite.onnx.passes import MixedPrecisionPass, OnnxOptions, onnx_rules
from amp_rewrite.runtime import gc_paused

logger = logging.getLogger(__name__)


@dataclass
class RewriteResult:
    model: ir.Model
    pass_: MixedPrecisionPass
    info: LoadInfo  # what loading learned: source file, weight files, ...
    seconds: float = 0.0
    _proto: onnx.ModelProto | None = None
    _report: Report | None = None
    opset_conversion: str | None = None  # why and how the opset was converted for bf16
    budget: dict | None = None  # the accuracy budget's report section (max_error given)
    pinned_by_budget: list | None = None
    lowered_by_budget: list | None = None

    @functools.cached_property
    def report(self) -> dict:
        """The ``--report`` JSON (built on first use: ``rewrite_onnx`` never needs it)."""
        return self._built().to_json()

    def explain(self, node_name: str) -> list[str]:
        """``core.report.explain`` on this rewrite (``UnknownNodeError`` for unknown names)."""
        return explain(self._built(), node_name)

    def _built(self) -> Report:
        if self._report is None:
            report = self._report = self.pass_.report()
            report.seconds = round(self.seconds, 3)
            report.details.opset_conversion = self.opset_conversion
            if self.budget is not None:
                report.budget, report.pinned_by_budget = self.budget, self.pinned_by_budget
                report.lowered_by_budget = self.lowered_by_budget
        return self._report

    def proto(self) -> onnx.ModelProto:
        """The rewritten model as a ModelProto (serialised once)."""
        if self._proto is None:
            self._proto = save.to_proto(self.model, self.info)
        return self._proto

    @functools.cached_property
    def needs_external_data(self) -> bool:
        """Whether the output must keep its weights in a side file (input had them, or > 1 GB)."""
        return save.needs_external_data(self.model, self.info.had_external_data)

    def save(self, output: str | os.PathLike, keep: Iterable[str | os.PathLike] = ()) -> Path:
        """Write the model atomically; reuses the checked ModelProto when it fits in one file.
        ``keep``: files the run reads, never removed as stale data files of ``output``.
        Writing over the input model or its weights is a UsageError."""
        output = save.check_save_target(self.model, self.info, output)
        keep = [*keep, *save.external_data_files(self.model, self.info)]
        if self.needs_external_data:
            return save.save_model(self.model, self.info, output, keep)
        return save.save_proto(self.proto(), output, keep)


def default_threshold(dtype: LowDtype | str) -> float:
    """Calibration pins values above 1/16 of the fp16 range: headroom for later growth.
    A mixed plan's threshold is fp16's: values above it run bf16 (``bf16_threshold``)."""
    low = dtype if dtype is LowDtype.BFLOAT16 else LowDtype.FLOAT16
    return low.range_threshold  # core/precision.py


def bf16_threshold() -> float:
    """Where a mixed plan pins values fp32: bf16's own calibration threshold."""
    return default_threshold(LowDtype.BFLOAT16)


def rewrite_onnx_model(source: Source, *, progress=None, **options) -> RewriteResult:
    """Load, rewrite and check a model; returns the onnx_ir model and the report.

    ``options``: the fields of ``RewriteOptions`` (``amp_rewrite/onnx/options.py``: each
    with its default, check and help, listed below), checked here. Constants the low dtype
    cannot hold keep their readers fp32 (the report's ``constants_kept_fp32``). bf16 on a
    model whose opset does not admit it for compute ops converts the opset first (the
    report's ``opset_conversion``); ``dtype="mixed"`` converts it only where ops that need
    range (values beyond fp16's) would otherwise lack bf16 (each node takes fp16, bf16 or
    fp32 from one exact plan, as its schema at that opset admits; the report's ``mixed``
    and each node's ``dtype``). ``progress(done, error)`` is called after each plan
    the accuracy budget measures.
    """
    return rewrite_checked(source, RewriteOptions.of(options), progress)


def rewrite_checked(source: Source, opts: RewriteOptions, progress=None) -> RewriteResult:
    """``rewrite_onnx_model`` with options already checked (the CLI checks them before any
    work, from its flags)."""
    start = time.perf_counter()
    low = opts.dtype
    with gc_paused():
        loaded = load_model(source)
        if opts.opset is not None:
            loaded = _converted(loaded, opts.opset)
        pinned = _calibrate(loaded, low, opts.calibration_data, opts.calibration_threshold)
        pinned, hot = _split_for_mixed(pinned) if low == MIXED else (pinned, {})
        options = OnnxOptions.from_rewrite(opts, pinned, hot)
        rules_ = onnx_rules(options.rules)
        loaded, conversion = _low_dtype_opset(loaded, low, rules_, opts.opset, opts.keep_opset,
                                              hot, cuda_bf16_only=opts.target == "ort")
        _check_cast_opset(loaded)
        outcome = None
        if opts.max_error is not None:
            outcome = _search_budget(loaded, options, rules_, opts.max_error,
                                     opts.calibration_data, opts.max_evaluations, progress)
            options = dataclasses.replace(options, budget_pins=outcome.pins,
                                          budget_low=outcome.lowered)
        model = loaded.model
        pass_ = MixedPrecisionPass(options, rules_, loaded.info)
        pass_(model)
        versions.set_lowest_ir_version(model, loaded.info.flat)
        advice = pass_.opset_advice()
        if advice:
            logger.warning("%s", advice)
        result = RewriteResult(model, pass_, loaded.info, opset_conversion=conversion)
        if opts.check:
            _check_output(result, source)
        if outcome is not None:
            result.budget, result.pinned_by_budget = outcome.report(), outcome.pinned()
            result.lowered_by_budget = outcome.lowered_nodes()
            result.budget.update(_held_out_on_runtime(result, outcome))
            if opts.emit_rules is not None:
                from amp_rewrite.onnx.budget import write_rule_overlay

                write_rule_overlay(opts.emit_rules, pass_, outcome, options)
    result.seconds = time.perf_counter() - start
    return result


def _search_budget(loaded: LoadedModel, options: OnnxOptions, rules, max_error: float,
                   data, max_evaluations: int, progress):
    """The accuracy-budget search on an FP32 copy of the loaded model."""
    from amp_rewrite.onnx import budget

    proto = save.proto_with_weights(loaded.model, loaded.info)
    search, held, inputs, held_inputs = budget.default_feeds(proto, data)
    copy = ir.from_proto(proto)
    pass_ = MixedPrecisionPass(dataclasses.replace(options, pad=False), rules)
    outcome = budget.search_budget(pass_, copy, max_error, search, held,
                                   max_evaluations=max_evaluations, inputs=inputs,
                                   held_out_inputs=held_inputs, progress=progress)
    outcome.fp32, outcome.held_feeds = proto, held
    return outcome


def _held_out_on_runtime(result: RewriteResult, outcome) -> dict:
    """The rewritten model's error on the held-out inputs in onnxruntime (fp16: its CPU
    provider runs fp16 models; bf16, and mixed plans with their bf16 nodes, have no CPU
    kernels here, so only the emulation counts)."""
    from amp_rewrite.core.metric import Difference
    from amp_rewrite.onnx import validate

    options = result.pass_.options
    if options.plan_dtype != LowDtype.FLOAT16.value or result.needs_external_data:
        return {"held_out_onnxruntime": None}
    errors, _ = validate.validate(outcome.fp32, result.proto(), LowDtype.FLOAT16,
                                  feeds=outcome.held_feeds)
    # each output's metric as core/metric.py defines it (infinite with a new NaN/Inf)
    worst = max((Difference(e.max_abs, e.max_rel, e.new_nonfinite).error for e in errors),
                default=0.0)
    return {"held_out_onnxruntime": "inf" if worst == float("inf") else float(f"{worst:.4g}")}


def rewrite_onnx(model: str | os.PathLike | onnx.ModelProto | bytes,
                 **options) -> onnx.ModelProto:
    """Rewrite an FP32 ONNX model to mixed precision; ``options`` as ``rewrite_onnx_model``
    (the fields of ``RewriteOptions``)."""
    with gc_paused():  # one pause around both: re-enabling triggers a full collection
        if isinstance(model, bytes):
            model = parse_bytes(model)
        result = rewrite_onnx_model(model, **options)
        proto = result.proto()
        # The IR never leaves this function: free it before the collector resumes, which
        # would otherwise scan it (~1M objects at 50k nodes) once more.
        release(result.model, result.info.flat)
        del result
    return proto


def _low_dtype_opset(loaded: LoadedModel, low: LowDtype | str, rules, opset: int | None,
                     keep_opset: bool, hot: Mapping[str, float] | None = None,
                     cuda_bf16_only: bool = False) -> tuple[LoadedModel, str | None]:
    """bf16 does what the user asked: (the model at the opset where its compute ops admit
    the low dtype, a note saying so) or (the model, None) where nothing is to convert.
    An explicit ``opset`` wins; ``keep_opset`` refuses instead (ModelError); a conversion
    that fails (the version converter, or serialising the model for it) keeps the opset as
    ``keep_opset`` would, without refusing: those ops stay fp32 and the note says why.

    A mixed plan converts only for the ops it may run bf16 for range (``hot``: the values
    calibration saw beyond fp16's threshold, less those a rescale brings within it;
    ``mixed.range_op_types``): a model that needs no range keeps its opset, and with
    ``keep_opset`` those ops stay fp32 without refusing, since the plan still has fp16 and
    fp32 for them. ``cuda_bf16_only``: only ops that onnxruntime's CUDA provider has a bf16
    kernel for at some opset count (``kernels.py``): converting for the others would not let
    them run bf16."""
    from amp_rewrite.core import OpClass

    current = versions.ai_onnx_opset(loaded.model.opset_imports)
    if low not in (LowDtype.BFLOAT16, MIXED) or opset is not None or current is None:
        return loaded, None
    bf16 = LowDtype.BFLOAT16.value

    def conversion_for(op_types: set[str]) -> tuple[int, list[str]] | None:
        if cuda_bf16_only:
            from amp_rewrite.onnx.kernels import lacks_bf16_kernel

            latest = onnx.defs.onnx_opset_version()
            op_types = {op for op in op_types if not lacks_bf16_kernel("", op, latest)}
        return versions.low_dtype_opset(
            current, op_types, f"tensor({bf16})",
            compute=lambda op: rules.class_of(op) in (OpClass.ALLOW, OpClass.GRAY))

    need = conversion_for(versions.default_domain_op_types(loaded.model, loaded.info.flat))
    if need is not None and low == MIXED:
        # only now the range screen: a model whose opset admits bf16 everywhere skips it
        from amp_rewrite.onnx.mixed import range_op_types
        from amp_rewrite.onnx.rescale import values_a_shift_fits

        hot = hot or {}
        fitted = values_a_shift_fits(loaded.model.graph, hot) if hot else set()
        need = conversion_for(range_op_types(
            loaded.model, {k: m for k, m in hot.items() if k not in fitted}, rules,
            loaded.info.flat))
    if need is None:
        return loaded, None
    target, ops = need
    why = f"{bf16} needs opset {target} for {', '.join(ops)}"
    if low == MIXED:
        why += " (values beyond fp16's range)"
        if keep_opset:
            note = f"kept opset {current}: {why}; they run fp32"
            logger.warning("%s", note)
            return loaded, note
    elif keep_opset:
        raise ModelError(f"--dtype bf16: the model is at opset {current} and {why}; drop "
                         "--keep-opset to convert it, or use --dtype fp16")
    try:
        converted = _converted(loaded, target)
    except ModelError as e:
        note = f"kept opset {current}: {e}; {', '.join(ops)} left fp32"
        logger.warning("%s", note)
        return loaded, note
    return converted, f"converted opset {current} -> {target} for {bf16} ({why})"


# The Cast the rewrite inserts takes ``to`` as an int from ai.onnx opset 6 (a string before)
CAST_OPSET = 6


def _check_cast_opset(loaded: LoadedModel) -> None:
    """Refuse a model below ``CAST_OPSET`` (onnxruntime loads opset 7 and later): no cast the
    rewrite inserts would be valid in it."""
    current = versions.ai_onnx_opset(loaded.model.opset_imports)
    if current is not None and current < CAST_OPSET:
        raise ModelError(f"the model is at ai.onnx opset {current}; the casts the rewrite "
                         f"inserts need opset {CAST_OPSET} or later: convert it with --opset "
                         "13 (opset=13 in Python)")


def _converted(loaded: LoadedModel, opset: int) -> LoadedModel:
    """The model at ``opset``, keeping what loading recorded (source, weight files)."""
    converted = versions.convert_opset(loaded.model, opset)
    if converted is loaded.model:
        return loaded
    source = loaded.info.source
    if source is not None:  # external weights stay beside the input
        ir.external_data.set_base_dir(converted.graph, source.parent)
    # the converter may write subgraphs and values without a type: walk and infer again
    return LoadedModel(converted, dataclasses.replace(loaded.info, flat=False, typed=False))


def _check_output(result: RewriteResult, source) -> None:
    """The output is checked at least as strictly as the input passes: the full check
    (type inference included) unless the input itself fails it, then the plain check."""
    if result.needs_external_data:
        return  # too large for an in-memory check; save_model checks the file by path
    proto = result.proto()
    with repair.shape_placeholders(proto, result.info.shapeless_outputs):
        _check_proto(proto, result.info.source or source)


def _check_proto(proto: onnx.ModelProto, source) -> None:
    try:
        onnx.checker.check_model(proto, full_check=True)
        return
    except Exception as e:
        error = e
    input_error = _full_check_error(source)
    if input_error is None:
        raise OutputCheckError(f"internal error: the rewritten model fails the ONNX checker: "
                               f"{first_line(error)}") from error
    if _UNRUNNABLE in str(input_error):  # a type no kernel takes: no runtime runs the input
        raise OutputCheckError(f"the input fails the full ONNX check: {first_line(input_error)}"
                               "; fix the model") from input_error
    try:
        onnx.checker.check_model(proto)
    except Exception as e:
        raise OutputCheckError(f"internal error: the rewritten model fails the ONNX checker: "
                               f"{first_line(e)}") from e
    logger.warning("the output fails the full ONNX check as the input does (%s); it passes "
                   "the plain check the input passed", first_line(error))


# The full check's message for an input type outside an op's type constraint (Exp of int64):
# runtimes refuse such models too (onnxruntime: "INVALID_GRAPH ... Type Error").
_UNRUNNABLE = "has unsupported type"


def _full_check_error(source) -> Exception | None:
    """The full check's error on the input as given (run only when the output fails it)."""
    if isinstance(source, (ir.Model, LoadedModel)):  # rewritten in place, and not from a file
        return None
    if isinstance(source, bytes):
        source = onnx.load_model_from_string(source)
    try:
        onnx.checker.check_model(source if isinstance(source, onnx.ModelProto) else str(source),
                                 full_check=True)
    except Exception as e:
        return e
    return None


def _split_for_mixed(hot: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """(values beyond bf16's threshold: pinned fp32, the others: their nodes run bf16)."""
    limit = bf16_threshold()
    return ({k: m for k, m in hot.items() if m > limit},
            {k: m for k, m in hot.items() if m <= limit})


def _calibrate(loaded: LoadedModel, low: LowDtype | str, data,
               threshold) -> dict[str, float]:
    if data is None:
        return {}
    from amp_rewrite.onnx import validate

    threshold = default_threshold(low) if threshold is None else threshold
    feeds = validate.load_feeds(data)
    maxima = validate.value_maxima(save.proto_with_weights(loaded.model, loaded.info), feeds)
    pinned = {name: m for name, m in maxima.items() if m > threshold}
    logger.info("calibration: %d of %d values exceed %.4g", len(pinned), len(maxima), threshold)
    return pinned


# help() and editors show the options as keywords; the docstring lists them
for _entry in (rewrite_onnx_model, rewrite_onnx):
    _entry.__signature__ = core_options.signature(_entry, RewriteOptions)
    _entry.__doc__ += "\n    Options:\n\n" + "\n".join(
        "    " + line for line in core_options.describe(RewriteOptions).splitlines()) + "\n"
del _entry
