"""Activation checkpointing that recomputes exactly what the forward computed: a
transformers BERT and ViT (``checkpoint_transformer_layers``), the torchvision ViT and
ResNet (``checkpoint_image_encoder``), float64, against the same model without it.

The recompute runs in backward, outside the ``sample_randomness`` block of the forward;
``keyed_recompute`` re-enters its keys. The control leaves it out: the recompute then
has no keys, and ``SampleDropout`` refuses to draw a mask rather than draw another one.
A ResNet's recompute keeps BatchNorm's running statistics; the control, without that,
updates them twice.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from models import SimCLR, convert_sample_dropout, sample_keys, sample_randomness
from models.checkpointing import checkpoint_image_encoder, checkpoint_transformer_layers
from models.dropout import switch_off_kernel_dropout

pytest.importorskip("transformers")
EXACT = 0.0  # the recompute runs the same float64 operations on the same inputs


def _bert() -> nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, hidden_dropout_prob=0.1,
                        attention_probs_dropout_prob=0.1)  # fmt: skip
    return BertModel(config, add_pooling_layer=False).double()


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    config = ViTConfig(image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=32, hidden_dropout_prob=0.1,
                       attention_probs_dropout_prob=0.1)  # fmt: skip
    return ViTModel(config).double()


def _tokens() -> dict[str, torch.Tensor]:
    ids = torch.randint(5, 50, (6, 7), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids}


def _pixels() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {"pixel_values": torch.randn(6, 3, 8, 8, generator=generator, dtype=torch.float64)}


def _keyed(model: nn.Module, inputs: dict) -> nn.Module:
    model = convert_sample_dropout(model)
    switch_off_kernel_dropout(model, tuple(inputs.values()), lambda line: None)
    return model.train()


def _gradients(model: nn.Module, inputs: dict) -> tuple[dict[str, torch.Tensor], int]:
    """The parameters' gradients of a fixed function of the outputs, and how many times
    the first layer's first module started (2 per step when it is recomputed: a
    pre-hook, as the recompute stops once it has what backward needs)."""
    calls = []
    layers = [m for m in model.modules() if type(m).__name__.endswith("Layer")]
    # Inside the layer: transformers keeps a layer's own hooks outside the checkpoint.
    hook = next(layers[0].children()).register_forward_pre_hook(lambda *_: calls.append(1))
    keys = sample_keys(0, 3, torch.arange(6))
    with sample_randomness(keys):
        hidden = model(**inputs).last_hidden_state
    weights = torch.linspace(-1, 1, hidden.numel(), dtype=hidden.dtype).view_as(hidden)
    (hidden * weights).sum().backward()
    hook.remove()
    return {
        name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None
    }, len(calls)


@pytest.mark.parametrize("build, inputs", [(_bert, _tokens), (_vit, _pixels)], ids=["bert", "vit"])
def test_checkpointed_layers_recompute_the_same_masks(build, inputs):
    inputs = inputs()
    plain = _keyed(build(), inputs)
    checkpointed = copy.deepcopy(plain)
    checkpoint_transformer_layers(checkpointed)
    expected, plain_calls = _gradients(plain, inputs)
    found, calls = _gradients(checkpointed, inputs)
    error = max((found[name] - expected[name]).abs().max().item() for name in expected)
    print(f"{build.__name__[1:]}: checkpointed vs plain gradients {error:.1e}, layer ran {calls}x")
    assert (plain_calls, calls) == (1, 2)  # the control of the recompute itself
    assert found.keys() == expected.keys() and error <= EXACT


@pytest.mark.parametrize("build, inputs", [(_bert, _tokens), (_vit, _pixels)], ids=["bert", "vit"])
def test_control_a_recompute_without_the_forwards_keys_cannot_draw_them(build, inputs):
    inputs = inputs()
    model = _keyed(build(), inputs)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(RuntimeError, match="needs each row's key"):
        _gradients(model, inputs)


def test_the_torchvision_vit_recomputes_each_block_with_the_same_masks():
    torch.manual_seed(0)
    plain = convert_sample_dropout(SimCLR(backbone="vit_tiny", image_size=16, dropout=0.1,
                                          drop_path=0.1)).double().train()  # fmt: skip
    checkpointed = copy.deepcopy(plain)
    checkpoint_image_encoder(checkpointed.encoder)
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(2)).double()
    gradients, calls = [], []
    for model in (plain, checkpointed):
        block = model.encoder.encoder.layers[0]
        hook = block.register_forward_pre_hook(lambda *_: calls.append(1))
        with sample_randomness(sample_keys(0, 1, torch.arange(4))):
            model(images).pow(2).sum().backward()
        hook.remove()
        gradients.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    error = max((gradients[1][n] - gradients[0][n]).abs().max().item() for n in gradients[0])
    print(f"vit_tiny: checkpointed vs plain gradients {error:.1e}, first block ran {len(calls)}x")
    assert len(calls) == 3  # once plain, twice checkpointed
    assert error <= EXACT


def _resnet_step(keep_statistics: bool | None) -> tuple[dict, dict, int]:
    """One training step of a float64 ResNet-18 (None: not checkpointed): its gradients,
    its BatchNorm buffers after the step, and how often the first block started."""
    torch.manual_seed(0)
    model = SimCLR(backbone="resnet18", image_size=16).double().train()
    if keep_statistics is not None:
        checkpoint_image_encoder(model.encoder, keep_statistics=keep_statistics)
    calls = []
    model.encoder.layer1[0].conv1.register_forward_pre_hook(lambda *_: calls.append(1))
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(2)).double()
    model(images).pow(2).sum().backward()
    gradients = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return gradients, {n: b.clone() for n, b in model.named_buffers()}, len(calls)


def test_a_checkpointed_resnet_keeps_its_running_statistics_and_gradients():
    (plain, plain_buffers, plain_calls), (found, buffers, calls) = (
        _resnet_step(None), _resnet_step(True)
    )  # fmt: skip
    gradient_error = max((found[n] - plain[n]).abs().max().item() for n in plain)
    buffer_error = max((buffers[n] - plain_buffers[n]).abs().max().item() for n in plain_buffers)
    print(f"resnet18: checkpointed vs plain gradients {gradient_error:.1e}, BatchNorm buffers "
          f"{buffer_error:.1e}, first block's conv ran {calls}x")  # fmt: skip
    assert (plain_calls, calls) == (1, 2)
    assert plain.keys() == found.keys() and gradient_error <= EXACT
    assert buffers.keys() == plain_buffers.keys() and buffer_error == 0.0


def test_control_a_recompute_that_updates_batchnorm_again_moves_its_statistics():
    _, plain_buffers, _ = _resnet_step(None)
    _, buffers, _ = _resnet_step(False)
    moved = {n: (buffers[n] - plain_buffers[n]).abs().max().item() for n in plain_buffers}
    print(f"resnet18 recomputed without keeping the statistics: running mean "
          f"{max(v for n, v in moved.items() if 'running_mean' in n):.1e} away, batch count "
          f"{max(v for n, v in moved.items() if 'num_batches' in n):.0f} more")  # fmt: skip
    assert max(v for n, v in moved.items() if "running_mean" in n) > 1e-6
    assert max(v for n, v in moved.items() if "num_batches" in n) == 1


def test_under_bf16_autocast_the_recompute_draws_the_same_masks():
    """bf16 autocast on the CPU: the recompute runs under the forward's autocast state
    (torch's checkpoint restores it) and the keys, so the gradients are the plain ones."""
    inputs = _tokens()
    plain = _keyed(_bert().float(), inputs)
    checkpointed = copy.deepcopy(plain)
    checkpoint_transformer_layers(checkpointed)
    autocast = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
    with autocast():
        expected, _ = _gradients(plain, inputs)
    with autocast():
        found, calls = _gradients(checkpointed, inputs)
    error = max((found[name] - expected[name]).abs().max().item() for name in expected)
    print(f"bert under bf16 autocast: checkpointed vs plain gradients {error:.1e}")
    assert calls == 2 and error <= EXACT


def test_a_timm_vit_recomputes_each_block_with_the_same_masks():
    """``checkpoint_timm_blocks`` on a timm ViT whose blocks hold dropout: the recompute
    draws the forward's per-sample masks (timm's own checkpointing would run it outside
    the keys), so the gradients are the plain ones and each block runs twice."""
    timm = pytest.importorskip("timm")
    from models.checkpointing import checkpoint_timm_blocks

    torch.manual_seed(0)
    sizes = {"img_size": 8, "patch_size": 4, "depth": 2, "embed_dim": 16, "num_heads": 2}
    plain = timm.create_model("vit_tiny_patch16_224", proj_drop_rate=0.1, num_classes=0, **sizes)
    plain = convert_sample_dropout(plain).double().train()
    checkpointed = copy.deepcopy(plain)
    checkpoint_timm_blocks(checkpointed)
    images = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(2)).double()
    gradients, calls = [], []
    for model in (plain, checkpointed):
        hook = model.blocks[0].register_forward_pre_hook(lambda *_: calls.append(1))
        with sample_randomness(sample_keys(0, 1, torch.arange(4))):
            model(images).pow(2).sum().backward()
        hook.remove()
        gradients.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    error = max((gradients[1][n] - gradients[0][n]).abs().max().item() for n in gradients[0])
    print(f"timm vit: checkpointed vs plain gradients {error:.1e}, first block ran {len(calls)}x")
    assert len(calls) == 3  # once plain, twice checkpointed
    assert error <= EXACT
    # The control: timm's own checkpointing recomputes outside the keys.
    timms = copy.deepcopy(plain)
    timms.set_grad_checkpointing(True)
    with sample_randomness(sample_keys(0, 1, torch.arange(4))):
        output = timms(images).pow(2).sum()
    with pytest.raises(RuntimeError, match="SampleDropout needs each row's key"):
        output.backward()
