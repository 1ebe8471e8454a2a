"""``--fsdp`` (FSDP2 on gloo CPU processes): sharded weights, gradients and optimizer
state train the model that one unsharded process trains, checkpoints reshard on load,
and what a sharded checkpoint holds is data only.

float64 throughout: the world sizes differ only in summation order (``EXACT`` says why
1e-12). The towers are the tiny BERT with a hard negative (with LoRA, with activation
checkpointing), image-text with the mlp (a replicated logit scale and bias) or a ViT,
and on the digits evaluated after every step, VICReg, MoCo, BYOL on ResNet-18 with
SyncBatchNorm and DINO on a ViT, the last three with a sharded EMA teacher; 3 processes
leave a rank idle on each epoch's short last batch. Each mechanism has its control: the
local negatives, gradients reduced on every chunk or never, a shard of another step, a
pickled metadata file, the consolidated model's exports (every weight whole).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from contrastive_accelerate.checkpoint import CheckpointError, load_checkpoint
from contrastive_accelerate.checkpoint_shards import SHARDS_FORMAT, ShardError, read_layout
from contrastive_accelerate.durable_files import content_digest
from contrastive_accelerate.workers import run_on_ranks

from launch import TrainerRuns, final_files_difference, one_chunk, one_line_errors, train_pooled

pytest.importorskip("transformers")
# float64: only the summation order differs between the world sizes. The runs reach 1e-17
# to 5e-14; 1e-12 (tighter than the 1e-9 of the other invariance tests) also catches
# gradients reduced in float32, which cost 3e-10 in this module's first version.
EXACT = 1e-12
PAIRS = ["--dtype", "float64", "--batch-size", "6", "--lr", "1e-3", "--max-length", "8",
         "--max-steps", "5", "--num-workers", "0",
         "--columns", "anchor,positive,negative_1"]  # fmt: skip
IMAGE_TEXT = ["--dtype", "float64", "--batch-size", "6", "--lr", "1e-3", "--max-steps", "5",
              "--columns", "image,caption", "--image-size", "8", "--knn-k", "0",
              "--num-workers", "0", "--max-length", "8"]  # fmt: skip
# The offline digits: BYOL on ResNet-18 with SyncBatchNorm, DINO on a ViT with
# two local crops (one forward per resolution, in one chunk) and drop path.
IMAGES = ["--dtype", "float64", "--batch-size", "6", "--max-steps", "2", "--knn-k", "0",
          "--num-workers", "0", "--warmup-steps", "1", "--lr", "0.1"]  # fmt: skip
BYOL_RESNET = ("--method", "byol", "--model", "resnet18")
DINO_VIT = ("--method", "dino", "--dino-out-dim", "64", "--model", "vit_tiny", "--local-crops",
            "2", "--local-crop-size", "4", "--drop-path", "0.1")  # fmt: skip
LORA = ("--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.1")
MLP = ("--model", "mlp", "--dropout", "0.1")
# The kNN of the teacher at the start and after each step, and the linear probe at the end.
EVALUATED = ("--knn-k", "20", "--eval-teacher", "--eval-every", "1")
# The offline digits with captions: the student's kNN after each step, then retrieval
# both ways and zero-shot, on 360 held-out images, whose margins are far above the
# runs' 1e-15 differences (on a handful of images a near-tie flips a figure).
# ("{{}}": the flags are formatted.)
IMAGE_TEXT_EVALUATED = ("--columns", "image,caption", "--text-model", "scratch",
                        "--model", "mlp", "--optimizer", "adamw", "--lr", "1e-3",
                        "--knn-k", "20", "--eval-every", "1", "--no-linear-probe",
                        "--zero-shot-template", "a handwritten {{}}")  # fmt: skip


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, sentence_pairs, tiny_bert):
    return TrainerRuns(tmp_path_factory, *PAIRS, "--dataset", sentence_pairs,
                       "--text-model", tiny_bert)  # fmt: skip


@pytest.fixture(scope="module")
def image_text(tmp_path_factory, captioned_images, tiny_bert):
    return TrainerRuns(tmp_path_factory, *IMAGE_TEXT, "--dataset", captioned_images,
                       "--text-model", tiny_bert)  # fmt: skip


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return TrainerRuns(tmp_path_factory, *IMAGES)


@pytest.mark.parametrize(
    "runs, flags, processes",
    [
        ("pairs", ("--accumulation-chunks", "3"), 3),
        ("pairs", LORA, 3),
        ("pairs", ("--gradient-checkpointing", "--accumulation-chunks", "2"), 2),
        ("image_text", MLP, 2),
        ("image_text", (*MLP, "--accumulation-chunks", "3"), 3),
        ("image_text", (*MLP, "--loss", "siglip"), 3),
        ("image_text", ("--image-model", "{vit}"), 2),
        ("images", ("--model", "mlp", "--loss", "vicreg"), 2),
        ("images", ("--method", "moco", "--model", "mlp", "--queue-size", "10", *EVALUATED), 3),
        ("images", BYOL_RESNET, 3),
        ("images", (*DINO_VIT, "--accumulation-chunks", "3"), 3),
        ("images", IMAGE_TEXT_EVALUATED, 3),
    ],
    ids=[
        "pairs-W3-K3",
        "pairs-lora-W3",
        "pairs-checkpointing-W2-K2",
        "mlp-W2",
        "mlp-W3-K3",
        "mlp-siglip-W3",
        "vit-W2",
        "vicreg-lars-mlp-W2",
        "moco-queue-mlp-W3",
        "byol-resnet18-syncbn-W3",
        "dino-vit-multi-crop-W3-K3",
        "image-text-digits-evaluated-W3",
    ],  # fmt: skip
)
def test_fsdp_on_n_processes_trains_what_one_process_trains(
    request, tiny_vit, runs, flags, processes
):
    runs = request.getfixturevalue(runs)
    flags = tuple(flag.format(vit=tiny_vit) for flag in flags)
    reference = runs(1, *one_chunk(flags))
    sharded = runs(processes, *flags, "--fsdp")
    error = final_files_difference(reference, sharded)  # with an EMA teacher's state
    print(f"--fsdp on {processes} processes {' '.join(flags)}: final/ within {error:.1e}")
    assert error < EXACT
    # The evaluations run on the sharded model (each rank its share, every rank as many
    # forwards): the figures are one process's.
    figures = [_evaluation_figures(output) for output in (reference, sharded)]
    print(f"evaluation figures: {figures[1]}")
    assert figures[0] == figures[1]
    if "--knn-k" in flags:
        assert {"knn_top1@0", "knn_top1@1", "knn_top1@2"} <= figures[1].keys()
    if "--zero-shot-template" in flags:
        assert {"zero_shot_top1@2", "image_to_text_recall@1@2"} <= figures[1].keys()


def _evaluation_figures(output: Path) -> dict[str, float]:
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return {f"{key}@{record['step']}": value for record in records if "step" in record
            for key, value in record.items()
            if "top1" in key or "recall" in key or "mrr" in key}  # fmt: skip


def test_control_fsdp_with_local_negatives_trains_another_model(pairs):
    """The gather is what makes it exact: without it, sharding changes nothing of that."""
    error = final_files_difference(pairs(1), pairs(2, "--fsdp", "--no-gather"))
    print(f"--fsdp --no-gather on 2 processes: final/ {error:.1e} from 1 process")
    assert error > 1e-6


@pytest.mark.parametrize(
    "written, resumed",
    [
        ((2, ("--fsdp",)), [(2, ("--fsdp",), 0.0), (3, ("--fsdp",), EXACT)]),
        ((3, ("--fsdp",)), [(1, (), EXACT)]),
        ((2, ()), [(3, ("--fsdp",), EXACT)]),
    ],
    ids=["sharded-2-to-2-and-3", "sharded-3-to-1", "replicas-2-to-sharded-3"],
)
def test_checkpoints_resume_sharded_or_not_on_any_number_of_processes(
    image_text, tmp_path, written, resumed
):
    """A mid-epoch checkpoint (step 2 of 5) of sharded processes continues on as many
    (exactly), on more, and on 1 unsharded; one of replicas continues sharded (``--fsdp``
    is a resume="apply" option)."""
    flags = (*MLP, "--save-every", "2")
    processes_written, fsdp_written = written
    straight = image_text(processes_written, *flags, *fsdp_written)
    names = sorted(path.name for path in (straight / "checkpoint-2").iterdir())
    if fsdp_written:
        last = f"model-{processes_written - 1:05d}-of-{processes_written:05d}.safetensors"
        assert "shards.json" in names and last in names, names
    for processes, fsdp, bound in resumed:
        output = tmp_path / f"resumed-{processes}"
        shutil.copytree(straight, output, ignore=shutil.ignore_patterns("final"))
        result = train_pooled(processes, *IMAGE_TEXT, *_image_text_data(image_text), *flags, *fsdp,
                              "--resume-from", str(output / "checkpoint-2"),
                              "--output-dir", str(output))  # fmt: skip
        error = final_files_difference(straight, output)
        print(f"{processes_written} {' '.join(fsdp_written)} -> {processes} {' '.join(fsdp)}: "
              f"final/ {error:.1e} from the straight run")  # fmt: skip
        assert error <= bound
        if fsdp != fsdp_written:
            change = "False -> True" if fsdp else "True -> False"
            assert f"resume: applying --fsdp {change}" in result.stdout


def _image_text_data(runs: TrainerRuns) -> tuple[str, ...]:
    common = list(runs.common_args)
    return tuple(common[len(IMAGE_TEXT) :])


@pytest.fixture(scope="module")
def sharded_checkpoints(image_text, tmp_path_factory) -> tuple[Path, Path]:
    """A copy of the 2-process sharded run's checkpoints 2 and 4 to spoil."""
    straight = image_text(2, *MLP, "--save-every", "2", "--fsdp")
    copy = tmp_path_factory.mktemp("spoiled")
    for step in (2, 4):
        shutil.copytree(straight / f"checkpoint-{step}", copy / f"checkpoint-{step}")
    return copy / "checkpoint-2", copy / "checkpoint-4"


def _spoiled(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / source.name
    shutil.copytree(source, target)
    return target


def test_a_sharded_checkpoint_loads_lazily_and_whole(sharded_checkpoints):
    checkpoint = load_checkpoint(str(sharded_checkpoints[1]))
    assert checkpoint.step == 4
    for name in checkpoint.model_state:  # each tensor whole, from both ranks' rows
        tensor = checkpoint.model_state[name]
        assert tuple(tensor.shape) == tuple(checkpoint.model_state.shape(name))


def _rewrite_shard(path: Path, value: float, digest: str | None = None) -> None:
    """Overwrite the first number of the shard's first floating-point tensor with
    ``value``, keeping the digest in its header (a tampered shard) or writing ``digest``
    into the header and ``shards.json`` (a consistent checkpoint that holds the value)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as shard:
        metadata = dict(shard.metadata())
    tensors = load_file(path)
    name = next(n for n in sorted(tensors) if tensors[n].is_floating_point() and tensors[n].numel())
    tensors[name].view(-1)[0] = value
    if digest is not None:
        metadata["digest"] = digest = content_digest(tensors)
        layout = json.loads((path.parent / "shards.json").read_text())
        layout["files"][path.name] = digest
        (path.parent / "shards.json").write_text(json.dumps(layout))
    save_file(tensors, path, metadata=metadata)


def _read_whole(path: Path) -> None:
    """Load the checkpoint and read every tensor of it, as a resume on one rank does."""
    checkpoint = load_checkpoint(str(path))
    for part in (checkpoint.model_state, checkpoint.optimizer_tensors, checkpoint.method_state):
        for name in part:
            part[name]


@pytest.mark.parametrize(
    "spoil", ["missing", "extra", "other-step", "other-run", "tampered", "non-finite"]
)
def test_a_spoiled_sharded_checkpoint_is_refused_in_one_line(sharded_checkpoints, tmp_path, spoil):
    """Each refused before a weight is loaded: the last two, whose headers are intact, when
    the rank first reads the shard (its content hashed, its tensors checked finite)."""
    two, four = sharded_checkpoints
    target = _spoiled(four, tmp_path)
    _read_whole(target)  # the control: the unspoiled copy reads whole
    if spoil == "missing":
        os.remove(target / "optimizer-00001-of-00002.safetensors")
        expected = "shard optimizer-00001-of-00002.safetensors is missing"
    elif spoil == "extra":
        shutil.copy(target / "model-00001-of-00002.safetensors",
                    target / "model-00002-of-00002.safetensors")  # fmt: skip
        expected = "unexpected shard model-00002-of-00002.safetensors"
    elif spoil == "other-step":
        shutil.copy(two / "model-00001-of-00002.safetensors", target)
        expected = "shard model-00001-of-00002.safetensors belongs to another checkpoint"
    elif spoil == "other-run":  # another run's shard: the same step, other weights
        shutil.copy(two / "model-00000-of-00002.safetensors",
                    target / "model-00000-of-00002.safetensors")  # fmt: skip
        expected = "shard model-00000-of-00002.safetensors belongs to another checkpoint"
    elif spoil == "tampered":  # bytes changed in place, the header's digest kept
        _rewrite_shard(target / "model-00001-of-00002.safetensors", 0.5)
        expected = "shard model-00001-of-00002.safetensors was changed after it was saved"
    else:
        _rewrite_shard(target / "optimizer-00000-of-00002.safetensors", float("nan"), digest="")
        expected = "holds a NaN or an infinity (a diverged or damaged run)"
    with pytest.raises((CheckpointError, ShardError)) as error:
        _read_whole(target)
    assert expected in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("spoil", ["other-step", "tampered"])
def test_a_shard_of_another_step_is_refused_on_every_rank(image_text, sharded_checkpoints,
                                                           tmp_path, spoil):  # fmt: skip
    """A shard changed after the save resumed silently before its content was hashed
    (final loss 2.2669 against the straight run's 2.3235)."""
    two, four = sharded_checkpoints
    target = _spoiled(four, tmp_path / "run")
    if spoil == "tampered":  # rank 1's own rows: the rank that reads them refuses
        _rewrite_shard(target / "model-00001-of-00002.safetensors", 0.5)
        expected = "was changed after it was saved"
    else:
        shutil.copy(two / "optimizer-00000-of-00002.safetensors", target)
        expected = "belongs to another checkpoint"
    result = train_pooled(2, *IMAGE_TEXT, *_image_text_data(image_text), "--model", "mlp",
                          "--dropout", "0.1", "--fsdp", "--resume-from", str(target),
                          "--output-dir", str(tmp_path / "run"), check=False)  # fmt: skip
    one_line_errors(result, expected, 2)


class _Payload:
    """Unpickling this writes a marker file: what a planted DCP ``.metadata`` could run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "executed"))


def test_a_planted_pickled_metadata_file_is_never_executed(image_text, sharded_checkpoints,
                                                           tmp_path):  # fmt: skip
    target = _spoiled(sharded_checkpoints[0], tmp_path / "run")
    marker = tmp_path / "marker"
    (target / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    train_pooled(2, *IMAGE_TEXT, *_image_text_data(image_text), "--model", "mlp", "--dropout",
                 "0.1", "--fsdp", "--resume-from", str(target), "--output-dir",
                 str(tmp_path / "run"))  # fmt: skip
    assert not marker.exists()
    pickle.loads((target / ".metadata").read_bytes())  # the control: unpickling runs it
    assert marker.read_text() == "executed"


def test_accelerate_fsdp_configuration_is_refused_in_one_line(image_text, tmp_path):
    result = train_pooled(2, *IMAGE_TEXT, *_image_text_data(image_text), "--model", "mlp",
                          "--output-dir", str(tmp_path), check=False,
                          environment={"ACCELERATE_USE_FSDP": "true"})  # fmt: skip
    one_line_errors(result, "pass --fsdp", 2)


class _Tower(torch.nn.Module):
    """Three blocks (three FSDP units) and a head (the root's)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh()) for _ in range(3)
        )
        self.head = torch.nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _one_step(rank: int, world_size: int, sync: str) -> dict:
    """One cached-backward step (K = 3 chunks) of a small tower under FSDP2 on this rank's
    share, counting the reduce-scatters, beside the same step under DDP: the loss, the
    full gradient and the updated weights of each."""
    import contextlib

    import torch.distributed as dist
    from torch import nn

    from contrastive_accelerate import grad_cache
    from contrastive_accelerate.collectives import gather
    from contrastive_accelerate.sharding import shard_model

    def tower() -> nn.Module:
        torch.manual_seed(0)
        return _Tower().double()

    inputs = torch.randn(12, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    share = inputs.tensor_split(world_size)[rank]

    def loss_fn(embeddings):  # each rank's share of a loss over the global batch
        z = torch.nn.functional.normalize(gather(torch.cat(embeddings)), dim=1)
        return torch.logsumexp(z @ z.T / 0.5, dim=1).sum() * world_size / len(inputs)

    results = {}
    for kind in ("fsdp", "ddp"):
        model = tower()
        if kind == "fsdp":
            shard_model(model)
        else:
            model = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        counted, original = [0], dist.reduce_scatter_single

        def counting(*args, counted=counted, original=original, **kwargs):
            counted[0] += 1
            return original(*args, **kwargs)

        dist.reduce_scatter_single = counting
        deferred = grad_cache.gradient_sync_deferred
        if sync != "last-chunk" and kind == "fsdp":
            grad_cache.gradient_sync_deferred = lambda model: contextlib.nullcontext()
            model.set_requires_gradient_sync(sync == "every-chunk")
        try:
            loss = grad_cache.cached_backward(model, share.tensor_split(3), loss_fn)
        finally:
            dist.reduce_scatter_single = original
            grad_cache.gradient_sync_deferred = deferred
        gradients = [
            (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).tolist()
            if p.grad is not None
            else None
            for p in model.parameters()
        ]
        optimizer.step()
        weights = [
            (p.full_tensor() if hasattr(p, "full_tensor") else p).tolist()
            for p in model.parameters()
        ]
        results[kind] = {
            "loss": loss.item(),
            "gradients": gradients,
            "weights": weights,
            "reduce_scatters": counted[0],
        }
    return results


def _max_difference(a, b) -> float:
    if a is None or b is None:
        return float("inf")
    return (torch.tensor(a) - torch.tensor(b)).abs().max().item()


@pytest.mark.parametrize("sync", ["last-chunk", "every-chunk", "never"])
def test_one_fsdp_step_is_one_ddp_step_with_one_reduce_scatter_per_unit(sync):
    """Peer parity on 2 processes, K = 3 chunks: the loss, the gradient and the updated
    weights equal DDP's, with one reduce-scatter per FSDP unit (4: three blocks and the
    root). The controls: reduced on every chunk (3 per unit), or never (wrong gradient)."""
    fsdp, ddp = (run_on_ranks(_one_step, 2, sync)[0][kind] for kind in ("fsdp", "ddp"))
    gradient = max(
        _max_difference(a, b) for a, b in zip(fsdp["gradients"], ddp["gradients"], strict=True)
    )
    weights = max(
        _max_difference(a, b) for a, b in zip(fsdp["weights"], ddp["weights"], strict=True)
    )
    print(f"{sync}: loss {abs(fsdp['loss'] - ddp['loss']):.1e}, gradient {gradient:.1e}, "
          f"weights {weights:.1e}, reduce-scatters {fsdp['reduce_scatters']}")  # fmt: skip
    if sync == "last-chunk":
        assert abs(fsdp["loss"] - ddp["loss"]) < 1e-12 and gradient < 1e-12 and weights < 1e-12
        assert fsdp["reduce_scatters"] == 4
    elif sync == "every-chunk":
        assert fsdp["reduce_scatters"] == 3 * 4
    else:
        assert gradient > 1e-3 and fsdp["reduce_scatters"] == 0


def test_fsdp_under_bf16_trains_finite_and_keeps_the_weights_and_teacher_in_float32(tmp_path):
    """``--mixed_precision bf16``: FSDP2's policy casts the weights to bf16 for compute and
    reduces in float32; the stored weights and the EMA teacher stay float32."""
    from safetensors.torch import load_file

    result = train_pooled(2, "--method", "byol", "--model", "mlp", "--batch-size", "8",
                          "--max-steps", "3", "--knn-k", "0", "--num-workers", "0", "--fsdp",
                          "--log-every", "1", "--output-dir", str(tmp_path),
                          environment={"ACCELERATE_MIXED_PRECISION": "bf16"})  # fmt: skip
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [record["loss"] for record in records if "samples_per_s" in record]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses))), result.stdout
    model = load_file(tmp_path / "final" / "model.safetensors")
    teacher = load_file(tmp_path / "final" / "method.safetensors")
    assert {t.dtype for t in model.values() if t.is_floating_point()} == {torch.float32}
    assert {t.dtype for t in teacher.values() if t.is_floating_point()} == {torch.float32}


class _TwoTowers(torch.nn.Module):
    """Two towers (each an FSDP unit, their blocks units too) and a replicated scalar.
    ``save_exports`` writes each tower inside ``whole(tower)`` and records how many of
    the model's weights are whole at that moment (the others are on the meta device)."""

    def __init__(self) -> None:
        super().__init__()
        self.towers = torch.nn.ModuleList([_Tower(), _Tower()])
        self.scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([tower(x) for tower in self.towers]) * self.scale

    def save_exports(self, directory: str, whole=None) -> None:
        import contextlib

        from safetensors.torch import save_file

        held = []
        for index, tower in enumerate(self.towers):
            with (whole or contextlib.nullcontext)(tower):
                held.append(sum(p.numel() for p in self.parameters() if not p.is_meta))
                state = {name: t.contiguous() for name, t in tower.state_dict().items()}
                save_file(state, os.path.join(directory, f"tower{index}.safetensors"))
        with open(os.path.join(directory, "held.json"), "w") as file:
            json.dump(held, file)


def _final_save(rank: int, world_size: int, directory: str) -> dict:
    """The final save of the sharded ``_TwoTowers`` on this rank, and of its consolidated
    copy (the control: every weight whole at once); rank 0 reads both back."""
    import copy

    from safetensors.torch import load_file

    from contrastive_accelerate.final_model import save_final_model
    from contrastive_accelerate.sharding import consolidated, shard_model

    torch.manual_seed(0)
    model = _TwoTowers().double()
    unsharded = copy.deepcopy(model)
    shard_model(model)
    final = save_final_model(os.path.join(directory, "sharded"), model, {})
    control = os.path.join(directory, "consolidated")
    whole = consolidated(model)
    if rank == 0:
        os.makedirs(control)
        whole.save_exports(control)
    if rank != 0:
        return {}
    expected = unsharded.state_dict()
    written = load_file(os.path.join(final, "model.safetensors"))
    towers = [load_file(os.path.join(final, f"tower{i}.safetensors")) for i in range(2)]
    return {
        "model_equal": written.keys() == expected.keys()
        and all(torch.equal(written[name], expected[name]) for name in expected),
        "towers_equal": all(
            torch.equal(tower[name], expected[f"towers.{i}.{name}"])
            for i, tower in enumerate(towers)
            for name in tower
        ),
        "held": json.loads(open(os.path.join(final, "held.json")).read()),
        "held_consolidated": json.loads(open(os.path.join(control, "held.json")).read()),
        "tower_size": sum(p.numel() for p in unsharded.towers[0].parameters()),
        "model_size": sum(p.numel() for p in unsharded.parameters()),
    }


def test_the_final_save_of_a_sharded_model_holds_one_tower_at_a_time(tmp_path):
    """``final/`` of a sharded two-tower model on 2 processes: ``model.safetensors`` is
    the unsharded model's state exactly (each tensor gathered in turn), and each tower's
    export runs with that tower alone whole. The control: the consolidated model's
    exports run with every weight whole."""
    found = run_on_ranks(_final_save, 2, str(tmp_path))[0]
    print(f"weights whole during each tower's export: {found['held']} (a tower has "
          f"{found['tower_size']}); consolidated: {found['held_consolidated']}")  # fmt: skip
    assert found["model_equal"] and found["towers_equal"]
    assert found["held"] == [found["tower_size"]] * 2
    assert found["held_consolidated"] == [found["model_size"]] * 2


def _final_save_that_fails(rank: int, world_size: int, directory: str) -> str:
    from contrastive_accelerate.final_model import save_final_model
    from contrastive_accelerate.sharding import shard_model

    torch.manual_seed(0)
    model = shard_model(_TwoTowers().double())
    with open(os.path.join(directory, ".final.partial"), "w"):  # a file where a folder goes
        pass
    try:
        save_final_model(directory, model, {})
    except CheckpointError as error:
        return str(error)
    return "written"


def test_a_failed_final_save_of_a_sharded_model_is_one_error_on_every_rank(tmp_path):
    errors = run_on_ranks(_final_save_that_fails, 2, str(tmp_path))
    print(errors)
    assert all(error.startswith("cannot write the final model") for error in errors), errors
    assert not (tmp_path / "final").exists()


def test_a_sharded_teacher_is_checkpointed_as_shards_and_resumes_anywhere(images, tmp_path):
    """MoCo's EMA teacher is sharded like its student: a checkpoint of 2 sharded processes
    stores each rank's rows of it (no rank gathers it whole) beside the replicated
    queue, and continues on 3 sharded processes and on 1 unsharded process within
    ``EXACT`` of the straight run."""
    flags = ("--method", "moco", "--model", "mlp", "--queue-size", "10", "--max-steps", "4",
             "--save-every", "2")  # fmt: skip
    straight = images(2, *flags, "--fsdp")
    shards = json.loads((straight / "checkpoint-2" / "shards.json").read_text())
    stored = shards["tensors"]["method"]
    teacher = [entry for name, entry in stored.items() if name.startswith("teacher.")]
    assert teacher and all(entry["rows"] is not None for entry in teacher)
    assert stored["queue"]["rows"] is None
    for processes, fsdp in ((3, ("--fsdp",)), (1, ())):
        output = tmp_path / f"resumed-{processes}"
        shutil.copytree(straight, output, ignore=shutil.ignore_patterns("final"))
        train_pooled(processes, *IMAGES, *flags, *fsdp, "--resume-from",
                     str(output / "checkpoint-2"), "--output-dir", str(output))  # fmt: skip
        error = final_files_difference(straight, output)
        print(f"teacher sharded on 2 -> {processes} {' '.join(fsdp)}: final/ {error:.1e}")
        assert error <= EXACT


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        pytest.param(
            {
                "format": SHARDS_FORMAT,
                "world_size": 30_000_000,
                "files": {},
                "tensors": {"model": {}, "optimizer": {}, "method": {}},
            },
            "shards.json names 30000000 ranks, but the checkpoint holds 0 shard files",
            id="huge-world-size",
        ),  # fmt: skip
        pytest.param(
            "[" * 200_000 + "]" * 200_000,
            "unreadable shards.json: nested too deeply to read",
            id="nested-200000-deep",
        ),
    ],
)
def test_a_hostile_shards_json_is_refused_before_it_sizes_anything(tmp_path, layout, message):
    """A count read from the file is bounded by the files there before it sizes a set (30
    million ranks were a MemoryError), and JSON too deep for the parser is one line."""
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    text = layout if isinstance(layout, str) else json.dumps(layout)
    (checkpoint / "shards.json").write_text(text)
    with pytest.raises(ShardError) as refused:
        read_layout(str(checkpoint))
    print(refused.value)
    assert message in str(refused.value) and "\n" not in str(refused.value)
