"""The differentiable gather against single-process autograd on the concatenated tensor.

Every rank applies a *different* downstream function to the gathered tensor: with
the same function everywhere, a backward that returns only the local slice can
still look right up to a factor, which is how this bug has slipped through elsewhere.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist

from contrastive_accelerate.collectives import gather
from contrastive_accelerate.testing import run_on_ranks

from loss_cases import local_slice_gather, no_grad_gather, slice_then_all_reduce_gather

FEATURES = (3, 2)  # trailing shape: more than one trailing dim on purpose
EXACT = 1e-10  # float64: the gather moves values, so only summation order differs


def _full_input(sizes: list[int], dtype=torch.float64) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(sum(sizes), *FEATURES, generator=generator, dtype=torch.float64).to(dtype)


def _downstream(rank: int, gathered: torch.Tensor) -> torch.Tensor:
    """A different nonlinear function of the whole gathered tensor on every rank."""
    generator = torch.Generator().manual_seed(100 + rank)
    projection = torch.randn(FEATURES[-1], 4, generator=generator, dtype=gathered.dtype)
    row_weights = torch.randn(gathered.shape[0], 1, 1, generator=generator, dtype=gathered.dtype)
    return (torch.tanh(gathered @ projection) ** 2 * row_weights).sum() * (rank + 1)


GATHERS = {
    "correct": gather,
    **{
        backward: partial(gather, backward=backward)
        for backward in ("reduce_scatter", "all_to_all", "all_reduce")
    },
    "local_slice": local_slice_gather,
    "slice_all_reduce": slice_then_all_reduce_gather,
    "no_grad": no_grad_gather,
}


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def gather_worker(rank: int, world_size: int, sizes: list[int]) -> dict:
    full = _full_input(sizes)
    rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))

    reference_input = full.clone().requires_grad_()
    reference_total = sum(_downstream(r, reference_input) for r in range(world_size))
    (reference_grad,) = torch.autograd.grad(reference_total, reference_input)

    result = {}
    for name, layer in GATHERS.items():
        local = full[rows].clone().requires_grad_()
        # Column-major copy: the gather must handle non-contiguous input.
        non_contiguous = local.transpose(0, 2).contiguous().transpose(0, 2)
        if name == "correct":
            gathered = gather(non_contiguous)
            result["forward_error"] = _max_abs(gathered.detach(), full)
        else:
            gathered = layer(non_contiguous, sizes=sizes)
        output = _downstream(rank, gathered)
        if output.requires_grad:  # not through a gather without gradient
            output.backward()
        grad = local.grad if local.grad is not None else torch.zeros_like(local)
        result[name] = _max_abs(grad, reference_grad[rows])

    # Other floating dtypes: forward is a copy, so it must be bit-exact.
    for dtype in (torch.float32, torch.bfloat16):
        local = full[rows].to(dtype)
        result[f"forward_error_{dtype}"] = _max_abs(gather(local).double(), full.to(dtype).double())

    try:
        gather(torch.zeros(sizes[rank], rank + 1))  # trailing dims differ across ranks
        result["mismatch_error"] = None
    except ValueError as error:
        result["mismatch_error"] = str(error)
    dist.barrier()  # the group is still usable: nobody is stuck in a collective
    return result


CASES = [
    pytest.param((2, [4, 4]), id="W2-even"),
    pytest.param((2, [3, 5]), id="W2-uneven"),
    pytest.param((3, [2, 0, 4]), id="W3-uneven-empty-rank"),
    pytest.param((3, [3, 3, 3]), id="W3-even"),
]


@pytest.fixture(scope="module", params=CASES)
def gather_results(request):
    world_size, sizes = request.param
    return sizes, run_on_ranks(gather_worker, world_size, sizes)


def test_forward_is_concatenation_in_rank_order(gather_results):
    _, results = gather_results
    for result in results:
        assert result["forward_error"] == 0.0
        assert result["forward_error_torch.float32"] == 0.0
        assert result["forward_error_torch.bfloat16"] == 0.0


@pytest.mark.parametrize("collective", ["correct", "reduce_scatter", "all_to_all", "all_reduce"])
def test_backward_equals_single_process_autograd(gather_results, collective):
    _, results = gather_results
    worst = max(result[collective] for result in results)
    print(f"{collective}: max |grad - reference| = {worst:.3e}")
    assert worst <= EXACT


@pytest.mark.parametrize("bad_gather", ["local_slice", "slice_all_reduce", "no_grad"])
def test_known_bad_backward_breaks_the_equivalence(gather_results, bad_gather):
    _, results = gather_results
    worst = max(result[bad_gather] for result in results)
    print(f"{bad_gather}: max |grad - reference| = {worst:.3e}")
    assert worst > 1e3 * EXACT


def test_trailing_shape_mismatch_raises_on_every_rank(gather_results):
    _, results = gather_results
    for result in results:
        assert result["mismatch_error"] and "disagree on trailing shape" in result["mismatch_error"]


def test_identity_without_process_group():
    x = torch.randn(3, 2, requires_grad=True)
    assert not dist.is_initialized()
    assert gather(x) is x
