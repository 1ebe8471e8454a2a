"""LARS against its formula, written out by hand."""

from __future__ import annotations

import torch

from contrastive_accelerate.optim import LARS


def test_step_matches_the_formula():
    weight = torch.nn.Parameter(torch.tensor([[3.0, 4.0]]))  # ||w|| = 5
    bias = torch.nn.Parameter(torch.tensor([1.0]))
    optimizer = LARS(
        [weight, bias], lr=0.1, momentum=0.9, weight_decay=0.01, trust_coefficient=0.002
    )
    weight.grad = torch.tensor([[0.0, 1.0]])
    bias.grad = torch.tensor([0.5])
    w0 = weight.detach().clone()
    optimizer.step()
    grad = torch.tensor([[0.0, 1.0]]) + 0.01 * w0
    trust = 0.002 * w0.norm() / grad.norm()
    assert torch.allclose(weight, w0 - 0.1 * trust * grad)
    # Biases (ndim 1): no weight decay, no adaptation.
    assert torch.allclose(bias, torch.tensor([1.0 - 0.1 * 0.5]))

    weight.grad = torch.tensor([[0.0, 1.0]])
    bias.grad = torch.tensor([0.5])
    w1 = weight.detach().clone()
    optimizer.step()
    grad1 = torch.tensor([[0.0, 1.0]]) + 0.01 * w1
    velocity = 0.9 * trust * grad + 0.002 * w1.norm() / grad1.norm() * grad1
    assert torch.allclose(weight, w1 - 0.1 * velocity)


def test_zero_weight_uses_unit_trust():
    weight = torch.nn.Parameter(torch.zeros(2, 2))
    weight.grad = torch.ones(2, 2)
    LARS([weight], lr=1.0, momentum=0.0).step()
    assert torch.allclose(weight, -torch.ones(2, 2))
