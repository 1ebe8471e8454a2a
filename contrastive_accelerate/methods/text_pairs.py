"""Text-text pairs, sentence-transformers' convention: ``--columns anchor,positive[,
negative...]`` through one or two ``transformers`` towers, scored by
``MultipleNegativesRankingLoss`` or ``GISTEmbedLoss`` over the global batch."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from functools import partial

import torch
from torch import nn

from contrastive_accelerate.data.beir import load_beir
from contrastive_accelerate.data.mixture import Mixture
from contrastive_accelerate.data.pairs import MixedPairs, PairBatch, PairData, TextColumns
from contrastive_accelerate.hub import unreachable_reason
from contrastive_accelerate.knn import KnnData
from contrastive_accelerate.launch import TrainerError
from contrastive_accelerate.methods.base import DTYPES, Say
from contrastive_accelerate.methods.loss_table import LOSSES
from contrastive_accelerate.methods.pairs import (
    TEXT_PAIR_LOSSES,
    PairsMethod,
    say_truncated,
    text_dropout,
    text_encoder,
    text_model_digests,
)
from contrastive_accelerate.methods.sentence_tools import (
    folder_prompts,
    matryoshka_terms,
    prompts_of,
    say_overridden,
    sentence_folder,
)
from contrastive_accelerate.retrieval import (
    embed_texts,
    first_texts,
    paired_retrieval,
    ranked_retrieval,
)
from contrastive_accelerate.sharding import reshard_after_evaluation
from models import sample_keys


class TextPairsMethod(PairsMethod):
    """Text-text pairs: each column through a ``transformers`` tower (one shared, or with
    ``--two-towers`` one for the anchors and one for the rest), scored by
    ``MultipleNegativesRankingLoss`` over the global batch, every hard negative of
    every rank a candidate.

    Tokenization happens in the loader's workers; each rank pads to its own longest
    text, and the attention masks keep that out of the result. Dropout inside the towers
    is keyed by (seed, step, row index, column); dropout that a kernel draws (attention
    dropout under SDPA) cannot be, and is switched off with a notice
    (``models.dropout.switch_off_kernel_dropout``).
    """

    def __init__(
        self,
        config,
        data: PairData,
        world_size: int,
        say: Say,
        *,
        total_steps: int | None = None,
        device: torch.device | str = "cpu",
    ):
        from models.text import TextPairModel, TextTower

        self.seed, self.unique_texts = config.seed, config.unique_texts
        self.masked = config.mnrl_false_negatives == "identity"  # same texts: no negatives
        encoder, tokenizer, self.inputs = text_encoder(config, data, data.columns)
        folder = sentence_folder(config)  # a sentence-transformers folder's own stack
        tower = TextTower(
            encoder,
            config.text_pooling,
            config.projection_dim or None,
            use_attention_mask=config.attention_mask,
            dense=folder.dense_layers(DTYPES[config.dtype]) if folder else None,
            normalize=folder.normalize if folder else False,
        ).to(DTYPES[config.dtype])
        towers = [text_dropout(tower, tokenizer, config, world_size, say)]
        if config.two_towers:  # the query and document towers start as one
            towers.append(copy.deepcopy(towers[0]))
        tokenizers = [tokenizer] * len(towers)
        # Each column's prefix, in training and evaluation: --prompts, else the folder's.
        self.prompts = prompts_of(config) or folder_prompts(folder, data.columns)
        say_overridden(config, folder, say)
        # The export names the prompts by column, and keeps the folder's own names too
        # (encode_query, encode_document) unless --prompts replaced them.
        named = folder.prompts if folder and not prompts_of(config) else {}
        self.model = TextPairModel(towers, tokenizers, max_length=config.max_length,
                                   prompts={**named, **self.prompts})  # fmt: skip
        say_truncated(data, data.columns, tokenizer, config.max_length, say)
        if isinstance(data, MixedPairs):  # each source its own columns
            self.dataset = Mixture(
                [TextColumns(source.train, source.columns, tokenizer, config.max_length,
                             config.seed, self.prompts) for source in data.sources],
                data.names,
                data.weights,
            )  # fmt: skip
        else:
            self.dataset = TextColumns(
                data.train, data.columns, tokenizer, config.max_length, config.seed, self.prompts
            )
        self.evaluation, self.columns = data.evaluation, data.columns
        beir = config.eval_beir
        self.beir = load_beir(beir, config.eval_beir_split) if beir else None
        self.tokenizer, self.max_length = tokenizers[0], config.max_length
        self.row = LOSSES[config.loss or TEXT_PAIR_LOSSES[0]]
        self.criterion = self.row.make(config)
        self.matryoshka = matryoshka_terms(config)
        self.guide = None  # --loss gist's frozen guide: no weight of the trained model
        if config.loss == "gist":
            self.guide, digests = guide_tower(config, tokenizer, DTYPES[config.dtype])
            self.guide.tower.to(device)
            self.inputs = {**self.inputs, "gist_guide": digests}

    def embed(self, model: nn.Module, chunk: PairBatch, step: int) -> torch.Tensor:
        """Every column of one chunk, column after column; column c's dropout keyed by
        (seed, step, row index, c)."""
        device = next(model.parameters()).device
        columns = [
            (ids.to(device, non_blocking=True), mask.to(device, non_blocking=True))
            for ids, mask in chunk.columns
        ]
        keys = [
            sample_keys(self.seed, step, chunk.indices, column).to(device, non_blocking=True)
            for column in range(len(columns))
        ]
        return model(columns, keys)

    def loss(
        self,
        outputs: list[torch.Tensor],
        batch: PairBatch,
        sizes: Sequence[int] | None,
        step: int,
    ) -> torch.Tensor:
        count = len(batch.columns)
        per_chunk = [output.unflatten(0, (count, -1)) for output in outputs]
        columns = [torch.cat([output[column] for output in per_chunk]) for column in range(count)]
        if self.guide is not None:  # the guide's embeddings of the same texts
            with torch.no_grad():
                guides = self.guide.embed(batch.columns, self.tokenizer, columns[0].device)
            return self.pair_loss(columns, sizes, guides)
        return self.pair_loss(columns, sizes, batch.identities if self.masked else None)

    def evaluate(self, knn: KnnData | None) -> dict[str, float]:
        """Retrieval on the held-out pairs: each anchor's positive among all of theirs
        (``retrieval_mrr@10``, ``retrieval_recall@k``), and with ``--eval-beir`` on its
        benchmark (``beir_ndcg@10``, ``beir_mrr@10``, ``beir_recall@k``): queries through
        the anchors' tower and prompt, the corpus through the positives'; sharded across
        ranks."""
        figures: dict[str, float] = {}
        model, device = self.model, next(self.model.parameters()).device

        def embedder(column: int, texts: list[str]):
            prompt = self.prompts.get(self.columns[column], "")
            return lambda rows: embed_texts(
                partial(model.project_texts, column=column), self.tokenizer,
                [prompt + texts[i] for i in rows], self.max_length, device,
            )  # fmt: skip

        model.eval()
        try:
            with torch.no_grad():
                if self.evaluation is not None:
                    anchors, positives = (first_texts(self.evaluation[c]) for c in self.columns[:2])
                    found = paired_retrieval(embedder(0, anchors), embedder(1, positives),
                                             len(anchors), device)  # fmt: skip
                    figures |= {f"retrieval_{name}": value for name, value in found.items()}
                if self.beir is not None:
                    found = ranked_retrieval(
                        embedder(0, self.beir.queries), embedder(1, self.beir.corpus),
                        self.beir.relevant, len(self.beir.corpus), device,
                    )  # fmt: skip
                    figures |= {f"beir_{name}": value for name, value in found.items()}
        finally:
            model.train()
            reshard_after_evaluation(model)
        return figures


class Guide:
    """``--loss gist``'s frozen guide: its tower, and, where it reads other tokens than
    the trained towers (another vocabulary, or fewer positions than ``--max-length``),
    its own tokenizer and length: each column's texts are decoded from the trained
    tokens and tokenized again, as sentence-transformers' ``GISTEmbedLoss`` does."""

    def __init__(self, tower: nn.Module, tokenizer=None, max_length: int | None = None) -> None:
        self.tower, self.tokenizer, self.max_length = tower, tokenizer, max_length

    def embed(self, columns, trained_tokenizer, device: torch.device) -> list[torch.Tensor]:
        """The guide's embeddings of each ``(input_ids, attention_mask)`` column."""
        guides = []
        for ids, mask in columns:
            if self.tokenizer is not None and len(ids):
                texts = trained_tokenizer.batch_decode(ids, skip_special_tokens=True)
                tokens = self.tokenizer(
                    texts, padding=True, truncation=True, max_length=self.max_length,
                    return_tensors="pt",
                )  # fmt: skip
                ids, mask = tokens["input_ids"], tokens["attention_mask"]
            guides.append(self.tower(ids.to(device), mask.to(device)))
        return guides


def guide_tower(config, tokenizer, dtype: torch.dtype) -> tuple[Guide, dict[str, str]]:
    """``--gist-guide``: a sentence-transformers folder taken as it is (its pooling, Dense,
    Normalize and ``max_seq_length``) or a transformers model under mean pooling, in eval
    mode, without gradients; and its digests, which a resume compares."""
    from models.sentence_folder import load_sentence_tower

    path = config.gist_guide
    if reason := unreachable_reason(path, "models"):
        raise TrainerError(f"cannot load --gist-guide {path!r}: {reason}")
    tower, guide_tokenizer, folder = load_sentence_tower(path, dtype, flag="--gist-guide")
    positions = getattr(tower.encoder.config, "max_position_embeddings", None)
    length = (folder.max_seq_length if folder else None) or positions or config.max_length
    length = min(length, positions or length)
    if guide_tokenizer.get_vocab() == tokenizer.get_vocab() and length >= config.max_length:
        return Guide(tower), text_model_digests(tower.encoder, tokenizer)
    return Guide(tower, guide_tokenizer, length), text_model_digests(tower.encoder, guide_tokenizer)
