"""Two-tower losses of the CLIP family (InfoNCE, SigLIP) over the global batch of all ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from contrastive_accelerate import collectives
from losses.inputs import check_batch, require_global_batch
from losses.logsumexp import (
    DENSE_MAX_BYTES,
    auto_tile_rows,
    cross_entropy,
    softplus,
    tiled_logsumexp,
)
from losses.precision import autocast_off, compute_dtype, matmul


def _as_tensor(value, like: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(like.dtype).reshape(())
    return like.new_tensor(float(value))


class InfoNCELoss(nn.Module):
    """Symmetric InfoNCE of two towers or two views, as in CLIP (Radford et al., 2021).

    For the global batch of N pairs ``(f0_i, f1_i)`` (features as given: CLIP models
    normalise them themselves) and ``l_ij = logit_scale * f0_i . f1_j``::

        loss = 1/(2N) * sum_i [ CE(l_i., i) + CE(l_.i, i) ]
             = 1/(2N) * sum_i [ log sum_j exp(l_ij) + log sum_j exp(l_ji) - 2 l_ii ]
             = 1/(2N) * sum_i [ softplus(log sum_{j != i} exp(l_ij) - l_ii) + (the same for l_ji) ]

    Each term is computed never negative and exact near 0, where a well-trained CLIP
    sits (the middle form subtracts nearly equal values): by ``cross_entropy`` (of
    ``losses.logsumexp``) on the logits in one tile, and as the last form in several.

    On one process this is open_clip's ``ClipLoss``. Each rank computes its own rows
    of both directions against the gathered columns of the other tower, with
    positives at their global index (uneven batches included; peers assume
    ``arange(n) + rank * n``). ``logit_scale`` is a float or a scalar tensor that may
    require grad; its gradient is exact too when it is a parameter of the DDP-wrapped
    model (see ``losses``).

    Example::

        criterion = InfoNCELoss()
        z0, z1 = F.normalize(model(view0), dim=1), F.normalize(model(view1), dim=1)
        loss = criterion(z0, z1, model.log_logit_scale.exp())  # SimCLR(logit_scale=1 / 0.07)
        accelerator.backward(loss)
    """

    def __init__(
        self,
        *,
        gather_distributed: bool = True,
        tile_rows: int | None = None,
        dense_max_bytes: int = DENSE_MAX_BYTES,
    ) -> None:
        super().__init__()
        self.gather_distributed = gather_distributed
        self.tile_rows = tile_rows
        self.dense_max_bytes = dense_max_bytes

    def forward(
        self,
        features0: torch.Tensor,
        features1: torch.Tensor,
        logit_scale,
        *,
        sizes: list[int] | None = None,
    ) -> torch.Tensor:
        name = type(self).__name__
        rank, world_size, sizes, (features0, features1, _) = check_batch(
            name, features0, features1, scalars=(logit_scale,),
            gather_distributed=self.gather_distributed, sizes=sizes,
        )  # fmt: skip
        require_global_batch(name, sizes, 2, "so that every sample has a negative")
        with autocast_off(features0.device):
            dtype = compute_dtype(features0, features1)
            f0, f1 = features0.to(dtype), features1.to(dtype)
            scale = _as_tensor(logit_scale, f0)
            keys0 = collectives.gather(f0, sizes=sizes) if world_size > 1 else f0
            keys1 = collectives.gather(f1, sizes=sizes) if world_size > 1 else f1
            tile_rows = self.tile_rows or auto_tile_rows(
                len(f0), len(keys0), f0, self.dense_max_bytes
            )
            offset = sum(sizes[:rank])
            own = torch.arange(offset, offset + len(f0), device=f0.device)[:, None]  # positives
            if tile_rows >= len(f0):  # one tile: the logits, as open_clip has them
                terms = cross_entropy(scale * f0, keys1, own)
                terms = terms + cross_entropy(scale * f1, keys0, own)
            else:
                negatives0 = tiled_logsumexp(scale * f0, keys1, own, tile_rows)
                negatives1 = tiled_logsumexp(scale * f1, keys0, own, tile_rows)
                positive = scale * (f0 * f1).sum(dim=1)
                terms = softplus(negatives0 - positive) + softplus(negatives1 - positive)
            return terms.sum() * (world_size / (2 * sum(sizes)))


class SigLIPLoss(nn.Module):
    """Pairwise sigmoid loss of SigLIP (Zhai et al., 2023) over the global batch.

    For N pairs, ``l_ij = logit_scale * f0_i . f1_j + logit_bias`` and ``y_ij = 1``
    if i == j else -1 (features as given)::

        loss = -1/N * sum_i sum_j log sigmoid(y_ij l_ij)

    On one process this is open_clip's ``SigLipLoss``. Each rank scores its rows
    against the gathered second tower (n x d features per rank: small) in tiles of
    ``tile_columns`` gathered columns, each tile recomputed in backward
    (``torch.utils.checkpoint``), so the n x N logits never exist at once and memory
    stays at one tile however many ranks there are (open_clip issue #942; its
    alternative is a ring exchange with neighbours). None picks one tile while it
    takes at most ``dense_max_bytes``. ``logit_scale`` and ``logit_bias`` are floats
    or scalar tensors that may require grad.

    Example::

        criterion = SigLIPLoss()  # SimCLR(logit_scale=10.0, logit_bias=-10.0)
        z0, z1 = F.normalize(model(view0), dim=1), F.normalize(model(view1), dim=1)
        loss = criterion(z0, z1, model.log_logit_scale.exp(), model.logit_bias)
        accelerator.backward(loss)
    """

    def __init__(
        self,
        *,
        gather_distributed: bool = True,
        tile_columns: int | None = None,
        dense_max_bytes: int = DENSE_MAX_BYTES,
    ) -> None:
        super().__init__()
        if tile_columns is not None and tile_columns < 1:
            raise ValueError(f"SigLIPLoss: tile_columns must be >= 1, got {tile_columns}")
        self.gather_distributed = gather_distributed
        self.tile_columns = tile_columns
        self.dense_max_bytes = dense_max_bytes

    def forward(
        self,
        features0: torch.Tensor,
        features1: torch.Tensor,
        logit_scale,
        logit_bias,
        *,
        sizes: list[int] | None = None,
    ) -> torch.Tensor:
        name = type(self).__name__
        rank, world_size, sizes, (features0, features1, _) = check_batch(
            name, features0, features1, scalars=(logit_scale, logit_bias),
            gather_distributed=self.gather_distributed, sizes=sizes,
        )  # fmt: skip
        require_global_batch(name, sizes, 1, "")
        with autocast_off(features0.device):
            dtype = compute_dtype(features0, features1)
            f0, f1 = features0.to(dtype), features1.to(dtype)
            scale, bias = _as_tensor(logit_scale, f0), _as_tensor(logit_bias, f0)
            keys = collectives.gather(f1, sizes=sizes) if world_size > 1 else f1
            offset, columns = sum(sizes[:rank]), len(keys)
            tile = self.tile_columns or auto_tile_rows(
                columns, max(len(f0), 1), f0, self.dense_max_bytes
            )
            if tile >= columns:
                local_sum = _sigmoid_loss_tile(f0, keys, scale, bias, offset)
            else:
                local_sum = sum(
                    checkpoint(
                        _sigmoid_loss_tile,
                        f0,
                        keys[start : start + tile],
                        scale,
                        bias,
                        offset - start,
                        use_reentrant=False,
                    )
                    for start in range(0, columns, tile)
                )
            return local_sum * (world_size / sum(sizes))


def _sigmoid_loss_tile(queries, keys, scale, bias, positive_offset: int) -> torch.Tensor:
    """``-sum log sigmoid(y_ij l_ij)`` of one tile; the positive of row i is column
    ``i + positive_offset`` (when inside the tile). Float32 also when recomputed in a
    backward that runs inside autocast."""
    with autocast_off(queries.device):
        return _sigmoid_loss(queries, keys, scale, bias, positive_offset)


def _sigmoid_loss(queries, keys, scale, bias, positive_offset: int) -> torch.Tensor:
    logits = scale * matmul(queries, keys.T) + bias
    # +1 on each row's positive column (if inside the tile), -1 elsewhere: a comparison,
    # not a boolean-mask assignment, whose shape would depend on the data.
    rows = torch.arange(len(queries), device=queries.device)
    columns = torch.arange(len(keys), device=queries.device)
    positive = columns[None, :] == (rows + positive_offset)[:, None]
    signs = torch.where(positive, 1.0, -1.0).to(logits.dtype)
    return -F.logsigmoid(signs * logits).sum()
