"""Linear probe: logistic regression on frozen, L2-normalised encoder features, the second
standard evaluation of self-supervised learning next to kNN.

Every rank embeds its share of the bank (training images) and of the queries, the
features are gathered, and the main process fits scikit-learn's multinomial logistic
regression on the bank and scores the queries; every rank receives the accuracy.
"""

from __future__ import annotations

import torch
from torch import nn

from contrastive_accelerate.collectives import all_gather_rows
from contrastive_accelerate.knn import KnnData, knn_features
from contrastive_accelerate.ranks import on_main_process

#: Inverse L2 strength: the features lie on the unit sphere, where logits are small, so the
#: probe needs weak regularisation (scikit-learn's default C=1 underfits them).
INVERSE_REGULARISATION = 10.0


@torch.no_grad()
def linear_probe_top1(model: nn.Module, data: KnnData, batch_size: int = 256) -> float:
    """Top-1 accuracy on ``data.queries`` of a logistic regression fitted on ``data.bank``.

    ``model.embed(images)`` gives the features. Call it on every rank (or on one process).
    """
    bank, bank_labels = knn_features(model, data, data.bank, data.bank_labels, batch_size)
    queries, query_labels = knn_features(model, data, data.queries, data.query_labels, batch_size)
    gathered = [
        all_gather_rows(t).cpu().numpy() for t in (bank, bank_labels, queries, query_labels)
    ]
    return on_main_process(_fit_and_score, *gathered, errors=(ValueError,))


def _fit_and_score(bank, bank_labels, queries, query_labels) -> float:
    from sklearn.linear_model import LogisticRegression

    if len(queries) == 0 or len(set(bank_labels.tolist())) < 2:
        raise ValueError("linear probe: needs evaluation images and two classes in the bank")
    probe = LogisticRegression(C=INVERSE_REGULARISATION, max_iter=5000)
    probe.fit(bank.astype("float64"), bank_labels)
    return float(probe.score(queries.astype("float64"), query_labels))
