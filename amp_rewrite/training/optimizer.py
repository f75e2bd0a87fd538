"""``AmpOptimizer``: mixed-precision training around any ``torch.optim`` optimizer.

One object per optimizer does what a GradScaler loop spells out by hand::

    opt = AmpOptimizer(torch.optim.AdamW(model.parameters()), accumulation_steps=4)
    for i, (x, y) in enumerate(loader):
        opt.backward(loss_fn(model(x), y))     # scaled; loss averaged over the micro-batches
        if opt.at_boundary:                    # 4 micro-batches accumulated
            opt.clip_grad_norm_(1.0)           # on unscaled gradients
            stepped = opt.step()               # falsy when skipped for Inf/NaN
            opt.zero_grad()

Works with FP32-parameter modules whose casts are in the graph (amp_rewrite's fx output, or
autocast) by default, and with modules stored in float16 via ``master_weights=True``.
"""
from __future__ import annotations

from typing import Any

import torch

from amp_rewrite.arguments import ArgumentError, plan_dtype
from amp_rewrite.core.precision import MIXED
from amp_rewrite.errors import TrainingError
from amp_rewrite.training._grads import optimizer_params
from amp_rewrite.training.master import MasterWeights
from amp_rewrite.training.scaler import LossScaler

class StepResult:
    """What ``AmpOptimizer.step()`` did: truthy when the optimizer stepped, falsy when the step
    was skipped for Inf/NaN gradients. Not a bool, because a fused optimizer decides the skip
    on the device: the flag is read only when the result is used as a bool. ``found_inf`` is
    the device flag itself (> 0: skipped).
    """

    __slots__ = ("_stepped", "found_inf")

    def __init__(self, stepped: bool | None, found_inf: torch.Tensor | None) -> None:
        self._stepped = stepped  # None: not read from the device yet
        self.found_inf = found_inf

    def __bool__(self) -> bool:
        if self._stepped is None:
            self._stepped = self.found_inf is None or not self.found_inf.item()
        return self._stepped

    def __eq__(self, other: object) -> bool:
        return bool(self) == other if isinstance(other, bool) else NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to a bool, so not hashable like one

    def __repr__(self) -> str:
        return f"StepResult(stepped={bool(self)})"


def scaling_dtype(dtype: object = None, model: Any = None) -> torch.dtype:
    """The dtype whose gradients decide the loss scaling: float16 when any node may run
    fp16 (fp16's gradients underflow without scaling), else bfloat16.

    ``dtype``: as for ``amp_rewrite.rewrite``; 'mixed' scales, as a mixed plan runs fp16
    wherever it fits. ``model``: a module ``amp_rewrite.rewrite`` or the ``amp_rewrite``
    compile backend made (compiled: after its first call); its reports say which dtypes its
    nodes run in. Neither: float16."""
    if model is not None:
        if dtype is not None:
            raise ArgumentError("dtype= and model= both given: model= reads the dtypes its "
                                "nodes run in from its report; pass one of them")
        return torch.float16 if _runs_fp16(model) else torch.bfloat16
    dtype = plan_dtype(torch.float16 if dtype is None else dtype)
    return torch.float16 if dtype == MIXED else dtype


def _runs_fp16(model: Any) -> bool:
    """Whether a graph of ``model`` runs a node in float16 (its amp_rewrite reports)."""
    from amp_rewrite.fx.backend import report

    for entry in report(model):
        graph = entry["report"]
        if graph["dtype"] == "float16" or (graph.get("dtype_counts") or {}).get("float16"):
            return True
    return False


def _default_scaler(dtype: torch.dtype, skip_nonfinite: bool) -> LossScaler:
    if dtype == torch.float16:
        return LossScaler()
    # bf16 has float32's exponent range: no scaling, but keep skipping non-finite steps.
    if skip_nonfinite:
        return LossScaler(init_scale=1.0, dynamic=False)
    return LossScaler(enabled=False)


class AmpOptimizer:
    """Loss scaling, unscaled clipping, accumulation and master weights for one optimizer.

    Args:
        optimizer: any ``torch.optim.Optimizer`` (``fused=True`` ones skip on the device).
        dtype: the low-precision compute dtype, spelled as for ``amp_rewrite.rewrite``
            (torch.float16 / torch.bfloat16 / 'fp16' / 'bf16' / 'mixed'; float32 is refused:
            a float32 loop needs no wrapper). float16 and 'mixed' (fp16 wherever it fits):
            dynamic ``LossScaler()``; bfloat16: no scaling, non-finite steps still skipped
            (``skip_nonfinite``). Default float16.
        model: instead of ``dtype``, the module amp_rewrite rewrote or compiled: scaled when
            any of its nodes runs float16 (its reports; ``scaling_dtype``).
        scaler: a ``LossScaler`` to use instead of the default (then ``skip_nonfinite`` is
            ignored). Give each wrapper its own: ``step()`` calls ``scaler.update()``.
        accumulation_steps: micro-batches per optimizer step; ``backward`` divides each loss by
            it, and the unscale and Inf/NaN check run once per optimizer step.
        master_weights: the module's parameters are float16/bfloat16; keep float32 masters
            (apex O2). The optimizer must be fresh (no state yet).
        skip_nonfinite: for bfloat16 without a scaler: skip steps whose gradients
            hold Inf/NaN (default) or step regardless.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        dtype: torch.dtype | str | None = None,
        model: Any = None,
        scaler: LossScaler | None = None,
        accumulation_steps: int = 1,
        master_weights: bool = False,
        skip_nonfinite: bool = True,
    ) -> None:
        dtype = scaling_dtype(dtype, model)
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) \
                or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be an integer >= 1, got "
                             f"{accumulation_steps!r}")
        self.optimizer = optimizer
        self.dtype = dtype
        self.scaler = scaler if scaler is not None else _default_scaler(dtype, skip_nonfinite)
        self.accumulation_steps = accumulation_steps
        self._master = MasterWeights(optimizer) if master_weights else None
        if self._master is None:
            self._refuse_fp16_params()
        self._micro_batches = 0
        self._unscaled = False
        self._optimizer_steps = 0

    def _refuse_fp16_params(self) -> None:
        if not self.scaler.scaling:
            return
        for index, param in enumerate(optimizer_params(self.optimizer)):
            if param.dtype == torch.float16:
                raise TrainingError(
                    f"parameter {index} (shape {tuple(param.shape)}) is stored in float16 and "
                    "would get float16 gradients, which cannot be unscaled safely; keep "
                    "parameters in float32 or pass master_weights=True")

    # ------------------------------------------------------------------ training

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward of ``scale * loss / accumulation_steps``; kwargs go to ``backward``."""
        if self._unscaled:
            raise TrainingError("backward() after the gradients of this step were unscaled "
                                "(clip_grad_norm_/unscale_): call step() or zero_grad() first")
        if self.accumulation_steps > 1:
            loss = loss / self.accumulation_steps
        self.scaler.scale(loss).backward(**kwargs)
        if self._master is not None:
            self._master.gather_grads()
        self._micro_batches += 1

    @property
    def at_boundary(self) -> bool:
        """True once ``accumulation_steps`` micro-batches have been accumulated."""
        return self._micro_batches >= self.accumulation_steps

    def _require_backward(self, caller: str) -> None:
        if self._micro_batches == 0:
            raise TrainingError(f"{caller} called without backward() since the last step: "
                                "call opt.backward(loss) first (not loss.backward(), whose "
                                "gradients would not be scaled)")

    def unscale_(self) -> None:
        """Divide the accumulated gradients by the scale (once per step); no host sync."""
        self._require_backward("unscale_()")
        if self._unscaled:
            raise TrainingError("unscale_() was already called in this step; a second call "
                                "would divide the gradients by the scale twice")
        self.scaler.unscale_(self.optimizer)
        self._unscaled = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        **kwargs: Any) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` on the unscaled gradients; returns the norm."""
        if not self._unscaled:
            self.unscale_()
        params = [p for p in optimizer_params(self.optimizer) if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> StepResult:
        """Unscale, check, step unless Inf/NaN, update the scale. The result is falsy when the
        step was skipped (``StepResult``).

        At most one host read (the found-Inf flag). Fused optimizers skip on the device: then
        there is none, unless the result is used as a bool.
        """
        self._require_backward("step()")
        _, found_inf, stepped = self.scaler._step(self.optimizer, args, kwargs)
        self.scaler.update()
        if self._master is not None and stepped is not False:
            self._master.copy_to_model()
        self._optimizer_steps += 1
        self._micro_batches = 0
        self._unscaled = False
        return StepResult(stepped, found_inf)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (and any half-done accumulation or unscale)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if self._master is not None:
            self._master.zero_model_grads()
        if self._micro_batches and self.scaler.is_enabled():
            self.scaler._forget(self.optimizer)
        self._micro_batches = 0
        self._unscaled = False

    # ------------------------------------------------------------------ logging

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def optimizer_steps(self) -> int:
        """Calls of ``step()`` (applied or skipped); a Python counter, no host read."""
        return self._optimizer_steps

    @property
    def micro_batches(self) -> int:
        """Micro-batches accumulated since the last step."""
        return self._micro_batches

    def get_scale(self) -> float:
        """Current loss scale (host read; 1.0 without scaling)."""
        return self.scaler.get_scale()

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for Inf/NaN so far (host read)."""
        return self.scaler.skipped_steps

    def stats(self) -> dict[str, float | int]:
        """scale, skipped_steps, optimizer_steps, growth_tracker for logging (one host read)."""
        out = self.scaler.counters()
        out.pop("updates")
        out["optimizer_steps"] = self._optimizer_steps
        return out

    # ----------------------------------------------------------------- persist

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, scaler, float32 masters and counters. Only between optimizer steps."""
        if self._micro_batches:
            raise TrainingError("state_dict() in the middle of gradient accumulation: the "
                                "accumulated gradients would be lost; save after step()")
        masters = None if self._master is None else [m.detach().clone()
                                                     for m in self._master.masters()]
        return {"optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(),
                "master_params": masters, "optimizer_steps": self._optimizer_steps,
                "accumulation_steps": self.accumulation_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict()`` saved (masters are copied into the module too)."""
        masters = state_dict.get("master_params")
        if (masters is None) != (self._master is None):
            raise TrainingError("state dict and wrapper disagree on master_weights")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.scaler.is_enabled() and state_dict["scaler"]:
            self.scaler.load_state_dict(state_dict["scaler"])
        if self._master is not None:
            self._master.load(masters)
        self._optimizer_steps = int(state_dict.get("optimizer_steps", 0))
        self._micro_batches = 0
        self._unscaled = False
