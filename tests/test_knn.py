"""Sharded, streamed kNN evaluation against the whole evaluation on one process.

The reference is computed here as the evaluation used to be: every image of the bank
and of the queries decoded into one tensor, embedded, one similarity matrix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from contrastive_accelerate.collectives import all_gather_rows
from contrastive_accelerate.data import evaluation_images, load_image_dataset
from contrastive_accelerate.knn import knn_data, knn_features, knn_top1
from contrastive_accelerate.testing import run_on_ranks
from models import SimCLR

FLOAT32 = 1e-5  # features of the same images in different batch compositions


def _setup():
    data = load_image_dataset(None)
    torch.manual_seed(0)
    model = SimCLR("mlp", image_size=8).eval()
    # 300 training images (the bank) and the 360 held-out queries; batches of 64 leave
    # a short last batch on each rank.
    knn = knn_data(data.train.select(range(300)), data.evaluation, data.image_column,
                   data.label_column, 8, False)  # fmt: skip
    return model, knn


@torch.no_grad()
def _reference(model, knn, k: int = 20, temperature: float = 0.07):
    def features(dataset):
        images, _ = evaluation_images(dataset, knn.image_column, knn.image_size)
        return F.normalize(model.embed(images), dim=1)

    bank, queries = features(knn.bank), features(knn.queries)
    similarity, neighbours = (queries @ bank.T).topk(k, dim=1)
    votes = torch.zeros(len(queries), int(knn.bank_labels.max()) + 1)
    votes.scatter_add_(1, knn.bank_labels[neighbours], (similarity / temperature).exp())
    accuracy = (votes.argmax(1) == knn.query_labels).double().mean().item()
    return accuracy, bank


def knn_worker(rank: int, world_size: int) -> dict:
    import contrastive_accelerate.knn as knn_module

    model, knn = _setup()
    accuracy = knn_top1(model, knn, batch_size=64)
    bank, _ = knn_features(model, knn, knn.bank, knn.bank_labels, 64)
    # The negative control: each rank's queries against its own share of the bank only.
    knn_module.all_gather_rows = lambda features: features
    local_bank_accuracy = knn_top1(model, knn, batch_size=64)
    return {
        "accuracy": accuracy,
        "bank": all_gather_rows(bank).tolist(),
        "local_rows": len(bank),
        "local_bank_accuracy": local_bank_accuracy,
    }


@pytest.fixture(scope="module")
def sharded():
    cache: dict[int, list[dict]] = {}

    def get(world_size: int) -> list[dict]:
        if world_size not in cache:
            cache[world_size] = run_on_ranks(knn_worker, world_size)
        return cache[world_size]

    return get


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_sharded_evaluation_equals_the_whole_evaluation(sharded, world_size):
    model, knn = _setup()
    accuracy, bank = _reference(model, knn)
    results = sharded(world_size)
    for result in results:
        error = (torch.tensor(result["bank"]) - bank).abs().max().item()
        print(f"W={world_size}: accuracy {result['accuracy']:.4f} (whole {accuracy:.4f}), "
              f"bank features {error:.1e}")  # fmt: skip
        assert result["accuracy"] == accuracy
        assert error <= FLOAT32
    assert sum(result["local_rows"] for result in results) == len(knn.bank)


def test_negative_control_without_the_gathered_bank_accuracy_changes(sharded):
    model, knn = _setup()
    accuracy, _ = _reference(model, knn)
    result = sharded(3)[0]
    print(f"W=3, each rank's own bank share: {result['local_bank_accuracy']:.4f} vs {accuracy:.4f}")
    assert result["local_bank_accuracy"] != accuracy


def unreadable_worker(rank: int, world_size: int, root: str, skip: bool) -> dict:
    data = load_image_dataset(root, eval_holdout=0.0)
    torch.manual_seed(0)
    model = SimCLR("mlp", image_size=8).eval()
    knn = knn_data(data.train, data.train, data.image_column, data.label_column, 8, skip)
    try:
        return {"accuracy": knn_top1(model, knn, k=3, batch_size=4)}
    except ValueError as error:
        return {"error": str(error)}


def test_an_unreadable_image_stops_every_rank_or_is_skipped_by_all(tmp_path):
    from launch import add_unusual_images, make_image_folder

    root = make_image_folder(tmp_path, count=10)
    truncated, _ = add_unusual_images(root)
    failed = run_on_ranks(unreadable_worker, 2, str(root), False)
    assert all(str(truncated) in result.get("error", "") for result in failed), failed
    skipped = run_on_ranks(unreadable_worker, 2, str(root), True)
    alone = run_on_ranks(unreadable_worker, 1, str(root), True)
    assert skipped[0]["accuracy"] == skipped[1]["accuracy"] == alone[0]["accuracy"]
