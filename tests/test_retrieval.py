"""Retrieval figures on hand-made embeddings whose ranks are known, on 1, 2 and 3 gloo
ranks (one of them idle on 3): the figures do not depend on the sharding."""

from __future__ import annotations

import pytest
import torch

from contrastive_accelerate.retrieval import paired_retrieval
from contrastive_accelerate.testing import run_on_ranks

# Query i is the unit vector e_i. Query 1's own document is e_1 + e_5 (cosine 0.71) and
# document 0 is e_0 + 2 e_1 (0.89 to it): rank 2. Query 2's own document is nearly flat
# (cosine 0.5) and documents 3..12 are e_j + e_2 (0.71 to it): rank 11, past @10. Every
# other query finds its own document first.
COUNT = 13


def queries(rows) -> torch.Tensor:
    return torch.eye(COUNT)[list(rows)]


def documents(rows) -> torch.Tensor:
    docs = torch.eye(COUNT)
    docs[0, 1] = 2.0
    docs[1, 5] = 1.0
    docs[2] = torch.full((COUNT,), 0.01)
    docs[2, 2] = 0.02
    docs[3:, 2] = 1.0
    return docs[list(rows)]


def expected() -> dict[str, float]:
    """The same figures, from the similarity matrix directly."""
    similarity = torch.nn.functional.normalize(queries(range(COUNT)), dim=1) @ (
        torch.nn.functional.normalize(documents(range(COUNT)), dim=1).T
    )
    ranks = 1 + (similarity > similarity.diagonal()[:, None]).sum(dim=1)
    reciprocal = torch.where(ranks <= 10, 1.0 / ranks.double(), 0.0)
    return {"mrr@10": reciprocal.mean().item(),
            **{f"recall@{k}": (ranks <= k).double().mean().item() for k in (1, 5, 10)}}  # fmt: skip


def retrieval_worker(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    """The sharded figures, and the control: each rank ranking its queries among its own
    share of the documents only (a per-rank evaluator), averaged over the ranks."""
    import torch.distributed as dist

    share = torch.arange(COUNT).tensor_split(world_size)[rank].tolist()
    similarity = torch.nn.functional.normalize(queries(share), dim=1) @ (
        torch.nn.functional.normalize(documents(share), dim=1).T
    )
    ranks = 1 + (similarity > similarity.diagonal()[:, None]).sum(dim=1)
    local = torch.stack([(ranks <= 10).sum().double(), torch.tensor(float(len(share)))])
    dist.all_reduce(local)
    return {
        "sharded": paired_retrieval(queries, documents, COUNT, batch_size=2),
        "per_rank_recall@10": (local[0] / local[1]).item(),
    }


def test_the_constructed_ranks_are_what_the_figures_count():
    figures = paired_retrieval(queries, documents, COUNT)
    print(f"one process: {figures}")
    assert figures == pytest.approx(expected(), abs=1e-12)
    assert figures["recall@1"] == pytest.approx(11 / 13)  # ranks 1 (x 11), 2 and 11
    assert figures["recall@5"] == figures["recall@10"] == pytest.approx(12 / 13)
    assert figures["mrr@10"] == pytest.approx(11.5 / 13)


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_figures_equal_one_process(world_size):
    per_rank = run_on_ranks(retrieval_worker, world_size)
    for result in per_rank:
        assert result["sharded"] == pytest.approx(expected(), abs=1e-12)
        # The control: documents of other ranks unseen, recall@10 reads higher.
        print(f"W={world_size}: per-rank recall@10 {result['per_rank_recall@10']:.3f}, "
              f"global {expected()['recall@10']:.3f}")  # fmt: skip
        assert result["per_rank_recall@10"] > expected()["recall@10"] + 0.05
