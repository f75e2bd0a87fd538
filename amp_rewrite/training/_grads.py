"""Gradient bookkeeping shared by the scaler and the optimizer wrapper.

Everything here stays on the device: the Inf/NaN check and the unscale run in torch's own
``_amp_foreach_non_finite_check_and_unscale_`` kernel (the one ``GradScaler`` uses, hence
bit-identical results), and the found-Inf flag is a 0-dim tensor that is never read on the host.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from amp_rewrite.errors import TrainingError


def optimizer_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every parameter of every group, in the optimizer's order."""
    for group in optimizer.param_groups:
        yield from group["params"]


def _sparse_grad_values(param: torch.Tensor) -> torch.Tensor:
    """The values of a sparse grad, to check/unscale in place."""
    grad = param.grad
    if grad.dtype == torch.float16:
        # Duplicate indices are summed by coalesce(); check the sums, which may overflow.
        param.grad = grad = grad.coalesce()
    return grad._values()


def _group_grads(
    optimizer: torch.optim.Optimizer, *, allow_fp16: bool
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    # Grouped by torch's own C++ helper (the one its optimizers use): a Python loop keyed on
    # each gradient's device and dtype is host time on every step.
    grads = [_sparse_grad_values(p) if g.is_sparse else g
             for p in optimizer_params(optimizer) if (g := p.grad) is not None]
    if not grads:
        return {}
    groups = _group_tensors_by_device_and_dtype([grads])
    if not allow_fp16 and any(dtype == torch.float16 for _, dtype in groups):
        _refuse_fp16_grads(optimizer)
    return {key: tensors for key, ((tensors,), _) in groups.items()}


def _refuse_fp16_grads(optimizer: torch.optim.Optimizer) -> None:
    for index, param in enumerate(optimizer_params(optimizer)):
        if param.grad is not None and param.grad.dtype == torch.float16:
            raise TrainingError(
                f"parameter {index} of the optimizer (shape {tuple(param.shape)}) has a float16 "
                "gradient: unscaling it in place would flush small gradients to zero; keep "
                "parameters in float32 or use AmpOptimizer(..., master_weights=True)"
            )


def check_and_unscale(
    optimizer: torch.optim.Optimizer,
    inv_scale: torch.Tensor,
    *,
    allow_fp16: bool,
    caller: str,
) -> torch.Tensor:
    """Multiply all gradients by ``inv_scale`` in place; return a 0-dim found-Inf flag.

    The flag (float32, on ``inv_scale``'s device) is > 0 iff some gradient holds Inf or NaN.
    Raises ``TrainingError`` when no parameter has a gradient (no backward ran).
    """
    groups = _group_grads(optimizer, allow_fp16=allow_fp16)
    if not groups:
        raise TrainingError(
            f"{caller}: none of the optimizer's parameters has a gradient; "
            "call backward() on the scaled loss first"
        )
    home = inv_scale.device
    found_inf = torch.zeros((), dtype=torch.float32, device=home)
    per_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        for (device, _), grads in groups.items():
            if device not in per_device:
                flag = found_inf if device == home else torch.zeros_like(found_inf, device=device)
                per_device[device] = (flag, inv_scale.to(device, non_blocking=True))
            flag, inv = per_device[device]
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv)
        for device, (flag, _) in per_device.items():
            if device != home:
                found_inf.add_(flag.to(home, non_blocking=True))
    return found_inf


def agree_across_ranks(
    found_inf: torch.Tensor, group: dist.ProcessGroup | None, mode: bool | None
) -> None:
    """All-reduce (MAX) the found-Inf flag in place so every rank skips the same steps.

    ``mode``: None = when a process group of more than one rank is initialised; True = always
    (error if torch.distributed is not initialised); False = never. The all-reduce is a
    collective on the device stream, not a host synchronisation.
    """
    if mode is False:
        return
    if not (dist.is_available() and dist.is_initialized()):
        if mode:
            raise TrainingError(
                "LossScaler(distributed=True) but torch.distributed is not initialised; "
                "call torch.distributed.init_process_group() first"
            )
        return
    if mode is None and dist.get_world_size(group) < 2:
        return
    dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
