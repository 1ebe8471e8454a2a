"""``--fsdp`` against DDP on CPU gloo processes: what each process holds of the
parameters, gradients and AdamW state at W = 1, 2 and 3, and the step time on 2.

    python -m benchmarks.fsdp            # a BERT-base-sized tower; writes docs/fsdp.md's tables
    python -m benchmarks.fsdp --quick    # a tiny tower, 2 steps (smoke)

The tower is a ``transformers`` BERT built in code (random weights, float32), trained
one contrastive step at a time as the trainer does: each rank embeds its share of a
global batch of text pairs, ``MultipleNegativesRankingLoss`` gathers every rank's
embeddings, then AdamW. Bytes are counted from the tensors each process holds after a
step (a sharded tensor's local rows); DDP's gradient buckets, a second copy of the
gradients, are counted apart. Step times are medians, DDP and FSDP interleaved step by
step in the same processes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from benchmarks.standalone import write_docs

SIZES = {  # hidden, layers, heads, intermediate
    "bert-base": (768, 12, 12, 3072),
    "tiny": (64, 2, 2, 128),
}
BATCH, TOKENS = 16, 32  # global pairs, tokens per text


def _tower(shape: tuple[int, int, int, int]) -> torch.nn.Module:
    """A BERT of ``(hidden, layers, heads, intermediate)``, without dropout."""
    from transformers import BertConfig, BertModel

    hidden, layers, heads, intermediate = shape
    config = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=intermediate, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)  # fmt: skip
    torch.manual_seed(0)
    return BertModel(config, add_pooling_layer=False)


class _Embedder(torch.nn.Module):
    def __init__(self, tower: torch.nn.Module) -> None:
        super().__init__()
        self.tower = tower

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tower(input_ids=ids).last_hidden_state.mean(dim=1)


def _embed_pairs(model: torch.nn.Module, pairs: torch.Tensor) -> torch.Tensor:
    """Anchors' then positives' embeddings: ``(2, n, tokens)`` ids in one forward."""
    return model(pairs.flatten(0, 1))


def _bytes(tensors) -> int:
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def _held(model, optimizer) -> dict[str, int]:
    parameters = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "parameters": _bytes(parameters),
        "gradients": _bytes(p.grad for p in parameters if p.grad is not None),
        "optimizer": _bytes(state),
    }


def measure(rank: int, world_size: int, size: str, kinds: list[str], steps: int) -> dict:
    """On each rank: bytes held after a step by each kind, and its step times."""
    from torch.nn.parallel import DistributedDataParallel

    from contrastive_accelerate.grad_cache import cached_backward
    from contrastive_accelerate.sharding import shard_model
    from losses import MultipleNegativesRankingLoss

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(1)
    criterion = MultipleNegativesRankingLoss(gather_distributed=True)
    runs = {}
    for kind in kinds:
        model = _Embedder(_tower(SIZES[size]))
        if kind == "fsdp":
            shard_model(model)
        else:
            model = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        runs[kind] = (model, optimizer)
    vocabulary = 30522 if size != "tiny" else 1000
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(steps):
        ids = torch.randint(vocabulary, (2, BATCH, TOKENS), generator=generator)
        share = ids[:, rank * BATCH // world_size : (rank + 1) * BATCH // world_size]
        for kind, (model, optimizer) in runs.items():
            started = time.perf_counter()
            embed = partial(_embed_pairs, model)
            cached_backward(model, [share], lambda z: criterion(*z[0].chunk(2)), forward=embed)
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            times[kind].append(time.perf_counter() - started)
    results = {}
    for kind, (model, optimizer) in runs.items():
        held = _held(model, optimizer)
        if kind == "ddp":  # its gradient buckets: a second copy of the gradients
            held["ddp_buckets"] = held["gradients"]
        results[kind] = {"bytes": held, "step_s": statistics.median(times[kind][1:] or times[kind])}
    return results


GPU_TOWERS = {  # built in code, random weights: a BERT-large-sized and a ViT-L-sized tower
    "bert-large": ("bert", (1024, 24, 16, 4096)),
    "vit-l": ("vit", (224, 16, 24, 16, 1024, 4096)),
    "tiny-bert": ("bert", (64, 2, 2, 128)),
    "tiny-vit": ("vit", (32, 16, 2, 2, 64, 128)),
}


def gpu_here(device: str, tower: str, sharded: bool, steps: int, batch_size: int) -> dict:
    """In this (fresh) process, a world of one process (NCCL on a GPU, gloo on the CPU):
    the tower whole or under ``shard_model`` (FSDP2 on NCCL: the collectives' code path),
    bf16 on a GPU; samples/s after a warm-up step and the peak memory allocated."""
    import torch.distributed as dist
    import torchvision

    from contrastive_accelerate.grad_cache import cached_backward
    from contrastive_accelerate.sharding import shard_model
    from contrastive_accelerate.workers import free_port
    from losses import InfoNCELoss

    on_gpu = device.startswith("cuda")
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)  # fmt: skip
    kind, shape = GPU_TOWERS[tower]
    torch.manual_seed(0)
    if kind == "bert":
        model = _Embedder(_tower(shape))
        inputs = torch.randint(1000, (2, batch_size, TOKENS))
    else:
        image, patch, layers, heads, hidden, mlp = shape
        model = torchvision.models.VisionTransformer(image, patch, layers, heads, hidden, mlp)
        model.heads = torch.nn.Identity()
        inputs = torch.randn(2, batch_size, 3, image, image)
    model = model.to(device)
    if sharded:
        shard_model(model, "bf16" if on_gpu else "no")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    criterion = InfoNCELoss()
    inputs = inputs.to(device)
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=on_gpu and not sharded)

    def step() -> None:
        with autocast:
            cached_backward(model, [inputs], lambda z: criterion(*z[0].float().chunk(2), 1 / 0.07),
                            forward=partial(_embed_pairs, model))  # fmt: skip
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    if on_gpu:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if on_gpu else None
    dist.destroy_process_group()
    return {"samples_per_s": steps * batch_size / elapsed, "peak_bytes": peak}


def gpu_rows_here(device: str, towers: list[str], steps: int, batch_size: int) -> list[dict]:
    """``gpu_here`` for each tower, whole then sharded, in this one process (the smoke
    test's: one interpreter start instead of four)."""
    return [{"tower": tower, "fsdp": sharded, **gpu_here(device, tower, sharded, steps, batch_size)}
            for tower in towers for sharded in (False, True)]  # fmt: skip


def main() -> None:
    from contrastive_accelerate.workers import run_on_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny tower, 2 steps")
    parser.add_argument(
        "--publish", action="store_true", help="refresh the published table in docs/fsdp.md"
    )
    args = parser.parse_args()
    if args.publish and args.quick:
        parser.error("--publish refreshes the published figures: a full run, not --quick")
    size, steps = ("tiny", 2) if args.quick else ("bert-base", 5)
    memory = ["| processes | kind | parameters (MiB) | gradients (MiB) | AdamW state (MiB) | "
              "total per process (MiB) | of DDP's |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    mib = 2**20
    timing = None
    for world_size in (1, 2, 3):
        kinds = ["ddp"] if world_size == 1 else ["ddp", "fsdp"]
        per_rank = run_on_ranks(measure, world_size, size, kinds, steps)
        ddp_total = None
        for kind in kinds:
            held = max((r[kind]["bytes"] for r in per_rank), key=lambda b: sum(b.values()))
            total = held["parameters"] + held["gradients"] + held["optimizer"]
            ddp_total = ddp_total or total
            memory.append(f"| {world_size} | {kind.upper()} | {held['parameters'] / mib:.1f} | "
                          f"{held['gradients'] / mib:.1f} | {held['optimizer'] / mib:.1f} | "
                          f"{total / mib:.1f} | {total / ddp_total:.2f} |")  # fmt: skip
        if world_size == 2:
            timing = {kind: max(r[kind]["step_s"] for r in per_rank) for kind in kinds}
    steps_table = ["| 2 gloo processes | DDP step (s) | FSDP step (s) | FSDP / DDP |",
                   "|---|---|---|---|",
                   f"| {size}, {BATCH} pairs x {TOKENS} tokens | {timing['ddp']:.3f} | "
                   f"{timing['fsdp']:.3f} | {timing['fsdp'] / timing['ddp']:.2f} |"]  # fmt: skip
    table = [f"Tower: {size}; DDP also holds gradient buckets, a second copy of the gradients "
             "(not in the totals).", "", *memory, "", *steps_table]  # fmt: skip
    print("\n".join(table))
    if args.publish:
        write_docs("fsdp", table, "fsdp.md")


if __name__ == "__main__":
    main()
