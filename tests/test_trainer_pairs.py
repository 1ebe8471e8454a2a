"""Text pairs through trainer.py on 1, 2 and 3 processes: a tiny BERT built in the test,
a tokenizer trained on the test's words, nothing downloaded.

float64, the tower's dropout keyed by sample, a hard-negative column, and 20 rows in
global batches of 6 (25 rows, 5 held out for retrieval): every epoch ends with a batch
of 2, which 3 processes split 1 + 1 + 0 (an idle rank), and each rank pads to its own
longest text. ``--max-length 8``
truncates some texts (said once). Each negative control removes one mechanism.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launch import (
    TrainerRuns,
    final_files_difference,
    make_text_model,
    make_word_level_model,
    one_chunk,
    one_line_errors,
    train_pooled,
)

pytest.importorskip("transformers")
EXACT = 1e-9  # float64: only the summation order differs between the world sizes
COLUMNS = "anchor,positive,negative_1"
# AdamW (the pairs' default) at 1e-3: at 0.1 its steps amplify float64 rounding to 1e-11.
COMMON = ["--dtype", "float64", "--batch-size", "6", "--lr", "1e-3", "--max-length", "8",
          "--log-every", "1", "--max-steps", "5", "--num-workers", "0"]  # fmt: skip
# The tiny BERT's 16 dims and two prefixes of them (sentence-transformers' MatryoshkaLoss).
MATRYOSHKA = ("--matryoshka-dims", "16,8,4", "--matryoshka-weights", "1,0.5,0.25")
# E5-style prompts on two of the columns (sentence-transformers' ``prompts``), with room
# for them: at 8 tokens the prompted positives truncate to near-copies, whose exact ties
# a 1e-14 difference breaks either way in the retrieval figures.
PROMPTS = ("--prompts", "anchor=query: ", "--prompts", "positive=passage: ", "--max-length", "16")
TWO_TOWERS = ["--two-towers", "--projection-dim", "8", "--text-pooling", "cls", "--mnrl-symmetric",
              "--unique-texts"]  # fmt: skip


@pytest.fixture(scope="module")
def data(sentence_pairs, tiny_bert, tiny_bert_without_pad, tmp_path_factory) -> dict[str, str]:
    # A model whose 50-token vocabulary the tokenizer's ids outrun.
    small = make_text_model(tmp_path_factory.mktemp("bert-small-vocabulary"), vocab_size=50)
    word_level = make_word_level_model(tmp_path_factory.mktemp("word-level"))
    return {"pairs": sentence_pairs, "model": tiny_bert, "no_pad": tiny_bert_without_pad,
            "small_vocabulary": str(small), "word_level": str(word_level)}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):
    return TrainerRuns(tmp_path_factory, *COMMON, "--dataset", data["pairs"],
                        "--columns", COLUMNS, "--text-model", data["model"])  # fmt: skip


@pytest.mark.parametrize(
    "flags, processes",
    [
        ((), 2),
        ((), 3),
        (("--accumulation-chunks", "3"), 2),
        (TWO_TOWERS, 2),
        (TWO_TOWERS, 3),
        ((*TWO_TOWERS, "--accumulation-chunks", "3"), 3),
        (("--gradient-checkpointing",), 2),
        (("--gradient-checkpointing", "--accumulation-chunks", "3"), 3),
        ((*MATRYOSHKA, *PROMPTS, "--accumulation-chunks", "3"), 3),
    ],
    ids=[
        "W2",
        "W3",
        "W2-K3",
        "two-towers-W2",
        "two-towers-W3",
        "two-towers-W3-K3",
        "checkpointing-W2",
        "checkpointing-W3-K3",
        "matryoshka-prompts-W3-K3",
    ],  # fmt: skip
)
def test_one_process_and_n_processes_train_the_same_towers(runs, flags, processes):
    reference = runs(1, *one_chunk(flags))
    error = final_files_difference(reference, runs(processes, *flags))
    print(f"pairs {' '.join(flags) or 'shared tower'}, 1 vs {processes}: {error:.1e}")
    assert error <= EXACT
    # Sums of counts and reciprocal ranks: equal up to their float64 summation order.
    assert retrieval(reference) == pytest.approx(retrieval(runs(processes, *flags)), abs=1e-12)


@pytest.fixture(scope="module")
def duplicated_runs(tmp_path_factory, data):
    """The pairs with texts repeated across rows, as real data repeat them: every third
    row's positive is row 0's, and every fourth row's negative is row 1's positive."""
    rows = [json.loads(line) for line in Path(data["pairs"]).read_text().splitlines()]
    for index, row in enumerate(rows):
        if index % 3 == 0:
            row["positive"] = rows[0]["positive"]
        if index % 4 == 2:
            row["negative_1"] = rows[1]["positive"]
    path = tmp_path_factory.mktemp("duplicated") / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return TrainerRuns(tmp_path_factory, *COMMON, "--dataset", str(path),
                       "--columns", COLUMNS, "--text-model", data["model"])  # fmt: skip


MASKED = ("--mnrl-false-negatives", "identity")


@pytest.mark.parametrize(
    "flags, processes",
    [(MASKED, 2), ((*MASKED, "--accumulation-chunks", "3"), 3),
     ((*MASKED, "--mnrl-symmetric", *MATRYOSHKA, "--accumulation-chunks", "3"), 3)],
    ids=["W2", "W3-K3", "symmetric-matryoshka-W3-K3"],
)  # fmt: skip
def test_false_negatives_masked_across_the_global_batch_train_alike(duplicated_runs, flags,
                                                                     processes):  # fmt: skip
    """A text equal to an anchor's positive is not its negative, wherever the ranks hold
    it: 1 and N processes train the same model; the control, the same runs without the
    masking, train another."""
    reference = duplicated_runs(1, *one_chunk(flags))
    error = final_files_difference(reference, duplicated_runs(processes, *flags))
    unmasked = tuple(flag for flag in one_chunk(flags) if flag not in MASKED)
    control = final_files_difference(reference, duplicated_runs(1, *unmasked))
    print(f"masked false negatives {' '.join(flags)}, 1 vs {processes}: {error:.1e}; "
          f"unmasked {control:.1e}")  # fmt: skip
    assert error <= EXACT and control > 1e3 * EXACT


def gist(data, margin: str = "0.05", guide: str = "model") -> tuple[str, ...]:
    """GISTEmbed guided by the tiny BERT as it starts (a frozen copy of the towers), or
    by ``data[guide]``."""
    return ("--loss", "gist", "--gist-guide", data[guide], "--gist-margin", margin)


@pytest.mark.parametrize("extra, processes", [((), 2), (("--accumulation-chunks", "3"), 3)],
                         ids=["W2", "W3-K3"])  # fmt: skip
def test_gist_trains_alike_on_1_and_n_processes(runs, data, extra, processes):
    """--loss gist: the guide's embeddings of every rank's texts vet every rank's
    negatives; the control, a margin that leaves nothing out, trains another model."""
    reference = runs(1, *gist(data))
    error = final_files_difference(reference, runs(processes, *gist(data), *extra))
    control = final_files_difference(reference, runs(1, *gist(data, margin="-2")))
    print(f"--loss gist {' '.join(extra)}, 1 vs {processes}: {error:.1e}; a guide that "
          f"leaves nothing out: {control:.1e}")  # fmt: skip
    assert error <= EXACT and control > 1e3 * EXACT


def test_a_guide_of_another_vocabulary_trains_alike_on_1_and_3_processes(runs, data):
    """A guide that reads other tokens (a word-level vocabulary, another BERT): each
    column's texts decoded and tokenized again for it, as sentence-transformers does.
    1 process and 3 with 3 chunks train the same model; the control, the run guided by
    the tiny BERT itself, another."""
    flags = gist(data, guide="word_level")
    reference = runs(1, *flags)
    error = final_files_difference(reference, runs(3, *flags, "--accumulation-chunks", "3"))
    control = final_files_difference(reference, runs(1, *gist(data)))
    print(f"a guide of another vocabulary, 1 vs 3 with 3 chunks: {error:.1e}; guided by "
          f"the towers' own tokens instead: {control:.1e}")  # fmt: skip
    assert error <= EXACT and control > 1e3 * EXACT


def test_a_guide_it_cannot_take_is_one_line_on_every_rank(data, tmp_path):
    common = (*COMMON, "--dataset", data["pairs"], "--text-model", data["model"],
              "--columns", COLUMNS)  # fmt: skip
    for flags, message in (
        (("--loss", "gist"), "--loss gist needs --gist-guide"),
        (("--gist-guide", data["model"]), "--gist-guide does not apply"),
    ):
        result = train_pooled(2, *common, *flags, "--output-dir", str(tmp_path / "run"),
                              check=False)  # fmt: skip
        one_line_errors(result, message, 2)


def test_checkpointing_recomputes_the_same_masks_as_the_plain_run(runs):
    """--gradient-checkpointing recomputes each BERT layer in backward with the forward's
    per-sample dropout masks: the model trains as without it."""
    error = final_files_difference(runs(1), runs(1, "--gradient-checkpointing"))
    print(f"pairs with vs without --gradient-checkpointing, 1 process: {error:.1e}")
    assert error <= EXACT


def retrieval(run: Path) -> dict[str, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    return {key: value for record in records for key, value in record.items() if "@" in key}


@pytest.mark.parametrize(
    "control, reference_flags",
    [
        (("--dropout-masks", "per-process"), ()),
        (("--no-gather",), ()),
        (("--no-attention-mask",), ("--no-attention-mask",)),
        (("--gradient-checkpointing", "--dropout-masks", "per-process"), ()),
        ((*MATRYOSHKA, "--no-gather"), MATRYOSHKA),
        (MATRYOSHKA, ()),
        (PROMPTS, ("--max-length", "16")),
    ],
    ids=[
        "per-process-dropout",
        "local-negatives",
        "no-attention-mask",
        "checkpointing-per-process-dropout",
        "matryoshka-local-negatives",
        "matryoshka-is-another-objective",
        "prompts-are-other-texts",
    ],  # fmt: skip
)
def test_control_each_mechanism_removed_breaks_it(runs, control, reference_flags):
    error = final_files_difference(runs(1, *reference_flags), runs(2, *control))
    print(f"control {' '.join(control)}, 1 vs 2: {error:.1e}")
    assert error > 1e3 * EXACT


def test_the_straight_run_trains_and_says_what_it_changed(runs):
    records = [json.loads(line) for line in (runs(2) / "metrics.jsonl").open()]
    output = runs.output(2)
    losses = [record["loss"] for record in records if "loss" in record]
    assert len(losses) == 5 and all(loss > 0 for loss in losses)
    assert output.count("are longer than --max-length 8 tokens and are truncated") == 1
    assert output.count("dropout drawn inside a kernel cannot be keyed by sample") == 1


def test_a_mid_epoch_resume_ends_where_the_straight_run_does(runs, data, tmp_path):
    """Resumed from a copy of the text model at another path: the checkpoint records what
    the model and tokenizer are (content digests), not where they were."""
    straight = runs(1, "--save-every", "2")
    copy = shutil.copytree(data["model"], tmp_path / "same-model-elsewhere")
    resumed = tmp_path / "resumed"
    train_pooled(1, *COMMON, "--dataset", data["pairs"], "--columns", COLUMNS, "--text-model",
           str(copy), "--output-dir", str(resumed),
           "--resume-from", str(straight / "checkpoint-2"))  # fmt: skip
    error = final_files_difference(straight, resumed)
    print(f"pairs resumed at step 2 of 5, the model by another path: {error:.1e}")
    assert error == 0.0


def test_a_tokenizer_changed_in_place_is_refused_on_resume(runs, data, tmp_path):
    """The control of the test above: the model's path and weights kept, its tokenizer
    edited (no lower-casing), and the resume is refused, on every rank."""
    straight = runs(1, "--save-every", "2")
    model = shutil.copytree(data["model"], tmp_path / "model")
    rules = json.loads((model / "tokenizer.json").read_text())
    rules["normalizer"]["lowercase"] = False
    (model / "tokenizer.json").write_text(json.dumps(rules))
    result = train_pooled(2, *COMMON, "--dataset", data["pairs"], "--columns", COLUMNS,
                          "--text-model", str(model), "--output-dir", str(tmp_path / "resumed"),
                          "--resume-from", str(straight / "checkpoint-2"), check=False)  # fmt: skip
    (line,) = set(one_line_errors(result, "--text-model's tokenizer (content digest", 2))
    assert "weights" not in line
    print(line)


def test_a_guide_with_other_weights_is_refused_on_resume(runs, data, tmp_path):
    """--loss gist resumed with the guide's weights changed at the same options: refused
    on every rank, naming the guide; the same guide at another path resumes."""
    from safetensors.torch import save_file

    straight = runs(1, *gist(data), "--save-every", "2")
    guide = shutil.copytree(data["model"], tmp_path / "guide")
    resume = ("--resume-from", str(straight / "checkpoint-2"), "--output-dir")
    moved = train_pooled(2, *COMMON, "--dataset", data["pairs"], "--columns", COLUMNS,
                         "--text-model", data["model"], *gist(data)[:2], "--gist-guide",
                         str(guide), *gist(data)[4:], *resume, str(tmp_path / "moved"))  # fmt: skip
    assert moved.returncode == 0
    weights = load_file(guide / "model.safetensors")
    save_file({name: value + 0.01 for name, value in weights.items()},
              str(guide / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    result = train_pooled(2, *COMMON, "--dataset", data["pairs"], "--columns", COLUMNS,
                          "--text-model", data["model"], *gist(data)[:2], "--gist-guide",
                          str(guide), *gist(data)[4:], *resume, str(tmp_path / "changed"),
                          check=False)  # fmt: skip
    (line,) = set(one_line_errors(result, "--gist-guide's weights (content digest", 2))
    print(line)


def test_final_loads_in_transformers_and_sentence_transformers_and_embeds_alike(runs):
    """final/tower0 through AutoModel and AutoTokenizer, final/sentence_transformer through
    SentenceTransformer: each embeds as the trained weights of final/model.safetensors do."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    from models.text import TextPairModel, TextTower, load_text_encoder

    final = runs(1) / "final"
    tokenizer = AutoTokenizer.from_pretrained(final / "tower0")
    encoder, _ = load_text_encoder(str(final / "tower0"), torch.float64)
    ours = TextPairModel([TextTower(encoder, "mean")])
    ours.load_state_dict(load_file(final / "model.safetensors"))
    ours.eval()
    texts = ["red cat runs", "the quick dog jumps over a stone near the river"]
    tokens = tokenizer(texts, padding=True, truncation=True, max_length=8, return_tensors="pt")
    with torch.no_grad():
        reference = ours([(tokens["input_ids"], tokens["attention_mask"])])
        hf = AutoModel.from_pretrained(final / "tower0").eval()(**tokens).last_hidden_state
        mask = tokens["attention_mask"][..., None].double()
        hf = (hf * mask).sum(1) / mask.sum(1)  # mean pooling, as trained
    st = SentenceTransformer(str(final / "sentence_transformer"), device="cpu")
    embedded = st.encode(texts, convert_to_tensor=True).double()
    errors = (reference - hf).abs().max().item(), (reference - embedded).abs().max().item()
    print(f"final/ round trip: AutoModel {errors[0]:.1e}, SentenceTransformer {errors[1]:.1e}")
    assert max(errors) <= 1e-6


def test_the_prompts_are_the_sentence_transformers_exports_own(runs):
    """A run with ``--prompts``: final/sentence_transformer names them (its
    ``config_sentence_transformers.json``), and ``encode(texts, prompt_name=column)``
    embeds what the trained tower embeds from the prompted texts (1e-6)."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    from models.text import TextPairModel, TextTower, load_text_encoder

    final = runs(1, *PROMPTS) / "final"
    described = json.loads((final / "sentence_transformer" /
                            "config_sentence_transformers.json").read_text())  # fmt: skip
    prompts = {"anchor": "query: ", "positive": "passage: "}
    # sentence-transformers adds its empty "query" and "document" prompts beside them.
    assert prompts.items() <= described["prompts"].items()
    tokenizer = AutoTokenizer.from_pretrained(final / "tower0")
    encoder, _ = load_text_encoder(str(final / "tower0"), torch.float64)
    ours = TextPairModel([TextTower(encoder, "mean")]).double()
    ours.load_state_dict(load_file(final / "model.safetensors"))
    st = SentenceTransformer(str(final / "sentence_transformer"), device="cpu")
    texts = ["red cat runs", "a stone near the river"]
    for column, prompt in prompts.items():
        tokens = tokenizer(
            [prompt + text for text in texts],
            padding=True,
            truncation=True,
            max_length=16,
            return_tensors="pt",
        )  # PROMPTS' --max-length
        with torch.no_grad():
            reference = ours.eval()([(tokens["input_ids"], tokens["attention_mask"])])
        embedded = st.encode(texts, prompt_name=column, convert_to_tensor=True).double()
        error = (reference - embedded).abs().max().item()
        print(f"--prompts {column}: SentenceTransformer with prompt_name vs ours: {error:.1e}")
        assert error <= 1e-6


def test_two_identical_runs_write_the_same_final_files(runs, data, tmp_path):
    """Every safetensors file of final/ (the model, tower0/, the sentence-transformers
    export), 0.0 apart; and every tower loads whole: nothing missing, nothing drawn at
    random by AutoModel or SentenceTransformer (BERT's pooler included)."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    again = tmp_path / "again"
    train_pooled(1, *COMMON, "--dataset", data["pairs"], "--columns", COLUMNS, "--text-model",
                 data["model"], "--output-dir", str(again))  # fmt: skip
    files = sorted(p.relative_to(again / "final") for p in (again / "final").rglob("*.safetensors"))
    error = final_files_difference(runs(1), again)
    print(f"two identical runs: {len(files)} files of final/ ({', '.join(map(str, files))}) "
          f"{error:.1e} apart")  # fmt: skip
    assert error == 0.0 and len(files) == 3
    _, loading = AutoModel.from_pretrained(again / "final" / "tower0", output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"]
    exported = SentenceTransformer(str(again / "final" / "sentence_transformer"), device="cpu")
    tower = load_file(again / "final" / "tower0" / "model.safetensors")
    state = exported[0].auto_model.state_dict()
    assert state.keys() == tower.keys()
    assert all(torch.equal(state[name].to(tower[name].dtype), tower[name]) for name in tower)


def test_control_a_tower_saved_without_its_pooler_loads_with_a_random_one(tmp_path):
    """What the export did before: a BERT saved without pooler weights, loaded twice under
    different seeds, gets two different poolers (and a report that they are missing)."""
    from transformers import AutoModel, BertConfig, BertModel

    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32)  # fmt: skip
    BertModel(config, add_pooling_layer=False).save_pretrained(tmp_path)
    poolers = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model, loading = AutoModel.from_pretrained(tmp_path, output_loading_info=True)
        assert "pooler.dense.weight" in loading["missing_keys"]
        poolers.append(model.pooler.dense.weight.detach())
    difference = (poolers[0] - poolers[1]).abs().max().item()
    print(f"a pooler drawn at load, two seeds: {difference:.2e} apart")
    assert difference > 1e-3


def test_the_logged_retrieval_is_what_the_final_towers_give(runs, data):
    """MRR@10 and recall@1 on the held-out pairs, recomputed here from final/'s weights
    with sentence-transformers' encoder, against the figures the run logged."""
    from sentence_transformers import SentenceTransformer

    from contrastive_accelerate.data.pairs import load_pair_dataset

    held_out = load_pair_dataset(data["pairs"], tuple(COLUMNS.split(","))).evaluation
    # In the run's float64: float32 can break the near-ties of these short paraphrases
    # otherwise than the logged figures did (seen once in a full run).
    path = str(runs(1) / "final" / "sentence_transformer")
    st = SentenceTransformer(path, device="cpu").double()
    anchors, positives = (
        st.encode(held_out[column], convert_to_tensor=True, normalize_embeddings=True)
        for column in ("anchor", "positive")
    )
    similarity = anchors @ positives.T
    ranks = 1 + (similarity > similarity.diagonal()[:, None]).sum(dim=1)
    # In float64, as the run computes it: 1.0 / ranks would be float32 (0.9 -> 0.89999998).
    mrr = torch.where(ranks <= 10, 1.0 / ranks.double(), 0.0).mean().item()
    logged = retrieval(runs(1))
    print(f"held-out retrieval: logged {logged}, recomputed mrr@10 {mrr:.4f}")
    assert logged["retrieval_mrr@10"] == pytest.approx(mrr, abs=1e-9)
    assert logged["retrieval_recall@1"] == pytest.approx((ranks == 1).double().mean().item())


def test_two_towers_save_each_tower_and_a_query_document_sentence_transformer(runs):
    """tower0/ and tower1/ with their projections in config.json, and
    sentence_transformer/ as a query/document Router whose encode_query and
    encode_document embed as our two towers do (its Dense layers hold float32 weights:
    1e-6)."""
    from sentence_transformers import SentenceTransformer

    from models.text import TextPairModel, TextTower, load_text_encoder

    final = runs(1, *TWO_TOWERS) / "final"
    assert (final / "tower0" / "tokenizer.json").exists()
    assert (final / "tower1" / "model.safetensors").exists()
    assert json.loads((final / "config.json").read_text())["towers"][1]["projection"] == 8
    towers, tokenizer = [], None
    for index in range(2):
        encoder, tokenizer = load_text_encoder(str(final / f"tower{index}"), torch.float64)
        towers.append(TextTower(encoder, "cls", 8))
    ours = TextPairModel(towers).double()
    ours.load_state_dict(load_file(final / "model.safetensors"))
    ours.eval()
    st = SentenceTransformer(str(final / "sentence_transformer"), device="cpu").double()
    texts = ["red cat runs", "the quick dog jumps over a stone near the river"]
    tokens = tokenizer(texts, padding=True, truncation=True, max_length=8, return_tensors="pt")
    with torch.no_grad():
        query, document = (ours.towers[i](tokens["input_ids"], tokens["attention_mask"])
                           for i in (0, 1))  # fmt: skip
    errors = (
        (st.encode_query(texts, convert_to_tensor=True) - query).abs().max().item(),
        (st.encode_document(texts, convert_to_tensor=True) - document).abs().max().item(),
    )
    print(
        f"two towers through SentenceTransformer: query {errors[0]:.1e}, document {errors[1]:.1e}"
    )
    assert max(errors) <= 1e-6
    assert (query - document).abs().max().item() > 1e-3  # the towers differ: the routes matter


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--columns", "anchor,answer"], "has no column 'answer'"),
        ("no-pad", "has no pad token"),
        (["--columns", "anchor,positive", "--image-column", "anchor"], "cannot be read"),
        (["--columns", COLUMNS, "--model", "mlp"], "--model does not apply to text pairs"),
        (["--columns", COLUMNS, "--max-length", "80"], "--max-length 80: --text-model"),
        ("small-vocabulary", "tokens, more than the model's vocabulary of 50"),
        (["--columns", COLUMNS, "--matryoshka-dims", "32,8"], "matryoshka dims 32,8: each must"),
        (["--columns", COLUMNS, "--prompts", "query=q: "], "--prompts: query is not a column"),
    ],
    ids=[
        "missing-column",
        "tokenizer-without-pad-token",
        "text-column-as-the-image-tower",
        "an-image-option",
        "longer-than-the-positions",
        "tokenizer-beyond-the-vocabulary",
        "matryoshka-wider-than-the-embeddings",
        "a-prompt-for-no-column",
    ],  # fmt: skip
)
def test_bad_input_is_one_line_on_every_rank(data, tmp_path, flags, message):
    model = {"no-pad": data["no_pad"], "small-vocabulary": data["small_vocabulary"]}.get(
        flags if isinstance(flags, str) else "", data["model"]
    )
    columns = [] if isinstance(flags, str) else flags
    result = train_pooled(2, *COMMON, "--dataset", data["pairs"], "--text-model", model,
                    *(columns or ["--columns", COLUMNS]), "--output-dir", str(tmp_path),
                    check=False)  # fmt: skip
    one_line_errors(result, message, 2)


@pytest.mark.parametrize(
    "columns, message",
    [
        (("anchor",), "give at least two"),
        (("anchor", "anchor"), "names a column twice"),
        (("anchor", "label"), "column 'label' holds int64: neither text"),
    ],
)
def test_bad_columns_are_refused_before_anything_loads(tmp_path, columns, message):
    from contrastive_accelerate.data import DataError
    from contrastive_accelerate.data.pairs import load_pair_dataset

    path = tmp_path / "rows.jsonl"
    path.write_text('{"anchor": "a cat", "positive": "the cat", "label": 1}\n' * 3)
    with pytest.raises(DataError, match=message):
        load_pair_dataset(str(path), columns)


@pytest.mark.parametrize(
    "value, shown",
    [("null", "None"), ("[]", "[]")],
    ids=["null", "empty-list"],
)
def test_a_cell_that_is_no_text_is_named_at_start_up(tmp_path, value, shown):
    """A JSON null, an empty list of captions: one line at loading naming the column,
    the row of the file and the value, before any hold-out renumbers the rows (a number
    among texts makes the column's type mixed, refused as a column already)."""
    from contrastive_accelerate.data import DataError
    from contrastive_accelerate.data.pairs import load_pair_dataset

    rows = ['{"anchor": "a cat", "positive": ["the cat", "one cat"]}'] * 5
    rows[3] = f'{{"anchor": "a dog", "positive": {value}}}'
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(rows) + "\n")
    expected = f"column 'positive', row 3 of split 'train': {shown} is neither a text"
    with pytest.raises(DataError, match=re.escape(expected)):
        load_pair_dataset(str(path), ("anchor", "positive"))


def test_a_null_text_is_one_line_on_every_rank(data, tmp_path):
    path = tmp_path / "rows.jsonl"
    lines = Path(data["pairs"]).read_text().splitlines()
    lines[7] = json.dumps({**json.loads(lines[7]), "positive": None})
    path.write_text("\n".join(lines) + "\n")
    result = train_pooled(2, *COMMON, "--dataset", str(path), "--text-model", data["model"],
                          "--columns", COLUMNS, "--output-dir", str(tmp_path / "run"),
                          check=False)  # fmt: skip
    one_line_errors(result, "column 'positive', row 7 of split 'train': None", 2)
