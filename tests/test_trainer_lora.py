"""LoRA adapters (``--lora-rank``, through peft) on 1, 2 and 3 processes, float64.

Text pairs on a tiny BERT whose own dropout is 0, so that the adapters' dropout (0.1) is
the only randomness: keyed by sample it trains the same adapters on any number of
processes, drawn per process it does not. Image-text adapts both transformers towers
(a tiny ViT and the BERT). The base weights stay frozen and out of the checkpoints;
final/ holds each adapter for ``PeftModel.from_pretrained`` and the merged model for
``AutoModel`` and ``SentenceTransformer``.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from launch import (
    LAUNCHER_BF16,
    TrainerRuns,
    final_files_difference,
    make_text_model,
    one_chunk,
    one_line_errors,
    train_pooled,
)

pytest.importorskip("peft")
EXACT = 1e-9  # float64: only the summation order differs between the world sizes
LORA = ("--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.1")
PAIRS = ["--dtype", "float64", "--batch-size", "6", "--lr", "1e-2", "--max-length", "8",
         "--max-steps", "5", "--num-workers", "0", "--columns", "anchor,positive,negative_1",
         *LORA]  # fmt: skip
IMAGE_TEXT = ["--dtype", "float64", "--batch-size", "6", "--lr", "1e-2", "--max-steps", "5",
              "--columns", "image,caption", "--knn-k", "0", "--num-workers", "0",
              "--max-length", "8", *LORA]  # fmt: skip


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> str:
    """The tiny BERT without dropout of its own."""
    return str(make_text_model(tmp_path_factory.mktemp("bert-no-dropout"), dropout=0.0))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sentence_pairs, bert):
    return TrainerRuns(tmp_path_factory, *PAIRS, "--dataset", sentence_pairs, "--text-model", bert)


@pytest.fixture(scope="module")
def image_text_runs(tmp_path_factory, captioned_images, bert, tiny_vit):
    return TrainerRuns(tmp_path_factory, *IMAGE_TEXT, "--dataset", captioned_images,
                       "--text-model", bert, "--image-model", tiny_vit)  # fmt: skip


@pytest.mark.parametrize(
    "flags, processes",
    [((), 2), (("--accumulation-chunks", "3"), 3), (("--gradient-checkpointing",), 2)],
    ids=["W2", "W3-K3", "checkpointing-W2"],
)
def test_text_pairs_train_the_same_adapters_on_n_processes(runs, flags, processes):
    error = final_files_difference(runs(1, *one_chunk(flags)), runs(processes, *flags))
    print(f"LoRA text pairs {' '.join(flags)}, 1 vs {processes}: {error:.1e}")
    assert error <= EXACT


@pytest.mark.parametrize(
    "flags, processes", [((), 2), (("--accumulation-chunks", "3"), 3)], ids=["W2", "W3-K3"]
)
def test_image_text_trains_the_same_adapters_on_both_towers(image_text_runs, flags, processes):
    error = final_files_difference(
        image_text_runs(1, *one_chunk(flags)), image_text_runs(processes, *flags)
    )
    print(f"LoRA on both image-text towers {' '.join(flags)}, 1 vs {processes}: {error:.1e}")
    assert error <= EXACT


def test_lora_with_checkpointing_trains_under_bf16_autocast(sentence_pairs, bert, tmp_path):
    """``--mixed_precision bf16``: the adapters and the recompute under autocast, float32
    parameters (the run's dtype), 2 processes; finite losses and moved adapters. bf16
    rounds differently on 1 and 2 processes, so no equality is asserted."""
    output = tmp_path / "bf16"
    train_pooled(2, *PAIRS[2:], "--dtype", "float32", "--dataset", sentence_pairs,
                 "--text-model", bert, "--gradient-checkpointing", "--log-every", "1",
                 "--output-dir", str(output), environment=LAUNCHER_BF16)  # fmt: skip
    losses = [json.loads(line).get("loss") for line in (output / "metrics.jsonl").open()]
    losses = [loss for loss in losses if loss is not None]
    adapters = {n: t for n, t in load_file(output / "final" / "model.safetensors").items()
                if ".lora_B" in n}  # fmt: skip
    print(f"LoRA + checkpointing under bf16, 2 processes: losses {losses}")
    assert len(losses) == 5 and all(math.isfinite(loss) for loss in losses)
    assert all(t.dtype == torch.float32 for t in adapters.values())
    assert max(t.abs().max().item() for t in adapters.values()) > 0  # B starts at 0


def test_control_lora_dropout_drawn_per_process_is_not_the_same(runs):
    error = final_files_difference(runs(1), runs(2, "--dropout-masks", "per-process"))
    print(f"LoRA dropout per process, 1 vs 2: {error:.1e}")
    assert error > 1e3 * EXACT


def test_only_the_adapters_train_and_the_checkpoint_holds_only_them(runs, bert):
    """The base weights in final/ are the loaded ones; a checkpoint holds the adapters
    (and nothing frozen), a fraction of the model."""
    run = runs(1, "--save-every", "5")
    final = load_file(run / "final" / "model.safetensors")
    base = load_file(f"{bert}/model.safetensors")
    checkpoint = load_file(run / "checkpoint-5" / "model.safetensors")
    adapters = {name for name in final if ".lora_" in name}
    frozen = {name: tensor for name, tensor in final.items() if name not in adapters}
    for name, tensor in frozen.items():
        original = name.replace("towers.0.encoder.base_model.model.", "").replace(".base_layer", "")
        if original.startswith("pooler."):  # not in the files: drawn from the run's seed
            continue
        assert torch.equal(tensor, base[original].double()), name
    assert adapters and set(checkpoint) == adapters
    held, total = (sum(t.numel() for t in d.values()) for d in (checkpoint, final))
    print(f"checkpoint: {len(checkpoint)} adapter tensors, {held} of {total} values")


def test_a_checkpoint_of_two_processes_resumes_on_one_and_ends_alike(runs, sentence_pairs, bert,
                                                                     tmp_path):  # fmt: skip
    straight = runs(2, "--save-every", "2")
    resumed = tmp_path / "resumed"
    train_pooled(1, *PAIRS, "--dataset", sentence_pairs, "--text-model", bert,
                 "--output-dir", str(resumed),
                 "--resume-from", str(straight / "checkpoint-2"))  # fmt: skip
    error = final_files_difference(straight, resumed)
    print(f"LoRA resumed at step 2 of 5 on 1 process, from 2: {error:.1e}")
    assert error <= EXACT


def test_final_loads_as_a_peft_adapter_a_merged_model_and_a_sentence_transformer(runs, bert):
    """PeftModel.from_pretrained(base, final/adapter0), AutoModel(final/tower0) and
    SentenceTransformer(final/sentence_transformer) each embed as the trained model."""
    from peft import PeftModel
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    final = runs(1) / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["towers"][0]["adapter"] == "adapter0"
    tokenizer = AutoTokenizer.from_pretrained(final / "tower0")
    texts = ["red cat runs", "the quick dog jumps over a stone near the river"]
    tokens = tokenizer(texts, padding=True, truncation=True, max_length=8, return_tensors="pt")
    mask = tokens["attention_mask"][..., None].double()

    def pooled(encoder) -> torch.Tensor:
        with torch.no_grad():
            hidden = encoder.eval()(**tokens).last_hidden_state
        return (hidden * mask).sum(1) / mask.sum(1)

    base = AutoModel.from_pretrained(bert, dtype=torch.float64)
    adapted = PeftModel.from_pretrained(base, final / "adapter0")
    merged = AutoModel.from_pretrained(final / "tower0", dtype=torch.float64)
    weights = load_file(final / "model.safetensors")
    adapter = {k.replace("towers.0.encoder.", ""): v for k, v in weights.items() if ".lora_" in k}
    theirs = {k: v for k, v in adapted.state_dict().items() if ".lora_" in k}
    assert {k.replace(".default", ""): v for k, v in theirs.items()}.keys() == {
        k.replace(".default", "") for k in adapter
    }
    st = SentenceTransformer(str(final / "sentence_transformer"), device="cpu").double()
    reference = pooled(adapted)
    errors = {
        "merged AutoModel": (pooled(merged) - reference).abs().max().item(),
        "SentenceTransformer": (st.encode(texts, convert_to_tensor=True) - reference)
        .abs()
        .max()
        .item(),
    }
    untrained = (pooled(AutoModel.from_pretrained(bert, dtype=torch.float64)) - reference).abs()
    print(f"LoRA final/ round trips against PeftModel.from_pretrained: {errors}; the base "
          f"model embeds {untrained.max().item():.1e} away")  # fmt: skip
    assert max(errors.values()) <= 1e-12
    assert untrained.max().item() > 1e-3  # the control: the adapters did train


@pytest.mark.parametrize(
    "flags, expected",
    [
        (("--lora-target-modules", "q_proj"), "--lora-target-modules q_proj matches no linear"),
        (("--text-model", "{distilbert}"), "has none of query, value, q_proj, v_proj"),
    ],
    ids=["targets-match-nothing", "no-default-targets"],
)
def test_an_adapter_problem_is_one_line_on_every_rank(sentence_pairs, bert, tmp_path, flags,
                                                      expected):  # fmt: skip
    """DistilBERT names its projections q_lin and v_lin: no default target."""
    from transformers import DistilBertConfig, DistilBertModel

    distilbert = shutil.copytree(bert, tmp_path / "distilbert")
    (distilbert / "model.safetensors").unlink()
    config = DistilBertConfig(vocab_size=200, dim=16, n_layers=1, n_heads=2, hidden_dim=32)
    DistilBertModel(config).save_pretrained(distilbert)
    flags = [flag.format(distilbert=distilbert) for flag in flags]
    result = train_pooled(2, *PAIRS, "--dataset", sentence_pairs, "--text-model", bert, *flags,
                          "--output-dir", str(tmp_path / "run"), check=False)  # fmt: skip
    one_line_errors(result, expected, 2)


def _two_ddp_steps(rank: int, world_size: int, frozen: bool) -> str:
    """Two DDP steps of a model whose second layer only rank 0 uses (as a pooler only some
    ranks reach, or an adapter an idle rank skips); ``frozen``: that layer frozen, as the
    trainer freezes what no forward reaches. Returns "trained"; DDP's refusal on rank 1
    is raised, so that the pool replaces workers whose gloo pairs timed out."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    layers[1].requires_grad_(not frozen)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = layers

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.layers[0](x)
            return self.layers[1](x) if rank == 0 else x

    model = DistributedDataParallel(Model())
    try:
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
    except RuntimeError as error:
        if rank == 1:
            raise
        return f"timed out waiting for rank 1: {str(error).splitlines()[0][:80]}"
    return "trained"


def test_control_ddp_refuses_a_trainable_parameter_that_one_rank_skips():
    """What freezing prevents: with the layer trainable, DDP stops at the second step (the
    rank that skipped it finds the previous reduction unfinished, the other times out
    waiting for it); frozen, both ranks train."""
    from contrastive_accelerate.workers import run_in_group

    frozen = run_in_group(_two_ddp_steps, 2, (True,), timeout_s=60, collective_timeout_s=2)
    with pytest.raises(RuntimeError, match="Expected to have finished reduction") as refused:
        run_in_group(_two_ddp_steps, 2, (False,), timeout_s=60, collective_timeout_s=2)
    (refusal,) = [line for line in str(refused.value).splitlines() if "Expected" in line][:1]
    print(f"frozen: {frozen}; trainable, one rank skipping it: {refusal.strip()[:90]}")
    assert frozen == ["trained", "trained"]
