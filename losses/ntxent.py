"""NT-Xent (SimCLR) loss over the global batch of all ranks."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from losses.distributed import all_gather_sizes, gather, is_distributed
from losses.precision import autocast_off, compute_dtype

_SHAPE_MISMATCH, _NOT_2D, _NOT_FINITE = 1, 2, 3
_PROBLEMS = {
    _SHAPE_MISMATCH: "out0 and out1 have different shapes",
    _NOT_2D: "out0 and out1 must be 2-D (batch, features)",
    _NOT_FINITE: "embeddings contain NaN or Inf",
}


class NTXentLoss(nn.Module):
    """Normalised temperature-scaled cross entropy (NT-Xent), SimCLR (Chen et al., 2020).

    For the 2N L2-normalised embeddings of N pairs in the global batch, with
    ``s_ij = z_i . z_j / temperature`` and ``p(i)`` the other view of sample i::

        loss = 1/(2N) * sum_i [ -s_{i,p(i)} + log sum_{j != i} exp(s_ij) ]

    Inputs of any floating dtype, inside or outside autocast: the similarities,
    log-sum-exp and the loss are computed in float32 (float64 stays float64), and
    the gradient is returned in the input's dtype.

    Each rank computes the rows of its own 2n samples against all 2N gathered
    columns, never the full 2N x 2N matrix, with one similarity matmul over both
    views. The gather is differentiable (``losses.gather``), and the local sum is
    scaled by ``world_size / (2N)`` so that DDP's gradient *average* equals the
    single-process gradient on the concatenated global batch, for uneven per-rank
    batch sizes too. The mean of the returned values over ranks is the loss above.
    (``Accelerator.gather`` in place of the gather would carry no gradient to the
    other ranks: each would optimise only the rows of its own samples.)

    Rows are processed in tiles of ``tile_rows``; when the rows do not fit in one
    tile, similarities are recomputed in backward, so extra memory grows as
    ``O(tile_rows x 2N)`` instead of ``O(2n x 2N)``. ``None`` picks one tile when
    the local logits take at most ``dense_max_bytes``.

    Example::

        criterion = NTXentLoss(temperature=0.5)
        loss = criterion(model(view0), model(view1))
        accelerator.backward(loss)
    """

    def __init__(
        self,
        temperature: float = 0.5,
        gather_distributed: bool = True,
        tile_rows: int | None = None,
        dense_max_bytes: int = 2**30,
    ) -> None:
        super().__init__()
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"NTXentLoss: temperature must be positive, got {temperature}")
        if tile_rows is not None and tile_rows < 1:
            raise ValueError(f"NTXentLoss: tile_rows must be >= 1, got {tile_rows}")
        self.temperature = temperature
        self.gather_distributed = gather_distributed
        self.tile_rows = tile_rows
        self.dense_max_bytes = dense_max_bytes

    def forward(self, out0: torch.Tensor, out1: torch.Tensor) -> torch.Tensor:
        problem = _check_local(out0, out1)
        if self.gather_distributed and is_distributed():
            rank, world_size = dist.get_rank(), dist.get_world_size()
            # One small collective tells every rank about every rank's problem, so
            # they all raise together instead of some waiting in the gather.
            sizes, problems = all_gather_sizes(out0, error_code=problem[0] if problem else 0)
            if problem:
                raise ValueError(f"NTXentLoss: {problem[1]}")
            for bad_rank, code in enumerate(problems):
                if code:
                    raise ValueError(f"NTXentLoss: rank {bad_rank}: {_PROBLEMS[code]}")
        else:
            if problem:
                raise ValueError(f"NTXentLoss: {problem[1]}")
            rank, world_size, sizes = 0, 1, [out0.shape[0]]
        global_pairs = sum(sizes)
        if global_pairs < 2:
            raise ValueError(
                f"NTXentLoss: the global batch has {global_pairs} pair(s); at least 2 are "
                "needed so that every sample has a negative"
            )

        dtype = compute_dtype(out0, out1)
        with autocast_off(out0.device):
            z0 = F.normalize(out0.to(dtype), dim=1)
            z1 = F.normalize(out1.to(dtype), dim=1)
            local = torch.cat([z0, z1])  # rows 0..n-1: first views, n..2n-1: second views
            if world_size > 1:
                keys = gather(local, sizes=[2 * size for size in sizes])
            else:
                keys = local
            self_offset = 2 * sum(sizes[:rank])
            tile_rows = self.tile_rows or _auto_tile_rows(local, keys, self.dense_max_bytes)
            log_denominator = _LogSumExpOverNegatives.apply(
                local / self.temperature, keys, self_offset, tile_rows
            )
            positive = (z0 * z1).sum(dim=1) / self.temperature
            local_sum = log_denominator.sum() - 2 * positive.sum()
            return local_sum * (world_size / (2 * global_pairs))


def _check_local(out0: torch.Tensor, out1: torch.Tensor) -> tuple[int, str] | None:
    if out0.shape != out1.shape:
        return _SHAPE_MISMATCH, (
            f"{_PROBLEMS[_SHAPE_MISMATCH]}: {tuple(out0.shape)} and {tuple(out1.shape)}"
        )
    if out0.dim() != 2:
        return _NOT_2D, f"{_PROBLEMS[_NOT_2D]}, got shape {tuple(out0.shape)}"
    if not (torch.isfinite(out0).all() and torch.isfinite(out1).all()):
        return _NOT_FINITE, _PROBLEMS[_NOT_FINITE]
    return None


def _auto_tile_rows(queries: torch.Tensor, keys: torch.Tensor, dense_max_bytes: int) -> int:
    rows, columns = queries.shape[0], max(keys.shape[0], 1)
    if rows * columns * queries.element_size() <= dense_max_bytes:
        return max(rows, 1)
    # A tile of this many rows keeps its logits within 1/8 of the dense budget.
    return max(1, dense_max_bytes // (8 * columns * queries.element_size()))


class _LogSumExpOverNegatives(torch.autograd.Function):
    """Row-wise ``lse_i = log sum_{j != self(i)} exp(q_i . k_j)`` in tiles of rows.

    ``self(i) = self_offset + i`` is the column of row i's own embedding.
    Backward: with ``P_ij = exp(q_i . k_j - lse_i) * g_i`` (zero at the self column),
    ``dq = P k`` and ``dk = P^T q``. A single tile keeps its logits from forward
    and turns them into ``P`` in place; several tiles recompute them, so memory
    stays at one tile of logits.
    """

    @staticmethod
    def forward(ctx, queries, keys, self_offset: int, tile_rows: int):
        rows = queries.shape[0]
        log_denominator = queries.new_empty(rows)
        logits = None
        for start in range(0, rows, tile_rows):
            logits = _masked_logits(queries, keys, self_offset, start, tile_rows)
            torch.logsumexp(logits, dim=1, out=log_denominator[start : start + tile_rows])
        single_tile = rows <= tile_rows
        ctx.self_offset, ctx.tile_rows = self_offset, tile_rows
        ctx.saved_logits = logits if single_tile else None
        ctx.save_for_backward(queries, keys, log_denominator)
        return log_denominator

    @staticmethod
    def backward(ctx, grad_log_denominator):
        queries, keys, log_denominator = ctx.saved_tensors
        grad_queries = torch.empty_like(queries)
        grad_keys = torch.zeros_like(keys)
        saved_logits, ctx.saved_logits = ctx.saved_logits, None  # consumed in place below
        # Backward may run inside the caller's autocast block: keep float32 here too.
        with autocast_off(queries.device):
            for start in range(0, queries.shape[0], ctx.tile_rows):
                stop = start + ctx.tile_rows
                if saved_logits is not None:
                    probs = saved_logits
                else:
                    probs = _masked_logits(queries, keys, ctx.self_offset, start, ctx.tile_rows)
                probs.sub_(log_denominator[start:stop, None]).exp_()
                probs.mul_(grad_log_denominator[start:stop, None])
                torch.mm(probs, keys, out=grad_queries[start:stop])
                grad_keys.addmm_(probs.T, queries[start:stop])
        return grad_queries, grad_keys, None, None


def _masked_logits(queries, keys, self_offset: int, start: int, tile_rows: int) -> torch.Tensor:
    logits = queries[start : start + tile_rows] @ keys.T
    logits.diagonal(self_offset + start).fill_(-math.inf)
    return logits
