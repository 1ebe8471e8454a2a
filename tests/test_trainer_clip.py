"""A whole CLIP or SigLIP checkpoint (``--clip-model``) fine-tuned on image-text pairs on
1, 2 and 3 processes, float64: a tiny ``CLIPModel`` and ``SiglipModel`` built in the
test, with the test's tokenizer and an image processor configured in code.

Fine-tuned whole, and with LoRA adapters (dropout 0.1, keyed by sample) on both towers,
the projections, scale and bias trained in full. final/ is the model in its own format,
and with adapters also the adapter that ``PeftModel.from_pretrained`` loads.
"""

from __future__ import annotations

import pytest
import torch

from launch import TrainerRuns, final_files_difference, one_chunk, one_line_errors, train_pooled

pytest.importorskip("transformers")
EXACT = 1e-9  # float64: only the summation order differs between the world sizes
LORA = ("--lora-rank", "4", "--lora-dropout", "0.1")
COMMON = ["--dtype", "float64", "--batch-size", "6", "--lr", "1e-3", "--max-steps", "5",
          "--columns", "image,caption", "--knn-k", "0", "--num-workers", "0", "--max-length",
          "8"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory, captioned_images, tiny_clip):
    return TrainerRuns(tmp_path_factory, *COMMON, "--dataset", captioned_images,
                       "--clip-model", tiny_clip)  # fmt: skip


@pytest.fixture(scope="module")
def siglip_runs(tmp_path_factory, captioned_images, tiny_siglip):
    return TrainerRuns(tmp_path_factory, *COMMON, "--dataset", captioned_images,
                       "--clip-model", tiny_siglip)  # fmt: skip


@pytest.mark.parametrize(
    "flags, processes",
    [
        ((), 2),
        (("--accumulation-chunks", "3"), 3),
        (LORA, 2),
        ((*LORA, "--accumulation-chunks", "3"), 3),
        ((*LORA, "--lora-towers", "text", "--gradient-checkpointing"), 2),
    ],
    ids=["whole-W2", "whole-W3-K3", "lora-W2", "lora-W3-K3", "lora-text-checkpointing-W2"],
)
def test_a_clip_checkpoint_trains_alike_on_n_processes(runs, flags, processes):
    error = final_files_difference(runs(1, *one_chunk(flags)), runs(processes, *flags))
    print(f"--clip-model {' '.join(flags) or 'whole'}, 1 vs {processes}: {error:.1e}")
    assert error <= EXACT


@pytest.mark.parametrize("flags", [(), LORA], ids=["whole", "lora"])
def test_a_siglip_checkpoint_trains_alike_on_two_processes(siglip_runs, flags):
    error = final_files_difference(siglip_runs(1, *flags), siglip_runs(2, *flags))
    print(f"--clip-model SigLIP {' '.join(flags) or 'whole'}, 1 vs 2: {error:.1e}")
    assert error <= EXACT


def test_control_lora_dropout_drawn_per_process_is_not_the_same(runs):
    error = final_files_difference(runs(1, *LORA), runs(2, *LORA, "--dropout-masks", "per-process"))
    print(f"--clip-model LoRA dropout per process, 1 vs 2: {error:.1e}")
    assert error > 1e3 * EXACT


def test_a_lora_checkpoint_of_two_processes_resumes_on_three(runs, captioned_images, tiny_clip,
                                                             tmp_path):  # fmt: skip
    straight = runs(2, *LORA, "--save-every", "2")
    resumed = tmp_path / "resumed"
    train_pooled(3, *COMMON, "--dataset", captioned_images, "--clip-model", tiny_clip, *LORA,
                 "--output-dir", str(resumed),
                 "--resume-from", str(straight / "checkpoint-2"))  # fmt: skip
    error = final_files_difference(straight, resumed)
    print(f"--clip-model LoRA resumed at step 2 of 5 on 3 processes, from 2: {error:.1e}")
    assert error <= EXACT


def _inputs(final):
    """Two captions' tokens, and one 8x8 picture: as the processor prepares it, and as
    the data give it to the model (``NORMALIZE``: [-1, 1])."""
    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    from contrastive_accelerate.data import NORMALIZE

    tokenizer = AutoTokenizer.from_pretrained(final)
    tokens = tokenizer(["red cat runs", "the quick dog jumps over a stone"], padding=True,
                       return_tensors="pt")  # fmt: skip
    array = (np.random.default_rng(0).random((8, 8, 3)) * 255).astype(np.uint8)
    processor = AutoImageProcessor.from_pretrained(final)
    processed = processor(Image.fromarray(array), return_tensors="pt")["pixel_values"]
    data = NORMALIZE(torch.from_numpy(array).permute(2, 0, 1))[None]
    return tokens, processed.double(), data.double()


def _embeddings(model, tokens, pixels) -> torch.Tensor:
    """Both sides' projections from transformers' own feature methods."""
    with torch.no_grad():
        images = model.get_image_features(pixel_values=pixels)
        texts = model.get_text_features(**tokens)
    return torch.cat([getattr(x, "pooler_output", x) for x in (images, texts)])


def test_final_loads_in_its_own_format_and_as_an_adapter_and_embeds_alike(runs, tiny_clip):
    """CLIPModel.from_pretrained(final) of a whole fine-tuning and of a LoRA one (merged),
    on the processor's pixels, embeds as our DualEncoder on the data's; and
    PeftModel.from_pretrained(base, final/adapter) as the merged model."""
    from peft import PeftModel
    from transformers import AutoImageProcessor, CLIPModel

    from models.dual_encoder import DualEncoder

    whole, adapted = runs(1) / "final", runs(1, *LORA) / "final"
    tokens, processed, data = _inputs(whole)
    errors = {}
    for name, final in (("whole", whole), ("lora merged", adapted)):
        model = CLIPModel.from_pretrained(final, dtype=torch.float64).eval()
        ours = DualEncoder(model, None, AutoImageProcessor.from_pretrained(final)).double().eval()
        with torch.no_grad():
            reference = torch.cat([ours.image(data), ours.text(**tokens)])
        errors[name] = (_embeddings(model, tokens, processed) - reference).abs().max().item()
    base = CLIPModel.from_pretrained(tiny_clip, dtype=torch.float64)
    peft_model = PeftModel.from_pretrained(base, adapted / "adapter").eval()
    merged = CLIPModel.from_pretrained(adapted, dtype=torch.float64).eval()
    merged_embeddings = _embeddings(merged, tokens, processed)
    errors["adapter vs merged"] = (
        (_embeddings(peft_model, tokens, processed) - merged_embeddings).abs().max().item()
    )
    untrained = CLIPModel.from_pretrained(tiny_clip, dtype=torch.float64).eval()
    moved = (_embeddings(untrained, tokens, processed) - merged_embeddings).abs().max().item()
    print(f"--clip-model final/ round trips: {errors}; the untrained model {moved:.1e} away")
    # The processor rescales and normalises in float32, the data in float32 too.
    assert max(errors.values()) <= 1e-5
    assert moved > 1e-4  # the control: the model did train


def test_our_clip_step_equals_clip_models_own_loss_and_gradients(captioned_images, tiny_clip):
    """One batch through the method (its embed and loss) against transformers'
    ``CLIPModel(..., return_loss=True)`` on the same pixels and tokens: the loss value
    and every parameter's gradient, on one process."""
    from contrastive_accelerate.methods import METHODS
    from trainer import TrainConfig

    config = TrainConfig(
        columns="image,caption", clip_model=tiny_clip, dataset=captioned_images,
        dtype="float64", knn_k=0, max_length=8, num_workers=0,
    ).resolved()  # fmt: skip
    row = METHODS["pairs"]
    method = row.build(config, row.load(config), 1, lambda line: None)
    batch = method.dataset.collate([method.dataset[(0, index)] for index in range(6)])
    model = method.model
    ours = method.loss([method.embed(model, batch, step=0)], batch, None, step=0)
    ours.backward()
    expected = {n: p.grad.clone() for n, p in model.model.named_parameters() if p.grad is not None}
    model.zero_grad()
    ((input_ids, attention_mask),) = batch.columns
    pixels = batch.images.double() * model.scale + model.shift
    theirs = model.model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixels,
                         return_loss=True).loss  # fmt: skip
    theirs.backward()
    found = {n: p.grad for n, p in model.model.named_parameters() if p.grad is not None}
    gradient_error = max((found[n] - expected[n]).abs().max().item() for n in expected)
    print(f"CLIP step: loss ours {ours.item():.6f} vs CLIPModel {theirs.item():.6f}, "
          f"gradients {gradient_error:.1e}")  # fmt: skip
    assert found.keys() == expected.keys()
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-12) and gradient_error <= 1e-12


@pytest.mark.parametrize(
    "flags, expected",
    [
        (("--clip-model", "{clip}", "--text-model", "{bert}"),
         "--text-model does not apply with --clip-model"),
        (("--clip-model", "{bert}"), "is not a dual encoder"),
        (("--clip-model", "{siglip}", "--loss", "infonce"),
         "whose logit bias only --loss siglip trains"),
        (("--clip-model", "{clip}", "--lora-rank", "4", "--lora-target-modules", "query"),
         "--lora-target-modules query matches no linear layer"),
    ],
    ids=["with-text-model", "not-a-dual-encoder", "siglip-with-infonce", "lora-targets"],
)  # fmt: skip
def test_a_clip_model_problem_is_one_line_on_every_rank(
    captioned_images, tiny_clip, tiny_siglip, tiny_bert, tmp_path, flags, expected
):
    flags = [f.format(clip=tiny_clip, siglip=tiny_siglip, bert=tiny_bert) for f in flags]
    result = train_pooled(2, *COMMON, "--dataset", captioned_images, *flags,
                          "--output-dir", str(tmp_path), check=False)  # fmt: skip
    one_line_errors(result, expected, 2)


def test_the_logit_scale_and_bias_train_under_lora(siglip_runs, tiny_siglip):
    """LoRA freezes the towers' own weights; SigLIP's scale and bias still train."""
    from safetensors.torch import load_file

    final = load_file(siglip_runs(1, *LORA) / "final" / "model.safetensors")
    base = load_file(f"{tiny_siglip}/model.safetensors")
    moved = {name: (final[name] - base[name].double()).abs().max().item()
             for name in ("logit_scale", "logit_bias")}  # fmt: skip
    print(f"SigLIP under LoRA: scale and bias moved by {moved}")
    assert min(moved.values()) > 0
