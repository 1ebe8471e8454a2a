"""A sentence-transformers folder taken as it is (``--text-model`` on a folder with
``modules.json``): a test-made one with CLS pooling, a ``Dense`` layer (tanh),
``Normalize``, a ``max_seq_length`` and a query prompt, on the tiny BERT.

- Loaded, before any step, our tower embeds what ``SentenceTransformer(folder)`` embeds,
  and the export of the untrained towers does too; the control: the tower today's
  ``--text-pooling mean`` builds (no Dense, no Normalize) embeds otherwise.
- Trained, ``SentenceTransformer(final/sentence_transformer)`` embeds what the trained
  weights of final/model.safetensors embed; 1 and 3 processes train the same model.
- A flag that overrides one of the folder's settings says so; a module it cannot take
  is one line.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from contrastive_accelerate.config import parse_args
from contrastive_accelerate.data.pairs import load_pair_dataset
from contrastive_accelerate.methods import METHODS
from models.text import POOLINGS
from trainer import TrainConfig

from launch import (
    TrainerRuns,
    final_files_difference,
    make_sentence_transformer,
    make_text_model,
    train_pooled,
)

pytest.importorskip("sentence_transformers")
EXACT = 1e-9  # float64: only the summation order differs between the world sizes
COLUMNS = "anchor,positive,negative_1"
COMMON = ["--dtype", "float64", "--batch-size", "6", "--lr", "1e-3", "--max-steps", "5",
          "--num-workers", "0", "--columns", COLUMNS]  # fmt: skip
TEXTS = ["red cat runs", "the quick dog jumps over a stone near the river"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """The tiny BERT under CLS pooling, a Dense with tanh and Normalize, 16 tokens at most
    and a "query: " prompt (``make_sentence_transformer``)."""
    return str(make_sentence_transformer(tmp_path_factory.mktemp("sentence-transformer")))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sentence_pairs, folder):
    return TrainerRuns(tmp_path_factory, *COMMON, "--dataset", sentence_pairs,
                       "--text-model", folder)  # fmt: skip


def built(folder: str, sentence_pairs: str, *flags: str):
    """The text-pairs method as the trainer builds it from ``folder``, and its config."""
    config = parse_args(TrainConfig, [*COMMON, "--dataset", sentence_pairs, "--text-model",
                                      folder, *flags]).resolved()  # fmt: skip
    data = load_pair_dataset(sentence_pairs, tuple(COLUMNS.split(",")))
    return METHODS["pairs"].build(config, data, 1, print), config


def embedded(model, texts: list[str], max_length: int, column: int = 0) -> torch.Tensor:
    tokenizer = model.tokenizers[0]
    tokens = tokenizer(texts, padding=True, truncation=True, max_length=max_length,
                       return_tensors="pt")  # fmt: skip
    with torch.no_grad():
        return model.eval().project_texts(tokens["input_ids"], tokens["attention_mask"], column)


def test_the_folder_is_taken_as_it_is_and_its_untrained_export_embeds_alike(
    folder, sentence_pairs, tmp_path
):
    from sentence_transformers import SentenceTransformer

    method, config = built(folder, sentence_pairs)
    assert (config.text_pooling, config.max_length) == ("cls", 16)
    assert method.prompts == {"anchor": "query: "}
    theirs = SentenceTransformer(folder, device="cpu").double()
    reference = theirs.encode(TEXTS, convert_to_tensor=True, prompt_name="query").double()
    ours = embedded(method.model, ["query: " + text for text in TEXTS], 16)
    method.model.save_pretrained(str(tmp_path / "untrained"))
    export = SentenceTransformer(str(tmp_path / "untrained" / "sentence_transformer"),
                                 device="cpu")  # fmt: skip
    exported = export.encode(TEXTS, convert_to_tensor=True, prompt_name="query").double()
    errors = (ours - reference).abs().max().item(), (exported - reference).abs().max().item()
    print(f"the folder as it is: ours {errors[0]:.1e}, its untrained export {errors[1]:.1e}")
    assert max(errors) <= 1e-6
    control, _ = built(folder, sentence_pairs, "--text-pooling", "mean")
    other = embedded(control.model, ["query: " + text for text in TEXTS], 16)
    assert other.shape != reference.shape or (other - reference).abs().max().item() > 1e-3


@pytest.mark.parametrize("mode", POOLINGS)
def test_every_pooling_mode_of_a_folder_embeds_as_sentence_transformers_does(
    mode, sentence_pairs, tmp_path
):
    """Each of sentence-transformers' pooling modes, on texts of different lengths (the
    padding left out), in the folder and in the export of the untrained tower."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    bert = make_text_model(tmp_path / "bert", dropout=0.0)
    folder = tmp_path / "folder"
    modules = [Transformer(str(bert), max_seq_length=16), Pooling(16, mode)]
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    method, config = built(str(folder), sentence_pairs)
    reference = SentenceTransformer(str(folder), device="cpu").double()
    reference = reference.encode(TEXTS, convert_to_tensor=True).double()
    method.model.save_pretrained(str(tmp_path / "untrained"))
    export = SentenceTransformer(str(tmp_path / "untrained" / "sentence_transformer"),
                                 device="cpu").double()  # fmt: skip
    exported = export.encode(TEXTS, convert_to_tensor=True).double()
    ours = embedded(method.model, TEXTS, 16)
    errors = (ours - reference).abs().max().item(), (exported - reference).abs().max().item()
    print(f"pooling {mode}: ours {errors[0]:.1e}, the untrained export {errors[1]:.1e}")
    assert config.text_pooling == mode and max(errors) <= 1e-6


def test_the_trained_export_embeds_as_the_trained_towers(runs, folder):
    from sentence_transformers import SentenceTransformer

    from models.sentence_folder import read_sentence_folder
    from models.text import TextPairModel, TextTower, load_text_encoder

    final = runs(1) / "final"
    encoder, tokenizer = load_text_encoder(str(final / "tower0"), torch.float64)
    stack = read_sentence_folder(folder)
    tower = TextTower(encoder, "cls", dense=stack.dense_layers(torch.float64), normalize=True)
    ours = TextPairModel([tower], [tokenizer])
    ours.load_state_dict(load_file(final / "model.safetensors"))
    reference = embedded(ours, ["query: " + text for text in TEXTS], 16)
    st = SentenceTransformer(str(final / "sentence_transformer"), device="cpu")
    exported = st.encode(TEXTS, convert_to_tensor=True, prompt_name="anchor").double()
    described = json.loads((final / "sentence_transformer" / "modules.json").read_text())
    kinds = [module["type"].rsplit(".", 1)[-1] for module in described]
    error = (reference - exported).abs().max().item()
    print(f"trained: SentenceTransformer(final/sentence_transformer) vs ours: {error:.1e}; "
          f"its modules {kinds}")  # fmt: skip
    assert kinds == ["Transformer", "Pooling", "Dense", "Normalize"] and error <= 1e-6


def test_one_and_three_processes_train_the_same_model(runs):
    error = final_files_difference(runs(1), runs(3))
    print(f"a sentence-transformers folder, 1 vs 3 processes: {error:.1e}")
    assert error <= EXACT


def test_a_flag_that_overrides_the_folder_says_so(runs):
    output = runs.output(1, "--text-pooling", "mean", "--max-length", "8")
    assert "--text-pooling mean overrides --text-model's own cls" in output
    assert "--max-length 8 overrides --text-model's own 16" in output


@pytest.mark.parametrize(
    "pooling, message",
    [({"pooling_mode": ["cls", "mean"]}, "pooling cls + mean is not taken here yet"),
     ({"include_prompt": False}, "(include_prompt false) is not taken here yet")],
    ids=["concatenated-modes", "prompt-left-out"],
)  # fmt: skip
def test_a_module_it_cannot_take_is_one_line(folder, sentence_pairs, tmp_path, pooling, message):
    import shutil

    broken = tmp_path / "folder"
    shutil.copytree(folder, broken)
    config = broken / "1_Pooling" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **pooling}))
    result = train_pooled(1, *COMMON, "--dataset", sentence_pairs, "--text-model", str(broken),
                          "--output-dir", str(tmp_path / "run"), check=False)  # fmt: skip
    last = (result.stdout + result.stderr).strip().splitlines()[-1]
    assert result.returncode != 0 and message in last, last
