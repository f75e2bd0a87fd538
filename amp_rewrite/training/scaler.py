"""Dynamic loss scaling (Micikevicius et al., Mixed Precision Training, ICLR 2018).

``LossScaler`` is a drop-in for ``torch.amp.GradScaler`` (same method names, same defaults, same
kernels, bit-identical trajectories with the default options) plus what large-scale trainers
added: hysteresis (back off only after N consecutive overflows), a minimum and maximum scale, a
static-scale mode, and agreement on overflow across ``torch.distributed`` ranks.

Device residency: the scale, the growth and hysteresis trackers, the found-Inf flags and the
step counters are 0-dim tensors on the gradients' device. ``scale``, ``unscale_`` and
``update`` never read them on the host; ``step`` reads the found-Inf flag once to decide whether
to call ``optimizer.step()``, and not at all for optimizers that take ``grad_scale``/``found_inf``
themselves (``fused=True`` Adam/AdamW/SGD/Adagrad), which skip the update on the device.
"""
from __future__ import annotations

import enum
import functools
import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from amp_rewrite.errors import TrainingError
from amp_rewrite.training._grads import agree_across_ranks, check_and_unscale, optimizer_params

T = TypeVar("T")


class _Stage(enum.Enum):
    READY = "ready"
    UNSCALED = "unscaled"
    STEPPED = "stepped"


@dataclass
class _OptimizerRecord:
    """What happened to one optimizer since the last ``update()``."""

    stage: _Stage = _Stage.READY
    found_inf: torch.Tensor | None = None


_STATE_DTYPES = {"scale": torch.float32, "growth_tracker": torch.int32,
                 "hysteresis_tracker": torch.int32, "skipped_steps": torch.int64,
                 "updates": torch.int64}


def _positive_finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class _Policy:
    """The validated, immutable scaling policy."""

    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    min_scale: float | None
    max_scale: float | None
    dynamic: bool

    @classmethod
    def build(cls, **kw: Any) -> _Policy:
        init, growth, backoff = (_positive_finite(name, kw[name])
                                 for name in ("init_scale", "growth_factor", "backoff_factor"))
        if growth <= 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth!r}")
        if backoff >= 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff!r}")
        for name in ("growth_interval", "hysteresis"):
            if isinstance(kw[name], bool) or not isinstance(kw[name], int) or kw[name] < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {kw[name]!r}")
        lo, hi = (None if kw[name] is None else _positive_finite(name, kw[name])
                  for name in ("min_scale", "max_scale"))
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"min_scale ({lo!r}) must not exceed max_scale ({hi!r})")
        if (lo is not None and init < lo) or (hi is not None and init > hi):
            raise ValueError(f"init_scale {init!r} lies outside [min_scale, max_scale]")
        return cls(init, growth, backoff, kw["growth_interval"], kw["hysteresis"], lo, hi,
                   bool(kw["dynamic"]))

    @property
    def check_only(self) -> bool:
        """Static scale 1: nothing to multiply or divide, only the Inf/NaN check remains."""
        return not self.dynamic and self.init_scale == 1.0


@functools.lru_cache(maxsize=None)
def _takes_grad_scaler(step: Callable) -> bool:
    """Whether an optimizer's step takes ``grad_scaler=`` (the deprecated protocol); asked of
    the class's function once, not of every step."""
    return "grad_scaler" in inspect.signature(step).parameters


class LossScaler:
    """Dynamic loss scaler with device-resident state; a drop-in for ``torch.amp.GradScaler``.

    Args:
        device: where the state tensors live; ``None`` (default) puts them on the device of the
            first scaled loss (or, in check-only mode, of the first gradients).
        init_scale: initial scale (2**16). Must be positive and finite.
        growth_factor: multiplier after ``growth_interval`` consecutive clean steps (2.0).
        backoff_factor: multiplier on overflow (0.5).
        growth_interval: consecutive clean steps before growing (2000).
        enabled: ``False`` makes every method a pass-through, as in ``GradScaler``.
        hysteresis: back off only after this many consecutive overflowing steps (1 = every
            overflow, as ``GradScaler``). Overflowing steps are skipped either way.
        min_scale, max_scale: clamp the scale after each update (``None`` = unbounded).
        dynamic: ``False`` keeps the scale at ``init_scale`` for ever (static loss scaling);
            non-finite steps are still skipped. ``dynamic=False, init_scale=1.0`` is the
            check-only mode used for bf16: no multiplication at all, only skipping.
        process_group, distributed: agreement on overflow across ranks (see
            ``_grads.agree_across_ranks``); by default on whenever torch.distributed runs with
            more than one rank.
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        dynamic: bool = True,
        process_group: dist.ProcessGroup | None = None,
        distributed: bool | None = None,
    ) -> None:
        self._policy = _Policy.build(
            init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
            growth_interval=growth_interval, hysteresis=hysteresis, min_scale=min_scale,
            max_scale=max_scale, dynamic=dynamic)
        self._enabled = bool(enabled)
        self._device = None if device is None else torch.device(device)
        self._process_group = process_group
        self._distributed = distributed
        self._records: dict[int, _OptimizerRecord] = {}
        self._state: dict[str, torch.Tensor] | None = None
        # Values for the lazily created state tensors (set by load_state_dict before first use).
        self._pending = {"scale": self._policy.init_scale, "growth_tracker": 0,
                         "hysteresis_tracker": hysteresis, "skipped_steps": 0, "updates": 0}

    # ----------------------------------------------------------------------------- state

    def _ensure_state(self, device: torch.device) -> dict[str, torch.Tensor]:
        if self._state is None:
            where = device if self._device is None else self._device
            self._state = {key: torch.full((), self._pending[key], dtype=dtype, device=where)
                           for key, dtype in _STATE_DTYPES.items()}
        return self._state

    def _record(self, optimizer: torch.optim.Optimizer) -> _OptimizerRecord:
        return self._records.setdefault(id(optimizer), _OptimizerRecord())

    # ------------------------------------------------------------------------ scale

    def scale(self, outputs: T) -> T:
        """Multiply a tensor (or nested list/tuple of tensors) by the current scale."""
        if not self._enabled or self._policy.check_only:
            return outputs
        if isinstance(outputs, torch.Tensor):
            scale = self._ensure_state(outputs.device)["scale"]
            return outputs * scale.to(outputs.device, non_blocking=True)  # type: ignore[return-value]
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)  # type: ignore[return-value]
        if isinstance(outputs, Iterable):
            return map(self.scale, outputs)  # type: ignore[return-value]
        raise TypeError(f"scale() expects a tensor or an iterable of tensors, got "
                        f"{type(outputs).__name__}")

    # ---------------------------------------------------------------------- unscale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and check them for Inf/NaN.

        Once per optimizer between ``update()`` calls; no host synchronisation.
        """
        if self._enabled:
            self._unscale(optimizer, "unscale_()")

    def _unscale(self, optimizer: torch.optim.Optimizer, caller: str) -> None:
        record = self._record(optimizer)
        if record.stage is _Stage.UNSCALED:
            raise TrainingError(
                "unscale_() was already called for this optimizer since the last update(); "
                "a second call would divide the gradients by the scale twice")
        if record.stage is _Stage.STEPPED:
            raise TrainingError("unscale_() called after step() for this optimizer; "
                                "call update() first")
        record.found_inf = self._check(optimizer, unscale=True, caller=caller)
        record.stage = _Stage.UNSCALED

    def _home_device(self, optimizer: torch.optim.Optimizer, caller: str) -> torch.device:
        if self._state is not None:
            return self._state["scale"].device
        if self._policy.check_only:
            for param in optimizer_params(optimizer):
                if param.grad is not None:
                    return param.grad.device if self._device is None else self._device
        raise TrainingError(f"{caller} before scale(): the gradients did not come from a loss "
                            "scaled by this scaler; call backward() on scaler.scale(loss) first")

    def _check(self, optimizer: torch.optim.Optimizer, *, unscale: bool,
               caller: str) -> torch.Tensor:
        """Inf/NaN check (and unscale when asked), agreed across ranks; returns the flag."""
        state = self._ensure_state(self._home_device(optimizer, caller))
        if unscale and not self._policy.check_only:
            # Reciprocal in float64 as GradScaler does: float32 division may be inexact.
            inv_scale = state["scale"].double().reciprocal().float()
        else:
            inv_scale = torch.ones((), dtype=torch.float32, device=state["scale"].device)
        found_inf = check_and_unscale(optimizer, inv_scale,
                                      allow_fp16=not unscale or self._policy.check_only,
                                      caller=caller)
        agree_across_ranks(found_inf, self._process_group, self._distributed)
        return found_inf

    # ------------------------------------------------------------------------- step

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless already done), then ``optimizer.step()`` unless Inf/NaN was found.

        Returns what ``optimizer.step`` returned (``None`` when skipped), like ``GradScaler``.
        """
        return self._step(optimizer, args, kwargs)[0]

    def _step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> tuple[Any, torch.Tensor | None, bool | None]:
        """Returns (optimizer.step's result, found-Inf flag, stepped) — ``stepped`` is None
        when the optimizer decided on the device (fused path, no host read)."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs), None, True
        if "closure" in kwargs:
            raise TrainingError("step(closure=...) is not supported with loss scaling: the "
                                "closure's backward would produce unscaled gradients")
        record = self._record(optimizer)
        if record.stage is _Stage.STEPPED:
            raise TrainingError("step() was already called for this optimizer since the last "
                                "update()")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_step(optimizer, record, args, kwargs)
        if record.stage is _Stage.READY:
            self._unscale(optimizer, "step()")
        assert record.found_inf is not None
        stepped = not record.found_inf.item()  # the one host read of a step
        result = optimizer.step(*args, **kwargs) if stepped else None
        record.stage = _Stage.STEPPED
        return result, record.found_inf, stepped

    def _fused_step(self, optimizer: torch.optim.Optimizer, record: _OptimizerRecord,
                    args: tuple[Any, ...], kwargs: dict[str, Any]
                    ) -> tuple[Any, torch.Tensor | None, bool | None]:
        """Hand ``grad_scale``/``found_inf`` to an optimizer that unscales and skips itself."""
        if _takes_grad_scaler(getattr(optimizer.step, "__func__", optimizer.step)):
            raise TrainingError("optimizers taking a grad_scaler= argument (the deprecated "
                                "GradScaler protocol) are not supported; use one that reads "
                                "optimizer.grad_scale/found_inf, such as Adam(fused=True)")
        if record.stage is _Stage.READY:
            record.found_inf = self._check(optimizer, unscale=False, caller="step()")
            if not self._policy.check_only:
                assert self._state is not None
                optimizer.grad_scale = (  # type: ignore[attr-defined]
                    self._state["scale"] * getattr(optimizer, "grad_scale", 1))
        optimizer.found_inf = record.found_inf  # type: ignore[attr-defined]
        try:
            result = optimizer.step(*args, **kwargs)
        finally:
            for name in ("grad_scale", "found_inf"):
                if hasattr(optimizer, name):
                    delattr(optimizer, name)
        record.stage = _Stage.STEPPED
        return result, record.found_inf, None

    # ----------------------------------------------------------------------- update

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Adjust the scale from this iteration's Inf/NaN flags (no host synchronisation).

        ``new_scale`` sets the scale explicitly instead, as in ``GradScaler``.
        """
        if not self._enabled:
            return
        if new_scale is not None:
            self._set_scale(new_scale)
        else:
            flags = [r.found_inf for r in self._records.values() if r.found_inf is not None]
            if not flags:
                raise TrainingError("update() called but no optimizer was stepped or unscaled "
                                    "since the last update(); call step(optimizer) first")
            found_inf = flags[0] if len(flags) == 1 else torch.stack(flags).sum()
            self._apply_update(found_inf)
        self._records.clear()

    def _set_scale(self, new_scale: float | torch.Tensor) -> None:
        if isinstance(new_scale, torch.Tensor):
            if new_scale.numel() != 1 or new_scale.requires_grad:
                raise ValueError("new_scale must be a one-element tensor without grad")
            self._ensure_state(new_scale.device)["scale"].copy_(new_scale.reshape(()))
        elif self._state is None:
            self._pending["scale"] = _positive_finite("new_scale", new_scale)
        else:
            self._state["scale"].fill_(_positive_finite("new_scale", new_scale))

    def _apply_update(self, found_inf: torch.Tensor) -> None:
        state, p = self._state, self._policy
        assert state is not None
        overflow = found_inf > 0
        state["skipped_steps"].add_(overflow)
        state["updates"].add_(1)
        if not p.dynamic:
            return
        scale, tracker = state["scale"], state["growth_tracker"]
        before = scale.clone() if p.hysteresis > 1 else None
        # GradScaler's own kernel: identical arithmetic (float64 factor products, finite check).
        torch._amp_update_scale_(scale, tracker, found_inf, p.growth_factor, p.backoff_factor,
                                 p.growth_interval)
        if before is not None:
            hyst = state["hysteresis_tracker"]
            hyst.copy_(torch.where(overflow, (hyst - 1).clamp_(min=0), p.hysteresis))
            # An overflow inside the hysteresis budget skips the step but keeps the scale.
            scale.copy_(torch.where(overflow & (hyst > 0), before, scale))
        if p.min_scale is not None or p.max_scale is not None:
            scale.clamp_(min=p.min_scale, max=p.max_scale)

    # --------------------------------------------------------------------- inspect

    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def dynamic(self) -> bool:
        return self._policy.dynamic

    @property
    def scaling(self) -> bool:
        """True when losses are actually multiplied (enabled, and not check-only mode)."""
        return self._enabled and not self._policy.check_only

    def _value(self, key: str) -> float | int:
        if self._state is None:
            return self._pending[key]
        return self._state[key].item()

    def get_scale(self) -> float:
        """The current scale as a Python float (a host synchronisation); 1.0 when disabled."""
        if not self._enabled:
            return 1.0
        return float(self._value("scale"))

    def scale_tensor(self) -> torch.Tensor | None:
        """The device-resident scale (no synchronisation); None before first use."""
        return None if self._state is None else self._state["scale"]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """All device-resident state (scale, trackers, counters); empty before first use."""
        return {} if self._state is None else dict(self._state)

    def counters(self) -> dict[str, float | int]:
        """scale, skipped_steps, updates, growth_tracker as Python numbers (one host read)."""
        if not self._enabled:
            return {"scale": 1.0, "skipped_steps": 0, "updates": 0, "growth_tracker": 0}
        keys = ("scale", "skipped_steps", "updates", "growth_tracker")
        if self._state is None:
            return {k: self._pending[k] for k in keys}
        values = torch.stack([self._state[k].double() for k in keys]).tolist()
        return {k: (v if k == "scale" else int(v)) for k, v in zip(keys, values)}

    @property
    def skipped_steps(self) -> int:
        """Number of updates that found Inf/NaN (host read)."""
        return int(self._value("skipped_steps")) if self._enabled else 0

    # -------------------------------------------------------------------- persist

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``) plus this scaler's extras. Empty when
        disabled. Call after ``update()``."""
        if not self._enabled:
            return {}
        p = self._policy
        return {
            "scale": self.get_scale(), "growth_factor": p.growth_factor,
            "backoff_factor": p.backoff_factor, "growth_interval": p.growth_interval,
            "_growth_tracker": int(self._value("growth_tracker")),
            "hysteresis": p.hysteresis,
            "_hysteresis_tracker": int(self._value("hysteresis_tracker")),
            "min_scale": p.min_scale, "max_scale": p.max_scale, "dynamic": p.dynamic,
            "skipped_steps": int(self._value("skipped_steps")),
            "updates": int(self._value("updates")),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from ``state_dict()`` — or from a ``GradScaler`` state dict, whose missing
        extras keep this scaler's configuration."""
        if not self._enabled:
            return
        if not state_dict:
            raise TrainingError("the scaler state dict is empty: it was saved from a disabled "
                                "scaler")
        p = self._policy
        self._policy = _Policy.build(
            init_scale=state_dict["scale"], growth_factor=state_dict["growth_factor"],
            backoff_factor=state_dict["backoff_factor"],
            growth_interval=state_dict["growth_interval"],
            hysteresis=state_dict.get("hysteresis", p.hysteresis),
            min_scale=state_dict.get("min_scale", p.min_scale),
            max_scale=state_dict.get("max_scale", p.max_scale),
            dynamic=state_dict.get("dynamic", p.dynamic))
        self._pending = {
            "scale": self._policy.init_scale,
            "growth_tracker": int(state_dict["_growth_tracker"]),
            "hysteresis_tracker": int(state_dict.get("_hysteresis_tracker",
                                                     self._policy.hysteresis)),
            "skipped_steps": int(state_dict.get("skipped_steps", 0)),
            "updates": int(state_dict.get("updates", 0)),
        }
        if self._state is not None:
            for key, value in self._pending.items():
                self._state[key].fill_(value)
        self._records.clear()

    def _forget(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop this iteration's record of ``optimizer`` (its gradients were discarded)."""
        self._records.pop(id(optimizer), None)
