"""Retrieval evaluation of paired embeddings: MRR@10 and recall@k, sharded across ranks.

Row i of the queries is paired with row i of the documents (an anchor and its positive,
an image and its caption). Every rank embeds its contiguous share of both, the
documents are gathered to every rank, each rank ranks its own queries against all of
them, and one all-reduce sums the figures: the same result on any number of processes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from contrastive_accelerate.collectives import all_gather_rows, rank_and_world_size

RECALL_AT = (1, 5, 10)


def paired_retrieval(
    embed_queries: Callable[[Sequence[int]], torch.Tensor],
    embed_documents: Callable[[Sequence[int]], torch.Tensor],
    count: int,
    device: torch.device | str = "cpu",
    batch_size: int = 256,
) -> dict[str, float]:
    """``mrr@10`` and ``recall@k`` (k in 1, 5, 10) of each query's own document among all
    ``count`` documents, by cosine similarity. ``embed_*(indices)`` embed those rows (on
    ``device``, the model's; no rows: a (0, width) tensor). Call it on every rank."""
    (queries, share), (documents, _) = _embedded_shares(
        (embed_queries, count), (embed_documents, count), batch_size=batch_size, device=device
    )
    documents = all_gather_rows(documents)
    sums = torch.zeros(1 + len(RECALL_AT), dtype=torch.float64, device=device)
    if len(queries):
        similarity = queries @ documents.T
        own = similarity[torch.arange(len(queries)), share.to(device)]
        # Each query's own document's rank: 1 + the documents scored strictly higher.
        ranks = 1 + (similarity > own[:, None]).sum(dim=1)
        reciprocal = ranks.to(torch.float64).reciprocal()
        sums[0] = torch.where(ranks <= 10, reciprocal, 0.0).sum()
        for i, k in enumerate(RECALL_AT, start=1):
            sums[i] = (ranks <= k).sum()
    if rank_and_world_size()[1] > 1:
        dist.all_reduce(sums)
    figures = (sums / count).tolist()
    return {"mrr@10": figures[0], **{f"recall@{k}": figures[i]
                                     for i, k in enumerate(RECALL_AT, start=1)}}  # fmt: skip


def _embedded_shares(
    *sides: tuple[Callable[[Sequence[int]], torch.Tensor], int],
    batch_size: int,
    device: torch.device | str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each ``(embed, count)`` side's contiguous share of its rows on this rank,
    embedded in batches and L2-normalised, with the share's row indices. Every rank runs
    as many batches, some empty (a sharded model's forward is a collective), and an idle
    rank's empty embeddings take the others' width, to join a gather."""
    rank, world_size = rank_and_world_size()
    embedded, shares = [], []
    for embed, count in sides:
        share = torch.arange(count).tensor_split(world_size)[rank]
        rounds = math.ceil(math.ceil(count / world_size) / batch_size)
        batches = [share[i * batch_size : (i + 1) * batch_size].tolist() for i in range(rounds)]
        parts = [F.normalize(embed(batch).float(), dim=1) for batch in batches]
        embedded.append(torch.cat(parts) if parts else None)
        shares.append(share)
    width = _max_over_ranks(max(x.shape[1] if x is not None else 0 for x in embedded), device)
    empty = torch.zeros(0, width, device=device)
    return [(empty if x is None else x, share) for x, share in zip(embedded, shares, strict=True)]


def _max_over_ranks(value: int, device) -> int:
    if rank_and_world_size()[1] == 1:
        return value
    tensor = torch.tensor(value, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor)


#: The cut-offs of ``ranked_retrieval``'s figures (sentence-transformers'
#: ``InformationRetrievalEvaluator`` names and defaults).
NDCG_AT, MRR_AT = 10, 10


def ranked_retrieval(
    embed_queries: Callable[[Sequence[int]], torch.Tensor],
    embed_corpus: Callable[[Sequence[int]], torch.Tensor],
    relevant: Sequence[set[int]],
    corpus_count: int,
    device: torch.device | str = "cpu",
    batch_size: int = 256,
) -> dict[str, float]:
    """``ndcg@10``, ``mrr@10`` and ``recall@k`` (k in 1, 5, 10) of each query against a
    corpus with relevance judgements (``relevant[q]``: the corpus rows relevant to query
    q, binary), by cosine similarity, as sentence-transformers'
    ``InformationRetrievalEvaluator`` computes them: ties broken by the corpus row (its
    rows in ascending id order), recall@k the share of a query's relevant rows in its top
    k, nDCG with binary gains. Queries and corpus are embedded sharded over the ranks,
    the corpus gathered, each rank ranking its own queries, one all-reduce: the same
    figures on any number of processes. Call it on every rank."""
    (queries, mine), (corpus, _) = _embedded_shares(
        (embed_queries, len(relevant)), (embed_corpus, corpus_count),
        batch_size=batch_size, device=device,
    )  # fmt: skip
    corpus = all_gather_rows(corpus)
    sums = torch.zeros(2 + len(RECALL_AT), dtype=torch.float64, device=device)
    top = min(max(NDCG_AT, MRR_AT, *RECALL_AT), corpus_count)
    discounts = 1 / torch.log2(torch.arange(2, top + 2, dtype=torch.float64, device=device))
    for row, query in enumerate(mine.tolist()):
        scores = corpus @ queries[row]
        # Stable: among equal scores the lower corpus row (id) first, as the peer sorts.
        order = torch.sort(scores, descending=True, stable=True).indices[:top].tolist()
        hits = torch.tensor([float(doc in relevant[query]) for doc in order],
                            dtype=torch.float64, device=device)  # fmt: skip
        ideal = discounts[: min(len(relevant[query]), NDCG_AT)].sum()
        sums[0] += (hits[:NDCG_AT] * discounts[:NDCG_AT]).sum() / ideal
        first = torch.nonzero(hits[:MRR_AT]).flatten()
        sums[1] += 1 / (first[0].item() + 1) if len(first) else 0.0
        for i, k in enumerate(RECALL_AT, start=2):
            sums[i] += hits[:k].sum() / len(relevant[query])
    if rank_and_world_size()[1] > 1:
        dist.all_reduce(sums)
    figures = (sums / max(len(relevant), 1)).tolist()
    return {f"ndcg@{NDCG_AT}": figures[0], f"mrr@{MRR_AT}": figures[1],
            **{f"recall@{k}": figures[i] for i, k in enumerate(RECALL_AT, start=2)}}  # fmt: skip


def first_texts(values: list) -> list[str]:
    """Each row's text, or the first of its list: evaluation takes no draw."""
    return [value if isinstance(value, str) else value[0] for value in values]


def embed_texts(
    tower: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    tokenizer,
    texts: list[str],
    max_length: int,
    device: torch.device,
) -> torch.Tensor:
    """``texts`` through ``tower`` (a model's ``project_texts``) on ``device``, padded to
    their longest and truncated to ``max_length``; no texts: the tower's (0, width)."""
    if not texts:
        empty = torch.zeros((0, 1), dtype=torch.int64, device=device)
        return tower(empty, empty)
    tokens = tokenizer(texts, padding=True, truncation=True, max_length=max_length,
                       return_tensors="pt")  # fmt: skip
    return tower(tokens["input_ids"].to(device), tokens["attention_mask"].to(device))
