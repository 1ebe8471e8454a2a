"""LARS: layer-wise adaptive rate scaling (You et al., 2017), as used by SimCLR."""

from __future__ import annotations

import torch


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
