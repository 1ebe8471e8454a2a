"""Multiple-negatives ranking with hard negatives, exact on W ranks, against
sentence-transformers: its MNRL and CachedMNRL at one process, its
``gather_across_devices=True`` at two processes with equal batches, and its ``rank * n``
offsets (restated in tests/references.py) breaking on uneven ones.

The distributed checks use the invariance kit (``contrastive_accelerate.testing``): the
mean of the per-rank values against one process, and every input row's gradient, on
even, uneven and idle-rank splits, float64 (atol 1e-10: only summation order differs).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from contrastive_accelerate.data.pairs import TextColumns
from contrastive_accelerate.grad_cache import cached_backward
from contrastive_accelerate.testing import assert_loss_invariant
from losses import GISTEmbedLoss, MatryoshkaLoss, MultipleNegativesRankingLoss

import references
from launch import WORDS, make_text_model, make_word_level_model

st_losses = pytest.importorskip("sentence_transformers.sentence_transformer.losses")
SCALE = 20.0
ROWS, WIDTH = 7, 6


def anchors_positives_negatives(negatives: int = 2) -> tuple[torch.Tensor, ...]:
    """Positives near their anchors, hard negatives near them too (harder than the batch)."""
    generator = torch.Generator().manual_seed(3)
    anchors = torch.randn(ROWS, WIDTH, generator=generator, dtype=torch.float64)
    positives = anchors + 0.5 * torch.randn(ROWS, WIDTH, generator=generator, dtype=torch.float64)
    hard = [
        anchors + 0.8 * torch.randn(ROWS, WIDTH, generator=generator, dtype=torch.float64)
        for _ in range(negatives)
    ]
    return anchors, positives, *hard


class SentenceTransformersMNRL(torch.nn.Module):
    """sentence-transformers' own loss on embeddings, as the kit calls a loss."""

    def __init__(self, gather_across_devices: bool = False, symmetric: bool = False) -> None:
        super().__init__()
        directions = ("query_to_doc", "doc_to_query") if symmetric else ("query_to_doc",)
        self.peer = st_losses.MultipleNegativesRankingLoss(
            model=None,
            scale=SCALE,
            gather_across_devices=gather_across_devices,
            directions=directions,
            partition_mode="per_direction",
        )

    def forward(self, *columns: torch.Tensor) -> torch.Tensor:
        return self.peer.compute_loss_from_embeddings(list(columns), None)


@pytest.mark.parametrize("symmetric", [False, True], ids=["one-direction", "symmetric"])
def test_hard_negatives_are_exact_on_any_split(symmetric):
    report = assert_loss_invariant(
        partial(MultipleNegativesRankingLoss, SCALE, symmetric=symmetric),
        anchors_positives_negatives,
    )
    print(f"mnrl with 2 hard-negative columns, symmetric={symmetric}: {report.worst:.1e}")


def with_duplicates() -> tuple[torch.Tensor, ...]:
    """``anchors_positives_negatives`` with three texts twice, equal embeddings for equal
    texts, and each row's texts' ids last (``(rows, 3)``, rows first as the kit splits
    inputs): anchor 5 is anchor 1, positive 4 positive 0, negative 3 positive 6, so
    that duplicates fall on different ranks."""
    columns = [x.clone() for x in anchors_positives_negatives(1)]
    identities = torch.arange(3 * ROWS).reshape(3, ROWS)
    for (column, row), (same_column, same_row) in (((0, 5), (0, 1)), ((1, 4), (1, 0)),
                                                   ((2, 3), (1, 6))):  # fmt: skip
        columns[column][row] = columns[same_column][same_row]
        identities[column, row] = identities[same_column, same_row]
    return *columns, identities.T.contiguous()


class IdentityMaskedMNRL(torch.nn.Module):
    """MNRL masking false negatives by the ids given as its last input; ``per_rank``: the
    control, each rank's ids made its own, so that only duplicates on one rank match."""

    def __init__(self, symmetric: bool = False, per_rank: bool = False) -> None:
        super().__init__()
        self.loss = MultipleNegativesRankingLoss(SCALE, symmetric=symmetric)
        self.per_rank = per_rank

    def forward(self, *columns_and_ids: torch.Tensor) -> torch.Tensor:
        *columns, identities = columns_and_ids
        if self.per_rank and torch.distributed.is_initialized():
            identities = identities + torch.distributed.get_rank() * 2**40
        return self.loss(*columns, identities=identities.T)


@pytest.mark.parametrize("symmetric", [False, True], ids=["one-direction", "symmetric"])
def test_false_negatives_by_identity_are_left_out_as_the_reference_does(symmetric):
    *columns, identities = with_duplicates()
    ours = IdentityMaskedMNRL(symmetric)(*columns, identities)
    reference = references.mnrl(*columns, scale=SCALE, symmetric=symmetric,
                                identities=identities.T.tolist())  # fmt: skip
    unmasked = MultipleNegativesRankingLoss(SCALE, symmetric=symmetric)(*columns)
    error, control = (abs(value.item() - reference.item()) for value in (ours, unmasked))
    print(f"masked by identity, symmetric={symmetric}: {error:.1e} from the reference; "
          f"unmasked {control:.1e}")  # fmt: skip
    assert error <= 1e-12 and control > 1e-3


@pytest.mark.parametrize("symmetric", [False, True], ids=["one-direction", "symmetric"])
def test_false_negatives_masked_across_ranks_are_exact_on_any_split(symmetric):
    report = assert_loss_invariant(partial(IdentityMaskedMNRL, symmetric), with_duplicates)
    print(f"masked by identity across the global batch, symmetric={symmetric}: "
          f"{report.worst:.1e}")  # fmt: skip
    with pytest.raises(AssertionError, match="not exact on 2 processes") as failure:
        assert_loss_invariant(partial(IdentityMaskedMNRL, symmetric, per_rank=True),
                              with_duplicates, world_sizes=(2,), splits={2: [[4, 3]]})  # fmt: skip
    print(f"control, masked per rank: {str(failure.value).splitlines()[0]}")


@pytest.mark.parametrize(
    "make_loss",
    [
        partial(MultipleNegativesRankingLoss, SCALE, gather_distributed=False),
        partial(references.RankOffsetMNRL, SCALE),
    ],
    ids=["local-negatives-only", "rank-times-n-offsets"],
)
def test_control_local_negatives_or_rank_offsets_break_on_uneven_batches(make_loss):
    with pytest.raises(AssertionError, match="not exact on 2 processes") as failure:
        assert_loss_invariant(make_loss, anchors_positives_negatives, world_sizes=(2,),
                              splits={2: [[4, 3]]})  # fmt: skip
    print(str(failure.value).splitlines()[0])


def test_rank_offsets_are_right_on_even_batches():
    """The control's restatement of the peer is faithful: exact where its assumption holds,
    as sentence-transformers' own loss is (next test)."""
    rows = anchors_positives_negatives()[0].shape[0] + 1  # 8: two even shares
    inputs = partial(_even_inputs, rows)
    assert_loss_invariant(
        partial(references.RankOffsetMNRL, SCALE), inputs, world_sizes=(2,), splits={2: [[4, 4]]}
    )


def _even_inputs(rows: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(5)
    return tuple(torch.randn(rows, WIDTH, generator=generator, dtype=torch.float64) for _ in "apn")


@pytest.mark.parametrize("symmetric", [False, True], ids=["one-direction", "symmetric"])
def test_sentence_transformers_gather_across_devices_on_equal_batches(symmetric):
    """Their distributed loss at 2 processes on 4 + 4 rows is the one-process loss, and
    so is ours: the two agree (previous tests) where the peer is right."""
    inputs = partial(_even_inputs, 8)
    peer = partial(SentenceTransformersMNRL, gather_across_devices=True, symmetric=symmetric)
    assert_loss_invariant(peer, inputs, world_sizes=(2,), splits={2: [[4, 4]]})


@pytest.mark.parametrize("symmetric", [False, True], ids=["one-direction", "symmetric"])
def test_one_process_equals_sentence_transformers(symmetric):
    columns = [x.clone().requires_grad_() for x in anchors_positives_negatives()]
    ours = MultipleNegativesRankingLoss(SCALE, symmetric=symmetric)(*columns)
    ours_grads = torch.autograd.grad(ours, columns)
    theirs = SentenceTransformersMNRL(symmetric=symmetric)(*columns)
    their_grads = torch.autograd.grad(theirs, columns)
    reference = references.mnrl(*columns, scale=SCALE, symmetric=symmetric)
    value = abs(ours.item() - theirs.item())
    pairs = zip(ours_grads, their_grads, strict=True)
    gradient = max((a - b).abs().max().item() for a, b in pairs)
    print(
        f"vs sentence-transformers, symmetric={symmetric}: value {value:.1e}, grad {gradient:.1e}"
    )
    assert value <= 1e-12 and gradient <= 1e-12
    assert ours.item() == pytest.approx(reference.item(), abs=1e-12)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """No dropout: sentence-transformers' cached loss replays it with its own RNG state."""
    return str(make_text_model(tmp_path_factory.mktemp("bert"), dropout=0.0))


COLUMNS = ("anchor", "positive", "negative")


def ours_and_peers(tiny_bert):
    """Six rows of anchor, positive and negative texts; our trainer's tower on
    ``tiny_bert`` (``TextPairModel``) with the batch ``TextColumns`` makes of them, and
    sentence-transformers' model of the same tower with its features: float64, training."""
    import datasets
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    from models.text import TextPairModel, TextTower, load_text_encoder

    generator = torch.Generator().manual_seed(0)
    words = list(WORDS)

    def sentence() -> str:
        count = int(torch.randint(2, 8, (1,), generator=generator))
        return " ".join(
            words[int(i)] for i in torch.randint(len(words), (count,), generator=generator)
        )

    rows = {column: [sentence() for _ in range(6)] for column in COLUMNS}
    encoder, tokenizer = load_text_encoder(tiny_bert, torch.float64)
    model = TextPairModel([TextTower(encoder, "mean")]).train()
    items = TextColumns(datasets.Dataset.from_dict(rows), COLUMNS, tokenizer, max_length=32)
    batch = items.collate([items[(0, index)] for index in range(6)])
    modules = [
        Transformer(tiny_bert, max_seq_length=32),
        Pooling(encoder.config.hidden_size, "mean"),
    ]
    peer_model = SentenceTransformer(modules=modules, device="cpu").double().train()
    features = [peer_model.tokenize(rows[column]) for column in COLUMNS]
    return model, batch, peer_model, features


def our_loss(model, batch, criterion, chunks: int, cached: bool = True) -> torch.Tensor:
    """``criterion`` on the batch's columns through our gradient caching in ``chunks``
    (the trainer's path), or (``cached=False``, the control) plain accumulation over
    them; its gradients left in ``model``."""

    def loss_fn(outputs):
        per_chunk = [output.unflatten(0, (3, -1)) for output in outputs]
        return criterion(*(torch.cat([o[c] for o in per_chunk]) for c in range(3)))

    parts = batch.split(chunks)
    if cached:
        return cached_backward(model, parts, loss_fn, forward=lambda chunk: model(chunk.columns))
    loss = sum(loss_fn([model(chunk.columns)]) / len(parts) for chunk in parts)
    loss.backward()
    return loss


def gradient_gap(model, peer_model) -> float:
    """The largest difference between our tower's and the peer's encoder gradients."""
    ours = {name.removeprefix("towers.0.encoder."): p.grad for name, p in model.named_parameters()}
    return max((parameter.grad - ours[name.split("model.", 1)[1]]).abs().max().item()
               for name, parameter in peer_model[0].named_parameters()
               if parameter.grad is not None)  # fmt: skip


@pytest.mark.parametrize("chunking", ["cached", "accumulated"])
def test_gradient_caching_equals_sentence_transformers_cached_mnrl(tiny_bert, chunking):
    """The trainer's path (TextColumns, TextPairModel, cached_backward in 3 chunks) against
    ``CachedMultipleNegativesRankingLoss(mini_batch_size=2)`` on the same tiny BERT, float64:
    the loss and every encoder weight's gradient. The control, "accumulated", is plain
    gradient accumulation over the same chunks (each chunk's loss on its own negatives,
    averaged): its gradients are not the cached loss's."""
    model, batch, peer_model, features = ours_and_peers(tiny_bert)
    criterion = MultipleNegativesRankingLoss(SCALE)
    ours = our_loss(model, batch, criterion, 3, cached=chunking == "cached")
    peer = st_losses.CachedMultipleNegativesRankingLoss(peer_model, scale=SCALE, mini_batch_size=2)
    theirs = peer(features, None)
    theirs.backward()
    worst, value = gradient_gap(model, peer_model), abs(ours.item() - theirs.item())
    print(f"{chunking} vs CachedMultipleNegativesRankingLoss: value {value:.1e}, "
          f"gradients {worst:.1e}")  # fmt: skip
    if chunking == "cached":
        assert value <= 1e-12 and worst <= 1e-12
    else:
        assert worst > 1e-4


@pytest.mark.parametrize(
    "chunks, cached", [(1, True), (3, True), (3, False)],
    ids=["gist", "cached-gist", "accumulated-gist"],
)  # fmt: skip
def test_the_trainers_path_equals_sentence_transformers_gist_on_a_tower(tiny_bert, chunks,
                                                                        cached):  # fmt: skip
    """The trainer's path (TextColumns, TextPairModel, gradient caching in ``chunks``)
    with the tiny BERT as it starts as its guide, against sentence-transformers'
    ``GISTEmbedLoss`` and ``CachedGISTEmbedLoss(mini_batch_size=2)`` on the same towers,
    float64: the loss and every encoder weight's gradient within 1e-12. The control,
    "accumulated", is plain gradient accumulation over the same chunks."""
    import copy

    model, batch, peer_model, features = ours_and_peers(tiny_bert)
    guide = copy.deepcopy(model.towers[0]).eval()
    with torch.no_grad():
        guides = [guide(ids, mask) for ids, mask in batch.columns]
    criterion = partial(_with_guides, GISTEmbedLoss(temperature=0.05, margin=0.02))
    if cached:
        ours = our_loss(model, batch, partial(criterion, guides), chunks)
    else:  # each chunk's loss with its own rows' guides, averaged
        pieces = [[g.tensor_split(chunks)[k] for g in guides] for k in range(chunks)]
        loss_of = iter([partial(criterion, piece) for piece in pieces])
        ours = our_loss(model, batch, lambda *c: next(loss_of)(*c), chunks, cached=False)
    peer_guide = copy.deepcopy(peer_model).eval()
    options = {"temperature": 0.05, "margin": 0.02}
    peer = (
        st_losses.CachedGISTEmbedLoss(peer_model, peer_guide, mini_batch_size=2, **options)
        if chunks > 1
        else st_losses.GISTEmbedLoss(peer_model, peer_guide, **options)
    )
    theirs = peer(features, None)
    theirs.backward()
    worst, value = gradient_gap(model, peer_model), abs(ours.item() - theirs.item())
    print(f"{'cached ' if chunks > 1 else ''}GIST ({'cached' if cached else 'accumulated'}) "
          f"vs sentence-transformers: value {value:.1e}, gradients {worst:.1e}")  # fmt: skip
    if cached:
        assert value <= 1e-12 and worst <= 1e-12
    else:
        assert worst > 1e-4


@pytest.mark.parametrize("max_length", [64, 4], ids=["retokenized", "truncated-control"])
def test_a_guide_of_another_vocabulary_is_sentence_transformers_retokenized_guide(
    tiny_bert, tmp_path, max_length
):
    """A guide that reads other tokens than the trained tower (a word-level vocabulary,
    another BERT): ``Guide.embed`` decodes each column and tokenizes it again, as
    sentence-transformers' ``GISTEmbedLoss`` does when its guide's vocabulary differs.
    The loss and every encoder gradient equal the peer's (float64, 1e-12); the control,
    the guide's texts cut at 4 tokens, gives another loss."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    from contrastive_accelerate.methods.text_pairs import Guide
    from models.text import TextTower, load_text_encoder

    model, batch, peer_model, features = ours_and_peers(tiny_bert)
    folder = make_word_level_model(tmp_path / "guide")
    encoder, tokenizer = load_text_encoder(str(folder), torch.float64)
    guide = Guide(TextTower(encoder, "mean").eval(), tokenizer, max_length)
    trained_tokenizer = load_text_encoder(tiny_bert)[1]
    with torch.no_grad():
        guides = guide.embed(batch.columns, trained_tokenizer, torch.device("cpu"))
    options = {"temperature": 0.05, "margin": 0.02}
    ours = our_loss(model, batch, partial(_with_guides, GISTEmbedLoss(**options), guides), 1)
    modules = [Transformer(str(folder), max_seq_length=64), Pooling(64, "mean")]
    peer_guide = SentenceTransformer(modules=modules, device="cpu").double().eval()
    theirs = st_losses.GISTEmbedLoss(peer_model, peer_guide, **options)(features, None)
    theirs.backward()
    worst, value = gradient_gap(model, peer_model), abs(ours.item() - theirs.item())
    print(f"a guide of another vocabulary, {max_length} tokens, vs sentence-transformers: "
          f"value {value:.1e}, gradients {worst:.1e}")  # fmt: skip
    if max_length == 64:
        assert value <= 1e-12 and worst <= 1e-12
    else:
        assert value > 1e-6


def _with_guides(criterion, guides, *columns):
    return criterion(*columns, guides=guides)


MATRYOSHKA_DIMS, MATRYOSHKA_WEIGHTS = (16, 8, 4), (1.0, 0.5, 0.25)


@pytest.mark.parametrize("cached", [False, True], ids=["mnrl", "cached-mnrl"])
def test_matryoshka_equals_sentence_transformers_matryoshka_loss(tiny_bert, cached):
    """``MatryoshkaLoss`` over MNRL (one chunk) and over gradient caching (3 chunks)
    against sentence-transformers' ``MatryoshkaLoss`` around its ``MNRL`` and its
    ``CachedMNRL(mini_batch_size=2)``, on the same tiny BERT (16 dims: 16, 8 and 4 with
    weights 1, 0.5, 0.25), float64: the loss and every gradient within 1e-12. The control:
    the loss of the whole embeddings alone is not it."""
    model, batch, peer_model, features = ours_and_peers(tiny_bert)
    criterion = MatryoshkaLoss(MultipleNegativesRankingLoss(SCALE), MATRYOSHKA_DIMS,
                               MATRYOSHKA_WEIGHTS)  # fmt: skip
    ours = our_loss(model, batch, criterion, 3 if cached else 1)
    inner = (
        st_losses.CachedMultipleNegativesRankingLoss(peer_model, scale=SCALE, mini_batch_size=2)
        if cached
        else st_losses.MultipleNegativesRankingLoss(peer_model, scale=SCALE)
    )
    peer = st_losses.MatryoshkaLoss(peer_model, inner, list(MATRYOSHKA_DIMS),
                                    matryoshka_weights=list(MATRYOSHKA_WEIGHTS))  # fmt: skip
    theirs = peer(features, None)
    theirs.backward()
    worst, value = gradient_gap(model, peer_model), abs(ours.item() - theirs.item())
    print(f"Matryoshka, {'cached ' if cached else ''}MNRL vs sentence-transformers: "
          f"value {value:.1e}, gradients {worst:.1e}")  # fmt: skip
    assert value <= 1e-12 and worst <= 1e-12
    whole = our_loss(*ours_and_peers(tiny_bert)[:2], MultipleNegativesRankingLoss(SCALE), 1)
    assert abs(whole.item() - theirs.item()) > 1e-3


def test_an_empty_tower_batch_still_has_every_weight_in_the_graph(tiny_bert):
    """An idle rank's zero rows must still reach every trained weight (DDP waits for each
    one); the frozen pooler takes none, as DDP does not wait for it."""
    from models.text import TextTower, load_text_encoder

    encoder, _ = load_text_encoder(tiny_bert, torch.float64)
    tower = TextTower(encoder, "mean", projection_dim=4).double()
    empty = torch.zeros((0, 1), dtype=torch.long)
    output = tower(empty, empty)
    assert output.shape == (0, 4)
    output.sum().backward()
    assert all(p.grad is not None for p in tower.parameters() if p.requires_grad)
    assert all(p.grad is None for p in tower.encoder.pooler.parameters())


def test_padding_does_not_change_an_embedding_and_the_control_does(tiny_bert):
    """A text padded to a longer batch embeds as alone (attention mask, masked mean), in
    float64 to 1e-12; without the mask the pad tokens change it."""
    from models.text import TextTower, load_text_encoder

    encoder, tokenizer = load_text_encoder(tiny_bert, torch.float64)
    texts = ["red cat", "the quick dog jumps over a stone near the river"]
    alone = tokenizer(texts[:1], return_tensors="pt")
    padded = tokenizer(texts, return_tensors="pt", padding=True)
    for pooling in ("mean", "cls"):
        tower = TextTower(encoder, pooling).eval()
        control = TextTower(encoder, pooling, use_attention_mask=False).eval()
        with torch.no_grad():
            reference = tower(alone["input_ids"], alone["attention_mask"])
            masked = tower(padded["input_ids"], padded["attention_mask"])[:1]
            unmasked = control(padded["input_ids"], padded["attention_mask"])[:1]
        error, broken = (
            (reference - masked).abs().max().item(),
            (reference - unmasked).abs().max().item(),
        )
        print(f"{pooling} pooling, padded from 4 to {padded['input_ids'].shape[1]} tokens: "
              f"{error:.1e}; without the mask {broken:.1e}")  # fmt: skip
        assert error <= 1e-12 and broken > 1e-6


def test_bf16_autocast_keeps_the_loss_float32_and_finite():
    columns = [x.float().requires_grad_() for x in anchors_positives_negatives()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = MultipleNegativesRankingLoss(SCALE)(
            *(F.linear(c, torch.eye(WIDTH)) for c in columns)
        )
    loss.backward()
    reference = references.mnrl(*(c.detach().double() for c in columns), scale=SCALE)
    print(f"bf16 inputs: loss {loss.item():.4f}, float64 reference {reference.item():.4f}")
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert all(torch.isfinite(c.grad).all() for c in columns)
    assert loss.item() == pytest.approx(reference.item(), rel=2e-2)  # bf16: 8 mantissa bits
    *columns, identities = with_duplicates()
    columns = [x.float() for x in columns]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        masked = IdentityMaskedMNRL()(*(F.linear(c, torch.eye(WIDTH)) for c in columns), identities)
    reference = references.mnrl(*(c.double() for c in columns), scale=SCALE,
                                identities=identities.T.tolist())  # fmt: skip
    print(f"bf16, masked: loss {masked.item():.4f}, float64 reference {reference.item():.4f}")
    assert masked.dtype == torch.float32
    assert masked.item() == pytest.approx(reference.item(), rel=2e-2)
