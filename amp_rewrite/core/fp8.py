"""FP8 GEMM choice: which low GEMMs run as scaled FP8 matrix products (decision 0029), pure.

The adapter decides legality (the GEMM runs bf16, is 2-D after flattening, no ``keep_bf16``
pattern names it) and hands each legal GEMM to ``plan_fp8`` as a ``Gemm``. Profitability is a
roofline model of one step of that GEMM, forward and, when training, the two backward GEMMs
(dX = dY·W, dW = dYᵀ·X, each with the forward's FLOPs):

* bf16: each GEMM at ``bf16_tflops`` reading and writing 2-byte operands, plus the per-step
  fp32 → bf16 cast of a parameter weight (read 4, write 2 bytes per element);
* FP8: each GEMM at ``fp8_tflops`` on dims padded to ``MULTIPLE`` (``torch._scaled_mm``
  requires it), reading 1-byte operands and writing 2 bytes, plus every quantization: amax
  and scaled cast (read the source twice, write 1 byte) of X and dY, and of the weight once
  per step (its fp32 master: read 4 twice). The backward needs X and dY in the other layout:
  a transposed copy of the FP8 value (read 1, write 1) with one tensor-wide scale, a second
  quantization along the other axis with row-wise scales, and the same for the weight.

Every kernel costs ``kernel_us`` on top (launch and tail: it is what keeps small GEMMs bf16).
An activation quantized for several FP8 GEMMs (Q, K, V reading one normalised X) is
quantized once and its cost shared among them; ``plan_fp8`` drops readers that stay bf16 and
re-decides until nothing changes (sharers only drop out, each cost only rises: it ends). A
GEMM runs FP8 when its bf16 time is at least ``min_gain`` times its FP8 time. ``min_size``
replaces the model by a size threshold (0: every legal GEMM; tests and measurements).
Constants: decision 0029.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from amp_rewrite.core.padding import PadPolicy, round_up

MULTIPLE = 16  # torch._scaled_mm: both dims of each operand a multiple of 16


@dataclass(frozen=True)
class Fp8Policy:
    """Knobs of ``should_fp8``; defaults model an H100 SXM5 (decision 0029).

    * ``fp8_tflops`` / ``bf16_tflops``: dense Tensor-Core peaks (FP8 twice bf16).
    * ``memory_tbps``: HBM bandwidth.
    * ``kernel_us``: fixed cost of one kernel (launch and tail), FP8's extra quantize kernels.
    * ``min_gain``: the FP8 step must be predicted this much faster (model error margin).
    * ``rowwise``: row-wise scales (the backward re-quantizes instead of transposing).
    * ``min_size``: None: the cost model decides; an int: FP8 iff M·N·K ≥ ``min_size``.
    """

    fp8_tflops: float = 1978.9
    bf16_tflops: float = PadPolicy.tensor_core_tflops
    memory_tbps: float = PadPolicy.memory_tbps
    kernel_us: float = 4.0
    min_gain: float = 1.1
    rowwise: bool = False
    min_size: int | None = None

    def seconds(self, flops: float, traffic: float, kernels: int,
                tflops: float = 0.0) -> float:
        """Roofline time of ``kernels`` kernels doing ``flops`` at ``tflops`` and moving
        ``traffic`` bytes."""
        compute = flops / (tflops * 1e12) if flops else 0.0
        return (max(compute, traffic / (self.memory_tbps * 1e12))
                + kernels * self.kernel_us * 1e-6)


class Gemm(NamedTuple):
    """A legal GEMM Y (M×N) = X (M×K) · Wᵀ. ``activation``: the key of the value X (its
    quantization is shared by the FP8 GEMMs reading it); ``weight_is_parameter``: W is an
    fp32 master quantized once per step; ``training``: the backward GEMMs run too."""

    key: Hashable
    name: str
    m: int
    n: int
    k: int
    activation: Hashable
    weight_is_parameter: bool = True
    training: bool = True


class Fp8Choice(NamedTuple):
    key: Hashable
    name: str
    fp8: bool
    m: int
    n: int
    k: int
    reason: str
    bf16_us: float
    fp8_us: float


def _quantize(elements: int, source_bytes: int, policy: Fp8Policy, layouts: int
              ) -> tuple[int, int]:
    """(bytes, kernels) to quantize a value into ``layouts`` layouts: amax + scaled cast for
    the first, then a transposed copy (tensor-wise) or a second quantization (row-wise)."""
    first = (2 * source_bytes + 1) * elements
    if layouts == 1:
        return first, 2
    if policy.rowwise:
        return 2 * first, 4
    return first + 2 * elements, 3


def _gemm_traffic(m: int, n: int, k: int, operand_bytes: int, training: bool) -> list[int]:
    """Bytes each GEMM of the step moves: two operands read, a 2-byte result written
    (forward X·Wᵀ, then dX = dY·W and dW = dYᵀ·X)."""
    shapes = [(m * k + n * k, m * n)]
    if training:
        shapes += [(m * n + n * k, m * k), (m * n + m * k, n * k)]
    return [operand_bytes * read + 2 * written for read, written in shapes]


def step_seconds(g: Gemm, policy: Fp8Policy, sharing: int = 1) -> tuple[float, float]:
    """(bf16, FP8) seconds of ``g``'s step (module docstring); X's quantization is divided
    among ``sharing`` FP8 GEMMs."""
    flops = 2 * g.m * g.n * g.k
    bf16 = sum(policy.seconds(flops, io, 1, policy.bf16_tflops)
               for io in _gemm_traffic(g.m, g.n, g.k, 2, g.training))
    if g.weight_is_parameter:  # the bf16 rewrite casts the fp32 master every step
        bf16 += policy.seconds(0, 6 * g.n * g.k, 1)
    m, n, k = (round_up(d, MULTIPLE) for d in (g.m, g.n, g.k))
    fp8 = sum(policy.seconds(2 * m * n * k, io, 1, policy.fp8_tflops)
              for io in _gemm_traffic(m, n, k, 1, g.training))
    layouts = 2 if g.training else 1
    x = policy.seconds(0, *_quantize(m * k, 2, policy, layouts))
    w = policy.seconds(0, *_quantize(n * k, 4 if g.weight_is_parameter else 2, policy,
                                     layouts))
    dy = policy.seconds(0, *_quantize(m * n, 2, policy, 2)) if g.training else 0.0
    return bf16, fp8 + x / sharing + w + dy


def should_fp8(g: Gemm, policy: Fp8Policy, sharing: int = 1) -> Fp8Choice:
    """FP8 or bf16 for one legal GEMM, with the numbers behind it."""
    bf16, fp8 = step_seconds(g, policy, sharing)
    size = g.m * g.n * g.k
    if policy.min_size is not None:
        chosen = size >= policy.min_size
        reason = (f"fp8_min_size={policy.min_size}: M·N·K = {size} "
                  f"{'≥' if chosen else '<'} {policy.min_size}")
    else:
        chosen = bf16 >= policy.min_gain * fp8
        step = "training step" if g.training else "forward"
        reason = (f"cost model ({step}): bf16 {bf16 * 1e6:.1f} µs vs FP8 {fp8 * 1e6:.1f} µs "
                  f"with quantization{f' shared by {sharing} GEMMs' if sharing > 1 else ''}: "
                  + ("FP8 pays" if chosen else
                     f"FP8 is not {policy.min_gain}x faster (quantize traffic and kernels)"))
    return Fp8Choice(g.key, g.name, chosen, g.m, g.n, g.k, reason, round(bf16 * 1e6, 2),
                     round(fp8 * 1e6, 2))


def plan_fp8(gemms: Iterable[Gemm], policy: Fp8Policy) -> dict[Hashable, Fp8Choice]:
    """``should_fp8`` for every GEMM, sharing each activation's quantization among the GEMMs
    that read it in FP8, to a fixed point (module docstring)."""
    gemms = list(gemms)
    fp8 = {g.key for g in gemms}
    while True:
        readers: dict[Hashable, int] = {}
        for g in gemms:
            if g.key in fp8:
                readers[g.activation] = readers.get(g.activation, 0) + 1
        # a GEMM now bf16 is costed as if it joined the FP8 readers, so none flips back
        choices = {g.key: should_fp8(g, policy, readers.get(g.activation, 0) + (g.key not in fp8))
                   for g in gemms}
        chosen = {key for key, c in choices.items() if c.fp8}
        if chosen == fp8:
            return choices
        fp8 = chosen
