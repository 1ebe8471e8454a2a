"""Row-wise log-sum-exp of ``queries @ keys.T`` with excluded columns, in memory-bounded tiles.

The denominator of every softmax-type contrastive loss here (NT-Xent, DCL, SupCon,
InfoNCE) is one such log-sum-exp per local row over the gathered columns. Computed
densely it needs a ``rows x columns`` matrix and autograd keeps several; here one
matrix at most, turned into the softmax in place during backward, and, above a
size, tiles of rows whose logits are recomputed in backward.
"""

from __future__ import annotations

import math

import torch

from losses.precision import autocast_off

#: Logits up to this size are computed in one tile (and kept for backward).
DENSE_MAX_BYTES = 2**30


def tiled_logsumexp(
    queries: torch.Tensor,
    keys: torch.Tensor,
    excluded_columns: torch.Tensor | None = None,
    tile_rows: int | None = None,
    dense_max_bytes: int = DENSE_MAX_BYTES,
) -> torch.Tensor:
    """``lse_i = log sum_{j not excluded for i} exp(queries_i . keys_j)`` for every row i.

    ``excluded_columns``: ``(rows, k)`` column indices left out of row i's sum (a
    sample's own column, its positive), or a ``(rows, columns)`` boolean mask of them,
    or None. A row must keep one column. ``tile_rows``: rows per tile;
    None picks one tile while the logits fit in ``dense_max_bytes``.
    """
    if tile_rows is None:
        tile_rows = auto_tile_rows(queries.shape[0], keys.shape[0], queries, dense_max_bytes)
    with autocast_off(queries.device):
        return _TiledLogSumExp.apply(queries, keys, excluded_columns, tile_rows)


def cross_entropy(queries: torch.Tensor, keys: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``loss_i = -log softmax(l_i)[t_i]`` of the logits ``l = queries @ keys.T``, for every
    row i, exact near 0.

    ``targets``: ``(rows, 1)`` column indices ``t_i``. ``F.cross_entropy`` reads the loss
    of a dominant target as ``-(l_it - lse_i)`` with ``lse_i = l_it + log(1 + eps_i)``,
    ``eps_i = sum_{j != t} exp(l_ij - l_it)``: in float32 ``log(1 + eps)`` is 0 below
    ``eps = 6e-8``, where a well-trained CLIP sits. Here, with ``p = softmax(l)``::

        loss_i = log(p_it + m_i) - log p_it = softplus(log m_i - log p_it)
        m_i = sum_{j != t} p_ij

    where each term of ``m_i`` keeps its own relative precision: never negative, and as
    exact at 1e-24 as at 10. One ``rows x columns`` matrix is kept for backward, as
    ``F.cross_entropy`` keeps one, and autocast is off in forward and backward.
    """
    with autocast_off(queries.device):
        return _CrossEntropy.apply(queries, keys, targets)


class _CrossEntropy(torch.autograd.Function):
    """forward:  ``loss_i = softplus(log m_i - log p_it)``, ``p = softmax(q k^T)``,
    ``m_i = sum_{j != t_i} p_ij``.

    backward: with ``G_ij = (p_ij - [j = t_i]) * g_i``, ``dq = G k`` and ``dk = G^T q``.
    The target column of ``p - onehot`` is ``-m_i``, kept from forward, rather than
    ``p_it - 1``, which cancels.
    """

    @staticmethod
    def forward(ctx, queries, keys, targets):
        log_probs = torch.log_softmax(queries @ keys.mT, dim=-1)
        log_target = log_probs.gather(-1, targets)
        probs = log_probs.exp_()  # in place: the matrix backward needs
        probs.scatter_(-1, targets, 0.0)
        others = probs.sum(dim=-1, keepdim=True)  # m_i
        probs.scatter_(-1, targets, -others)  # p - onehot
        ctx.save_for_backward(queries, keys, probs)
        return softplus(others.log_().sub_(log_target)).squeeze(-1)

    @staticmethod
    def backward(ctx, grad_loss):
        queries, keys, probs = ctx.saved_tensors
        # Backward may run inside the caller's autocast block: keep float32 here too.
        with autocast_off(queries.device):
            weighted = probs * grad_loss.unsqueeze(-1)
            return weighted @ keys, weighted.mT @ queries, None


def softplus(x: torch.Tensor) -> torch.Tensor:
    """``log(1 + exp(x))`` to the last bit: ``F.softplus`` returns ``x`` itself above 20,
    off by up to ``exp(-20)`` (2e-9), which float64 comparisons with a peer would see."""
    return torch.logaddexp(x, torch.zeros_like(x))


def auto_tile_rows(rows: int, columns: int, like: torch.Tensor, dense_max_bytes: int) -> int:
    columns = max(columns, 1)
    if rows * columns * like.element_size() <= dense_max_bytes:
        return max(rows, 1)
    # A tile of this many rows keeps its logits within 1/8 of the dense budget.
    return max(1, dense_max_bytes // (8 * columns * like.element_size()))


class _TiledLogSumExp(torch.autograd.Function):
    """forward:  ``lse_i = log sum_{j in J(i)} exp(q_i . k_j)``, tile by tile of rows.

    backward: with ``P_ij = exp(q_i . k_j - lse_i) * g_i`` for j in J(i) (zero
    elsewhere), ``dq = P k`` and ``dk = P^T q``. A single tile keeps its logits from
    forward and turns them into ``P`` in place; several tiles recompute them, so
    memory stays at one tile of logits.
    """

    @staticmethod
    def forward(ctx, queries, keys, excluded_columns, tile_rows: int):
        rows = queries.shape[0]
        log_denominator = queries.new_empty(rows)
        logits = None
        for start in range(0, rows, tile_rows):
            logits = _masked_logits(queries, keys, excluded_columns, start, tile_rows)
            torch.logsumexp(logits, dim=1, out=log_denominator[start : start + tile_rows])
        ctx.tile_rows = tile_rows
        ctx.saved_logits = logits if rows <= tile_rows else None
        ctx.save_for_backward(queries, keys, log_denominator, excluded_columns)
        return log_denominator

    @staticmethod
    def backward(ctx, grad_log_denominator):
        queries, keys, log_denominator, excluded_columns = ctx.saved_tensors
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
                    probs = _masked_logits(queries, keys, excluded_columns, start, ctx.tile_rows)
                probs.sub_(log_denominator[start:stop, None]).exp_()
                probs.mul_(grad_log_denominator[start:stop, None])
                torch.mm(probs, keys, out=grad_queries[start:stop])
                grad_keys.addmm_(probs.T, queries[start:stop])
        return grad_queries, grad_keys, None, None


def _masked_logits(queries, keys, excluded_columns, start: int, tile_rows: int) -> torch.Tensor:
    logits = queries[start : start + tile_rows] @ keys.T
    if excluded_columns is not None and excluded_columns.dtype == torch.bool:
        logits.masked_fill_(excluded_columns[start : start + tile_rows], -math.inf)
    elif excluded_columns is not None:
        logits.scatter_(1, excluded_columns[start : start + tile_rows], -math.inf)
    return logits
