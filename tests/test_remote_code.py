"""Loading never executes code: a ``--text-model`` folder that ships code of its own (an
``auto_map`` and a ``.py``) is refused with one line and its code never runs, even with
``y`` waiting on standard input, where transformers asks whether to run it and runs it on
``y`` unless told ``trust_remote_code=False``. The control loads the same folder with
``trust_remote_code=True``: its code runs then. A scan holds every ``from_pretrained`` of
the project to ``trust_remote_code=False``."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys

import pytest

from launch import ENV, REPO, launch_command, train_pooled

pytest.importorskip("transformers")

#: The folder's code: it leaves a marker file when imported.
PLANTED = """import pathlib
pathlib.Path({marker!r}).write_text("ran")
from transformers import BertConfig, PreTrainedTokenizerFast


class PlantedConfig(BertConfig):
    model_type = "planted"


class PlantedTokenizer(PreTrainedTokenizerFast):
    pass
"""


@pytest.fixture(scope="module")
def folder_with_code(tmp_path_factory, tiny_bert):
    """The tiny BERT as a model type that transformers does not know, whose config and
    tokenizer classes live in ``planted.py`` (``auto_map``): transformers can load it
    only by running that code. And where the code leaves its marker."""
    root = tmp_path_factory.mktemp("remote_code")
    folder, marker = root / "model", root / "marker"
    shutil.copytree(tiny_bert, folder)
    (folder / "planted.py").write_text(PLANTED.format(marker=str(marker)))
    for name, changes in {
        "config.json": {
            "model_type": "planted",
            "auto_map": {"AutoConfig": "planted.PlantedConfig"},
        },
        "tokenizer_config.json": {
            "tokenizer_class": "PlantedTokenizer",
            "auto_map": {"AutoTokenizer": ["planted.PlantedTokenizer"] * 2},
        },
    }.items():
        config = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**config, **changes}))
    return folder, marker


def test_a_text_model_folders_own_code_never_runs_and_is_refused(
    folder_with_code, sentence_pairs, tmp_path
):
    folder, marker = folder_with_code
    command = launch_command(
        1, REPO / "trainer.py", "--dataset", sentence_pairs, "--columns", "anchor,positive",
        "--text-model", str(folder), "--max-steps", "1", "--output-dir", str(tmp_path / "run"),
    )  # fmt: skip
    result = subprocess.run(
        command, input="y\n" * 10, capture_output=True, text=True, timeout=300, env=ENV
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    print(f"exit {result.returncode}; the folder's code ran: {marker.exists()}; {errors}")
    assert not marker.exists()
    assert result.returncode != 0
    assert len(errors) == 1 and "cannot load --text-model" in errors[0], result.stderr[-2000:]


def test_control_trusting_remote_code_runs_the_folders_code(folder_with_code, tmp_path):
    folder, marker = folder_with_code
    load = (
        "from transformers import AutoTokenizer; "
        f"AutoTokenizer.from_pretrained({str(folder)!r}, trust_remote_code=True)"
    )
    # transformers copies remote code into HF_MODULES_CACHE: keep it in the test's folder.
    env = {**ENV, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    subprocess.run([sys.executable, "-c", load], check=True, timeout=300, env=env)
    assert marker.exists()
    marker.unlink()


def _from_pretrained_calls():
    """Every ``*.from_pretrained(...)`` call in the project's own code."""
    files = [REPO / "trainer.py"]
    for package in ("contrastive_accelerate", "losses", "models"):
        files += sorted((REPO / package).rglob("*.py"))
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "from_pretrained":
                yield f"{path.relative_to(REPO)}:{node.lineno}", node


def test_every_from_pretrained_refuses_remote_code():
    calls = list(_from_pretrained_calls())
    assert calls  # the scan sees the loading code
    for where, call in calls:
        keywords = {k.arg: k.value for k in call.keywords}
        trust = keywords.get("trust_remote_code")
        assert isinstance(trust, ast.Constant) and trust.value is False, where
        # Weights load from safetensors only. Tokenizers, processors and configs read no
        # weights (JSON, vocabularies): transformers would only write the flag into
        # their saved config.
        if "Model" in ast.unparse(call.func.value):
            safetensors = keywords.get("use_safetensors")
            assert isinstance(safetensors, ast.Constant) and safetensors.value is True, where


def test_the_export_drops_an_auto_map_that_names_code_it_does_not_hold(
    tiny_bert, sentence_pairs, tmp_path
):
    """A BERT whose config and tokenizer also carry an ``auto_map`` loads as the BERT it
    is (no code runs); ``final/`` leaves the map out, as it holds no such code. The
    control: the input folder keeps it."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_bert, folder)
    for name, key in (("config.json", "AutoModel"), ("tokenizer_config.json", "AutoTokenizer")):
        config = json.loads((folder / name).read_text())
        config["auto_map"] = {key: "elsewhere.Planted"}
        (folder / name).write_text(json.dumps(config))
    train_pooled(1, "--dataset", sentence_pairs, "--columns", "anchor,positive", "--text-model",
                 str(folder), "--max-length", "16", "--max-steps", "1", "--knn-k", "0",
                 "--output-dir", str(tmp_path / "run"))  # fmt: skip
    exported = tmp_path / "run" / "final" / "tower0"
    for name in ("config.json", "tokenizer_config.json"):
        assert "auto_map" in json.loads((folder / name).read_text())
        assert "auto_map" not in json.loads((exported / name).read_text()), name
