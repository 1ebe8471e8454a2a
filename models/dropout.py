"""Dropout whose mask belongs to the sample, not to the process.

``torch.nn.Dropout`` draws its mask from the process's global RNG: the same sample
gets a different mask on 1 or N processes, and a second forward of the same batch
(gradient caching's recompute) gets a different mask again. ``SampleDropout`` makes
the mask of row ``b`` a function of that row's key, the module and the element's
position only::

    keep[b, j] = hash(key[b] ^ hash(j + salt)) >= p * 2**32     (32-bit integer hashes)

where ``key[b] = sample_keys(seed, step, index[b], view)`` is computed from the
sample's global index in the dataset order, so every process, chunking and recompute
draws the same mask for it. The hash is vectorised integer arithmetic on the tensor's
device: no Python loop over samples, no generator state.

    model = convert_sample_dropout(model)                # nn.Dropout -> SampleDropout
    with sample_randomness(sample_keys(seed, step, indices, view=0)):
        out = model(images)                              # row b drops by its own key
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar

import torch
from torch import nn
from torchvision.ops import StochasticDepth

from contrastive_accelerate.compat import DropoutBase

# The keys of the enclosing ``sample_randomness`` block and their int32 codes, computed
# once for the block's dropout layers.
_ROW_KEYS: contextvars.ContextVar[tuple[torch.Tensor, torch.Tensor] | None] = (
    contextvars.ContextVar("sample_dropout_row_keys", default=None)
)
_GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: spreads consecutive salts and seeds
_MASK32 = 0xFFFFFFFF
CPU_BLOCK_ELEMENTS = 1 << 20  # 4 MiB of int32 scratch per pass
T = TypeVar("T", int, torch.Tensor)


@contextmanager
def sample_randomness(keys: torch.Tensor) -> Iterator[None]:
    """Every ``SampleDropout`` that runs inside this block keys row ``b`` of its input by
    ``keys[b]`` (one integer per row, e.g. from ``sample_keys``). Thread- and
    task-local, so a model's ``forward`` signature stays as it is."""
    token = _ROW_KEYS.set((keys, _row_codes(keys)))
    try:
        yield
    finally:
        _ROW_KEYS.reset(token)


def sample_keys(seed: int, step: int, indices: torch.Tensor, view: int = 0) -> torch.Tensor:
    """One 32-bit key per sample from (seed, step, the sample's dataset index, view):
    independent of the process, the rank's share and the chunk the sample lands in."""
    key = seed & _MASK32
    for value in (step, view):  # the same for every sample: hashed once, on the host
        key = lowbias32(key ^ (value * _GOLDEN & _MASK32))
    return lowbias32(key ^ (indices.to(torch.int64) & _MASK32))


class SampleDropout(nn.Module):
    """``nn.Dropout(p)`` with a per-sample mask (see the module docstring).

    Row ``b`` of the input (dim 0 is the batch, as in batch-first transformers) is
    kept or dropped by the key given to ``sample_randomness``; ``salt`` tells this
    module's mask apart from the other dropout layers' (``convert_sample_dropout``
    numbers them). In ``eval()`` mode it is the identity and needs no keys.
    """

    def __init__(self, p: float = 0.5, salt: int = 0) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p, self.salt = p, salt
        # Position j's code depends on (j, salt) only, so one computed for the longest row so
        # far serves every shorter one as a prefix: an int32 per element of one row.
        self._position_codes: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return f"p={self.p}, salt={self.salt}"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return input
        return self.dropped(input, input.shape)

    def row_keys(self, input: torch.Tensor) -> torch.Tensor:
        """The keys of ``input``'s rows, from the enclosing ``sample_randomness``."""
        keys, _ = _ROW_KEYS.get() or (None, None)
        if keys is None:
            raise RuntimeError(
                f"{type(self).__name__} needs each row's key: run the forward inside "
                "models.sample_randomness(keys)"
            )
        if keys.shape != input.shape[:1]:
            raise RuntimeError(
                f"{type(self).__name__} got {input.shape[0]} rows and {len(keys)} keys: give "
                "one key per row of the batch"
            )
        return keys.to(input.device)

    def dropped(self, input: torch.Tensor, mask_shape: torch.Size) -> torch.Tensor:
        """``input * keep / (1 - p)`` with the keep-mask of ``mask_shape`` (broadcast), and
        for backward what torch's own dropout keeps on the device: on a CPU, a mask in the
        input's dtype (a bool operand of a product is cast element by element: 2x slower
        forward and backward), carrying the scale where that rounds as ``mul_``'s scalar
        does; elsewhere the bool mask, a quarter of float32's memory. The same bits each way."""
        keys, scale = self.row_keys(input), 1.0 / (1.0 - self.p)
        if input.device.type != "cpu":
            return (input * self.mask(keys, mask_shape)).mul_(scale)
        keep = self.mask(keys, mask_shape, dtype=input.dtype)
        if input.dtype in (torch.float32, torch.float64):
            return input * keep.mul_(scale)
        return (input * keep).mul_(scale)

    def mask(
        self, keys: torch.Tensor, shape: torch.Size, dtype: torch.dtype = torch.bool
    ) -> torch.Tensor:
        """The keep-mask (1 kept, 0 dropped) of a batch of ``shape`` whose rows have ``keys``."""
        rows, per_row = shape[0], shape[1:].numel()
        position_codes = self.position_codes(per_row, keys.device)
        block_keys, block_codes = _ROW_KEYS.get() or (None, None)
        row_codes = block_codes if keys is block_keys else _row_codes(keys)
        # bits are uniform over int32: P(bits < threshold) = p.
        threshold = round(self.p * 2**32) - 2**31
        keep = torch.empty(rows, per_row, dtype=dtype, device=keys.device)
        # On a CPU, blocks of rows whose int32 scratch stays in cache: 4x to 20x faster
        # than one pass over a large activation; a GPU takes the whole batch at once.
        block = max(1, CPU_BLOCK_ELEMENTS // per_row) if keys.device.type == "cpu" else rows
        bits = torch.empty(min(block, rows), per_row, dtype=torch.int32, device=keys.device)
        scratch = torch.empty_like(bits)
        for start in range(0, rows, block):
            count = min(block, rows - start)
            torch.bitwise_xor(
                row_codes[start : start + count, None], position_codes, out=bits[:count]
            )
            lowbias32_int32_(bits[:count], scratch[:count], premixed=True)
            torch.ge(bits[:count], threshold, out=keep[start : start + count])
        return keep.view(shape)

    def position_codes(self, count: int, device: torch.device) -> torch.Tensor:
        """``premix(hash(j + salt))`` as int32 for positions ``j < count``, from the cache."""
        codes = self._position_codes
        if codes is None or len(codes) < count or codes.device != device:
            positions = torch.arange(count, device=device, dtype=torch.int64)
            codes = as_int32(_premix(lowbias32((positions + self.salt * _GOLDEN) & _MASK32)))
            self._position_codes = codes
        return codes[:count]


def _premix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32's first round, ``x ^ (x >> 16)``, of int64 values in [0, 2**32). It
    distributes over XOR, so the mask's ``hash(row ^ position)`` takes it on the row and
    position codes apart (n + m values) rather than on their n x m combinations."""
    return x ^ (x >> 16)


def _row_codes(keys: torch.Tensor) -> torch.Tensor:
    return as_int32(_premix(keys & _MASK32))


class SampleDropPath(SampleDropout):
    """Stochastic depth (Huang et al., 2016) per sample: torchvision's
    ``StochasticDepth(p, "row")`` with row ``b``'s whole residual branch kept or dropped
    by its key, and the kept rows scaled by ``1 / (1 - p)``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return input
        return self.dropped(input, torch.Size((input.shape[0],) + (1,) * (input.dim() - 1)))


def convert_sample_dropout(module: nn.Module) -> nn.Module:
    """Replace every ``nn.Dropout`` in ``module`` by a ``SampleDropout`` of the same ``p``
    and every torchvision ``StochasticDepth(p, "row")`` by a ``SampleDropPath`` (each with
    its own salt), as ``convert_sync_batchnorm`` does for BatchNorm.

    Raises ``ValueError`` for randomness it cannot key by sample: channel dropout
    (``nn.Dropout1d/2d/3d``, ``AlphaDropout``) and the attention-probability dropout
    inside ``nn.MultiheadAttention`` (``dropout > 0``), which PyTorch draws internally.
    """
    salt = 0
    for name, child in module.named_modules():
        if isinstance(child, nn.MultiheadAttention) and child.dropout > 0:
            raise ValueError(
                f"{name or 'the model'}: attention dropout ({child.dropout}) is drawn inside "
                "nn.MultiheadAttention and cannot be made per-sample; set it to 0"
            )
        if isinstance(child, DropoutBase) and type(child) is not nn.Dropout:
            raise ValueError(f"{name}: {type(child).__name__} cannot be made per-sample")
        if isinstance(child, StochasticDepth) and child.mode != "row":
            raise ValueError(f"{name}: StochasticDepth in {child.mode!r} mode is not per-sample")

    def convert(parent: nn.Module) -> nn.Module:
        nonlocal salt
        if type(parent) is nn.Dropout:
            salt += 1
            return SampleDropout(parent.p, salt=salt)
        if isinstance(parent, StochasticDepth):
            salt += 1
            return SampleDropPath(parent.p, salt=salt)
        for child_name, child in parent.named_children():
            parent.add_module(child_name, convert(child))
        return parent

    return convert(module)


def switch_off_kernel_dropout(
    tower: nn.Module, probe: tuple[torch.Tensor, ...], say: Callable[[str], Any]
) -> list[str]:
    """Switch off the dropout that no sample key reaches, and prove none is left.

    Dropout that a model's own code reads and draws inside a kernel (attention dropout
    under SDPA) comes from each process's RNG: a ``SampleDropout`` that ``tower(*probe)``
    never calls (BERT's, whose ``p`` the attention reads) and a float attribute named
    ``*dropout*`` (ViT's, CLIP's and SigLIP's ``attention_dropout``) are set to 0. Then
    two forwards of ``probe`` under the same keys and different global seeds must agree
    exactly, or ``ValueError`` names the randomness left. Says what it switched off in
    one line; returns the names."""
    candidates = {
        module: name
        for name, module in tower.named_modules()
        if isinstance(module, SampleDropout) and module.p > 0
    }
    called: set[nn.Module] = set()
    hooks = [m.register_forward_hook(lambda m, i, o: called.add(m)) for m in candidates]
    try:
        _probe_forward(tower, probe, seed=0)
    finally:
        for hook in hooks:
            hook.remove()
    silent = [name for module, name in candidates.items() if module not in called]
    for module, name in candidates.items():
        if name in silent:
            module.p = 0.0
    for name, module in tower.named_modules():
        if isinstance(module, nn.Dropout | SampleDropout):
            continue
        for attribute, value in vars(module).items():
            if "dropout" in attribute and isinstance(value, float) and value > 0:
                setattr(module, attribute, 0.0)
                silent.append(f"{name}.{attribute}")
    if silent:
        shown = ", ".join(silent[:2]) + (f" and {len(silent) - 2} more" if len(silent) > 2 else "")
        say(
            f"notice: dropout drawn inside a kernel cannot be keyed by sample, so it is switched "
            f"off: {shown} (e.g. attention dropout under SDPA)"
        )
    if not torch.equal(_probe_forward(tower, probe, seed=0), _probe_forward(tower, probe, seed=1)):
        raise ValueError(
            f"{type(tower).__name__} draws randomness that no sample key reaches (its outputs "
            "change with the global seed): the run would differ with the number of processes; "
            "set its dropout to 0 or use --dropout-masks per-process"
        )
    return silent


def _probe_forward(tower: nn.Module, probe: tuple[torch.Tensor, ...], seed: int) -> torch.Tensor:
    """``tower(*probe)`` in training mode, under sample keys and the global seed ``seed``,
    leaving the process's RNG as it was."""
    was_training = tower.training
    tower.train()
    try:
        with (
            torch.random.fork_rng(devices=[]),
            torch.no_grad(),
            sample_randomness(torch.zeros(len(probe[0]), dtype=torch.int64)),
        ):
            torch.manual_seed(seed)
            output = tower(*probe)
            return output if isinstance(output, torch.Tensor) else output[0]  # a ModelOutput
    finally:
        tower.train(was_training)


def keyed_recompute() -> tuple[AbstractContextManager, AbstractContextManager]:
    """``torch.utils.checkpoint``'s ``context_fn`` for towers with ``SampleDropout``: a
    checkpointed block recomputes its forward during backward, outside the
    ``sample_randomness`` block it ran in; the recompute re-enters that block's keys,
    so it draws the masks the forward drew. Non-reentrant checkpointing only (the
    reentrant one takes no ``context_fn``)."""
    keys = _ROW_KEYS.get()

    @contextmanager
    def restored() -> Iterator[None]:
        token = _ROW_KEYS.set(keys)
        try:
            yield
        finally:
            _ROW_KEYS.reset(token)

    return contextlib.nullcontext(), restored()


def lowbias32(x: T) -> T:
    """A 32-bit integer hash (Wellons' lowbias32) of values in [0, 2**32): a Python int or
    an int64 tensor."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32  # the product fits in 64 unsigned bits; the low 32 are kept
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def lowbias32_int32_(x: torch.Tensor, scratch: torch.Tensor, *, premixed: bool = False) -> None:
    """The same hash, in place on int32 tensors (a quarter of the memory traffic of int64
    with temporaries): multiplication wraps modulo 2**32, and masks make the shifts logical.
    ``premixed``: ``x`` has had the first round, ``x ^ (x >> 16)``, already."""
    rounds = ((16, 0x7FEB352D), (15, 0x846CA68B - 2**32), (16, None))
    for index, (shift, multiplier) in enumerate(rounds):
        if not (premixed and index == 0):
            torch.bitwise_right_shift(x, shift, out=scratch)
            scratch &= (1 << (32 - shift)) - 1
            x ^= scratch
        if multiplier is not None:
            x *= multiplier


def as_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) as the int32 of the same bits."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)
