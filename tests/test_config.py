"""Options: one declaration per field gives the flag, the config-file key and the validation."""

from __future__ import annotations

import dataclasses
import json
import re
from types import SimpleNamespace

import pytest
import yaml

from contrastive_accelerate.config import ConfigError, field_names, flag, parse_args, parser
from contrastive_accelerate.launch import TrainerError
from contrastive_accelerate.methods import DINO_OPTIONS, METHOD_OPTIONS, METHODS, SIMCLR_LOSSES
from contrastive_accelerate.options import MIXTURE_OPTIONS, STREAMING_OPTIONS, check_data
from models.lora import LoRAOptions
from models.towers import IMAGE_TOWERS, TOWER_KINDS
from trainer import TrainConfig

FIELDS = dataclasses.fields(TrainConfig)


def _other_value(field: dataclasses.Field):
    """A valid value different from the field's default, derived from its declaration."""
    choices, kind = field.metadata["choices"], field.type.split(" |")[0]
    if choices:
        return next(choice for choice in choices if choice != field.default)
    if kind == "bool":
        return not field.default
    at_least, above, below, at_most = field.metadata["bounds"]
    low = next((b for b in (at_least, above) if b is not None), 0)
    high = next((b for b in (below, at_most) if b is not None), None)
    if kind == "int":
        return (field.default or low) + 3
    if kind == "float":
        return (low + high) / 2 if high is not None else (field.default or 1.0) * 2.5
    return f"custom-{field.name}"


VALUES = {field.name: _other_value(field) for field in FIELDS}
VALUES["model"] = "mlp"  # an encoder with dropout layers, so that --dropout is valid
VALUES["zero_shot_template"] = "a photo of a {}"  # the class name's place, marked
VALUES["mixture_weights"] = "2,1"  # one per source of MIXED
VALUES["matryoshka_dims"], VALUES["matryoshka_weights"] = "8,4", "1,0.5"
VALUES["prompts"] = "a=query: "  # a column of PAIRS' --columns
VALUES["distill_teacher"] = "teacher"  # as NEEDS gives it
VALUES["mask_probability"], VALUES["mask_ratio_max"] = 0.25, 0.75  # defaults: the middle
# Options valid only beside another option's value.
STREAMED = ["--dataset", "shards", "--max-steps", "5", "--columns", "a,b"]
MIXED = ["--dataset", "one", "--dataset", "two", "--max-steps", "5", "--columns", "a,b"]
PAIRS = ["--columns", "a,b"]  # what --method pairs needs besides its row
#: What each method needs besides its row.
NEEDS = {"pairs": PAIRS, "distill": ["--distill-teacher", "teacher"],
         "dinov2": ["--model", "vit_micro"]}  # fmt: skip


def _part_flags() -> list[list[str]]:
    """A command line for every row of every table: each method (with each loss its
    families take), each tower from scratch, each kind of tower its option names, each
    kind of source, and LoRA's adapters: an option applies under one of them."""
    methods = {name: ["--method", name, *NEEDS.get(name, [])] for name in METHODS}
    lines = [*methods.values()]
    lines += [[*methods[name], "--loss", loss] for name, row in METHODS.items()
              for family in row.families for loss in family.losses]  # fmt: skip
    lines += [["--model", tower] for tower in IMAGE_TOWERS]
    lines += [[flag(kind.option), "vit", *pairs] for kind in TOWER_KINDS.values()
              for pairs in ([], PAIRS)
              if kind.option not in (None, "model")]  # --model: IMAGE_TOWERS' rows  # fmt: skip
    adapted = [*PAIRS, "--text-model", "bert", "--lora-rank", "4"]
    matryoshka = [*PAIRS, "--matryoshka-dims", "8,4"]  # its weights apply beside it
    beir = [*PAIRS, "--eval-beir", "benchmark"]  # its split applies beside it
    lines += [[*STREAMED, "--streaming"], MIXED, adapted, matryoshka, beir]
    return lines


def _companions(name: str, value) -> list[str]:
    """The first of ``_part_flags`` under which ``name`` set to ``value`` is accepted."""
    for line in [[], *_part_flags()]:
        try:
            parse_args(TrainConfig, _cli(name, value) + line)
        except ConfigError:
            continue
        return line
    raise AssertionError(f"no row of a table reads {flag(name)}: is it a part's option?")


def _cli(name: str, value) -> list[str]:
    if isinstance(value, bool):
        return [flag(name) if value else "--no-" + flag(name)[2:]]
    return [flag(name), str(value)]


def test_every_field_has_a_flag_and_a_help_line():
    text = parser(TrainConfig, "").format_help()
    for field in FIELDS:
        assert flag(field.name) in text, field.name
        assert field.metadata["help"], f"{field.name} has no help text"
        # One short line each: the reasons behind an option belong to the README.
        assert len(field.metadata["help"]) <= 80, f"{field.name}: help longer than one line"


def test_derived_defaults_are_resolved_in_one_place():
    """Every option left at None for a derived default gets it from ``resolved()``; the
    rest stay None (no default to derive: they mean "none")."""
    meaning_none = {
        "dataset",
        "dataset_config",
        "image_column",
        "label_column",
        "num_workers",
        "max_steps",
        "loss_tile_rows",
        "resume_from",
        "save_total_limit",
        "collective_timeout",
        "columns",
        "text_model",
        "image_model",
        "clip_model",
        "lora_target_modules",
        "matryoshka_dims",
        "matryoshka_weights",
        "max_length",  # pairs': the folder's or 128, resolved by its row
        "text_pooling",
        "prompts",
        "eval_beir",
        "gist_guide",
        "zero_shot_template",
        "eval_dataset",
        "timm_model",
        "timm_weights",
        "distill_teacher",
        "streams",  # from the shards (find_shards)
        "mixture_weights",  # from the sources' sizes (mixture_weights)
    }
    for loss in ("ntxent", "infonce", "siglip", "vicreg"):
        resolved = dataclasses.asdict(TrainConfig(loss=loss).resolved())
        left = {name for name, value in resolved.items() if value is None} - meaning_none
        # No teacher, no DINO head, no crops.
        expected = {"teacher_momentum", "teacher_temperature", "dino_out_dim", "dino_center"}
        expected |= {"koleo_weight"}
        expected |= {"local_crops", "local_crop_size", "freeze_last_layer"}
        expected |= {"prototypes", "freeze_prototypes_steps"}  # no SwAV
        # What the loss does not read stays unset: a value there would be refused.
        expected |= {"temperature"} if loss in ("infonce", "siglip", "vicreg") else set()
        expected |= set() if loss in ("infonce", "siglip") else {"logit_scale_init"}
        assert left == expected, (loss, left)
    assert TrainConfig(loss="vicreg").resolved().optimizer == "lars"
    assert TrainConfig().resolved().horizontal_flip is False  # a mirrored digit is no digit
    assert TrainConfig(dataset="cifar10").resolved().horizontal_flip is True
    assert TrainConfig(loss="vicreg", optimizer="sgd").resolved().lr == 0.03


def test_moco_byol_dino_and_swav_take_their_digits_recipes_when_their_flags_are_left_unset():
    """The methods' defaults rows: on the digits each method's measured recipe, elsewhere
    the papers' values; a flag given wins over either."""
    recipe = ("temperature", "teacher_momentum", "lr", "epochs")
    for method, temperature, paper_momentum in (("moco", 0.2, 0.99), ("byol", None, 0.996)):
        digits = TrainConfig(method=method).resolved()
        assert tuple(getattr(digits, name) for name in recipe) == (temperature, 0.95, 0.1, 75)
        paper = TrainConfig(method=method, dataset="cifar10").resolved()
        assert tuple(getattr(paper, name) for name in recipe) == (
            temperature, paper_momentum, 0.03, 45,
        )  # fmt: skip
        assert TrainConfig(method=method, optimizer="lars").resolved().lr == 0.2  # LARS's own
        assert TrainConfig(method=method, lr=0.05, epochs=3).resolved().lr == 0.05

    recipe += ("teacher_temperature", "dino_out_dim", "local_crops", "local_crop_size")
    dino = TrainConfig(method="dino").resolved()
    assert tuple(getattr(dino, name) for name in recipe) == (0.1, 0.99, 0.03, 90, 0.01, 256, 0, 4)
    dino = TrainConfig(method="dino", dataset="cifar10").resolved()
    assert tuple(getattr(dino, name) for name in recipe) == (
        0.1, 0.996, 0.03, 45, 0.04, 1024, 6, 16,  # half of 32 px
    )  # fmt: skip
    for model, crops in (("mlp", 0), ("vit_tiny", 6)):  # the mlp takes one input size
        assert TrainConfig(method="dino", dataset="c", model=model).resolved().local_crops == crops
    given = TrainConfig(method="dino", local_crops=2, teacher_temperature=0.04).resolved()
    assert (given.local_crops, given.teacher_temperature) == (2, 0.04)

    recipe = ("temperature", "prototypes", "freeze_prototypes_steps", "local_crops", "epochs")
    swav = TrainConfig(method="swav").resolved()
    assert tuple(getattr(swav, name) for name in recipe) == (0.1, 30, 20, 0, 45)
    swav = TrainConfig(method="swav", dataset="cifar10").resolved()
    assert tuple(getattr(swav, name) for name in recipe) == (0.1, 3000, 313, 6, 45)


@pytest.mark.parametrize("field", FIELDS, ids=[field.name for field in FIELDS])
def test_every_field_is_settable_from_the_command_line(field):
    value = VALUES[field.name]
    assert value != field.default
    config = parse_args(TrainConfig, _cli(field.name, value) + _companions(field.name, value))
    assert getattr(config, field.name) == value


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_every_field_is_settable_from_a_config_file(tmp_path, suffix):
    # --overwrite-output-dir and --resume-from exclude each other, and each method takes
    # its own options (DINO's local crops a resnet or a vit): every field is in one of three files.
    vit = ("drop_path", "gradient_checkpointing", "fsdp")  # in the vit's file only
    streamed = ("streaming", *STREAMING_OPTIONS, *MIXTURE_OPTIONS)  # in files of their own
    kinds = {kind: (row.option, *row.reads) for kind, row in TOWER_KINDS.items()
             if row.option and row.option not in (*METHOD_OPTIONS, "model")}  # fmt: skip
    lora = field_names(LoRAOptions)  # on a pretrained tower, in a file of its own
    views = ("augmentation",)  # another augmentation draws views: not beside --no-augment
    apart = ("method", *vit, *METHOD_OPTIONS, *streamed, *sum(kinds.values(), ()), *lora, *views)
    shared = {n: v for n, v in VALUES.items() if n not in apart}
    moco_options = ("teacher_momentum", "eval_teacher", "queue_size", "queue_keys")
    moco = {"method": "moco", **{n: VALUES[n] for n in moco_options}}
    dino = {"method": "dino", **{n: VALUES[n] for n in DINO_OPTIONS}}
    files = [
        {
            **shared,
            "loss": VALUES["loss"],
            "overwrite_output_dir": None,
            "model": "vit_tiny",
            **{name: VALUES[name] for name in vit},
        },  # fmt: skip
        {**shared, **moco, "resume_from": None},
        {**shared, **dino, "resume_from": None, "dropout": None, "model": "resnet34"},
    ]
    stream = {"dataset": "shards", "max_steps": 5, "columns": "a,b"}
    files.append({**stream, **{name: VALUES[name] for name in ("streaming", *STREAMING_OPTIONS)}})
    mixed = {"dataset": ["one", "two"], "max_steps": 5, "columns": ["a,b", "a,b,c"]}
    files += [{**mixed, name: VALUES[name]} for name in MIXTURE_OPTIONS]
    files.append({name: VALUES[name] for name in views})
    # Each pretrained kind of tower's options, in a file of its own.
    files += [{name: VALUES[name] for name in names} for names in kinds.values()]
    files.append({"image_model": "vit", "image_size": 8, **{n: VALUES[n] for n in lora}})
    # Each loss's own options, in a file of its own.
    files += [
        {"loss": loss, **{n: VALUES[n] for n in row.options}} for loss, row in SIMCLR_LOSSES.items()
    ]
    for values in files:
        values = {name: value for name, value in values.items() if value is not None}
        path = tmp_path / f"run{suffix}"
        text = json.dumps(values) if suffix == ".json" else yaml.safe_dump(values)
        path.write_text(text)
        config = parse_args(TrainConfig, ["--config", str(path)])
        as_read = {name: list(v) if isinstance(v, tuple) else v
                   for name, v in ((name, getattr(config, name)) for name in values)}  # fmt: skip
        assert as_read == values


def test_command_line_overrides_the_file_and_dashes_are_accepted(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lr: 1e-3\nbatch-size: 32\naugment: false\nmax_steps: 7\n")
    config = parse_args(TrainConfig, ["--config", str(path), "--lr", "0.2", "--augment"])
    assert (config.lr, config.batch_size, config.augment, config.max_steps) == (0.2, 32, True, 7)
    # An optional option set in the file can be set back to its automatic default.
    assert parse_args(TrainConfig, ["--config", str(path), "--max-steps", "none"]).max_steps is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("learning_rate: 0.1\n", "unknown option(s) learning_rate"),
        ("epochs: ten\n", "--epochs: expected int, got 'ten'"),
        ("augment: 1\n", "--augment: expected bool"),
        ("- lr\n", "expected a mapping"),
        ("lr: [1\n", "not valid YAML/JSON"),
        pytest.param(
            "lr: " + "[" * 100_000 + "]" * 100_000 + "\n",
            "not valid YAML/JSON: nested too deeply",
            id="nested-100000-deep",
        ),
        ("model: vgg\n", "--model 'vgg': choose one of"),
    ],
)
def test_bad_config_files_name_the_problem(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_args(TrainConfig, ["--config", str(path)])
    with pytest.raises(ConfigError, match="No such file"):
        parse_args(TrainConfig, ["--config", str(tmp_path / "missing.yaml")])


def test_a_json_config_nested_too_deeply_is_one_line(tmp_path):
    """200,000 levels: json's own parser raises RecursionError, which the reader turns
    into the config file's one-line error."""
    path = tmp_path / "run.json"
    path.write_text('{"lr": ' + "[" * 200_000 + "]" * 200_000 + "}")
    with pytest.raises(ConfigError) as refused:
        parse_args(TrainConfig, ["--config", str(path)])
    assert (
        str(refused.value)
        == f"--config {str(path)!r}: not valid YAML/JSON: nested too deeply to read"
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"image_size": 0}, "--image-size 0: must be >= 1"),
        ({"log_every": 0}, "--log-every 0: must be >= 1"),
        ({"crop_min_scale": 2.0}, "--crop-min-scale 2: must be > 0 and <= 1"),
        ({"augment": False, "augmentation": "affine"}, "no views under --no-augment"),
        ({"save_every": -1}, "--save-every -1: must be >= 0"),
        ({"epochs": 0}, "--epochs 0: must be >= 1"),
        ({"max_steps": 0}, "--max-steps 0: must be >= 1"),
        ({"batch_size": 1}, "--batch-size 1: must be >= 2"),
        ({"lr": float("nan")}, "--lr nan: must be a finite number"),
        # Finite, but an overflow where the optimizer turns it into float32: a traceback.
        ({"lr": 1e308}, "--lr 1e+308: must be within float32's range"),
        ({"weight_decay": 1e39}, "--weight-decay 1e+39: must be within float32's range"),
        ({"temperature": 0.0}, "--temperature 0: must be > 0"),
        ({"momentum": 1.0}, "--momentum 1: must be >= 0 and < 1"),
        ({"eval_holdout": 1.0}, "--eval-holdout 1: must be >= 0 and < 1"),
        ({"save_total_limit": 0}, "--save-total-limit 0: must be >= 1"),
        ({"collective_timeout": -5.0}, "--collective-timeout -5: must be > 0"),
        ({"num_workers": -1}, "--num-workers -1: must be >= 0"),
        ({"optimizer": "adam"}, "--optimizer 'adam': choose one of sgd, adamw, lars"),
        ({"epochs": 2.5}, "--epochs: expected int, got 2.5"),
        ({"overwrite_output_dir": True, "resume_from": "latest"}, "exclude each other"),
        (
            {"dropout": 0.1},
            "--dropout applies to vit_micro, vit_tiny, vit_small, mlp, not --model resnet18",
        ),
        ({"dropout": 1.0, "model": "vit_tiny"}, "--dropout 1: must be >= 0 and < 1"),
        ({"accumulation_chunks": 0}, "--accumulation-chunks 0: must be >= 1"),
    ],
)
def test_bad_values_are_refused_in_python_as_on_the_command_line(options, message):
    """``TrainConfig(...)`` validates exactly as the CLI does: train() gets no bad config."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainConfig(**options)


def test_usage_errors_are_one_line(capfd):
    for argv in (["--epochs", "ten"], ["--no-such-flag"], ["--model", "vgg"]):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(TrainConfig, argv)
        assert exit_info.value.code == 2
        lines = capfd.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), lines


@pytest.mark.parametrize(
    "options, message",
    [
        ({"method": "moco", "loss": "dcl"}, "--loss does not apply to --method moco"),
        ({"method": "byol", "queue_size": 8}, "--queue-size does not apply to --method byol"),
        ({"loss": "dcl", "queue_size": 8}, "--queue-size applies to --loss ntxent, not dcl"),
        ({"teacher_momentum": 0.99}, "--teacher-momentum does not apply to --method simclr"),
        ({"method": "moco", "teacher_momentum": 1.5}, "--teacher-momentum 1.5: must be"),
        ({"method": "moco", "teacher_momentum": -0.1}, "--teacher-momentum -0.1: must be"),
        ({"method": "dino", "loss": "dcl"}, "--loss does not apply to --method dino"),
        ({"method": "moco", "columns": "a,b"}, "--columns does not apply to --method moco"),
        ({"method": "pairs"}, "--method pairs needs --columns anchor,positive"),
        ({"loss": "mnrl"}, "--loss mnrl does not apply to --method simclr"),
        ({"columns": "a,b", "loss": "ntxent"}, "--loss ntxent does not apply to --method pairs"),
        ({"text_pooling": "cls"}, "--text-pooling does not apply to --method simclr"),
        ({"columns": "a,b", "image_pooling": "cls"}, "--image-pooling applies to --image-model"),
        ({"columns": "a,b", "lora_alpha": 16.0}, "--lora-alpha applies with --lora-rank"),
        (
            {"columns": "a,b", "text_model": "bert", "lora_rank": 4, "lora_towers": "image"},
            "--lora-towers image needs a pretrained image tower",
        ),
        ({"lora_rank": 4}, "--lora-rank adapts a pretrained tower"),
        ({"columns": "a,b", "matryoshka_weights": "1,2"}, "--matryoshka-weights applies with"),
        ({"columns": "a,b", "eval_beir_split": "dev"}, "--eval-beir-split applies with"),
        ({"columns": "a,b", "matryoshka_dims": "8,8"}, "--matryoshka-dims 8,8: distinct widths"),
        (
            {"columns": "a,b", "matryoshka_dims": "8,4", "matryoshka_weights": "1"},
            "--matryoshka-weights 1: one weight > 0 per dim",
        ),
        ({"matryoshka_dims": "8,4"}, "--matryoshka-dims does not apply to --method simclr"),
        (
            {"image_model": "vit", "lora_rank": 4, "lora_towers": "image"},
            "--lora-towers does not apply to --method simclr",
        ),
        (
            {"model": "mlp", "gradient_checkpointing": True},
            "--gradient-checkpointing applies to resnet18, resnet34, resnet50, vit_micro, "
            "vit_tiny, vit_small, not --model mlp",
        ),
        (
            {"columns": "a,b", "clip_model": "clip", "text_model": "bert"},
            "--text-model does not apply with --clip-model",
        ),
        (
            {"columns": "a,b", "clip_model": "clip", "logit_scale_init": 20.0},
            "--logit-scale-init does not apply with --clip-model",
        ),
        (
            {"columns": "a,b", "image_model": "vit", "model": "mlp"},
            "--model does not apply with --image-model",
        ),
        (
            {"columns": "a,b", "image_model": "vit", "dropout": 0.1},
            "--dropout does not apply with --image-model",
        ),
        (
            {"drop_path": 0.1},
            "--drop-path applies to vit_micro, vit_tiny, vit_small, not --model resnet18",
        ),
        ({"method": "byol", "local_crops": 2}, "--local-crops does not apply to --method byol"),
        (
            {"method": "dino", "dino_center": "sinkhorn", "center_momentum": 0.8},
            "--center-momentum does not apply to --dino-center sinkhorn",
        ),
        ({"method": "distill"}, "--method distill needs --distill-teacher"),
        (
            {"columns": "a,b", "zero_shot_template": "a photo of {1}"},
            r"--zero-shot-template 'a photo of \{1\}': mark the class name's place with one",
        ),
        ({"columns": "a,b", "zero_shot_template": "a photo"}, "mark the class name's place"),
        ({"columns": "a,b", "zero_shot_template": "a {} of a {}"}, "mark the class name's place"),
        # Options that a method or a loss does not read (issue 37, item 6).
        ({"method": "byol", "temperature": 0.3}, "--temperature does not apply to --method byol"),
        ({"loss": "infonce", "temperature": 0.3}, "--temperature does not apply to --loss infonce"),
        ({"columns": "a,b", "temperature": 0.3}, "--temperature does not apply to --method pairs"),
        ({"dclw_sigma": 0.3}, "--dclw-sigma does not apply to --loss ntxent"),
        ({"method": "moco", "vicreg_mu": 1.0}, "--vicreg-mu does not apply to --method moco"),
        (
            {"columns": "a,b", "loss": "infonce", "two_towers": True},
            "--two-towers does not apply to --loss infonce",
        ),
        (
            {"columns": "a,b", "loss": "siglip", "mnrl_scale": 5.0},
            "--mnrl-scale does not apply to --loss siglip",
        ),
        (
            {"columns": "a,b", "loss": "mnrl", "logit_scale_init": 5.0},
            "--logit-scale-init does not apply to --loss mnrl",
        ),
        (
            {"columns": "a,b", "loss": "infonce", "logit_bias_init": -5.0},
            "--logit-bias-init does not apply to --loss infonce",
        ),
        ({"method": "dino", "model": "mlp", "local_crops": 2}, "use a resnet or a vit"),
        (
            {"method": "dino", "model": "vit_tiny", "image_size": 16, "local_crop_size": 5},
            "--local-crop-size 5: vit_tiny at --image-size 16 has patches of 2 px",
        ),
        (
            {"method": "dino", "image_size": 16, "local_crop_size": 24},
            "--local-crop-size 24 is larger than the global crops",
        ),
    ],
)
def test_options_of_another_method_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**options)


@pytest.mark.parametrize(
    "options",
    [
        {"two_towers": True},
        {"mnrl_symmetric": True},
        {"mnrl_scale": 5.0},
        {"logit_bias_init": -5.0},
    ],
    ids=lambda options: next(iter(options)),
)
def test_text_pair_options_are_refused_when_the_data_are_image_text(options):
    """Without --loss the data decide: these options read by text pairs (and SigLIP's
    bias) are refused once the columns turn out to hold an image; the control, the same
    options with text columns, passes."""
    image_text = SimpleNamespace(
        train=list(range(20)), image_column="image", label_column=None, evaluation=None
    )
    text = SimpleNamespace(**{**vars(image_text), "image_column": None})
    config = TrainConfig(columns="image,caption", text_model="scratch", **options).resolved()
    with pytest.raises(
        TrainerError, match=f"{flag(next(iter(options)))} does not apply to image-text"
    ):
        check_data(config, image_text)
    if "logit_bias_init" not in options:  # the text pairs' own options
        check_data(config, text)


def test_a_dataset_given_several_times_is_a_mixture_of_them(tmp_path):
    """``--dataset`` (and ``--columns``) repeated, or a list in a file, is a tuple: one
    given once is the string; a flag replaces the file's list."""
    config = parse_args(TrainConfig, MIXED + ["--columns", "q,d,n"])
    assert config.dataset == ("one", "two") and config.mixed
    assert config.columns == ("a,b", "q,d,n")
    single = parse_args(TrainConfig, ["--dataset", "one"])
    assert single.dataset == "one" and not single.mixed
    path = tmp_path / "run.yaml"
    path.write_text("dataset: [one, two, three]\nmax_steps: 5\ncolumns: a,b\n")
    assert parse_args(TrainConfig, ["--config", str(path)]).dataset == ("one", "two", "three")
    assert parse_args(TrainConfig, ["--config", str(path), "--dataset", "x"]).dataset == "x"
    refused = {
        "--mixture-weights 2": [*MIXED, "--mixture-weights", "2"],
        "--columns is given 3 times": [*MIXED, "--columns", "c,d", "--columns", "e,f"],
        "applies to several --dataset": ["--dataset", "one", "--mixture", "round-robin"],
        "applies to --mixture proportional": [*MIXED, "--mixture", "round-robin",
                                              "--mixture-weights", "1,2"],
        "--eval-dataset applies with kNN evaluation": ["--eval-dataset", "d", "--knn-k", "0"],
        "--freeze-last-layer counts epochs, which a stream or a mixture has not": [
            "--dataset", "a", "--dataset", "b", "--max-steps", "2", "--method", "dino",
            "--freeze-last-layer", "1"],
    }  # fmt: skip
    for message, argv in refused.items():
        with pytest.raises(ConfigError, match=message):
            parse_args(TrainConfig, argv)
    # Each weight finite, and their sum: 1e308 + 1e308 overflows to inf.
    for weights in ("inf,1", "nan,1", "1e308,1e308", "-1,2"):
        with pytest.raises(ConfigError) as error:
            parse_args(TrainConfig, [*MIXED, f"--mixture-weights={weights}"])
        assert str(error.value) == (
            f"--mixture-weights {weights}: 2 positive finite numbers, one per --dataset, "
            "with a finite sum"
        )
