"""FP8 GEMMs in the torch plan (decision 0029): ``Fp8Gemms``, ``RestoreFp8Gemms`` and ``fp8_linear``.

``Fp8Gemms`` runs after ``MixedPrecisionPass``. Each GEMM the plan runs bf16 (``linear``,
``mm``, ``addmm``, ``matmul`` with a 2-D right operand) is legal unless a ``keep_bf16``
pattern names it; ``core.fp8.plan_fp8`` decides which legal ones pay in FP8. A chosen node is
retargeted in place to ``fp8_linear(x, w, bias, transposed=, scaling=, grad_dtype=)`` (name,
users and ``meta['val']`` kept), reading the FP32 master weight instead of its bf16 cast,
which is erased when nothing else reads it. ``meta[FP8_TAG]`` records the original op;
``RestoreFp8Gemms`` undoes the rewrite at the start of the next one, so a second rewrite
plans the bf16 graph again and gives the same code.

``fp8_linear`` is a straight-through ``autograd.Function``: forward Y = X·Wᵀ, backward
dX = dY·W and dW = dYᵀ·X, all three as ``torch._scaled_mm`` on operands quantized with
dynamic scales (amax taken on the fly, fp32 scales, one per tensor or one per row along the
GEMM's K), activations and weights E4M3, gradients ``grad_dtype``, dims padded to 16, bf16
results; dW reaches the FP32 master as FP32. Outside compilation a quantization is memoised
per source tensor and ``_version``: a weight is quantized once per optimizer step, an
activation read by several FP8 GEMMs once. On CPU the product is emulated from the same
FP8 operands (``EMULATED_DEVICES``); CUDA calls the kernel.
"""
from __future__ import annotations

import fnmatch
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch.fx import Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult
from torch.utils.weak import WeakIdKeyDictionary

from amp_rewrite import arguments
from amp_rewrite.core.fp8 import MULTIPLE, Fp8Choice, Fp8Policy, Gemm, plan_fp8
from amp_rewrite.fx.apply import insert_cast, retyped
from amp_rewrite.fx.lowering import erase_node
from amp_rewrite.fx.opkeys import size_hint, tensor_val
from amp_rewrite.fx.view import finished, is_cast

aten = torch.ops.aten
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SCALINGS = ("tensorwise", "rowwise")
GRAD_DTYPES = {"e4m3": E4M3, "e5m2": E5M2, E4M3: E4M3, E5M2: E5M2}
FP8_TAG = "amp_rewrite_fp8"  # node.meta key on FP8 nodes: (original target, its arity)
_GEMMS = (aten.linear.default, aten.mm.default, aten.addmm.default, aten.matmul.default,
          aten.bmm.default)
_EPS = 1e-12  # amax floor: an all-zero (or padding) row still gets a finite scale


@dataclass(frozen=True)
class Fp8Options:
    """The FP8 options of ``rewrite``, checked once (``Fp8Options.checked``)."""

    scaling: str = "tensorwise"
    grad_dtype: torch.dtype = E5M2
    min_size: int | None = None
    keep_bf16: tuple[str, ...] = ()

    @classmethod
    def checked(cls, fp8: object, grad_dtype: object, min_size: object, keep_bf16: object,
                low: torch.dtype) -> Fp8Options | None:
        if fp8 is None:
            if grad_dtype is not None or min_size is not None or list(keep_bf16):
                raise arguments.ArgumentError("fp8_grad_dtype, fp8_min_size and keep_bf16 "
                                              "apply to FP8 GEMMs: pass fp8='tensorwise' or "
                                              "'rowwise'")
            return None
        scaling = arguments.choice(fp8, SCALINGS, name="fp8")
        if low != torch.bfloat16:
            raise arguments.ArgumentError("fp8 needs dtype=torch.bfloat16: FP8 GEMMs write "
                                          "bf16 results")
        if grad_dtype is not None and grad_dtype not in GRAD_DTYPES:
            raise arguments.ArgumentError(f"fp8_grad_dtype={grad_dtype!r}: expected "
                                          "torch.float8_e5m2, torch.float8_e4m3fn, 'e5m2' or "
                                          "'e4m3'")
        if min_size is not None and (isinstance(min_size, bool) or not isinstance(min_size, int)
                                     or min_size < 0):
            raise arguments.ArgumentError(f"fp8_min_size={min_size!r}: expected None or an "
                                          "int >= 0")
        # row-wise: E4M3 gradients by default, as torchao's row-wise recipe the benchmark
        # compares with (an H100 with torch 2.11 also runs row-wise E5M2: decision 0029)
        default_grad = E5M2 if scaling == "tensorwise" else E4M3
        return cls(scaling, GRAD_DTYPES[grad_dtype] if grad_dtype is not None else default_grad,
                   min_size, tuple(arguments.patterns(keep_bf16, name="keep_bf16")))


# ----------------------------------------------------------------------------- runtime


def _pad16(t: torch.Tensor) -> torch.Tensor:
    rows, cols = t.shape
    extra_rows, extra_cols = -rows % MULTIPLE, -cols % MULTIPLE
    return F.pad(t, (0, extra_cols, 0, extra_rows)) if extra_rows or extra_cols else t


def quantize(t: torch.Tensor, dtype: torch.dtype, rowwise: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D tensor, padded to multiples of 16, as (contiguous FP8 values, fp32 dequantization
    scale): one scale, or (rowwise) one per row (shape (rows, 1)), from the amax on the fly."""
    t = _pad16(t)
    amax = t.abs().amax(dim=-1, keepdim=True) if rowwise else t.abs().amax()
    top = torch.finfo(dtype).max
    scale = top / amax.float().clamp(min=_EPS)
    values = (t.float() * scale).clamp(-top, top).to(dtype).contiguous()
    return values, scale.reciprocal()


def _transposed(quantized: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor-wise quantized value in the other layout: one transposed copy, same scale."""
    values, scale = quantized
    return values.t().contiguous(), scale


_MEMO: WeakIdKeyDictionary = WeakIdKeyDictionary()  # source -> {spec: (version, result)}


def _memoised(source: torch.Tensor, spec: tuple, compute: Callable[[], tuple]) -> tuple:
    """``compute()``, cached per ``source`` object, ``spec`` and ``source._version`` in eager
    runs; compiled and traced runs (a dispatch mode active) always compute."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() \
            or source.is_inference():
        return compute()
    entries = _MEMO.setdefault(source, {})
    hit = entries.get(spec)
    if hit is None or hit[0] != source._version:
        hit = entries[spec] = (source._version, compute())
    return hit[1]


# Device types whose ``_scaled_mm`` is emulated (dequantize, fp32 matmul, round to bf16: the
# kernel's math up to accumulation order). The CPU kernel of torch 2.13 takes every combination
# used here but runs a 128×32×64 product in ~40 ms against 0.07 ms emulated (decision 0029).
EMULATED_DEVICES = frozenset({"cpu"})


def _mm(a: tuple[torch.Tensor, torch.Tensor], b_t: tuple[torch.Tensor, torch.Tensor],
        rows: int, cols: int) -> torch.Tensor:
    """A · B (bf16) from quantized A (M×K) and Bᵀ (N×K), both row-major (so B is column-major,
    as ``_scaled_mm`` wants), unpadded to ``rows`` × ``cols``."""
    (a_values, a_scale), (b_values, b_scale) = a, b_t
    if a_values.device.type in EMULATED_DEVICES:
        out = (a_values.float() * a_scale) @ (b_values.float() * b_scale).t()
        return out.to(torch.bfloat16)[:rows, :cols]
    out = torch._scaled_mm(a_values, b_values.t(), scale_a=a_scale, scale_b=b_scale.t(),
                           out_dtype=torch.bfloat16)
    return out[:rows, :cols]


def _weight(w: torch.Tensor, transposed: bool, rowwise: bool, layout: str
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight (N×K; stored K×N when ``transposed``) quantized E4M3 as Bᵀ of the forward
    (layout 'nk': reduced along K) or of dX = dY·W (layout 'kn': reduced along N)."""
    def compute() -> tuple[torch.Tensor, torch.Tensor]:
        w_nk = w.t() if transposed else w
        if layout == "nk":
            return quantize(w_nk, E4M3, rowwise)
        if rowwise:
            return quantize(w_nk.t(), E4M3, True)
        return _transposed(_weight(w, transposed, False, "nk"))
    return _memoised(w, (layout, transposed, rowwise), compute)


class _Fp8Linear(torch.autograd.Function):
    """Y = X·Wᵀ with all three GEMMs of the step in FP8 (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, transposed: bool, rowwise: bool,
                grad_dtype: torch.dtype) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        n = w.shape[1] if transposed else w.shape[0]
        xq = _memoised(x, ("x", rowwise), lambda: quantize(x2, E4M3, rowwise))
        out = _mm(xq, _weight(w, transposed, rowwise, "nk"), x2.shape[0], n)
        # dW needs X reduced along M: tensor-wise, a transposed copy of X's FP8 values (kept
        # instead of X); row-wise, a new quantization of X
        ctx.save_for_backward(w, *((x,) if rowwise else xq))
        ctx.settings = (x.shape, x.dtype, transposed, rowwise, grad_dtype)
        return out.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple:
        w, *saved = ctx.saved_tensors
        x_shape, x_dtype, transposed, rowwise, grad_dtype = ctx.settings
        dy2 = dy.reshape(-1, dy.shape[-1])
        (m, n), k = dy2.shape, x_shape[-1]
        dx = dw = None
        dyq = quantize(dy2, grad_dtype, rowwise)
        if ctx.needs_input_grad[0]:
            dx = _mm(dyq, _weight(w, transposed, rowwise, "kn"), m, k)
            dx = dx.reshape(x_shape).to(x_dtype)
        if ctx.needs_input_grad[1]:
            if rowwise:
                x2 = saved[0].reshape(-1, k)
                dy_t, x_t = quantize(dy2.t(), grad_dtype, True), quantize(x2.t(), E4M3, True)
            else:
                dy_t, x_t = _transposed(dyq), _transposed((saved[0], saved[1]))
            dw = _mm(dy_t, x_t, n, k)
            dw = (dw.t() if transposed else dw).to(w.dtype)
        return dx, dw, None, None, None


def fp8_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
               transposed: bool = False, scaling: str = "tensorwise",
               grad_dtype: torch.dtype = E5M2) -> torch.Tensor:
    """``x @ w.T + bias`` (``x @ w + bias`` when ``transposed``) in FP8, bf16 result."""
    out = _Fp8Linear.apply(x, w, transposed, scaling == "rowwise", grad_dtype)
    return out if bias is None else out + bias


# ----------------------------------------------------------------------------- the pass


def _operands(node: Node) -> tuple[Node, Node, Node | None, bool] | str:
    """The GEMM as X·Wᵀ + bias: (x, w, bias, w stored K×N), or why it cannot run as one
    ``_scaled_mm``."""
    target, args = node.target, node.args
    if target is aten.bmm.default:
        return "batched GEMM: torch._scaled_mm multiplies 2-D matrices"
    if node.kwargs:
        return f"scaled GEMM ({', '.join(node.kwargs)}): not an FP8 pattern"
    if target is aten.linear.default:
        x, w, bias, transposed = args[0], args[1], (args[2] if len(args) > 2 else None), False
    elif target is aten.addmm.default:
        bias, x, w, transposed = *args, True
    else:
        (x, w), bias, transposed = args, None, True
    shapes = [tensor_val(a) for a in (x, w)]
    if any(s is None for s in shapes) or shapes[0].dim() < 2 or shapes[1].dim() != 2:
        return "operands are not (…, K) × 2-D: torch._scaled_mm multiplies 2-D matrices"
    if bias is not None and (tensor_val(bias) is None or tensor_val(bias).dim() != 1):
        return "the bias is not a vector"
    return x, w, bias, transposed


def _fp32_source(w: Node) -> Node:
    """The FP32 value a weight operand is the inserted bf16 cast of, else the operand."""
    if is_cast(w) and tensor_val(w.args[0]) is not None and tensor_val(w.args[0]).dtype == torch.float32:
        return w.args[0]
    return w


class Fp8Gemms(PassBase):
    """bf16 GEMMs the cost model picks → ``fp8_linear`` (module docstring); ``records``: one
    per GEMM node (dtype, M, N, K, reason), for the report and ``explain``."""

    def __init__(self, options: Fp8Options, policy: Fp8Policy | None = None) -> None:
        self.options = options
        self.policy = policy or Fp8Policy(rowwise=options.scaling == "rowwise",
                                          min_size=options.min_size)
        self.records: list[dict] = []

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        graph = graph_module.graph
        training = any(p.requires_grad for p in graph_module.parameters())
        legal: dict[Node, tuple] = {}
        refused: dict[Node, tuple[str, str]] = {}
        for node in graph.nodes:
            if node.op != "call_function" or node.target not in _GEMMS:
                continue
            why = self._refusal(node)
            if why is not None:
                refused[node] = why
            else:
                legal[node] = _operands(node)
        gemms = {node: self._gemm(node, ops, training) for node, ops in legal.items()}
        choices = plan_fp8(gemms.values(), self.policy)
        self.records = [self._record(n, choices.get(n), refused.get(n))
                        for n in graph.nodes if n in legal or n in refused]
        chosen = [n for n in legal if choices[n].fp8]
        for node in chosen:
            self._retarget(graph, node, *legal[node])
        return finished(graph_module, bool(chosen))

    def _refusal(self, node: Node) -> tuple[str, str] | None:
        """(dtype, why) for a GEMM that is not an FP8 candidate, else None (legality)."""
        val = tensor_val(node)
        if val is None or val.dtype != torch.bfloat16:
            return "fp32", "runs fp32 in the precision plan: FP8 replaces bf16 GEMMs only"
        pattern = next((p for p in self.options.keep_bf16 if fnmatch.fnmatchcase(node.name, p)),
                       None)
        if pattern is not None:
            return "bf16", f"kept bf16 by keep_bf16 pattern {pattern!r}"
        operands = _operands(node)
        return ("bf16", operands) if isinstance(operands, str) else None

    @staticmethod
    def _gemm(node: Node, operands: tuple, training: bool) -> Gemm:
        x, w, _, transposed = operands
        xs, ws = tensor_val(x).shape, tensor_val(w).shape
        m = math.prod(size_hint(d) for d in xs[:-1])
        n = size_hint(ws[1] if transposed else ws[0])
        weight = _fp32_source(w).op in ("get_attr", "placeholder")
        return Gemm(node, node.name, m, n, size_hint(xs[-1]), x, weight, training)

    def _retarget(self, graph: torch.fx.Graph, node: Node, x: Node, w: Node,
                  bias: Node | None, transposed: bool) -> None:
        node.meta[FP8_TAG] = (node.target, len(node.args))
        source = _fp32_source(w)
        node.target = fp8_linear
        node.args = (x, source, bias)
        node.kwargs = {"transposed": transposed, "scaling": self.options.scaling,
                       "grad_dtype": self.options.grad_dtype}
        if source is not w and not w.users:
            erase_node(graph, w)

    def _record(self, node: Node, choice: Fp8Choice | None,
                refused: tuple[str, str] | None) -> dict:
        op = str(node.target).split(".")[1]
        if choice is None:
            return {"name": node.name, "op_type": op, "dtype": refused[0], "m": None,
                    "n": None, "k": None, "reason": refused[1]}
        return {"name": node.name, "op_type": op, "dtype": "fp8" if choice.fp8 else "bf16",
                "m": choice.m, "n": choice.n, "k": choice.k, "reason": choice.reason,
                "bf16_us": choice.bf16_us, "fp8_us": choice.fp8_us}

    def report(self) -> dict:
        return {"enabled": True, "scaling": self.options.scaling,
                "grad_dtype": str(self.options.grad_dtype).removeprefix("torch."),
                "counts": dict(Counter(r["dtype"] for r in self.records)),
                "gemms": self.records}

    def explanations(self) -> dict[str, str]:
        """Node name → the line ``explain`` adds: the GEMM's dtype, sizes and reason."""
        return {r["name"]: f"{r['name']}: {r['dtype']} GEMM"
                           + (f" (M, N, K) = ({r['m']}, {r['n']}, {r['k']})" if r["m"] else "")
                           + f": {r['reason']}" for r in self.records}


def _restored_args(target: object, arity: int, x: Node, w: Node, bias: Node | None) -> tuple:
    if target is aten.linear.default:
        return (x, w, bias)[:arity]
    if target is aten.addmm.default:
        return (bias, x, w)
    return (x, w)


class RestoreFp8Gemms(PassBase):
    """Undo ``Fp8Gemms``: each FP8 node is its original GEMM again, reading the weight's
    bf16 cast (re-inserted, with its old name, where the pass erased it)."""

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        graph = graph_module.graph
        nodes = [n for n in graph.nodes if FP8_TAG in n.meta]
        memo: dict = {}  # see apply.retyped
        for node in nodes:
            target, arity = node.meta.pop(FP8_TAG)
            x, w, bias = node.args
            if tensor_val(w).dtype != torch.bfloat16:
                w = self._bf16_cast(graph, w, memo)
            node.target, node.kwargs = target, {}
            node.args = _restored_args(target, arity, x, w, bias)
        return finished(graph_module, bool(nodes))

    @staticmethod
    def _bf16_cast(graph: torch.fx.Graph, value: Node, memo: dict) -> Node:
        for user in value.users:
            if is_cast(user) and tensor_val(user) is not None and tensor_val(user).dtype == torch.bfloat16:
                return user
        cast = insert_cast(graph, value, torch.bfloat16)
        cast.meta["val"] = retyped(tensor_val(value), torch.bfloat16, memo)
        return cast


def fp8_section(gm: torch.fx.GraphModule, options: Fp8Options | None
                ) -> tuple[dict, dict[str, str]]:
    """Run ``Fp8Gemms`` with ``options`` (None: FP8 off); the report's ``fp8`` section and
    the explanation lines per node."""
    if options is None:
        return {"enabled": False}, {}
    fp8 = Fp8Gemms(options)
    fp8(gm)
    return fp8.report(), fp8.explanations()

