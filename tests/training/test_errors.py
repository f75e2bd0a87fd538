"""Bad input: exception type and message."""
from __future__ import annotations

import math

import pytest
import torch

from amp_rewrite.errors import AmpRewriteError, TrainingError
from amp_rewrite.training import AmpOptimizer, LossScaler


def _model_opt(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Linear, torch.optim.SGD]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(dtype)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _loss(model: torch.nn.Linear) -> torch.Tensor:
    w = model.weight
    return model(torch.ones(4, 3, dtype=w.dtype)).float().square().mean()


def test_training_error_is_a_runtime_error() -> None:
    assert issubclass(TrainingError, AmpRewriteError) and issubclass(TrainingError, RuntimeError)


# ------------------------------------------------------------------- unscaling twice

def test_scaler_unscale_twice() -> None:
    model, opt = _model_opt()
    scaler = LossScaler()
    scaler.scale(_loss(model)).backward()
    scaler.unscale_(opt)
    with pytest.raises(TrainingError, match=r"unscale_\(\) was already called for this "
                                            r"optimizer.*divide the gradients by the scale twice"):
        scaler.unscale_(opt)


def test_wrapper_unscale_twice() -> None:
    model, opt = _model_opt()
    amp = AmpOptimizer(opt)
    amp.backward(_loss(model))
    amp.unscale_()
    with pytest.raises(TrainingError, match=r"unscale_\(\) was already called in this step"):
        amp.unscale_()
    amp.clip_grad_norm_(1.0)  # clipping after an explicit unscale_ does not unscale again
    assert amp.step()


def test_unscale_after_step() -> None:
    model, opt = _model_opt()
    scaler = LossScaler()
    scaler.scale(_loss(model)).backward()
    scaler.step(opt)
    with pytest.raises(TrainingError, match=r"unscale_\(\) called after step\(\)"):
        scaler.unscale_(opt)
    with pytest.raises(TrainingError, match=r"step\(\) was already called"):
        scaler.step(opt)


def test_backward_after_unscale() -> None:
    model, opt = _model_opt()
    amp = AmpOptimizer(opt, accumulation_steps=2)
    amp.backward(_loss(model))
    amp.clip_grad_norm_(1.0)
    with pytest.raises(TrainingError, match=r"backward\(\) after the gradients of this step "
                                            r"were unscaled"):
        amp.backward(_loss(model))
    amp.zero_grad()  # discarding the step makes the wrapper usable again
    amp.backward(_loss(model))
    amp.backward(_loss(model))
    assert amp.step()


# ------------------------------------------------------------- step without backward

def test_scaler_step_without_backward() -> None:
    model, opt = _model_opt()
    scaler = LossScaler()
    scaler.scale(_loss(model))  # scaled, but no backward
    with pytest.raises(TrainingError, match=r"step\(\): none of the optimizer's parameters "
                                            r"has a gradient; call backward\(\)"):
        scaler.step(opt)


def test_scaler_unscale_before_scale() -> None:
    model, opt = _model_opt()
    _loss(model).backward()
    with pytest.raises(TrainingError, match=r"unscale_\(\) before scale\(\)"):
        LossScaler().unscale_(opt)


def test_wrapper_step_without_backward() -> None:
    model, opt = _model_opt()
    amp = AmpOptimizer(opt)
    _loss(model).backward()  # unscaled gradients: the wrapper must not divide them by 2**16
    with pytest.raises(TrainingError, match=r"step\(\) called without backward\(\) since the "
                                            r"last step.*not loss.backward\(\)"):
        amp.step()


def test_update_without_step() -> None:
    scaler = LossScaler()
    scaler.scale(torch.ones(()))
    with pytest.raises(TrainingError, match=r"update\(\) called but no optimizer was stepped"):
        scaler.update()


# ------------------------------------------------------- fp16 gradients, FP32 mode

def test_wrapper_refuses_fp16_parameters_without_master_weights() -> None:
    _, opt = _model_opt(torch.float16)
    with pytest.raises(TrainingError, match=r"parameter 0 \(shape \(2, 3\)\) is stored in "
                                            r"float16.*master_weights=True"):
        AmpOptimizer(opt)


def test_scaler_refuses_to_unscale_fp16_gradients() -> None:
    model, opt = _model_opt(torch.float16)
    scaler = LossScaler()
    scaler.scale(_loss(model)).backward()
    with pytest.raises(TrainingError, match=r"parameter 0 of the optimizer \(shape \(2, 3\)\) "
                                            r"has a float16 gradient"):
        scaler.step(opt)


def test_master_weights_needs_a_fresh_optimizer() -> None:
    model, opt = _model_opt(torch.float16)
    opt.state[model.weight]["momentum_buffer"] = torch.zeros_like(model.weight)
    with pytest.raises(TrainingError, match=r"needs a fresh optimizer"):
        AmpOptimizer(opt, master_weights=True)
    with pytest.raises(TrainingError, match=r"no parameter of the optimizer is float16"):
        AmpOptimizer(_model_opt()[1], master_weights=True)


# ------------------------------------------------------------ configuration values

@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan, -math.inf])
def test_init_scale_must_be_positive_finite(value: float) -> None:
    with pytest.raises(ValueError, match=r"init_scale must be a positive finite number, got"):
        LossScaler(init_scale=value)


def test_init_scale_must_be_a_number() -> None:
    with pytest.raises(TypeError, match=r"init_scale must be a number, got str"):
        LossScaler(init_scale="65536")  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"growth_factor": 1.0}, r"growth_factor must be > 1"),
    ({"backoff_factor": 1.0}, r"backoff_factor must be in \(0, 1\)"),
    ({"backoff_factor": 0.0}, r"backoff_factor must be a positive finite number"),
    ({"growth_interval": 0}, r"growth_interval must be an integer >= 1"),
    ({"hysteresis": 0}, r"hysteresis must be an integer >= 1"),
    ({"min_scale": 8.0, "max_scale": 4.0}, r"min_scale \(8.0\) must not exceed max_scale"),
    ({"max_scale": 1024.0}, r"init_scale 65536.0 lies outside \[min_scale, max_scale\]"),
    ({"min_scale": -1.0}, r"min_scale must be a positive finite number"),
])
def test_bad_scaler_options(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LossScaler(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"accumulation_steps": 0}, r"accumulation_steps must be an integer >= 1, got 0"),
    ({"dtype": torch.int8}, r"dtype=torch.int8: expected a low-precision dtype"),
    ({"dtype": torch.float32}, r"dtype=torch.float32: expected a low-precision dtype"),
    ({"dtype": "fp8"}, r"dtype='fp8': expected one of torch.float16"),
])
def test_bad_wrapper_options(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AmpOptimizer(_model_opt()[1], **kwargs)


def test_bad_new_scale() -> None:
    scaler = LossScaler()
    with pytest.raises(ValueError, match=r"new_scale must be a positive finite number"):
        scaler.update(-2.0)


# ------------------------------------------------------------------- other misuse

def test_closure_is_refused() -> None:
    model, opt = _model_opt()
    scaler = LossScaler()
    scaler.scale(_loss(model)).backward()
    with pytest.raises(TrainingError, match=r"step\(closure=...\) is not supported"):
        scaler.step(opt, closure=lambda: _loss(model))


def test_state_dict_mid_accumulation() -> None:
    model, opt = _model_opt()
    amp = AmpOptimizer(opt, accumulation_steps=2)
    amp.backward(_loss(model))
    with pytest.raises(TrainingError, match=r"state_dict\(\) in the middle of gradient "
                                            r"accumulation"):
        amp.state_dict()


def test_load_empty_scaler_state() -> None:
    with pytest.raises(TrainingError, match=r"saved from a disabled scaler"):
        LossScaler().load_state_dict({})


def test_distributed_required_but_not_initialised() -> None:
    model, opt = _model_opt()
    scaler = LossScaler(distributed=True)
    scaler.scale(_loss(model)).backward()
    with pytest.raises(TrainingError, match=r"torch.distributed is not initialised"):
        scaler.unscale_(opt)
