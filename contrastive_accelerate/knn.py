"""kNN evaluation: top-1 accuracy of a weighted k-nearest-neighbour classifier on encoder
features (Wu et al., 2018), a standard probe of representation quality during training.

Sharded and streamed: every rank decodes and embeds its contiguous share of the bank
and of the queries, a batch at a time; the bank's features are gathered to every rank,
each rank classifies its own queries, and one all-reduce sums the correct answers. Peak
memory grows with the number of features (bank and queries x feature width) and one
batch of similarities, never with images x pixels or queries x bank, and no rank waits
idle while another evaluates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from contrastive_accelerate.collectives import all_gather_rows, rank_and_world_size
from contrastive_accelerate.data import DataError, UnreadableImage, evaluation_images
from contrastive_accelerate.ranks import any_rank, raise_together

#: At most this many training images form the neighbour bank.
BANK_SIZE = 10_000


@dataclass
class KnnData:
    """The bank (training images) and the queries, undecoded, with integer labels."""

    bank: object  # a datasets.Dataset
    bank_labels: torch.Tensor
    queries: object
    query_labels: torch.Tensor
    image_column: str
    image_size: int
    skip_unreadable: bool


def evaluated_images(config, data) -> tuple[Any, str]:
    """What kNN evaluation reads: ``--eval-dataset``'s splits (a labelled table: the bank
    its training split, the queries its evaluation split or ``--eval-holdout`` of it, as
    a training table's), else the training data's own (none for a stream or a mixture);
    and the line that says where they come from. Image-text reads the table's image
    column under the training data's name, as its retrieval does (``--columns``); an
    image method finds it as a table's."""
    if config.eval_dataset is None:
        return data, data.evaluation_source
    from contrastive_accelerate.data.pairs import MixedPairs, PairData
    from contrastive_accelerate.data.sources import load_image_dataset

    name = config.eval_dataset
    image_text = isinstance(data, (PairData, MixedPairs))
    held = load_image_dataset(name, image_column=data.image_column if image_text else None)
    if held.label_column is None or held.evaluation is None:
        raise DataError(
            f"--eval-dataset {name!r}: kNN needs labels and held-out images; it has "
            f"{'no label column' if held.label_column is None else 'no evaluation split'}"
        )
    queries, bank = len(held.evaluation), min(len(held.train), BANK_SIZE)
    return held, f"kNN evaluation: --eval-dataset {name!r}, {queries} queries, a bank of {bank}"


def knn_data(
    train, evaluation, image_column: str, label_column: str, image_size: int, skip_unreadable: bool
) -> KnnData:
    """The evaluation's datasets and their labels (only the label column is read here)."""
    bank = train.select(range(min(len(train), BANK_SIZE)))
    bank_labels, query_labels = bank[label_column], evaluation[label_column]
    # Labels may be strings (a CSV's class names): number them consistently.
    classes = {label: i for i, label in enumerate(sorted(set(bank_labels) | set(query_labels)))}
    return KnnData(
        bank,
        torch.tensor([classes[label] for label in bank_labels]),
        evaluation,
        torch.tensor([classes[label] for label in query_labels]),
        image_column,
        image_size,
        skip_unreadable,
    )


@torch.no_grad()
def knn_top1(
    model,
    data: KnnData,
    k: int = 20,
    temperature: float = 0.07,
    batch_size: int = 256,
) -> float:
    """Top-1 accuracy of a cosine-similarity kNN classifier with exp(sim / t) weighted votes.

    ``model.embed(images)`` gives the features. Call it on every rank (or on one
    process): each embeds its share. An unreadable image raises on every rank, or is
    left out with a warning when ``data.skip_unreadable``.
    """
    bank, bank_labels = knn_features(model, data, data.bank, data.bank_labels, batch_size)
    bank, bank_labels = all_gather_rows(bank), all_gather_rows(bank_labels)
    if len(bank) == 0:
        raise DataError("no readable training image for the kNN bank")
    queries, query_labels = knn_features(model, data, data.queries, data.query_labels, batch_size)
    correct = torch.zeros((), dtype=torch.float64, device=bank.device)
    classes = int(bank_labels.max()) + 1
    # A batch of queries at a time: the similarities never exceed batch x bank.
    for batch, labels in zip(
        queries.split(batch_size), query_labels.split(batch_size), strict=True
    ):
        similarity, neighbours = (batch @ bank.T).topk(min(k, len(bank)), dim=1)
        votes = torch.zeros(len(batch), classes, device=bank.device)
        votes.scatter_add_(1, bank_labels[neighbours], (similarity / temperature).exp())
        correct += (votes.argmax(1) == labels).sum()
    counts = torch.stack([correct, correct.new_tensor(len(queries))])
    if rank_and_world_size()[1] > 1:
        dist.all_reduce(counts)
    if counts[1] == 0:  # every rank sees the same sums: every rank raises
        raise DataError("no readable evaluation image")
    return (counts[0] / counts[1]).item()


def knn_features(model, data: KnnData, dataset, labels: torch.Tensor, batch_size: int):
    """This rank's share of ``dataset``: normalised float32 features and their labels,
    ``batch_size`` images at a time; every rank calls ``model.embed`` as many times."""
    device, dtype = _placement(model)
    rank, world_size = rank_and_world_size()
    share = torch.arange(len(dataset)).tensor_split(world_size)[rank]
    # Every rank runs the same number of batches (some empty): each exchanges its news.
    batches = math.ceil(math.ceil(len(dataset) / world_size) / batch_size)
    features, kept_labels = [], []
    for index in range(batches):
        indices = share[index * batch_size : (index + 1) * batch_size]
        images, kept, problem = None, [], None
        try:
            images, kept = evaluation_images(
                dataset,
                data.image_column,
                data.image_size,
                data.skip_unreadable,
                indices=indices.tolist(),
            )
        except UnreadableImage as unreadable:
            problem = unreadable
        (failed,) = any_rank(problem is not None)
        if failed:
            raise_together(problem)
        if not kept:
            images = torch.zeros(0, 3, data.image_size, data.image_size)
        # Every batch, even an empty one: a sharded model's forward is a collective.
        embedded = model.embed(images.to(device, dtype))
        features.append(F.normalize(embedded.float(), dim=1))
        kept_labels.append(labels[kept])
    if not features:  # no batch at all still gives its (0, width) part to the gather
        empty = torch.zeros(0, 3, data.image_size, data.image_size)
        features.append(model.embed(empty.to(device, dtype)).float())
        kept_labels.append(labels[:0])
    return torch.cat(features), torch.cat(kept_labels).to(device)


def _placement(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Where the model's images go: its parameters' device and dtype (CPU float32 without)."""
    parameter = next(model.parameters(), None)
    return (
        (torch.device("cpu"), torch.float32)
        if parameter is None
        else (parameter.device, parameter.dtype)
    )


class RawPixels(nn.Module):
    """The identity encoder: each image's pixels as its features, the baseline that a
    trained encoder's features must beat on the same held-out images."""

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        return images.flatten(1)


def zero_shot_top1(
    image_projections: nn.Module,
    class_embeddings: torch.Tensor,
    data: KnnData,
    batch_size: int = 256,
) -> float:
    """Zero-shot top-1 accuracy (CLIP): each held-out image's class is the one whose text
    embedding (``class_embeddings``, one row per class in ``data``'s label order) is the
    most similar to the image's projection, ``image_projections.embed(images)``. Sharded
    as the kNN's queries are; one all-reduce sums the correct answers."""
    queries, labels = knn_features(image_projections, data, data.queries, data.query_labels,
                                   batch_size)  # fmt: skip
    classes = F.normalize(class_embeddings.float(), dim=1).to(queries.device)
    correct = (queries @ classes.T).argmax(1).eq(labels).sum().double()
    counts = torch.stack([correct, correct.new_tensor(len(queries))])
    if rank_and_world_size()[1] > 1:
        dist.all_reduce(counts)
    if counts[1] == 0:
        raise DataError("no readable evaluation image")
    return (counts[0] / counts[1]).item()
