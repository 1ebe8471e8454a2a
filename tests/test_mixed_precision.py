"""Every numeric primitive under ``torch.autocast`` bf16 on CPU, on 1 process and on 2 gloo ranks
(and every loss on float16 inputs too).

What is exact and what is not:
- Every loss computes in float32 whatever autocast says, so inside an autocast block
  on float32 embeddings it equals the float32 loss exactly (tolerance 1e-6: the same
  float32 operations in the same order), and on bfloat16 embeddings it equals the
  float32 loss of those bf16 values upcast (same argument); its gradient comes back
  in bfloat16, within one bf16 rounding (relative 2^-8) of that float32 gradient.
- SyncBatchNorm on bfloat16 activations (a convolution's output under autocast)
  matches ``nn.BatchNorm`` on the concatenated batch under the same autocast: both
  normalise in float32 and round the output to bfloat16 once, so they agree within
  2 bf16 rounding steps of the output (|y| <= 4 here: 2 * 4 * 2^-8 = 0.03125). Their
  running statistics stay float32 and agree to float32 rounding (1e-5).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from contrastive_accelerate.ckpt_diff import max_abs_diff
from contrastive_accelerate.collectives import gather
from contrastive_accelerate.testing import run_on_ranks
from models import SyncBatchNorm, convert_sync_batchnorm

from launch import LAUNCHER_BF16, launch, train_pooled
from loss_cases import CASES, call

TEMPERATURE = 0.1  # a small temperature is where bf16 similarities hurt most
FLOAT32_SAME_OPS = 1e-6
BF16_STEP = 2.0**-8  # relative rounding of a bfloat16 value (8 significant bits)


def _embeddings(rows: int, features: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    out0 = torch.randn(rows, features, generator=generator)
    return out0, out0 + 0.3 * torch.randn(rows, features, generator=generator)


def _loss_and_grad(case, loss_fn, out0, out1, labels, autocast: bool):
    out0, out1 = out0.clone().requires_grad_(), out1.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = call(case, loss_fn, out0, out1, labels)
        loss.backward()  # inside the block, as in Accelerate's examples
    return loss.detach(), out0.grad


def _naive_ntxent(out0, out1):
    """NT-Xent as commonly written: no float32 island, so autocast runs the matmul in bf16."""
    z = F.normalize(torch.cat([out0, out1]), dim=1)
    logits = z @ z.T / TEMPERATURE
    logits = logits.masked_fill(torch.eye(len(z), dtype=torch.bool), float("-inf"))
    n = len(out0)
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return F.cross_entropy(logits.float(), targets)


def _max_abs(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def losses_worker(rank: int, world_size: int, sizes: list[int]) -> dict:
    """Every loss of ``losses`` in float32, inside autocast, and on bf16 inputs."""
    out0, out1 = _embeddings(sum(sizes))
    labels = torch.arange(sum(sizes)) % 3
    rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    out0, out1, labels = out0[rows], out1[rows], labels[rows]
    results = {}
    for name, case in CASES.items():
        criterion = case.make()
        float32_loss, float32_grad = _loss_and_grad(case, criterion, out0, out1, labels, False)
        autocast_loss, autocast_grad = _loss_and_grad(case, criterion, out0, out1, labels, True)
        bf16_0, bf16_1 = out0.bfloat16(), out1.bfloat16()
        bf16_loss, bf16_grad = _loss_and_grad(case, criterion, bf16_0, bf16_1, labels, True)
        upcast_loss, upcast_grad = _loss_and_grad(
            case, criterion, bf16_0.float(), bf16_1.float(), labels, False
        )
        scale = upcast_grad.abs().max().item() or 1.0
        half_0, half_1 = out0.half(), out1.half()
        half_loss, half_grad = _loss_and_grad(case, criterion, half_0, half_1, labels, False)
        half_upcast, _ = _loss_and_grad(
            case, criterion, half_0.float(), half_1.float(), labels, False
        )
        results[name] = {
            "fp16_grad_dtype": str(half_grad.dtype),
            "fp16_loss_vs_upcast": _max_abs(half_loss, half_upcast),
            "autocast_loss_dtype": str(autocast_loss.dtype),
            "autocast_vs_float32": max(
                _max_abs(autocast_loss, float32_loss), _max_abs(autocast_grad, float32_grad)
            ),
            "bf16_grad_dtype": str(bf16_grad.dtype),
            "bf16_loss_vs_upcast": _max_abs(bf16_loss, upcast_loss),
            "bf16_grad_vs_upcast_relative": _max_abs(bf16_grad, upcast_grad) / scale,
            "bf16_loss_vs_float32": _max_abs(bf16_loss, float32_loss),
        }
    return results


@pytest.fixture(scope="module", params=[(1, [6]), (2, [4, 2])], ids=["1-process", "W2-uneven"])
def loss_results(request):
    world_size, sizes = request.param
    if world_size == 1:
        return [losses_worker(0, 1, sizes)]
    return run_on_ranks(losses_worker, world_size, sizes)


@pytest.mark.parametrize("name", list(CASES))
def test_loss_inside_autocast_equals_float32(loss_results, name):
    worst = max(result[name]["autocast_vs_float32"] for result in loss_results)
    print(f"{name} inside autocast vs float32: {worst:.3e}")
    assert all(result[name]["autocast_loss_dtype"] == "torch.float32" for result in loss_results)
    assert worst <= FLOAT32_SAME_OPS


@pytest.mark.parametrize("name", list(CASES))
def test_loss_on_bf16_inputs_computes_in_float32(loss_results, name):
    loss_error = max(result[name]["bf16_loss_vs_upcast"] for result in loss_results)
    grad_error = max(result[name]["bf16_grad_vs_upcast_relative"] for result in loss_results)
    drift = max(result[name]["bf16_loss_vs_float32"] for result in loss_results)
    print(
        f"{name} on bf16 inputs: loss vs float32 of the same values {loss_error:.3e}, "
        f"gradient (relative) {grad_error:.3e}; vs the unrounded float32 inputs {drift:.3e}"
    )
    assert all(result[name]["bf16_grad_dtype"] == "torch.bfloat16" for result in loss_results)
    assert loss_error <= FLOAT32_SAME_OPS
    assert grad_error <= BF16_STEP


@pytest.mark.parametrize("name", list(CASES))
def test_loss_on_fp16_inputs_computes_in_float32(loss_results, name):
    loss_error = max(result[name]["fp16_loss_vs_upcast"] for result in loss_results)
    print(f"{name} on fp16 inputs: loss vs float32 of the same values {loss_error:.3e}")
    assert all(result[name]["fp16_grad_dtype"] == "torch.float16" for result in loss_results)
    assert loss_error <= FLOAT32_SAME_OPS


def test_negative_control_bf16_similarities_miss_float32():
    """The float32 island is what makes the autocast result exact: without it, it is not."""
    out0, out1 = _embeddings(1024)
    plain = CASES["ntxent"]  # called as a plain two-input loss
    float32_loss, _ = _loss_and_grad(plain, _naive_ntxent, out0, out1, None, autocast=False)
    autocast_loss, _ = _loss_and_grad(plain, _naive_ntxent, out0, out1, None, autocast=True)
    error = _max_abs(autocast_loss, float32_loss)
    print(f"naive NT-Xent, autocast vs float32: {error:.3e}")
    assert error > 100 * FLOAT32_SAME_OPS


def test_gather_returns_bf16_gradients_unchanged():
    x = torch.randn(3, 4, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (gather(x) * 2).sum().backward()
    assert x.grad.dtype == torch.bfloat16 and torch.equal(x.grad, torch.full_like(x, 2))


def sync_batchnorm_worker(rank: int, world_size: int, sizes: list[int]) -> dict:
    generator = torch.Generator().manual_seed(5)
    x = (torch.randn(sum(sizes), 4, 3, 3, generator=generator) * 2 + 1).bfloat16()
    upstream = torch.randn(x.shape, generator=generator).bfloat16()
    rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))

    reference = nn.BatchNorm2d(4)
    layer = convert_sync_batchnorm(nn.BatchNorm2d(4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x_all = x.clone().requires_grad_()
        y_all = reference(x_all)
        (y_all.float() * upstream.float()).sum().backward()

        x_local = x[rows].clone().requires_grad_()
        y_local = layer(x_local)
        (y_local.float() * upstream[rows].float()).sum().backward()
    grads = torch.cat([layer.weight.grad, layer.bias.grad])
    if world_size > 1:
        dist.all_reduce(grads)  # what DDP does with the local parameter gradients
    weight_grad, bias_grad = grads.chunk(2)

    upcast = x.float()  # float32 statistics of the same bf16 values
    return {
        "dtypes": (str(y_local.dtype), str(x_local.grad.dtype), str(layer.running_mean.dtype)),
        "output": _max_abs(y_local, y_all[rows]),
        "input_grad_relative": _max_abs(x_local.grad, x_all.grad[rows])
        / x_all.grad.abs().max().item(),
        "param_grad_relative": max(
            _max_abs(weight_grad, reference.weight.grad) / reference.weight.grad.abs().max(),
            _max_abs(bias_grad, reference.bias.grad) / reference.bias.grad.abs().max(),
        ).item(),
        "running_mean": _max_abs(layer.running_mean, 0.1 * upcast.mean((0, 2, 3))),
        "running_var": _max_abs(layer.running_var, 0.9 + 0.1 * upcast.var((0, 2, 3))),
        "running_vs_batchnorm": max(
            _max_abs(layer.running_mean, reference.running_mean),
            _max_abs(layer.running_var, reference.running_var),
        ),
    }


@pytest.fixture(scope="module", params=[(1, [5]), (2, [3, 2])], ids=["1-process", "W2-uneven"])
def sync_batchnorm_results(request):
    world_size, sizes = request.param
    if world_size == 1:
        # No process group: SyncBatchNorm is plain BatchNorm, which must hold the same rules.
        return [sync_batchnorm_worker(0, 1, sizes)]
    return run_on_ranks(sync_batchnorm_worker, world_size, sizes)


def test_sync_batchnorm_under_autocast_matches_batchnorm(sync_batchnorm_results):
    for result in sync_batchnorm_results:
        assert result["dtypes"] == ("torch.bfloat16", "torch.bfloat16", "torch.float32")
    worst = {
        key: max(result[key] for result in sync_batchnorm_results)
        for key in ("output", "input_grad_relative", "param_grad_relative")
    }
    print(
        "SyncBatchNorm bf16 vs nn.BatchNorm: " + ", ".join(f"{k} {v:.3e}" for k, v in worst.items())
    )
    assert worst["output"] <= 2 * 4 * BF16_STEP
    assert worst["input_grad_relative"] <= 2 * BF16_STEP
    assert worst["param_grad_relative"] <= 1e-5


def test_sync_batchnorm_running_statistics_stay_float32(sync_batchnorm_results):
    worst = {
        key: max(result[key] for result in sync_batchnorm_results)
        for key in ("running_mean", "running_var", "running_vs_batchnorm")
    }
    print("running statistics: " + ", ".join(f"{k} {v:.3e}" for k, v in worst.items()))
    assert max(worst.values()) <= 1e-5


def test_sync_batchnorm_keeps_float32_buffers_for_bf16_input_without_autocast():
    layer = SyncBatchNorm(4)
    output = layer(torch.randn(6, 4).bfloat16())
    assert output.dtype == torch.bfloat16 and layer.running_var.dtype == torch.float32


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory):
    """Final models and logged losses of short bf16 runs, keyed by (model, processes,
    extra flags, how): pooled with the launcher's bf16 variable, launched with its flag,
    or pooled in float32 (the control).

    Small on purpose: a CPU without native bf16 (no AVX-512) computes bf16 convolutions'
    and matrix products' backward in slow reference kernels, several seconds a step for
    ResNet-18 on 8-pixel digits, so the batch is 4 and ViT-Tiny sees 4-pixel images
    (17 tokens instead of 65)."""
    cache: dict[tuple, tuple[str, list[float]]] = {}

    def get(
        model: str, processes: int, *extra: str, how: str = "pooled"
    ) -> tuple[str, list[float]]:
        key = (model, processes, extra, how)
        if key not in cache:
            output = tmp_path_factory.mktemp(f"bf16-{model}-{processes}")
            args = (
                *("--model", model, "--batch-size", "4", "--max-steps", "3", "--log-every", "1"),
                *("--knn-k", "0", "--output-dir", str(output), *extra),
            )
            if how == "launched":
                launch(processes, *args, launcher_flags=["--mixed_precision", "bf16"])
            else:
                train_pooled(processes, *args, environment=LAUNCHER_BF16 if how == "pooled" else {})
            records = [json.loads(line) for line in (output / "metrics.jsonl").open()]
            losses = [record["loss"] for record in records if "loss" in record]
            cache[key] = (str(output / "final"), losses)
        return cache[key]

    return get


def test_the_launchers_bf16_flag_is_what_the_pooled_bf16_runs_get(bf16_runs):
    """``--mixed_precision bf16`` from the launcher: the same model as the pooled run that
    gets the launcher's variable, and not the float32 model (the control)."""
    launched, _ = bf16_runs("mlp", 2, how="launched")
    pooled, _ = bf16_runs("mlp", 2)
    float32, _ = bf16_runs("mlp", 2, how="float32")
    same, control = max_abs_diff(launched, pooled), max_abs_diff(launched, float32)
    print(f"mlp bf16: launched vs pooled {same:.1e}; vs float32 {control:.1e}")
    assert same == 0.0
    assert control > 1e-4


@pytest.mark.parametrize("model", ["mlp", "resnet18"])
def test_trainer_runs_bf16_on_one_and_two_processes(bf16_runs, model):
    """ResNet-18 on 2 processes is the shipped multi-GPU setting: SyncBatchNorm under bf16.
    bf16 rounds differently on 1 and 2 processes, so the difference is reported, not
    asserted to a float32 tolerance."""
    (one, one_losses), (two, two_losses) = bf16_runs(model, 1), bf16_runs(model, 2)
    assert len(one_losses) == len(two_losses) == 3
    assert all(math.isfinite(loss) for loss in one_losses + two_losses)
    print(f"{model} bf16: 1 vs 2 processes max abs diff {max_abs_diff(one, two):.3e}")


def test_trainer_runs_bf16_vit_with_dropout_and_chunks(bf16_runs):
    """Gradient caching under autocast: bf16 embeddings, float32 loss, bf16 cached gradients."""
    one, one_losses = bf16_runs("vit_tiny", 1, "--image-size", "4")
    chunked, chunked_losses = bf16_runs(
        "vit_tiny", 2, "--image-size", "4", "--accumulation-chunks", "2"
    )
    assert len(one_losses) == len(chunked_losses) == 3
    assert all(math.isfinite(loss) for loss in one_losses + chunked_losses)
    print(f"vit_tiny bf16: 1 process vs 2 x 2 chunks max abs diff {max_abs_diff(one, chunked):.3e}")
