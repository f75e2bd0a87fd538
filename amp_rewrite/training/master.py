"""FP32 master copies of low-precision parameters (the apex "O2" scheme).

For modules whose parameters are stored in float16/bfloat16: the optimizer is re-pointed at
float32 copies, every backward's low-precision gradients are moved into float32 master
gradients (so accumulation over micro-batches happens in float32), the optimizer updates the
masters, and the masters are copied back (rounded) into the module's parameters.
"""
from __future__ import annotations

import torch

from amp_rewrite.errors import TrainingError

_LOW = (torch.float16, torch.bfloat16)


class MasterWeights:
    """Pairs (model parameter, float32 master) for an optimizer's low-precision parameters."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer.state:
            raise TrainingError(
                "master_weights=True needs a fresh optimizer: its state already refers to the "
                "low-precision parameters; build the wrapper before the first step")
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for group in optimizer.param_groups:
            group["params"] = [self._master_for(p) for p in group["params"]]
        if not self.pairs:
            raise TrainingError("master_weights=True but no parameter of the optimizer is "
                                "float16 or bfloat16")

    def _master_for(self, param: torch.Tensor) -> torch.Tensor:
        if param.dtype not in _LOW:
            return param
        master = torch.nn.Parameter(param.detach().to(torch.float32),
                                    requires_grad=param.requires_grad)
        self.pairs.append((param, master))
        return master

    @torch.no_grad()
    def gather_grads(self) -> None:
        """Move the model's low-precision gradients into the float32 master gradients."""
        for param, master in self.pairs:
            if param.grad is None:
                continue
            if master.grad is None:
                master.grad = param.grad.to(torch.float32)
            else:
                master.grad.add_(param.grad)
            param.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the updated masters into the model's parameters."""
        torch._foreach_copy_([p for p, _ in self.pairs], self.masters())

    @torch.no_grad()
    def load(self, masters: list[torch.Tensor]) -> None:
        if len(masters) != len(self.pairs):
            raise TrainingError(f"state dict holds {len(masters)} master parameters, this "
                                f"wrapper has {len(self.pairs)}")
        for (_, master), saved in zip(self.pairs, masters):
            if saved.shape != master.shape:
                raise TrainingError(f"master parameter shape {tuple(saved.shape)} does not "
                                    f"match {tuple(master.shape)}")
            master.copy_(saved)
        self.copy_to_model()

    def zero_model_grads(self) -> None:
        for param, _ in self.pairs:
            param.grad = None

    def masters(self) -> list[torch.Tensor]:
        return [m for _, m in self.pairs]
