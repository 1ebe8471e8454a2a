"""Optimizers and the learning-rate schedule: SGD, AdamW, LARS, warm-up then cosine."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

OPTIMIZERS = ("sgd", "adamw", "lars")


def make_optimizer(
    name: str, params, *, lr: float, momentum: float, weight_decay: float
) -> torch.optim.Optimizer:
    """One of ``OPTIMIZERS`` over ``params`` (AdamW ignores ``momentum``)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "lars":
        return LARS(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


def warmup_cosine(peak: float, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The learning rate of step ``s`` (0-based): linear warm-up, then cosine to zero.
    A function of the step alone, so a checkpoint needs no scheduler state."""
    warmup_steps = min(warmup_steps, total_steps)

    def learning_rate(step: int) -> float:
        if step < warmup_steps:
            return peak * (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return peak * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return learning_rate


class LARS(torch.optim.Optimizer):
    """SGD with momentum whose step for each weight matrix is scaled by its trust ratio.

    For a parameter ``w`` with gradient ``g`` (weight decay folded in)::

        trust = trust_coefficient * ||w|| / ||g||      (1 when either norm is 0)
        v = momentum * v + trust * g
        w = w - lr * v

    As in SimCLR, biases and normalisation parameters (``ndim <= 1``) get neither
    weight decay nor adaptation: their trust ratio is 1.
    """

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
    ) -> None:
        if lr <= 0 or not 0 <= momentum < 1 or weight_decay < 0 or trust_coefficient <= 0:
            raise ValueError(
                "LARS: need lr > 0, 0 <= momentum < 1, weight_decay >= 0, trust_coefficient > 0"
            )
        defaults = dict(
            lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                if param.ndim > 1:
                    grad = grad.add(param, alpha=group["weight_decay"])
                    param_norm, grad_norm = param.norm(), grad.norm()
                    trust = torch.where(
                        (param_norm > 0) & (grad_norm > 0),
                        group["trust_coefficient"] * param_norm / grad_norm,
                        torch.ones_like(param_norm),
                    )
                    grad = grad.mul(trust)
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param)
                velocity = state["momentum_buffer"]
                velocity.mul_(group["momentum"]).add_(grad)
                param.sub_(velocity, alpha=group["lr"])
        return loss
