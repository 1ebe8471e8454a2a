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
    rank, world_size = rank_and_world_size()
    share = torch.arange(count).tensor_split(world_size)[rank]
    # As many batches on every rank, some empty: a sharded model's forward is a collective.
    rounds = math.ceil(math.ceil(count / world_size) / batch_size)
    batches = [share[i * batch_size : (i + 1) * batch_size].tolist() for i in range(rounds)]

    def embedded(embed) -> torch.Tensor | None:
        parts = [F.normalize(embed(batch).float(), dim=1) for batch in batches]
        return torch.cat(parts) if parts else None

    queries, documents = embedded(embed_queries), embedded(embed_documents)
    # An idle rank has embedded nothing: it learns the width to join the gather.
    width = _max_over_ranks(queries.shape[1] if queries is not None else 0, device)
    empty = torch.zeros(0, width, device=device)
    queries = empty if queries is None else queries
    documents = all_gather_rows(empty if documents is None else documents)
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
    if world_size > 1:
        dist.all_reduce(sums)
    figures = (sums / count).tolist()
    return {"mrr@10": figures[0], **{f"recall@{k}": figures[i]
                                     for i, k in enumerate(RECALL_AT, start=1)}}  # fmt: skip


def _max_over_ranks(value: int, device) -> int:
    if rank_and_world_size()[1] == 1:
        return value
    tensor = torch.tensor(value, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor)
