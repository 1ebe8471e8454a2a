"""kNN evaluation: top-1 accuracy of a weighted k-nearest-neighbour classifier on encoder
features (Wu et al., 2018), a standard probe of representation quality during training."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from contrastive_accelerate.data import evaluation_images

#: At most this many training images form the neighbour bank.
BANK_SIZE = 10_000


@dataclass
class KnnData:
    bank_images: torch.Tensor
    bank_labels: torch.Tensor
    query_images: torch.Tensor
    query_labels: torch.Tensor


def knn_data(
    train, evaluation, image_column: str, label_column: str, image_size: int, skip_unreadable: bool
) -> KnnData:
    """Images and integer labels of the bank (training images) and of the queries."""
    bank = train.select(range(min(len(train), BANK_SIZE)))
    bank_images, bank_kept = evaluation_images(bank, image_column, image_size, skip_unreadable)
    query_images, query_kept = evaluation_images(
        evaluation, image_column, image_size, skip_unreadable
    )
    bank_labels = [bank[label_column][i] for i in bank_kept]
    query_labels = [evaluation[label_column][i] for i in query_kept]
    # Labels may be strings (a CSV's class names): number them consistently.
    classes = {label: i for i, label in enumerate(sorted(set(bank_labels) | set(query_labels)))}
    return KnnData(
        bank_images,
        torch.tensor([classes[label] for label in bank_labels]),
        query_images,
        torch.tensor([classes[label] for label in query_labels]),
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

    ``model.embed(images)`` gives the features.
    """
    parameter = next(model.parameters())

    def features(images: torch.Tensor) -> torch.Tensor:
        chunks = [
            model.embed(chunk.to(parameter.device, parameter.dtype))
            for chunk in images.split(batch_size)
        ]
        return F.normalize(torch.cat(chunks).float(), dim=1)

    bank, queries = features(data.bank_images), features(data.query_images)
    bank_labels = data.bank_labels.to(bank.device)
    similarity, neighbours = (queries @ bank.T).topk(min(k, len(bank)), dim=1)
    votes = torch.zeros(len(queries), int(bank_labels.max()) + 1, device=bank.device)
    votes.scatter_add_(1, bank_labels[neighbours], (similarity / temperature).exp())
    predicted = votes.argmax(1).cpu().numpy()
    return float(np.mean(predicted == data.query_labels.numpy()))
