"""No training step waits for the device: zero host-device synchronisations per step.

On a GPU every read of a device value (``item()``, a tensor in an ``if``, a shape that
depends on the data) stalls the host until the device queue drains, once per read and
step. The same operators are visible on the CPU to ``HostSyncs``, so this test runs the
trainer's step (the method's embed and loss through ``cached_backward`` given the
sampler's sizes, DDP, the optimizer, the step's checks, the method's ``after_step``) on
2 gloo processes for every row of the loss table and every momentum method (teacher
update, queue) and counts them; a logging step's reads are counted apart.

What the losses no longer check per step is checked at logging and saving steps
(``ranks.StepChecks``): a non-finite loss and wrong given sizes still stop every rank
with one line, tested here on units and on the trainer.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from contrastive_accelerate.data import load_image_dataset, share_sizes
from contrastive_accelerate.grad_cache import cached_backward
from contrastive_accelerate.methods import METHODS, SIMCLR_LOSSES
from contrastive_accelerate.optim import make_optimizer
from contrastive_accelerate.ranks import StepChecks
from contrastive_accelerate.testing import HostSyncs, run_on_ranks
from losses import NTXentLoss, SigLIPLoss
from trainer import TrainConfig

from launch import make_teacher, one_line_errors, quick_tower, train_pooled

BATCH = 7  # odd: the two ranks hold 4 and 3 samples
#: (name, model, K): every --loss of simclr on the mlp, then ResNet-18 with SyncBatchNorm for
#: NT-Xent and Barlow Twins (whose projector has BatchNorm too): a loss's reads do not depend
#: on the encoder, nor SyncBatchNorm's on the loss. Then the other methods, on the mlp
#: (DINOv2 on its quick ViT): their steps add a teacher, a queue and a center, whose code
#: paths do not depend on it.
CASES = [(name, "mlp", chunks) for name in SIMCLR_LOSSES for chunks in (1, 3)]
CASES += [("ntxent", "resnet18", 1), ("ntxent", "resnet18", 3), ("barlowtwins", "resnet18", 1)]
CASES += [
    (method, quick_tower(method), chunks)
    for method in METHODS
    if method not in ("simclr", "pairs")
    for chunks in (1, 3)
]
CASES.append(("dino", "resnet18", 1))  # multi-crop: one forward per resolution
#: Under --fsdp, on 2 processes: sharded and replicated (siglip's scale and bias) gradients,
#: the deferred reduce-scatter of K chunks, SyncBatchNorm and a sharded EMA teacher.
FSDP_CASES = [("ntxent", "mlp", 3), ("siglip", "mlp", 1), ("byol", "resnet18", 3)]


def _config(name: str, model: str, chunks: int, teacher: str | None) -> TrainConfig:
    shared = {"model": model, "accumulation_chunks": chunks, "batch_size": BATCH}
    if name in SIMCLR_LOSSES:
        return TrainConfig(loss=name, **shared).resolved()
    # Queues pushed and wrapped every step (SwAV's full after the first, so used in the
    # second, the step counted).
    # DINOv2's AdamW reads its step counters on the host, where torch keeps them on any
    # device (not capturable): a read this CPU-only count cannot tell from the device's.
    own = {"moco": {"queue_size": 10}, "swav": {"queue_size": 5},
           "distill": {"distill_teacher": teacher}, "dinov2": {"optimizer": "sgd"},
           }.get(name, {})  # fmt: skip
    return TrainConfig(method=name, **own, **shared).resolved()


def step_syncs_worker(
    rank: int,
    world_size: int,
    cases: list,
    control: bool,
    fsdp: bool = False,
    teacher: str | None = None,
) -> dict:
    torch.manual_seed(0)
    data = load_image_dataset()
    seen = {}
    for name, model_name, chunks in cases:
        config = _config(name, model_name, chunks, teacher)
        method = METHODS[config.method].build(config, data, world_size, print, total_steps=10)
        if fsdp:
            method.shard("no")
            model = method.model
        else:
            model = DistributedDataParallel(method.model)
        optimizer = make_optimizer(
            config.optimizer, model.parameters(), lr=config.lr, momentum=0.9, weight_decay=5e-4
        )
        sizes = share_sizes(BATCH, world_size)
        indices = range(sum(sizes[:rank]), sum(sizes[: rank + 1]))
        batch = method.dataset.collate([method.dataset[(0, index)] for index in indices])
        checks, counts = StepChecks(torch.device("cpu")), []
        for step in range(2):  # DDP's first backward builds its buckets: count the second
            with HostSyncs() as syncs:
                value = cached_backward(
                    model,
                    batch.split(chunks),
                    partial(method.loss, batch=batch, sizes=sizes, step=step),
                    forward=partial(method.embed, model, step=step),
                )
                checks.record(step, value)
                method.before_optimizer_step(0, step)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                method.after_step(step)
                if control:
                    next(model.parameters()).sum().item()
            counts.append(syncs.seen)
        seen[f"{name}-{model_name}-K{chunks}"] = counts[-1]
        with HostSyncs() as syncs:  # what a logging step reads: the checks and the loss
            checks.raise_if_any()
            value.item()
        seen["logging step"] = syncs.seen
    return seen


@pytest.fixture(scope="module", params=[1, 2], ids=["1proc", "2proc"])
def step_syncs(request, tmp_path_factory):
    teacher = tmp_path_factory.mktemp("teacher")  # distillation's: a final/ of ours
    make_teacher(teacher)
    return run_on_ranks(step_syncs_worker, request.param, CASES, False, False, str(teacher))


@pytest.mark.parametrize("case", [f"{name}-{model}-K{k}" for name, model, k in CASES])
def test_a_training_step_never_waits_for_the_device(step_syncs, case):
    for rank, seen in enumerate(step_syncs):
        print(f"rank {rank}, {case}: {seen[case]}")
        assert seen[case] == [], f"rank {rank} synchronises in a {case} step: {seen[case]}"


def test_an_fsdp_training_step_never_waits_for_the_device():
    per_rank = run_on_ranks(step_syncs_worker, 2, FSDP_CASES, False, True)
    for rank, seen in enumerate(per_rank):
        for name, model, chunks in FSDP_CASES:
            case = f"{name}-{model}-K{chunks}"
            print(f"rank {rank}, --fsdp {case}: {seen[case]}")
            assert seen[case] == [], f"rank {rank} synchronises in an --fsdp {case} step"


def test_a_logging_step_reads_the_checks_and_the_loss(step_syncs):
    for rank, seen in enumerate(step_syncs):
        print(f"rank {rank}, host syncs of a logging step: {seen['logging step']}")
        assert len(seen["logging step"]) == 2  # the checks' flags and the loss


def test_negative_control_one_item_per_step_is_counted():
    seen = run_on_ranks(step_syncs_worker, 2, [("ntxent", "mlp", 1)], True)
    for record in seen:
        assert record["ntxent-mlp-K1"] == ["aten._local_scalar_dense.default"]


def wrong_sizes_worker(rank: int, world_size: int, loss_name: str) -> str:
    """Rank 1 holds 2 rows where the given sizes say 3: no hang, and one error on every
    rank at the next check."""
    checks = StepChecks(torch.device("cpu"))
    sizes = checks.known_sizes([4, 3])
    rows = 2 if rank == 1 else sizes[rank]
    x0, x1 = torch.randn(rows, 8, requires_grad=True), torch.randn(rows, 8)
    if loss_name == "siglip":
        value = SigLIPLoss()(x0, x1, 10.0, -10.0, sizes=sizes)
    else:
        value = NTXentLoss()(x0, x1, sizes=sizes)
    value.backward()  # the backward collective matches on every rank too
    try:
        checks.raise_if_any()
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("loss_name", ["ntxent", "siglip"])
def test_wrong_given_sizes_fail_on_every_rank_at_the_next_check(loss_name):
    messages = run_on_ranks(wrong_sizes_worker, 2, loss_name)
    print(messages)
    assert all("rank 1 has 2 rows where the given sizes say 3" in m for m in messages), messages


def plain_sizes_worker(rank: int, world_size: int) -> str:
    """Rank 1 holds 2 rows where a plain list of sizes says 3: with no ``ShareSizes`` to
    note it in, the loss raises at once, before its first collective (rank 0 makes none)."""
    if rank == 0:
        return "not called"
    try:
        NTXentLoss()(torch.randn(2, 8), torch.randn(2, 8), sizes=[4, 3])
    except ValueError as error:
        return str(error)
    return "no error"


def test_wrong_sizes_in_a_plain_list_raise_at_once_on_their_rank():
    messages = run_on_ranks(plain_sizes_worker, 2)
    assert "rank 1 has 2 rows where the given sizes say 3" in messages[1], messages


def non_finite_worker(rank: int, world_size: int) -> list[str]:
    checks, messages = StepChecks(torch.device("cpu")), []
    for step in range(6):
        bad = rank == 0 and step in (3, 5)  # one rank's loss, twice
        checks.record(step, torch.tensor(float("nan") if bad else 1.0))
        if step in (2, 5):  # logging steps
            try:
                checks.raise_if_any()
                messages.append("no error")
            except ValueError as error:
                messages.append(str(error))
    return messages


def test_a_non_finite_loss_fails_every_rank_at_the_next_check_naming_its_step():
    for messages in run_on_ranks(non_finite_worker, 2):
        assert messages[0] == "no error"
        assert "the loss is not finite at step 4" in messages[1], messages


def test_trainer_stops_a_non_finite_run_on_every_rank_before_saving(tmp_path):
    """SGD at lr 1e30 overflows the weights in its first step: the loss of step 2 is NaN.
    The check at the first logging step stops both ranks; no checkpoint is written."""
    output = tmp_path / "run"
    result = train_pooled(
        2, "--model", "mlp", "--batch-size", "8", "--knn-k", "0", "--warmup-steps", "0",
        "--lr", "1e30", "--max-steps", "6", "--log-every", "4", "--save-every", "4",
        "--output-dir", str(output), check=False,
    )  # fmt: skip
    one_line_errors(result, "the loss is not finite at step 2", 2)
    assert not list(output.glob("checkpoint-*")) and not (output / "final").exists()
