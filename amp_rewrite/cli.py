"""amp-rewrite: the command line. Parses, calls the library, prints a summary; no logic of its own.

Exit codes (DESIGN §7): 0 ok, 1 internal error, 2 usage or rule-file error,
3 unreadable/invalid/unsupported model, 4 validation failed.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from amp_rewrite.errors import AmpRewriteError, UsageError, ValidationError

logger = logging.getLogger("amp_rewrite")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints two)
        raise UsageError(f"{message} (see amp-rewrite --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="amp-rewrite", description="Rewrite an FP32 ONNX model to mixed precision "
                "with the exact minimum of casts.")
    p.add_argument("model", nargs="?", help="input .onnx model (never overwritten)")
    p.add_argument("-o", "--output", help="output path (default: MODEL.amp.onnx)")
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16", "float16", "bfloat16"])
    p.add_argument("--rules", action="append", default=[], metavar="FILE",
                   help="rule overlay TOML (repeatable; later files win)")
    p.add_argument("--keep-fp32", action="append", default=[], metavar="PATTERN",
                   help="node-name glob pinned to fp32 (repeatable)")
    p.add_argument("--no-keep-io-types", dest="keep_io_types", action="store_false",
                   help="let graph inputs/outputs change dtype too")
    p.add_argument("--calibrate", metavar="DATA.npz",
                   help="inputs for a FP32 run; values beyond --threshold stay fp32")
    p.add_argument("--threshold", type=float, help="calibration magnitude limit (default 4096 "
                   "for fp16)")
    p.add_argument("--savings-weight", type=float, default=0.0, metavar="BETA",
                   help="price of a byte of traffic saved vs a byte cast: 0 (default) gives "
                   "the fewest cast bytes; 1 also runs ops low whose savings pay their casts")
    p.add_argument("--target", choices=["ort", "onnx"], default="ort",
                   help="fused ops may be onnxruntime contrib ops (ort, default) or standard "
                   "ONNX ops of the model's opset only (onnx: TensorRT and other runtimes)")
    p.add_argument("--no-fuse", dest="fuse", action="store_false",
                   help="no pattern fusion before the plan (LayerNorm, RMSNorm, GELU, "
                   "attention chains stay spelled out)")
    p.add_argument("--validate", action="store_true",
                   help="compare FP32 and rewritten outputs in onnxruntime (exit 4 on failure)")
    p.add_argument("--tolerance", type=float, help="max relative output error for --validate")
    p.add_argument("--report", metavar="FILE.json", help="write per-node decisions as JSON")
    p.add_argument("--explain", metavar="NODE", action="append", default=[],
                   help="print the chain of reasons for one node")
    p.add_argument("--list-rules", action="store_true", help="print the effective op lists")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    p.add_argument("-v", "--verbose", action="store_true", help="log details")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                            format="amp-rewrite: %(levelname)s: %(message)s")
        if args.list_rules:
            return _list_rules(args)
        if not args.model:
            raise UsageError("missing MODEL.onnx (see amp-rewrite --help)")
        return _rewrite(args)
    except AmpRewriteError as e:
        print(f"amp-rewrite: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("amp-rewrite: interrupted; nothing was written", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - last resort: one line, exit 1, no traceback
        print(f"amp-rewrite: internal error: {type(e).__name__}: {e} "
              "(rerun with -v and report it)", file=sys.stderr)
        if "-v" in (argv or sys.argv) or "--verbose" in (argv or sys.argv):
            raise
        return 1


def _list_rules(args) -> int:
    from amp_rewrite.core import load_rules

    rules = load_rules("onnx", args.rules)
    for entry in rules.entries():
        print(f"{entry.op_class.value:6} {entry.op:40} {entry.reason}  [{entry.source}]")
    return 0


def _rewrite(args) -> int:
    from amp_rewrite.core.runtime import gc_paused
    from amp_rewrite.onnx import io
    from amp_rewrite.onnx.api import rewrite_onnx_model

    start = time.perf_counter()
    io.check_input_path(args.model)
    out = io.check_output_path(args.model, args.output or io.default_output_path(args.model))
    _check_side_paths(args)
    # The collector stays paused until the IR is freed: it would rescan the whole IR (~1M
    # objects at 50k nodes) during the check and the save, and once more at exit.
    with gc_paused(), _Stages(args) as stages:
        stages.step("rewrite")
        result = rewrite_onnx_model(args.model, dtype=args.dtype, keep_io_types=args.keep_io_types,
                                    rules=args.rules, keep_fp32=args.keep_fp32,
                                    calibration_data=args.calibrate,
                                    calibration_threshold=args.threshold,
                                    savings_weight=args.savings_weight, fuse=args.fuse,
                                    target=args.target)
        validation = None
        if args.validate:
            stages.step("validate")
            validation = _validate(args, result)
        stages.step("save")
        if validation is not None and not all(e.ok(validation[1]) for e in validation[0]):
            _print_validation(validation)
            raise ValidationError("rewritten outputs differ from FP32 beyond tolerance "
                                  f"{validation[1]:g}; nothing written (try --keep-fp32 or "
                                  "--calibrate)")
        result.save(out)
        _finish(args, result, out, validation, time.perf_counter() - start)
        io.release(result.model)
        del result
    return 0


def _check_side_paths(args) -> None:
    """Fail before any work, so a bad --report path never leaves a model without its report."""
    if args.report and not Path(args.report).resolve().parent.is_dir():
        raise UsageError(f"--report {args.report}: directory {Path(args.report).parent} "
                         "does not exist")
    if args.threshold is not None and not args.threshold > 0:
        raise UsageError(f"--threshold must be a magnitude > 0, got {args.threshold:g}")


def _validate(args, result):
    import onnx

    from amp_rewrite.core import LowDtype
    from amp_rewrite.onnx import validate

    fp32 = onnx.load(args.model)
    feeds = validate.load_feeds(args.calibrate) if args.calibrate else None
    return validate.validate(fp32, result.proto(), LowDtype.parse(args.dtype),
                             feeds, args.tolerance)


def _finish(args, result, out: Path, validation, seconds: float) -> None:
    report = dict(result.report, model=str(args.model), output=str(out),
                  seconds=round(seconds, 3))
    if validation is not None:
        report["validation"] = [e.__dict__ for e in validation[0]]
    if args.report:
        _write_json(Path(args.report), report)
    for name in args.explain:
        lines = result.explain(name)
        print("\n".join(lines) if lines else f"no node named {name!r} with float ports")
    if not args.quiet:
        _print_summary(report)
        if validation is not None:
            _print_validation(validation)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def _print_summary(r: dict) -> None:
    counts = r["precision_counts"]
    rows = [("output", r["output"]), ("dtype", r["dtype"]),
            ("nodes low / high", f"{counts['low']} / {counts['high']}"),
            ("casts inserted", r["casts_inserted"]),
            ("fused chains", ", ".join(f"{k.split('::')[-1]} {v}" for k, v in
                                       r.get("fused", {}).items()) or "none"),
            ("constants converted", f"{r['constants_converted']} "
                                    f"({r['constant_bytes_converted'] / 2**20:.2f} MiB fp32)"),
            ("values clamped", r["values_clamped"]),
            ("unlisted ops (kept fp32)", ", ".join(r["unlisted_ops"]) or "none"),
            ("time", f"{r['seconds']:.2f} s")]
    if r["identity_casts_removed"]:
        rows.insert(4, ("identity casts removed", r["identity_casts_removed"]))
    if not r["modified"]:
        rows.insert(2, ("note", "nothing to change (no float32 compute, or already converted)"))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))


def _print_validation(validation) -> None:
    errors, tol = validation
    print(f"{'output':<24} {'max abs':>10} {'max rel':>10}  status (tolerance {tol:g})")
    for e in errors:
        status = "NaN/Inf!" if e.new_nonfinite else ("ok" if e.ok(tol) else "FAIL")
        print(f"{e.name[:24]:<24} {e.max_abs:>10.3g} {e.max_rel:>10.3g}  {status}")


class _Stages:
    """A small stage progress bar (stderr, only on a terminal)."""

    def __init__(self, args) -> None:
        self.enabled = not args.quiet and sys.stderr.isatty()
        self.bar = None

    def __enter__(self):
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=3, desc="amp-rewrite", unit="stage", leave=False)
        return self

    def step(self, name: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(name)
            self.bar.update(1)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


if __name__ == "__main__":
    sys.exit(main())
