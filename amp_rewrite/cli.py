"""amp-rewrite: the command line. Parses, calls the library, prints a summary; no logic of its own.

Exit codes (docs/design.md §11): 0 ok, 1 internal error, 2 usage or rule-file error,
3 unreadable/invalid/unsupported model, 4 validation failed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from amp_rewrite.errors import (AmpRewriteError, ModelError, OutputCheckError, UsageError,
                                ValidationError, first_line)

logger = logging.getLogger("amp_rewrite")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints two)
        raise UsageError(f"{message} (see amp-rewrite --help)")


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is, so every ``with`` block cleans up."""


def _epilog() -> str:
    from amp_rewrite.core import LowDtype
    from amp_rewrite.core.precision import MIXED
    from amp_rewrite.core.rules import ENV_FILES, RULE_CLASSES
    from amp_rewrite.onnx.api import bf16_threshold, default_threshold
    from amp_rewrite.onnx.validate import REL_TOLERANCE, default_tolerance

    per_dtype = [(d.value, REL_TOLERANCE[d], default_threshold(d), "") for d in LowDtype]
    per_dtype.append((MIXED, default_tolerance(MIXED), default_threshold(MIXED),
                      f"  (bf16 above it, fp32 above {bf16_threshold():g})"))
    classes = ", ".join(c.value.upper() for c in RULE_CLASSES)
    return "\n".join([
        "defaults per --dtype:",
        *(f"  {d:9} --tolerance {tol:g}  --threshold {thr:g}{more}"
          for d, tol, thr, more in per_dtype),
        "",
        "exit codes:",
        "  0  ok",
        "  1  internal error (a bug: rerun with -v and report it)",
        "  2  usage or rule-file error (nothing written)",
        "  3  unreadable, invalid or unsupported model (nothing written)",
        "  4  validation failed or could not run (model not written; --report still is)",
        "  130, 143  interrupted by SIGINT, SIGTERM (temporary files removed)",
        "",
        "environment:",
        f"  {ENV_FILES}  rule overlay files, separated by '{os.pathsep}' (after --rules)",
        "  AMP_REWRITE_<CLASS>_ADD, AMP_REWRITE_<CLASS>_REMOVE",
        f"      comma-separated op keys added to / removed from a class ({classes})",
    ])


def build_parser() -> argparse.ArgumentParser:
    from amp_rewrite import __version__
    from amp_rewrite.core import options as core_options
    from amp_rewrite.onnx.options import RewriteOptions

    p = _Parser(prog="amp-rewrite", description="Rewrite an FP32 ONNX model to mixed precision "
                "with the exact minimum of casts.", epilog=_epilog(),
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"amp-rewrite {__version__}")
    p.add_argument("model", nargs="?", help="input .onnx model (never overwritten)")
    p.add_argument("-o", "--output", help="output file, or an existing directory "
                   "(default: MODEL.amp.onnx)")
    core_options.add_flags(p, RewriteOptions)  # the rewrite's options, declared once
    p.add_argument("--validate", action="store_true",
                   help="compare FP32 and rewritten outputs in onnxruntime on the --calibrate "
                   "data or seeded random inputs (exit 4 on failure)")
    p.add_argument("--tolerance", type=float, help="max relative output error for --validate "
                   "(default: per dtype, below)")
    p.add_argument("--report", metavar="FILE.json", help="write per-node decisions and every "
                   "inserted cast as JSON")
    p.add_argument("--explain", metavar="NODE", action="append", default=[],
                   help="print the chain of reasons for one node")
    p.add_argument("--list-rules", action="store_true", help="print the effective op lists")
    p.add_argument("--torch", nargs="?", const="cuda", choices=["cuda", "cpu"], metavar="DEVICE",
                   help="with --list-rules: the torch.fx rules instead of the ONNX ones, for "
                   "DEVICE cuda (default) or cpu (adds the torch_cpu.toml overlay)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    p.add_argument("-v", "--verbose", action="store_true", help="log details")
    return p


LOG_FORMAT = "amp-rewrite: %(levelname)s: %(message)s"


class _HeldLog(logging.Handler):
    """A run's log lines, printed on stderr once the run has succeeded and dropped when it
    fails: a failure's stderr is its one error line, whatever was logged on the way there
    (a warning that led to the error says less than the error)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(LOG_FORMAT))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def show(self) -> None:
        for line in self.lines:
            print(line, file=sys.stderr)
        self.lines.clear()


def main(argv: list[str] | None = None) -> int:
    held = _HeldLog()
    try:
        code = _exit_code(argv, held)
    finally:
        logging.getLogger().removeHandler(held)
    if code == 0:
        held.show()
    return code


def _exit_code(argv: list[str] | None, held: _HeldLog) -> int:
    try:
        with _sigterm_as_interrupt():
            return _main(argv, held)
    except AmpRewriteError as e:
        print(f"amp-rewrite: error: {e}", file=sys.stderr)
        return e.exit_code
    except _Terminated:
        print("amp-rewrite: terminated; temporary files removed", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("amp-rewrite: interrupted; temporary files removed", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `amp-rewrite --list-rules | head`: the reader had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 0
    except Exception as e:  # noqa: BLE001 - last resort: one line, exit 1, no traceback
        print(f"amp-rewrite: internal error: {type(e).__name__}: {e} "
              "(rerun with -v and report it)", file=sys.stderr)
        if "-v" in (argv or sys.argv) or "--verbose" in (argv or sys.argv):
            raise
        return 1


def _main(argv: list[str] | None, held: _HeldLog) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version: argparse printed them
        return e.code if isinstance(e.code, int) else 0
    _configure_logging(args.verbose, held)
    if args.list_rules:
        return _list_rules(args)
    if not args.model:
        raise UsageError("missing MODEL.onnx (see amp-rewrite --help)")
    return _rewrite(args, held)


def _configure_logging(verbose: bool, held: _HeldLog) -> None:
    """-v logs as it goes (with the traceback of a failure); otherwise warnings are held
    for the end of the run. A host application or test harness that already logs to the
    root logger keeps its own handlers."""
    if verbose:
        logging.basicConfig(level=logging.DEBUG, format=LOG_FORMAT)
        return
    root = logging.getLogger()
    if not root.handlers:
        root.setLevel(logging.WARNING)
        root.addHandler(held)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    def on_term(signum, frame):
        raise _Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread: leave signals alone
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _list_rules(args) -> int:
    from amp_rewrite.core import load_rules
    from amp_rewrite.core.rules import default_rules_path
    from amp_rewrite.onnx.passes import known_op_keys

    if args.torch:  # the rules ``amp_rewrite.rewrite`` uses (fx/__init__.py order)
        overlays = [default_rules_path("torch_cpu")] if args.torch == "cpu" else []
        rules = load_rules("torch", extra_files=[*overlays, *args.rules])
    else:
        rules = load_rules("onnx", args.rules, known_ops=known_op_keys())
    for entry in rules.entries():
        print(f"{entry.op_class.value:6} {entry.op:40} {entry.reason}  [{entry.source}]")
    for entry in rules.bounded_entries():
        print(f"{'bounded':6} {entry.op:40} {entry.reason}  [{entry.source}]")
    for entry in rules.range_entries():  # bf16 in a mixed plan
        print(f"{'range':6} {entry.op:40} {entry.reason}  [{entry.source}]")
    return 0


@dataclass
class _RunPaths:
    model: Path
    output: Path
    report: Path | None
    reads: dict[str, list]  # what it is -> paths; external data is added once loaded
    writes: dict[str, Path]  # flag -> path


def _rewrite(args, held: _HeldLog) -> int:
    from amp_rewrite.onnx.load import release
    from amp_rewrite.runtime import gc_paused

    from amp_rewrite.core import options as core_options
    from amp_rewrite.onnx.options import RewriteOptions

    start = time.perf_counter()
    keywords, flags = core_options.from_flags(RewriteOptions, args)
    args.options = RewriteOptions.of(keywords, "amp-rewrite", names=flags)
    paths = _check_paths(args)
    # The collector stays paused until the IR is freed: it would rescan the whole IR (~1M
    # objects at 50k nodes) during the check and the save, and once more at exit.
    with gc_paused():
        with _Stages(args) as stages:
            result = _load_and_rewrite(args, paths, stages)
            validation, failure = _validate_stage(args, result, stages)
            if failure is None:
                stages.step("save")
                with _input_blamed_if_invalid(paths.model):  # external data: checked on disk
                    result.save(paths.output,
                                keep=[p for group in paths.reads.values() for p in group])
        # the progress bar is finished and cleared before anything is printed
        if failure is None:
            held.show()  # the warnings before the summary they qualify
        _finish(args, result, None if failure else paths.output, validation,
                time.perf_counter() - start, paths.report)
        if failure is not None:
            raise failure
        release(result.model, result.info.flat)
        del result
    return 0


def _check_paths(args) -> _RunPaths:
    """Every path argument checked before any work; nothing written is something read."""
    from amp_rewrite.onnx import save
    from amp_rewrite.onnx.load import check_input_path

    model = check_input_path(args.model)
    out = save.check_output_path(args.model,
                                 args.output or save.default_output_path(args.model))
    report, emit = _check_side_paths(args)
    paths = _RunPaths(model, out, report, _read_paths(args),
                      {"-o": out, **({"--report": report} if report else {}),
                       **({"--emit-rules": emit} if emit else {})})
    save.check_path_conflicts(paths.reads, paths.writes)
    return paths


def _load_and_rewrite(args, paths: _RunPaths, stages):
    from amp_rewrite.onnx import save
    from amp_rewrite.onnx.api import rewrite_checked
    from amp_rewrite.onnx.load import load_model

    stages.step("load")
    model = load_model(paths.model)
    paths.reads["an external-data file of the input"] = save.external_data_files(model.model,
                                                                                  model.info)
    save.check_path_conflicts(paths.reads, paths.writes)  # still before anything is written
    stages.step("rewrite")
    with _input_blamed_if_invalid(paths.model):
        return rewrite_checked(model, args.options,
                               progress=stages.budget_progress(args.options.max_evaluations))


@contextlib.contextmanager
def _input_blamed_if_invalid(model_path: Path) -> Iterator[None]:
    try:
        yield
    except OutputCheckError:
        _blame_invalid_input(model_path)
        raise


def _blame_invalid_input(path: Path) -> None:
    """The output failed the full check: if the input fails it as well, say so (exit 3)
    instead of reporting an internal error (the plain check at load passes such models)."""
    import onnx

    try:  # in memory, with its weights: by path, inference cannot read external shapes
        proto = onnx.load(str(path))
    except Exception:  # noqa: BLE001 - too large to check in memory: no verdict on the input
        return
    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception as e:  # noqa: BLE001 - the checker raises several types
        raise ModelError(f"{path}: the model fails ONNX type and shape inference "
                         f"({first_line(e)}); "
                         "fix the model (see onnx.checker.check_model(path, full_check=True))"
                         ) from None


def _validate_stage(args, result, stages) -> tuple:
    """(errors and tolerance or None, the ValidationError to raise after the report or None)"""
    if not args.validate:
        return None, None
    stages.step("validate")
    try:
        validation = _validate(args, result)
    except ValidationError as e:  # could not run: still report and summarise, then exit 4
        return None, e
    if validation.ok():
        return validation, None
    if validation.overflows:
        return validation, ValidationError(f"{validation.overflow_summary()}; the model was "
                                           f"not written (fix: {validation.overflow_fix()})")
    return validation, ValidationError(
        f"rewritten outputs differ from FP32 beyond tolerance {validation.tolerance:g}; the "
        "model was not written (try --keep-fp32 or --calibrate)")


def _read_paths(args) -> dict[str, list[str]]:
    """Every file the run reads, by what it is (external data is added once loaded)."""
    env_rules = [p for p in os.environ.get("AMP_REWRITE_RULES", "").split(os.pathsep) if p]
    return {"the input model": [args.model],
            "the --calibrate data": [args.calibration_data] if args.calibration_data else [],
            "a --rules file": list(args.rules),
            "an $AMP_REWRITE_RULES file": env_rules}


def _check_side_paths(args) -> tuple[Path | None, Path | None]:
    """Fail before any work, so a bad side argument never costs a rewrite. Returns the
    --report and --emit-rules paths (None where not given)."""
    from amp_rewrite.onnx import save

    emit = None
    if args.emit_rules:
        save.check_writable_file(args.emit_rules, "--emit-rules")
        emit = Path(args.emit_rules)
    if args.tolerance is not None and not args.tolerance >= 0:
        raise UsageError(f"--tolerance must be >= 0, got {args.tolerance:g}")
    if args.calibration_data and not Path(args.calibration_data).is_file():
        raise UsageError(f"--calibrate {args.calibration_data}: no such file")
    if not args.report:
        return None, emit
    save.check_writable_file(args.report, "--report")
    return Path(args.report), emit


def _validate(args, result):
    import onnx

    from amp_rewrite.onnx import save, validate

    fp32 = onnx.load(args.model)
    # the IR of a model with external data still refers to the input's data file
    mixed = (save.proto_with_weights(result.model, result.info) if result.needs_external_data
             else result.proto())
    feeds = validate.load_feeds(args.calibration_data) if args.calibration_data else None
    return validate.validate_rewrite(fp32, mixed, args.options.dtype, feeds,
                                     args.tolerance)


def _finish(args, result, out: Path | None, validation, seconds: float,
            report_path: Path | None) -> None:
    report = dict(result.report, model=str(args.model),
                  output=str(out) if out else None, seconds=round(seconds, 3),
                  runs_on=_runs_on(args, result))
    if validation is not None:
        report["validation"] = [e.__dict__ for e in validation.errors]
        report["validation_overflows"] = [o.__dict__ for o in validation.overflows]
    if report_path is not None:
        from amp_rewrite.onnx import save

        save.write_bytes_atomically(report_path,
                                    json.dumps(report, indent=1, default=str).encode())
    for name in args.explain:
        _explain(result, name)
    if not args.quiet:
        _print_summary(report, args)
        if validation is not None:
            _print_validation(validation, report.get("runs_on"))


def _runs_on(args, result) -> dict | None:
    """Which providers run a bf16 or mixed output: whether onnxruntime's CUDA provider has
    a kernel for each 16-bit node (``validate.cuda_kernels``), and where this onnxruntime
    cannot load it, why (``validate.runtime_note``)."""
    from amp_rewrite.core import LowDtype
    from amp_rewrite.onnx import validate

    low = args.options.dtype
    if low is LowDtype.FLOAT16:
        return None
    note = None if result.needs_external_data else validate.runtime_note(result.proto(), low)
    return {**validate.cuda_kernels(result.model), "note": note}


def _explain(result, name: str) -> None:
    from amp_rewrite.core.report import UnknownNodeError

    try:
        print("\n".join(result.explain(name)))
    except UnknownNodeError as e:
        logger.warning("--explain %r: no node of that name with float ports%s", name, e.near)


def _print_summary(r: dict, args) -> None:
    counts = r["precision_counts"]
    output = r["output"] or "not written (validation failed)"
    rows = [("output", output), ("dtype", r["dtype"]),
            _node_counts_row(r),
            ("casts inserted", r["casts_inserted"]),
            ("fused chains", ", ".join(f"{k.split('::')[-1]} {v}" for k, v in
                                       r.get("fused", {}).items()) or "none"),
            ("constants converted", f"{r['constants_converted']} "
                                    f"({r['constant_bytes_converted'] / 2**20:.2f} MiB fp32)"),
            ("values clamped", r["values_clamped"]),
            ("padded GEMMs/convs", _padded_row(r.get("padding", {}))),
            ("unlisted ops (kept fp32)", ", ".join(r["unlisted_ops"]) or "none"),
            ("time", f"{r['seconds']:.2f} s")]
    if r["identity_casts_removed"]:
        rows.insert(4, ("identity casts removed", r["identity_casts_removed"]))
    if args.calibration_data:
        from amp_rewrite.onnx.api import default_threshold

        threshold = (args.calibration_threshold if args.calibration_threshold is not None
                     else default_threshold(args.options.dtype))
        rows.insert(3, _calibration_row(r, threshold))
    if r.get("budget"):
        rows[3:3] = _budget_rows(r["budget"], r.get("pinned_by_budget") or [])
    if r.get("constants_kept_fp32"):
        rows.insert(5, ("constants kept fp32 (range)", len(r["constants_kept_fp32"])))
    if r.get("low_io", {}).get("values"):
        from amp_rewrite.onnx.passes import format_bytes_saved

        low_io = r["low_io"]
        rows.insert(4, ("low-precision I/O", f"{len(low_io['values'])} values, saves "
                        f"{format_bytes_saved(low_io['bytes_saved'])} per run"))
    if r.get("opset_advice"):
        rows.insert(2, ("note", r["opset_advice"]))
    if r.get("mixed"):
        rows[3:3] = _mixed_rows(r["mixed"])
    if r.get("runs_on"):
        rows.insert(2, ("runs on", _runs_on_text(r["runs_on"])))
    if r.get("opset_conversion"):
        rows.insert(2, ("opset", r["opset_conversion"]))
    if not r["modified"]:
        rows.insert(2, ("note", _nothing_to_change(counts)))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))


def _node_counts_row(r: dict) -> tuple[str, str]:
    if r.get("dtype_counts"):
        c = r["dtype_counts"]
        return ("nodes fp16 / bf16 / fp32",
                f"{c['float16']} / {c['bfloat16']} / {c['float32']}")
    counts = r["precision_counts"]
    return ("nodes low / high", f"{counts['low']} / {counts['high']}")


def _calibration_row(r: dict, threshold: float) -> tuple[str, str]:
    pinned = f"{len(r['pinned_by_calibration'])} values"
    if r.get("mixed") is None:
        return ("pinned by calibration", f"{pinned} above {threshold:g} (kept fp32)")
    from amp_rewrite.onnx.api import bf16_threshold

    hot = len(r["mixed"].get("bf16_by_calibration", []))
    rescaled = r.get("rescaled") or []
    shifted = (f"{len(rescaled)} chains rescaled into fp16's range, " if rescaled else "")
    return ("calibration", f"{shifted}{hot} values above {threshold:g} (their nodes run "
                           f"bf16 where their kernels take it), {pinned} above "
                           f"{bf16_threshold():g} (kept fp32)")


def _mixed_rows(m: dict) -> list[tuple[str, str]]:
    """A mixed plan's lines: GEMM-weighted FLOPs per dtype, the casts between the two low
    dtypes, and the solver's verdict."""
    casts = m.get("cast_bytes", {})
    between = sum(casts.get(k, 0) for k in ("float16->bfloat16", "bfloat16->float16"))
    solver = m.get("solver", {})
    rows = [("cast bytes fp16<->bf16", f"{between} B (all casts: "
                                       f"{sum(casts.values())} B planned)"),
            ("solver", f"{solver.get('status', '?')}, gap {solver.get('gap', 0):g}, "
                       f"{solver.get('seconds', 0):.2f} s")]
    share = m.get("flop_share")
    if share:
        rows.insert(0, ("FLOPs fp16 / bf16 / fp32",
                        f"{share['float16']:.1%} / {share['bfloat16']:.1%} / "
                        f"{share['float32']:.1%}"))
    return rows


def _runs_on_text(runs_on: dict) -> str:
    cuda = runs_on.get("CUDAExecutionProvider")
    if cuda is None:
        text = f"CUDA kernels unknown ({runs_on.get('unknown')})"
    elif cuda:
        text = "CUDAExecutionProvider has a kernel for every 16-bit node"
    else:
        missing = runs_on["missing"]
        text = (f"CUDAExecutionProvider lacks {len(missing)} kernel(s): "
                f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    if runs_on.get("source"):
        text += f" (per {runs_on['source']})"
    return f"{text}; {runs_on['note']}" if runs_on.get("note") else text


def _budget_rows(b: dict, pinned: list) -> list[tuple[str, str]]:
    held = f"{b['held_out']} held out"
    if b.get("held_out_onnxruntime") is not None:
        held += f" ({b['held_out_onnxruntime']} in onnxruntime)"
    rows = [("accuracy budget", f"max error {b['max_error']:g}: {b['achieved']} on the inputs "
                                f"searched, {held}; {b['evaluations']} plans measured in "
                                f"{b['seconds']:.1f} s"),
            ("pinned by budget", f"{len(pinned)} nodes fp32; {b['low_flop_share']:.1%} of the "
                                 f"low FLOPs stay low (default plan: error "
                                 f"{b['default_plan_error']})"),
            ("budget inputs", f"{b['inputs']}; held out: {b['held_out_inputs']}")]
    if not b["reachable"]:
        rows.insert(1, ("note", f"--max-error {b['max_error']:g} is unreachable: with every "
                                f"node the rules run low pinned fp32 the error is "
                                f"{b['all_pinned_error']} (that plan was written)"))
    return rows


def _nothing_to_change(counts: dict) -> str:
    if counts.get("high") and not counts.get("low"):
        return ("nothing to change: the rules, --keep-fp32 patterns or calibration pins keep "
                "every float node fp32 (see --report or --explain NODE)")
    return "nothing to change (no float32 compute, or already converted)"


def _padded_row(padding: dict) -> str:
    if not padding.get("enabled", True):
        return "off (--no-pad)"
    return (f"{padding.get('padded_ops', 0)} (+{padding.get('extra_flop_fraction', 0):.1%} "
            f"FLOPs, {padding.get('pads_inserted', 0)} Pad / "
            f"{padding.get('slices_inserted', 0)} Slice)")


def _print_validation(validation, runs_on: dict | None = None) -> None:
    errors, tol = validation.errors, validation.tolerance
    if runs_on and runs_on.get("note"):
        print("validated in onnx.reference: bfloat16 targets GPU providers")
    print(f"{'output':<24} {'max abs':>10} {'max rel':>10}  status (tolerance {tol:g})")
    for e in errors:
        status = "NaN/Inf!" if e.new_nonfinite else ("ok" if e.ok(tol) else "FAIL")
        print(f"{e.name[:24]:<24} {e.max_abs:>10.3g} {e.max_rel:>10.3g}  {status}")


class _Stages:
    """A small stage progress bar (stderr, only on a terminal)."""

    def __init__(self, args) -> None:
        self.enabled = not args.quiet and sys.stderr.isatty()
        self.total = 4 if args.validate else 3  # load, rewrite, (validate,) save
        self.bar = None

    def __enter__(self):
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc="amp-rewrite", unit="stage", leave=False,
                            file=sys.stderr)
        return self

    def budget_progress(self, total: int):
        """A callback showing the accuracy budget's measured plans on the bar."""
        def show(done: int, error: float) -> None:
            if self.bar is not None:
                self.bar.set_postfix_str(f"budget: plan {done}/{total}, error {error:.3g}")
        return show

    def step(self, name: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(name)
            self.bar.update(1)

    def __exit__(self, *exc) -> None:
        """Shown complete, then cleared (``leave=False``): the summary follows on a clean
        terminal, also when a stage was skipped or failed."""
        if self.bar is not None:
            self.bar.n = self.total
            self.bar.refresh()
            self.bar.close()
            self.bar = None


if __name__ == "__main__":
    sys.exit(main())
