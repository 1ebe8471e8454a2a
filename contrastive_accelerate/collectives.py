"""Every collective of the project: differentiable ones for losses, plain ones for the rest.

Why not ``Accelerator.gather`` or ``torch.distributed.all_gather``: both return
tensors without autograd history, so the gradient that rank A's loss sends into
rank B's embeddings is dropped. Training still runs, but every rank optimises
only the part of the objective that touches its own rows. The widely copied
``GatherLayer`` whose backward returns ``grad_output[rank_slice]`` has the same
defect: it forgets the gradients that the *other* ranks' losses produced.

As in ``torch/distributed/nn/functional.py``, each differentiable collective is a
thin public function over a private ``autograd.Function`` with its forward and
backward side by side:

- ``gather``: all-gather along dim 0; its backward gives rank r, for its own rows,
  the sum over all ranks of the incoming gradient, which is exactly the gradient of
  ``sum_k loss_k(cat(x_0, ..., x_{W-1}))`` with respect to ``x_r``.
- ``all_reduce``: a sum over ranks whose backward sums the gradient over ranks too,
  for losses of global statistics (Barlow Twins, VICReg).

Ranks may hold different numbers of rows, none included: the one padded all-gather
(``all_gather_rows``) pads to the largest share, gathers and trims. Where the losses
return ``world_size / global_count`` times their local sum, DDP's gradient average is
the single-process gradient and the mean of the returned values is the loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from contrastive_accelerate.compat import group_timeout

# torch >= 2.10 renamed the single-tensor collectives; the old names warn there.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

#: Exact backward collectives of ``gather``, each giving rank r the sum over ranks of the
#: gradient of its rows: a reduce-scatter (each rank receives only its rows: 1/W of an
#: all-reduce's traffic), an all-to-all of the row blocks summed locally (what
#: ``torch.distributed.nn.all_gather`` does off NCCL), or an all-reduce and a slice.
GATHER_BACKWARDS = ("auto", "reduce_scatter", "all_to_all", "all_reduce")
#: What ``backward="auto"`` uses on each backend, from ``python -m benchmarks.gather`` (README,
#: gather backward table); any other backend gets a reduce-scatter.
AUTO_BACKWARD = {"nccl": "reduce_scatter", "gloo": "all_to_all"}

# Trailing dimensions exchanged alongside dim-0 sizes, so that every rank can check
# that all ranks agree on the feature shape before the payload moves.
_MAX_DIMS = 8


def is_distributed(group: dist.ProcessGroup | None = None) -> bool:
    """True when a process group with more than one member is active."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank_and_world_size(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """This process's rank and the number of ranks; ``(0, 1)`` without a process group."""
    if not is_distributed(group):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def host_group() -> dist.ProcessGroup | None:
    """A group of every rank whose collectives run on the host, for control flags that
    must not make the host wait for the device: the default group where it is gloo, else
    a gloo group with the default group's timeout. Every rank must make the first call
    at the same point (it creates the group)."""
    if dist.get_backend() == "gloo":
        return None
    default = dist.group.WORLD
    if _host_groups.get(id(default)) is None:
        _host_groups[id(default)] = dist.new_group(backend="gloo", timeout=group_timeout())
    return _host_groups[id(default)]


_host_groups: dict[int, dist.ProcessGroup] = {}


class ShareSizes(list):
    """Every rank's number of rows as the caller knows them (a list of ints), and
    ``problems``: where a loss given these sizes (``losses.inputs``) notes that this
    rank's rows differ from its entry. Raising there would leave the other ranks waiting
    in the next collective; the caller raises the notes on every rank at a point where
    all ranks meet.

    Example::

        sizes = ShareSizes(sampler.share_sizes(batch))
        loss = NTXentLoss()(z0, z1, sizes=sizes)
        assert not sizes.problems
    """

    def __init__(self, sizes, problems: list[str] | None = None) -> None:
        super().__init__(sizes)
        self.problems = [] if problems is None else problems


def all_gather_sizes(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, error_code: int = 0
) -> tuple[list[int], list[int]]:
    """Exchange dim-0 sizes and error codes between ranks in one small collective.

    Returns ``(sizes, error_codes)`` indexed by rank. Callers pass a non-zero
    ``error_code`` for a local problem that the other ranks must learn about, so
    that every rank can raise instead of leaving the others waiting in the next
    collective. Raises ``ValueError`` on every rank when the ranks disagree on
    the trailing shape or dtype.
    """
    trailing = list(x.shape[1:])
    if not 1 <= x.dim() <= _MAX_DIMS:
        error_code, trailing = error_code or _BAD_RANK, []
    size = x.shape[0] if x.dim() else 0
    meta = [size, error_code, x.dim(), _dtype_code(x.dtype)]
    meta += trailing + [0] * (_MAX_DIMS - 1 - len(trailing))
    local = torch.tensor(meta, dtype=torch.int64, device=x.device)
    table = local.new_empty(dist.get_world_size(group) * local.numel())
    all_gather_single(table, local, group=group)
    rows = table.view(-1, local.numel()).tolist()
    sizes, error_codes = [row[0] for row in rows], [row[1] for row in rows]
    if _BAD_RANK in error_codes:
        raise ValueError(f"gather: needs a tensor with 1 to {_MAX_DIMS} dimensions on every rank")
    if not any(error_codes) and len({tuple(row[2:]) for row in rows}) > 1:
        described = "; ".join(f"rank {rank}: {_describe(row)}" for rank, row in enumerate(rows))
        raise ValueError(f"gather: ranks disagree on trailing shape or dtype ({described})")
    return sizes, error_codes


_BAD_RANK = -1
_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _dtype_code(dtype: torch.dtype) -> int:
    # Deterministic across processes (unlike hash()), and readable for floats.
    if dtype in _DTYPES:
        return _DTYPES.index(dtype)
    return len(_DTYPES) + sum(ord(char) * (i + 1) for i, char in enumerate(str(dtype)))


def _describe(row: list[int]) -> str:
    ndim, dtype_code = row[2], row[3]
    dtype = _DTYPES[dtype_code] if dtype_code < len(_DTYPES) else "non-float dtype"
    return f"trailing shape {tuple(row[4 : 4 + ndim - 1])}, {dtype}"


def all_gather_rows(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, sizes: list[int] | None = None
) -> torch.Tensor:
    """Every rank's ``x`` concatenated along dim 0 in rank order, on every rank, without
    gradient (evaluation, statistics; training losses use ``gather``).

    Ranks may hold different numbers of rows, none included; pass ``sizes`` (every
    rank's row count, e.g. from ``all_gather_sizes``) when they are known, and no size
    exchange takes place. Identity on one process.
    """
    if not is_distributed(group):
        return x
    if sizes is None:
        sizes, _ = all_gather_sizes(x, group)
    max_size = max(sizes)
    if max_size == 0:
        return x.new_empty((0, *x.shape[1:]))
    padded = _pad_rows(x.detach().contiguous(), max_size)
    gathered = padded.new_empty((len(sizes) * max_size, *x.shape[1:]))
    all_gather_single(gathered, padded, group=group)
    if all(size == max_size for size in sizes):
        return gathered
    parts = gathered.split(max_size)
    return torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)])


def gather(
    x: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    sizes: list[int] | None = None,
    *,
    backward: str = "auto",
) -> torch.Tensor:
    """Differentiable all-gather of ``x`` along dim 0, concatenated in rank order.

    forward:  ``y = cat(x_0, x_1, ..., x_{W-1})``
    backward: ``dL/dx_r = sum_k (dL_k/dy)[rows of rank r]``, where ``L_k`` is the loss
    computed on rank k. ``backward`` names the collective (``GATHER_BACKWARDS``); the
    default picks the fastest exact one for the group's backend (``AUTO_BACKWARD``). A
    backend without reduce-scatter falls back to an all-reduce of the whole gradient and a
    slice.

    Ranks may hold different dim-0 sizes; pass ``sizes`` (from ``all_gather_sizes``)
    to skip the size exchange when they are already known. Identity, with no
    collective call, when ``torch.distributed`` is not initialised or the group has
    one member.

    Example::

        z = model(x)                        # (n_local, d), requires grad
        z_all = gather(z)                   # (n_global, d), gradients flow to every rank
        loss = my_loss(z, z_all)
    """
    if backward not in GATHER_BACKWARDS:
        raise ValueError(f"gather: backward must be one of {GATHER_BACKWARDS}, got {backward!r}")
    if not is_distributed(group):
        return x
    if sizes is None:
        sizes, _ = all_gather_sizes(x, group)
    if backward == "auto":
        backward = AUTO_BACKWARD.get(str(dist.get_backend(group)), "reduce_scatter")
    return _Gather.apply(x, sizes, group, backward)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int], group, backward: str):
        ctx.sizes, ctx.group, ctx.backward = sizes, group, backward
        ctx.rank = dist.get_rank(group)
        return all_gather_rows(x, group, sizes)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        sizes, max_size = ctx.sizes, max(ctx.sizes)
        if max_size == 0:  # no rank has a row: nothing to exchange
            return grad_output.new_zeros(grad_output.shape), None, None, None
        if ctx.backward == "reduce_scatter":
            stacked = _stack_padded(grad_output, sizes, copy=False)
            grad_input = stacked.new_empty((max_size, *grad_output.shape[1:]))
            try:
                reduce_scatter_single(grad_input, stacked, op=dist.ReduceOp.SUM, group=ctx.group)
                return grad_input[: sizes[ctx.rank]], None, None, None
            except (RuntimeError, NotImplementedError):
                pass  # the backend lacks reduce-scatter
        if ctx.backward == "all_to_all":
            stacked = _stack_padded(grad_output, sizes, copy=False)
            received = torch.empty_like(stacked)  # block k: rank k's gradient of our rows
            dist.all_to_all_single(received, stacked, group=ctx.group)
            summed = received.view(len(sizes), max_size, *grad_output.shape[1:]).sum(0)
            return summed[: sizes[ctx.rank]], None, None, None
        stacked = _stack_padded(grad_output, sizes, copy=True)  # all_reduce works in place
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=ctx.group)
        start = ctx.rank * max_size
        return stacked[start : start + sizes[ctx.rank]], None, None, None


def _stack_padded(grad_output: torch.Tensor, sizes: list[int], copy: bool) -> torch.Tensor:
    """Every rank's rows padded to the largest size; a fresh tensor when ``copy``."""
    max_size = max(sizes)
    if any(size != max_size for size in sizes):
        return torch.cat([_pad_rows(chunk, max_size) for chunk in grad_output.split(sizes)])
    if copy:
        return grad_output.clone(memory_format=torch.contiguous_format)
    return grad_output.contiguous()


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Differentiable sum of ``x`` over ranks; every rank must pass the same shape.

    forward:  ``y = sum_r x_r`` (on every rank)
    backward: ``dL/dx_r = sum_k dL_k/dy`` (an all-reduce of the gradient)

    A plain ``dist.all_reduce`` carries no gradient, so each rank's ``x_r`` would
    receive only its own loss's share and every gradient would shrink by 1/W (lightly
    issues #1920 and #1977). When every rank computes the same loss from ``y``, rank r
    receives ``W dL/dx_r``, and DDP's average gives the single-process gradient.
    Identity, with no collective call, on one process.

    Example::

        total = all_reduce(z.sum(0))        # (d,), the global sum, with gradients
        mean = total / global_batch_size
    """
    if not is_distributed(group):
        return x
    return _AllReduce.apply(x, group)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        ctx.group = group
        total = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad = grad_output.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None
