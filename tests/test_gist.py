"""GISTEmbed (``losses.GISTEmbedLoss``): in-batch negatives vetted by a frozen guide.

- On one process: sentence-transformers' own ``GISTEmbedLoss`` on the same embeddings
  (its models stand-ins that return them), value and gradients, float64, for both margin
  strategies, with and without the anchors' and positives' own contrast.
- On every 2- and 3-rank split (uneven ones included): exact, values and gradients; the
  control, sentence-transformers' ``gather_across_devices=True`` on an even split, is
  not (it contrasts each device's anchors only among its own).
- A row whose every negative the guide leaves out keeps its positive; bf16 autocast.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from contrastive_accelerate.testing import assert_loss_invariant
from losses import GISTEmbedLoss

from launch import make_text_model

st_losses = pytest.importorskip("sentence_transformers.sentence_transformer.losses")
ROWS, WIDTH, GUIDE_WIDTH = 8, 6, 5
EXACT = 1e-12  # float64: the same sums, in another order


def columns_and_guides(rows: int = ROWS) -> tuple[torch.Tensor, ...]:
    """Anchors, positives and one negative column, then the guide's embeddings of the
    same three columns (another width): near-duplicates among the rows, so that the
    guide leaves some candidates out at margin 0 and more at 0.1."""
    generator = torch.Generator().manual_seed(11)

    def noisy(x: torch.Tensor, scale: float) -> torch.Tensor:
        return x + scale * torch.randn(x.shape, generator=generator, dtype=torch.float64)

    topics = torch.randn(3, WIDTH + GUIDE_WIDTH, generator=generator, dtype=torch.float64)
    anchors = noisy(topics[torch.arange(rows) % 3], 0.6)
    positives, negatives = noisy(anchors, 0.4), noisy(anchors, 0.9)
    trained = [x[:, :WIDTH].contiguous() for x in (anchors, positives, negatives)]
    guided = [noisy(x[:, WIDTH:], 0.1) for x in (anchors, positives, negatives)]
    return *trained, *guided


class GuidedLoss(torch.nn.Module):
    """A GIST loss as the kit calls one: the columns, then their guide's embeddings."""

    def __init__(self, **options) -> None:
        super().__init__()
        self.loss = GISTEmbedLoss(**options)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        half = len(inputs) // 2
        return self.loss(*inputs[:half], guides=inputs[half:])


class _Returns(torch.nn.Module):
    """A stand-in SentenceTransformer whose features are its embeddings (``key``)."""

    def __init__(self, tokenizer, key: str) -> None:
        super().__init__()
        self.tokenizer, self.key, self.max_seq_length = tokenizer, key, 16

    def forward(self, features: dict) -> dict:
        return {"sentence_embedding": features[self.key]}


class SentenceTransformersGIST(torch.nn.Module):
    """sentence-transformers' ``GISTEmbedLoss`` on given embeddings."""

    def __init__(self, tokenizer, gather_across_devices: bool = False, **options) -> None:
        super().__init__()
        model, guide = _Returns(tokenizer, "trained"), _Returns(tokenizer, "guided")
        self.peer = st_losses.GISTEmbedLoss(
            model, guide, gather_across_devices=gather_across_devices, **options
        )

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        half = len(inputs) // 2
        features = [{"trained": x, "guided": g} for x, g in zip(inputs[:half], inputs[half:],
                                                                 strict=True)]  # fmt: skip
        return self.peer(features, None)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(make_text_model(tmp_path_factory.mktemp("bert"))))


OPTIONS = [
    {},
    {"margin_strategy": "absolute", "margin": 0.1},
    {"margin_strategy": "relative", "margin": 0.05},
    {"contrast_anchors": False, "contrast_positives": False},
    {"contrast_anchors": False, "margin": 0.1},
    {"temperature": 0.05, "contrast_positives": False},
]


def _named(options: dict) -> str:
    return ",".join(f"{key}={value}" for key, value in options.items()) or "defaults"


@pytest.mark.parametrize("options", OPTIONS, ids=_named)
def test_one_process_is_sentence_transformers_gist(tokenizer, options):
    inputs = columns_and_guides()
    ours_inputs = [x.clone().requires_grad_() for x in inputs[:3]]
    peer_inputs = [x.clone().requires_grad_() for x in inputs[:3]]
    ours = GuidedLoss(**options)(*ours_inputs, *inputs[3:])
    theirs = SentenceTransformersGIST(tokenizer, **options)(*peer_inputs, *inputs[3:])
    ours.backward()
    theirs.backward()
    gradient = max((a.grad - b.grad).abs().max().item()
                   for a, b in zip(ours_inputs, peer_inputs, strict=True))  # fmt: skip
    error = abs(ours.item() - theirs.item())
    print(f"GIST {options or 'defaults'}: loss {ours.item():.6f}, sentence-transformers "
          f"{error:.1e} away, gradients {gradient:.1e}")  # fmt: skip
    assert error <= EXACT and gradient <= EXACT


def test_the_guide_changes_the_loss():
    """The control of the comparison above: a guide that leaves nothing out (margin -2:
    no similarity exceeds the positive's + 2) gives the plain ranking loss's value
    over the same candidates, which the default guide's differs from."""
    inputs = columns_and_guides()
    vetted = GuidedLoss()(*inputs)
    unvetted = GuidedLoss(margin=-2.0)(*inputs)
    print(f"vetted {vetted.item():.4f}, unvetted {unvetted.item():.4f}")
    assert abs(vetted.item() - unvetted.item()) > 1e-2


@pytest.mark.parametrize("options", OPTIONS[:4], ids=_named)
def test_exact_on_every_split(options):
    report = assert_loss_invariant(partial(GuidedLoss, **options), columns_and_guides)
    print(f"GIST {options or 'defaults'} over 2 and 3 ranks: {report.worst:.1e}")


def test_control_sentence_transformers_gather_is_not_exact_even_on_even_splits(tokenizer):
    with pytest.raises(AssertionError, match="not exact on 2 processes") as failure:
        peer = partial(SentenceTransformersGIST, tokenizer, True)
        assert_loss_invariant(peer, columns_and_guides, world_sizes=(2,), splits={2: [[4, 4]]})
    print(f"sentence-transformers' gather_across_devices: {str(failure.value).splitlines()[0]}")


def test_a_row_whose_negatives_are_all_left_out_keeps_its_positive():
    """Every candidate a copy of the positive for the guide, beyond a margin of 0.5: only
    the positive is left, and the loss is 0 (log exp(s_ii) - s_ii), gradients finite."""
    trained = [x.clone().requires_grad_() for x in columns_and_guides()[:3]]
    same = torch.ones(ROWS, GUIDE_WIDTH, dtype=torch.float64)
    loss = GuidedLoss(margin=0.5)(*trained, same, same, same)
    loss.backward()
    print(f"every negative left out: loss {loss.item():.1e}")
    assert abs(loss.item()) <= EXACT
    assert all(torch.isfinite(x.grad).all() for x in trained)


def test_bf16_autocast_keeps_the_loss_float32_and_close():
    inputs = [x.float() for x in columns_and_guides()]
    trained = [x.clone().requires_grad_() for x in inputs[:3]]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = GuidedLoss()(*(F.linear(x, torch.eye(WIDTH)) for x in trained), *inputs[3:])
    loss.backward()
    reference = GuidedLoss()(*(x.double() for x in inputs))
    print(f"bf16: loss {loss.item():.4f}, float64 {reference.item():.4f}")
    assert loss.dtype == torch.float32 and all(torch.isfinite(x.grad).all() for x in trained)
    assert loss.item() == pytest.approx(reference.item(), rel=5e-2)  # bf16: 8 mantissa bits
