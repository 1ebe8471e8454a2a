"""The composition matrix (``methods.composition.cells``): every family of every row of
``METHODS`` with every kind of image tower and of source, each cell trained or refused.

- A cell that trains trains the same model on 1 process, on 2, and on 3 with
  ``--fsdp``: float64, 20 rows in global batches of 6 (each epoch ends with a batch of
  2: 1 + 1 on 2 processes, 1 + 1 + 0 on 3, an idle rank), 5 steps, every tensor of
  ``final/`` within ``EXACT``. A pretrained tower's stream and mixture cells leave out
  3 processes: the tower's sharded path with an idle rank is its table cell's, the
  source's ranks every scratch tower's (``worlds``). DINO and SwAV on the timm ViT,
  with its 6 local crops, reach 1e-10: DINO's sharp teacher and SwAV's Sinkhorn-Knopp at
  epsilon 0.05 amplify the summation order most.
- A cell that is refused stops in one line with the cell's own reason
  (``composition.refusal``), before any step.
- ``docs/composition.md`` is the page the table generates.

The cells come from the table: a family that gains a kind of source or tower is trained
here at once, and a new family fails until ``FAMILY_FLAGS`` has its command line.
The controls: per-process dropout masks break the 1-vs-2 equality of every method's
table cell and of each image method on a pretrained tower, per-rank shards break a
stream's, no synchronised BatchNorm a timm ResNet's, and a row that gives up streams is
refused them (the reason is the table's, not a hand-written ``if``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from contrastive_accelerate.config import ConfigError, parse_args
from contrastive_accelerate.methods import METHODS
from contrastive_accelerate.methods.base import image_data
from contrastive_accelerate.methods.composition import PAGE, TOWERS, Cell, cells, page
from trainer import TrainConfig

from launch import (
    REPO,
    TrainerRuns,
    final_files_difference,
    make_digit_parquet,
    make_digit_tar_shards,
    make_sentence_pairs,
    make_text_pair_shards,
    make_timm_model,
    quick_tower,
    train_pooled,
)

EXACT = 1e-9  # float64: only the summation order differs between the world sizes
COMMON = ["--dtype", "float64", "--batch-size", "6", "--max-steps", "5", "--save-every", "2",
          "--knn-k", "0", "--num-workers", "0", "--log-every", "5"]  # fmt: skip
IMAGES = ["--image-size", "8", "--lr", "0.1"]
TEXT = ["--max-length", "8", "--lr", "1e-3"]
#: Each family's own flags (its data are added by ``command``).
FAMILY_FLAGS = {
    "--method simclr": [*IMAGES, "--method", "simclr"],
    "--method moco": [*IMAGES, "--method", "moco", "--queue-size", "10"],
    "--method byol": [*IMAGES, "--method", "byol"],
    "--method dino": [*IMAGES, "--method", "dino", "--dino-out-dim", "64"],
    # AdamW (DINOv2's) at its own default lr: each step moves every weight by about lr,
    # whatever the gradient's size, and so does the float32 rounding inside timm's
    # position embedding resample (local crops) of each rank's part of a gradient.
    "--method dinov2": [
        "--image-size",
        "8",
        "--lr",
        "1e-3",
        "--method",
        "dinov2",
        "--dino-out-dim",
        "64",
    ],  # fmt: skip
    "--method swav": [
        *IMAGES,
        "--method",
        "swav",
        "--prototypes",
        "8",
        "--queue-size",
        "10",
        "--freeze-prototypes-steps",
        "1",
    ],
    "--method distill": [*IMAGES, "--method", "distill"],  # its teacher: ``command``
    "--method pairs (text pairs)": ["--columns", "anchor,positive,negative_1", *TEXT],
    "--method pairs (image-text)": ["--image-size", "8", *TEXT],
}
CONTROL = ("--dropout-masks", "per-process")
CELLS = cells(METHODS)
TRAINED = [cell for cell in CELLS if cell.reason is None]
REFUSED = [cell for cell in CELLS if cell.reason is not None]


def name(cell: Cell) -> str:
    return f"{cell.family.name}, {cell.tower or 'no image'} tower, {cell.source}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return TrainerRuns(tmp_path_factory, *COMMON)


@pytest.fixture(scope="module")
def data(tmp_path_factory, image_folder, sentence_pairs, captioned_images, tiny_bert, tiny_vit,
         tiny_clip) -> dict[str, str]:  # fmt: skip
    root = tmp_path_factory.mktemp("composition")
    return {
        "images": image_folder, "pairs": sentence_pairs, "captioned": captioned_images,
        "bert": tiny_bert, "vit": tiny_vit, "clip": tiny_clip,
        "more pairs": str(make_sentence_pairs(root / "more.jsonl", 11, seed=6)),
        "text shards": str(make_text_pair_shards(root / "text", [7, 11, 5])),
        "image shards": str(make_digit_tar_shards(root / "tar", [7, 11, 5])),
        "image parquet": str(make_digit_parquet(root / "digits.parquet", 13, start=40)),
        "timm": str(make_timm_model(root / "timm", img_size=8, patch_size=4, depth=2,
                                    embed_dim=16, num_heads=2, proj_drop_rate=0.1)),
        "timm resnet": str(make_timm_model(root / "resnet", "test_resnet", dropout=0.0)),
    }  # fmt: skip


def command(cell: Cell, data: dict[str, str]) -> tuple[str, ...]:
    """The cell's command line: the family's flags, its tower's and its source's."""
    family = cell.family.name
    text_pairs, image_text = family.endswith("(text pairs)"), family.endswith("(image-text)")
    tables = {"images": data["images"], "pairs": data["pairs"], "image-text": data["captioned"]}
    kind = "pairs" if text_pairs else "image-text" if image_text else "images"
    if cell.source == "table":
        source = ["--dataset", tables[kind]]
    elif cell.source == "mixture" and kind != "pairs":  # a table and a stream of images
        first = data["image parquet"] if kind == "images" else tables[kind]
        source = ["--streaming", "--dataset", first, "--dataset", data["image shards"],
                  "--shuffle-buffer", "4", "--mixture-weights", "1,2"]  # fmt: skip
    elif cell.source == "mixture":
        second = data["more pairs"] if text_pairs else tables[kind]
        source = ["--dataset", tables[kind], "--dataset", second]
    else:
        shards = data["text shards"] if text_pairs else data["image shards"]
        source = ["--streaming", "--dataset", shards, "--shuffle-buffer", "4"]
    scratch = ["--model", quick_tower(cell.method), "--dropout", "0.1"]  # with dropout
    tower = {None: [], "scratch": scratch, "transformers": ["--image-model", data["vit"]],
             "clip": ["--clip-model", data["clip"]], "timm": ["--timm-model", data["timm"]],
             }[cell.tower]  # fmt: skip
    if text_pairs:
        tower = ["--text-model", data["bert"]]
    elif image_text and cell.tower != "clip":  # a text tower from scratch, but CLIP's own
        tower = [*tower, "--text-model", "scratch"]
    columns = []
    if image_text:
        columns = ["--columns", "png,txt" if cell.source == "stream" else "image,caption"]
    if image_text and cell.source == "mixture":  # each source its own columns
        columns += ["--columns", "png,txt"]
    teacher = ["--distill-teacher", data["timm resnet"]] if family == "--method distill" else []
    return (*FAMILY_FLAGS[family], *teacher, *source, *tower, *columns)


def test_the_matrix_page_is_the_generated_one():
    assert (REPO / PAGE).read_text() == page(METHODS), (
        f"{PAGE} is not current: python -m contrastive_accelerate.methods"
    )


def test_every_family_has_its_flags_and_every_tower_its_command_line(data):
    assert {cell.family.name for cell in CELLS} == set(FAMILY_FLAGS)
    assert set(TOWERS) == {cell.tower for cell in CELLS if cell.tower}
    for cell in CELLS:
        command(cell, data)  # a kind of tower without its flags fails here


def worlds(cell: Cell) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """The runs a cell's one-process run is compared with (see the module's docstring)."""
    if cell.tower in ("transformers", "timm") and cell.source != "table":
        return ((2, ()),)
    return ((2, ()), (3, ("--fsdp",)))


@pytest.mark.parametrize("cell", TRAINED, ids=name)
def test_a_cell_that_trains_trains_one_model_on_1_2_and_3_processes(runs, data, cell):
    flags = command(cell, data)
    one = runs(1, *flags)
    for processes, extra in worlds(cell):
        error = final_files_difference(one, runs(processes, *flags, *extra))
        print(f"{name(cell)}: 1 process vs {processes} {' '.join(extra)}: {error:.1e}")
        assert error <= EXACT


@pytest.mark.parametrize("cell", REFUSED, ids=name)
def test_a_refused_cell_stops_in_one_line_with_its_reason(data, cell, tmp_path):
    flags = [*COMMON, *command(cell, data), "--output-dir", str(tmp_path / "run")]
    try:
        parse_args(TrainConfig, flags)
    except ConfigError as error:  # the options tell the family
        assert str(error) == cell.reason
        return
    result = train_pooled(1, *flags, check=False)  # only the data tell it
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode != 0 and lines[-1].startswith(f"error: {cell.reason}: "), lines
    assert not (tmp_path / "run" / "checkpoint-2").exists()


def test_control_a_row_that_gives_up_streams_is_refused_them(monkeypatch):
    """BYOL trains on streams because its row says so: the same row without them is
    refused them with the table's reason (no hand-written ``if`` decides)."""
    streamed = ["--dataset", "shards", "--streaming", "--max-steps", "2"]
    assert parse_args(TrainConfig, ["--method", "byol", *streamed]).streaming
    byol = METHODS["byol"]
    table_only = dataclasses.replace(byol.families[0], sources=("table",))
    monkeypatch.setitem(METHODS, "byol", dataclasses.replace(byol, families=(table_only,)))
    with pytest.raises(ConfigError, match="--method byol trains on a table, not on streamed"):
        parse_args(TrainConfig, ["--method", "byol", *streamed])


# Each row of METHODS: its options, its table cell's control, and a mid-epoch resume.

#: Each method's first family on a table, from scratch.
TABLE_CELLS = {
    method: next(cell for cell in TRAINED if cell.family == row.families[0]
                 and cell.source == "table" and cell.tower in (None, "scratch"))
    for method, row in METHODS.items()
}  # fmt: skip


#: What a method cannot run without.
REQUIRED = {"pairs": {"columns": "a,b"}, "distill": {"distill_teacher": "teacher"},
            "dinov2": {"model": "vit_micro"}}  # fmt: skip


def test_every_method_declares_its_options_and_families():
    fields = {field.name for field in dataclasses.fields(TrainConfig)}
    for method, row in METHODS.items():
        assert set(row.options) <= fields, method
        assert row.families, f"{method} declares no family"
        resolved = TrainConfig(method=method, **REQUIRED.get(method, {}))
        assert resolved.resolved().method == method


@pytest.mark.parametrize("method", list(METHODS))
def test_control_per_process_dropout_masks_break_it(runs, data, method):
    flags = command(TABLE_CELLS[method], data)
    error = final_files_difference(runs(1, *flags), runs(2, *flags, *CONTROL))
    print(f"{method}, per-process dropout masks, 1 vs 2 processes: {error:.1e}")
    assert error > 1e3 * EXACT


def resumed_difference(straight: Path, processes: int, flags, resumed: Path) -> float:
    """``straight``'s checkpoint of step 2 resumed on ``processes`` into ``resumed``: the
    largest difference of its final files from the straight run's."""
    train_pooled(
        processes, *COMMON, *flags, "--output-dir", str(resumed),
        "--resume-from", str(straight / "checkpoint-2"),
    )  # fmt: skip
    return final_files_difference(straight, resumed)


def test_control_per_rank_shards_break_an_image_methods_stream(runs, data):
    """webdataset's split_by_node (``--stream-split per-rank``): each rank reads its own
    shards, so 2 processes see other global batches than 1 and train another model."""
    cell = next(c for c in TRAINED if c.method == "simclr" and c.source == "stream")
    flags = command(cell, data)
    error = final_files_difference(runs(1, *flags), runs(2, *flags, "--stream-split", "per-rank"))
    print(f"simclr on a stream, --stream-split per-rank, 1 vs 2 processes: {error:.1e}")
    assert error > 1e3 * EXACT


@pytest.mark.parametrize("method", ["simclr", "dino"])
def test_a_mid_stream_checkpoint_of_two_processes_resumes_on_three(runs, data, method, tmp_path):
    """The stream's position is the step: a checkpoint of 2 processes mid-stream, continued
    on 3, gives the straight run's model."""
    cell = next(c for c in TRAINED if c.method == method and c.source == "stream")
    flags = command(cell, data)
    error = resumed_difference(runs(2, *flags), 3, flags, tmp_path / "resumed")
    print(f"{method} on a stream, resumed mid-stream from 2 processes on 3: {error:.1e}")
    assert error <= EXACT


#: The methods that read images alone (their data are ``image_data``'s) on the pretrained
#: towers.
IMAGE_METHODS = [name for name, row in METHODS.items() if row.load is image_data
                 and {"transformers", "timm"} <= set(row.families[0].towers)]  # fmt: skip
#: Those that train a convolutional tower too (DINOv2 masks a ViT's patches).
CONVOLUTIONAL_METHODS = [method for method in IMAGE_METHODS if method != "dinov2"]


def pretrained_cell(method: str, tower: str) -> Cell:
    return next(c for c in TRAINED if c.method == method and c.tower == tower
                and c.source == "table")  # fmt: skip


@pytest.mark.parametrize("tower", ["transformers", "timm"])
@pytest.mark.parametrize("method", IMAGE_METHODS)
def test_control_per_process_dropout_breaks_an_image_method_on_a_pretrained_tower(
    runs, data, method, tower
):
    """The ViT's own dropout (transformers' or timm's), keyed by sample where it loads:
    torch's per-process masks make 2 processes train another model."""
    flags = command(pretrained_cell(method, tower), data)
    error = final_files_difference(runs(1, *flags), runs(2, *flags, *CONTROL))
    print(f"{method} on a {tower} ViT, per-process dropout, 1 vs 2 processes: {error:.1e}")
    assert error > 1e3 * EXACT


@pytest.mark.parametrize("tower", ["transformers", "timm"])
@pytest.mark.parametrize("method", ["simclr", "dino", "pairs"])
def test_a_pretrained_image_tower_is_exported_in_its_own_format(runs, data, method, tower):
    """final/image is the trained tower as its own library loads it (``AutoModel`` with
    its processor beside it; ``timm.create_model`` with ``pretrained_cfg_overlay``): its
    weights are those of final/model.safetensors' tower, bit for bit, for an image
    method's as for image-text's (``pairs``)."""
    from safetensors.torch import load_file

    final = runs(1, *command(pretrained_cell(method, tower), data)) / "final"
    prefix = "image.encoder.encoder." if method == "pairs" else "encoder.encoder."
    trained = {name[len(prefix):]: tensor
               for name, tensor in load_file(final / "model.safetensors").items()
               if name.startswith(prefix)}  # fmt: skip
    assert trained
    if tower == "timm":
        import timm

        config = json.loads((final / "image" / "config.json").read_text())
        exported = timm.create_model(
            config["architecture"],
            pretrained=True,
            num_classes=0,
            **config["model_args"],
            pretrained_cfg_overlay={"file": str(final / "image" / "model.safetensors")},
        ).state_dict()  # fmt: skip  (timm builds it in float32: compared there)
    else:
        from transformers import AutoImageProcessor, AutoModel

        exported = AutoModel.from_pretrained(final / "image", dtype="float64").state_dict()
        assert AutoImageProcessor.from_pretrained(final / "image")
    assert set(trained) <= set(exported)
    error = max((exported[name] - tensor.to(exported[name].dtype)).abs().max().item()
                for name, tensor in trained.items())  # fmt: skip
    print(f"{method}: final/image ({tower}) vs the trained tower's weights: {error:.1e}")
    assert error == 0.0


@pytest.mark.parametrize("method", CONVOLUTIONAL_METHODS)
def test_a_timm_resnet_with_batchnorm_trains_alike_with_its_statistics_synchronised(
    runs, data, method
):
    """timm's test_resnet under each image method (DINO with its local crops): its
    BatchNorm layers become SyncBatchNorm, so 2 and 3 processes (an idle rank in the last
    batch) normalise by the global batch's statistics as 1 does; without it (the
    control) each normalises by its own share."""
    cell = pretrained_cell(method, "timm")
    flags = [*command(cell, data)[:-1], data["timm resnet"]]  # the ViT's folder replaced
    one = runs(1, *flags)
    errors = [final_files_difference(one, runs(processes, *flags)) for processes in (2, 3)]
    control = final_files_difference(one, runs(2, *flags, "--no-sync-batchnorm"))
    print(f"{method} on timm's test_resnet, 1 vs 2 / 1 vs 3 processes: {errors[0]:.1e} / "
          f"{errors[1]:.1e}; --no-sync-batchnorm: {control:.1e}")  # fmt: skip
    assert max(errors) <= EXACT and control > 1e3 * EXACT


@pytest.mark.parametrize("method", list(METHODS))
def test_a_mid_epoch_checkpoint_of_two_processes_resumes_on_one(runs, data, method, tmp_path):
    flags = command(TABLE_CELLS[method], data)
    error = resumed_difference(runs(2, *flags), 1, flags, tmp_path / "resumed")
    print(f"{method}, resumed at step 2 on 1 process vs 2 straight: {error:.1e}")
    assert error <= EXACT


# A new method is one module and one row: nothing else changes for it to be checked,
# refused where it does not apply, and trained exactly.

TOY_MODULE = '''
"""A toy method: two views through the image tower, NT-Xent at a fixed temperature."""
from contrastive_accelerate.methods.base import (
    Family, Method, MethodRow, embed_two_views, image_data, image_model, two_views_dataset,
    view_halves,
)
from losses import NTXentLoss
from models import SimCLR


class Toy(Method):
    def __init__(self, config, data, world_size, say, *, total_steps=None, device="cpu"):
        self.seed = config.seed
        self.dataset = two_views_dataset(config, data)
        self.model = image_model(config, world_size, say, SimCLR)
        self.criterion = NTXentLoss(0.3)

    def embed(self, model, chunk, step):
        return embed_two_views(model, chunk, self.seed, step)

    def loss(self, outputs, batch, sizes, step):
        return self.criterion(*view_halves(outputs), sizes=sizes)


TOY = MethodRow(Toy, image_data, families=(Family("--method toy"),))
'''


@contextlib.contextmanager
def toy_row(package: str) -> Iterator[None]:
    """``METHODS`` with the toy's row, its module imported from ``package``, as a project
    that adds the row has it; everything put back afterwards."""
    sys.path.insert(0, package)
    try:
        METHODS["toy"] = importlib.import_module("toy_methods.toy").TOY
        yield
    finally:
        METHODS.pop("toy", None)
        sys.path.remove(package)
        for module in [name for name in sys.modules if name.startswith("toy_methods")]:
            del sys.modules[module]


def test_a_toy_method_of_one_module_and_one_row_is_checked_refused_and_trained(
    image_folder, tmp_path
):
    (tmp_path / "toy_methods").mkdir()
    (tmp_path / "toy_methods" / "__init__.py").write_text("")
    (tmp_path / "toy_methods" / "toy.py").write_text(TOY_MODULE)
    streamed = ["--streaming", "--dataset", "shards", "--max-steps", "2"]
    refused = {
        "--method toy trains on a table, not on streamed shards (--streaming)": streamed,
        "--queue-size does not apply to --method toy": ["--queue-size", "8"],
        "--method toy trains a tower from scratch (--model), not a transformers vision tower "
        "(--image-model)": ["--image-model", "vit"],
    }
    with toy_row(str(tmp_path)):
        for reason, flags in refused.items():
            with pytest.raises(ConfigError) as error:
                parse_args(TrainConfig, ["--method", "toy", *flags])
            assert str(error.value) == reason
        assert parse_args(TrainConfig, ["--method", "toy", "--model", "vit_tiny",
                                        "--drop-path", "0.1"]).drop_path == 0.1  # fmt: skip
        toy = [cell for cell in cells(METHODS) if cell.method == "toy"]
        assert [(cell.tower, cell.source) for cell in toy if cell.reason is None] == [
            ("scratch", "table")
        ]
        assert len(toy) == len(TOWERS) * 3 and "--method toy" in page(METHODS)
    assert "toy" not in METHODS
    flags = ["--method", "toy", *COMMON, *IMAGES, "--model", "mlp", "--dropout", "0.1",
             "--dataset", image_folder]  # fmt: skip
    runs = {}
    for processes in (1, 2):
        runs[processes] = tmp_path / f"on-{processes}"
        train_pooled(processes, *flags, "--output-dir", str(runs[processes]),
                     within=functools.partial(toy_row, str(tmp_path)))  # fmt: skip
    error = final_files_difference(runs[1], runs[2])
    print(f"the toy method, 1 vs 2 processes: {error:.1e}")
    assert error <= EXACT


@pytest.mark.parametrize("tower", ["transformers", "timm"])
def test_a_checkpointed_pretrained_tower_trains_the_plain_ones_model(runs, data, tower):
    """``--gradient-checkpointing`` on SimCLR's pretrained tower (transformers' layers,
    timm's ``set_grad_checkpointing``): the recompute draws the forward's dropout masks,
    so checkpointed equals plain on 1 process and 1 equals 2 processes."""
    flags = command(pretrained_cell("simclr", tower), data)
    plain = runs(1, *flags)
    checkpointed = runs(1, *flags, "--gradient-checkpointing")
    against_plain = final_files_difference(plain, checkpointed)
    two = final_files_difference(checkpointed, runs(2, *flags, "--gradient-checkpointing"))
    print(f"simclr on a {tower} ViT, checkpointed vs plain: {against_plain:.1e}; "
          f"checkpointed 1 vs 2 processes: {two:.1e}")  # fmt: skip
    assert against_plain <= EXACT and two <= EXACT
