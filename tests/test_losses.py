"""Every loss of ``losses``, exact on W gloo processes: one harness for all of them.

For each loss and W = 2, 3, the global batch is split unevenly across real gloo
ranks (with an empty rank at W = 3). Each rank computes the loss on its share and
backpropagates; its gradients are divided by W, as DDP averages them, and compared
with the brute-force reference of ``references.py`` on the concatenated batch, in
float64: the mean of the returned values, every input row's gradient, and the
gradients of a learnable logit scale and bias. Tolerance 1e-10: only summation order
differs. Before the loss, each rank scales its rows by a factor of its own, so
that gradients routed to the wrong rank's rows cannot cancel out.

Negative controls, run in the same processes: the gather without gradient (as
``Accelerator.gather``), the all-reduce without gradient (lightly #1977), per-rank
BatchNorm-style standardisation (lightly's Barlow Twins) and the per-rank softmax
of DCLW's weights (lightly's DCLW) each break the equivalence by orders of magnitude.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from contrastive_accelerate.testing import run_on_ranks
from losses import (
    BarlowTwinsLoss,
    DCLLoss,
    DCLWLoss,
    InfoNCELoss,
    MultipleNegativesRankingLoss,
    NTXentLoss,
    SigLIPLoss,
    SupConLoss,
)
from losses.logsumexp import cross_entropy, tiled_logsumexp

from loss_cases import (
    CASES,
    TEMPERATURE,
    Patched,
    evaluate,
    global_batch,
    max_abs,
    owner_scales,
)

EXACT = 1e-10


def loss_worker(rank: int, world_size: int, name: str, sizes: list[int]) -> dict:
    case = CASES[name]
    batch = global_batch(sum(sizes))
    scales = owner_scales(sizes)
    rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    reference = evaluate(
        case, case.reference, batch["out0"], batch["out1"], batch["labels"], scales
    )

    def errors(loss_module) -> dict[str, float]:
        loss, grad0, grad1, scalar_grads = evaluate(
            case,
            loss_module,
            batch["out0"][rows],
            batch["out1"][rows],
            batch["labels"][rows],
            scales[rows],
        )
        mean_loss, scalar_grads = loss.clone(), scalar_grads.clone()
        dist.all_reduce(mean_loss)
        dist.all_reduce(scalar_grads)  # what DDP does with a parameter's gradients, then / W
        return {
            "value": abs(mean_loss.item() / world_size - reference[0].item()),
            "input_grad": max(
                max_abs(grad0 / world_size, reference[1][rows]),
                max_abs(grad1 / world_size, reference[2][rows]),
            ),
            "scalar_grad": max_abs(scalar_grads / world_size, reference[3]),
        }

    # Given every rank's size (as the trainer does), a loss exchanges none: same result.
    result = {
        "correct": errors(case.make()),
        "known_sizes": errors(partial(case.make(), sizes=sizes)),
    }
    for control, make in case.controls.items():
        made = make()
        if isinstance(made, Patched):
            with made:
                result[control] = errors(case.make())
        else:
            result[control] = errors(made)
    return result


SPLITS = {2: [3, 2], 3: [2, 0, 3]}
PARAMS = [
    pytest.param((name, world_size), id=f"{name}-W{world_size}")
    for name in CASES
    for world_size in SPLITS
]


@pytest.fixture(scope="module", params=PARAMS)
def results(request):
    name, world_size = request.param
    return name, run_on_ranks(loss_worker, world_size, name, SPLITS[world_size])


@pytest.mark.parametrize("sizes", ["correct", "known_sizes"])
def test_distributed_equals_single_process_on_the_concatenated_batch(results, sizes):
    name, per_rank = results
    worst = {
        key: max(result[sizes][key] for result in per_rank)
        for key in ("value", "input_grad", "scalar_grad")
    }
    print(f"{name} {sizes}: " + ", ".join(f"{key} {value:.2e}" for key, value in worst.items()))
    assert max(worst.values()) <= EXACT


def test_negative_controls_break_the_equivalence(results):
    name, per_rank = results
    for control in CASES[name].controls:
        worst = max(max(result[control].values()) for result in per_rank)
        print(f"{name} {control}: {worst:.2e}")
        assert worst > 1e3 * EXACT, control


# Peers on one process: the same value and input gradients as lightly and open_clip.

try:
    import lightly.loss as lightly_loss
except ImportError:  # a test-only extra
    lightly_loss = None
try:
    import open_clip.loss as open_clip_loss
except ImportError:
    open_clip_loss = None

PEERS = {
    "ntxent": ("lightly", lambda: lightly_loss.NTXentLoss(TEMPERATURE)),
    "dcl": ("lightly", lambda: lightly_loss.DCLLoss(TEMPERATURE)),
    "dclw": ("lightly", lambda: lightly_loss.DCLWLoss(TEMPERATURE, sigma=0.5)),
    "koleo": ("lightly", lambda: lightly_loss.KoLeoLoss()),
    "barlowtwins": ("lightly", lambda: lightly_loss.BarlowTwinsLoss(lambda_param=0.1)),
    "vicreg": ("lightly", lambda: lightly_loss.VICRegLoss()),
    "infonce": ("open_clip", lambda: open_clip_loss.ClipLoss()),
    "siglip": ("open_clip", lambda: open_clip_loss.SigLipLoss()),
}


@pytest.mark.parametrize("name", list(PEERS))
def test_single_process_value_equals_the_peers(name):
    library, make_peer = PEERS[name]
    if {"lightly": lightly_loss, "open_clip": open_clip_loss}[library] is None:
        pytest.skip(f"{library} is not installed (pip install -e '.[test]')")
    case = CASES[name]
    batch = global_batch(8)
    scales = owner_scales([8])
    ours = evaluate(case, case.make(), batch["out0"], batch["out1"], batch["labels"], scales)
    peer = evaluate(case, make_peer(), batch["out0"], batch["out1"], batch["labels"], scales)
    errors = [max_abs(a, b) for a, b in zip(ours, peer, strict=True)]
    print(f"{name} vs {library}: value {errors[0]:.2e}, gradients {max(errors[1:]):.2e}")
    assert max(errors) <= EXACT


def peer_worker(rank: int, world_size: int, name: str) -> dict:
    """lightly's distributed mode against its own single-process value, and ours."""
    batch = global_batch(4 * world_size)  # lightly's gather needs equal batch sizes
    rows = slice(4 * rank, 4 * (rank + 1))
    ours, peer = {
        "dclw": (
            lambda gather: DCLWLoss(TEMPERATURE, sigma=0.5, gather_distributed=gather),
            lambda gather: lightly_loss.DCLWLoss(TEMPERATURE, sigma=0.5, gather_distributed=gather),
        ),
        "barlowtwins": (
            lambda gather: BarlowTwinsLoss(0.1, gather_distributed=gather),
            lambda gather: lightly_loss.BarlowTwinsLoss(
                lambda_param=0.1, gather_distributed=gather
            ),
        ),
    }[name]
    differences = {}
    for label, make in (("lightly", peer), ("ours", ours)):
        local = make(True)(batch["out0"][rows], batch["out1"][rows]).detach()
        dist.all_reduce(local)
        whole = make(False)(batch["out0"], batch["out1"]).detach()  # one process's view
        differences[label] = abs(local.item() / world_size - whole.item())
    return differences


@pytest.mark.skipif(lightly_loss is None, reason="lightly is not installed")
@pytest.mark.parametrize("name", ["dclw", "barlowtwins"])
def test_peer_per_rank_statistics_differ_from_its_single_process_value(name):
    """lightly's DCLW takes its softmax over each rank's batch and its Barlow Twins
    standardises with each rank's statistics: distributed, each is a different
    function from the single-process one. Ours is the same function."""
    values = run_on_ranks(peer_worker, 2, name)[0]
    print(
        f"{name}, 2 ranks vs 1 process: lightly {values['lightly']:.2e}, ours {values['ours']:.2e}"
    )
    assert values["lightly"] > 1e3 * EXACT
    assert values["ours"] <= EXACT


# Bad input raises the same ValueError on every rank, never a hang.

BAD_INPUTS = {
    "shape_mismatch_on_last_rank": "different shapes",
    "not_2d_on_rank_0": "must be 2-D",
    "nan_on_rank_0": "NaN or Inf",
    "one_sample_in_the_global_batch": "the global batch has 1 sample",
    "labels_of_the_wrong_length_on_last_rank": "one label per sample",
    "nan_logit_scale_on_last_rank": "must be finite scalars",
}


def bad_input_worker(rank: int, world_size: int) -> dict:
    last, messages = world_size - 1, {}
    for name, case in CASES.items():
        criterion = case.make()
        n = 3
        good = torch.randn(n, 4, dtype=torch.float64)
        labels = torch.zeros(n, dtype=torch.long)
        scale, bias = torch.tensor(2.0), torch.tensor(0.0)
        inputs = {
            "shape_mismatch_on_last_rank": (good, torch.randn(n, 3) if rank == last else good),
            "not_2d_on_rank_0": (good[:, :, None] if rank == 0 else good,) * 2,
            "nan_on_rank_0": (good.clone().fill_(math.nan) if rank == 0 else good, good),
            "one_sample_in_the_global_batch": (good[: int(rank == 0)],) * 2,
            "labels_of_the_wrong_length_on_last_rank": (good, good),
            "nan_logit_scale_on_last_rank": (good, good),
        }
        for problem, (out0, out1) in inputs.items():
            bad_labels = labels[:1] if problem.startswith("labels") and rank == last else labels
            bad_scale = (
                torch.tensor(math.nan)
                if problem.startswith("nan_logit") and rank == last
                else scale
            )
            extra = {
                "labels": (
                    bad_labels[: len(out0)] if not problem.startswith("labels") else bad_labels,
                ),
                "scale": (bad_scale,),
                "scale_bias": (bad_scale, bias),
                "guides": (),
                "single": (),
                "": (),
            }[case.extra]
            guided = {"guides": (out0, out1)} if case.extra == "guides" else {}
            inputs = (out0,) if case.extra == "single" else (out0, out1)
            try:
                criterion(*inputs, *extra, **guided)
                messages[name, problem] = None
            except ValueError as error:
                messages[name, problem] = str(error)
            dist.barrier()  # the group is still usable: nobody is stuck in a collective
    return messages


def _applies(name: str, problem: str) -> bool:
    extra = CASES[name].extra
    if problem.startswith("labels"):
        return extra == "labels"
    if problem.startswith("nan_logit"):
        return extra in ("scale", "scale_bias")
    if problem.startswith("shape_mismatch"):
        return extra != "single"  # one input: no second shape to differ
    if problem.startswith("one_sample"):
        return not name.startswith("siglip")  # one pair is a valid SigLIP batch
    return True


@pytest.fixture(scope="module")
def bad_input_results():
    return run_on_ranks(bad_input_worker, 2)


@pytest.mark.parametrize("problem", list(BAD_INPUTS))
def test_bad_input_raises_on_every_rank(bad_input_results, problem):
    for name in CASES:
        if not _applies(name, problem):
            continue
        for rank, messages in enumerate(bad_input_results):
            message = messages[name, problem]
            assert message is not None, f"{name}: rank {rank} did not raise for {problem}"
            assert BAD_INPUTS[problem] in message, (name, message)


@pytest.mark.parametrize(
    "call",
    [
        lambda: NTXentLoss(0.1, 4096),  # lightly's second positional: memory_bank_size
        lambda: DCLLoss(0.1, None),
        lambda: DCLWLoss(0.1, 0.5),
        lambda: SupConLoss(0.1, False),
        lambda: InfoNCELoss(True),
        lambda: SigLIPLoss(True),
    ],
    ids=["ntxent", "dcl", "dclw", "supcon", "infonce", "siglip"],
)
def test_arguments_after_the_first_are_keyword_only(call):
    with pytest.raises(TypeError, match="positional argument"):
        call()


def _aligned_pairs(noise: float):
    """Unit pairs whose positives dominate: a well-trained encoder, whose loss is near 0."""
    generator = torch.Generator().manual_seed(0)
    f0 = torch.nn.functional.normalize(
        torch.randn(256, 64, generator=generator, dtype=torch.float64), dim=1
    )
    noisy = f0 + noise * torch.randn(256, 64, generator=generator, dtype=torch.float64)
    return f0, torch.nn.functional.normalize(noisy, dim=1)


NEAR_ZERO = {  # at logit scale 100, CLIP's clamp (NT-Xent: temperature 0.01)
    "infonce": lambda f0, f1: InfoNCELoss()(f0, f1, 100.0),
    "ntxent": lambda f0, f1: NTXentLoss(0.01)(f0, f1),
    "mnrl": lambda f0, f1: MultipleNegativesRankingLoss(100.0)(f0, f1),
}


@pytest.mark.parametrize("noise", [0.01, 0.1])
@pytest.mark.parametrize("name", list(NEAR_ZERO))
def test_values_near_zero_stay_exact_in_float32_and_never_negative(name, noise):
    """Float32 against float64 where the loss is 1e-24 to 1e-11. Each term is a softplus
    of (negatives' log-sum-exp - positive), whose argument (about -60 to -30) float32
    holds to ~1e-6 relative: 1e-4 relative to the value is generous."""
    f0, f1 = _aligned_pairs(noise)
    reference = NEAR_ZERO[name](f0, f1).item()
    value = NEAR_ZERO[name](f0.float(), f1.float()).item()
    print(f"{name}, noise {noise}: float64 {reference:.3e}, float32 {value:.3e}")
    assert 0 < value == pytest.approx(reference, rel=1e-4)


def test_control_the_subtractive_form_reads_negative_near_zero():
    """``log sum_j exp(l_ij) - l_ii``, the positive apart (ours before): the rows' float32
    rounding (~1e-5 at scale 100) swamps a loss of 1e-24 and some rows go negative."""
    f0, f1 = (f.float() for f in _aligned_pairs(0.01))
    rows = tiled_logsumexp(100 * f0, f1) - 100 * (f0 * f1).sum(dim=1)
    print(f"subtractive form: row minimum {rows.min().item():.1e}, mean {rows.mean().item():.1e}")
    assert rows.min().item() < 0
    assert abs(rows.mean().item()) > 1e6 * InfoNCELoss()(*_aligned_pairs(0.01), 100.0).item()


def test_cross_entropy_equals_torch_in_value_and_gradient():
    """Float64 logits spread over +-60, where the targets' probabilities range from ~0 to
    ~1: the same values and logit gradients as ``F.cross_entropy``; only rounding differs."""
    generator = torch.Generator().manual_seed(1)
    queries = (6 * torch.randn(12, 5, generator=generator, dtype=torch.float64)).requires_grad_()
    keys = torch.randn(9, 5, generator=generator, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, 9, (12, 1), generator=generator)
    weights = torch.rand(12, generator=generator, dtype=torch.float64)
    ours = cross_entropy(queries, keys, targets)
    theirs = F.cross_entropy(queries @ keys.T, targets[:, 0], reduction="none")
    ours_grads, their_grads = (
        torch.autograd.grad((v * weights).sum(), (queries, keys)) for v in (ours, theirs)
    )
    value = (ours - theirs).abs().max().item()
    gradient = max((a - b).abs().max().item() for a, b in zip(ours_grads, their_grads, strict=True))
    print(f"cross_entropy vs F.cross_entropy: values {value:.1e}, gradients {gradient:.1e}")
    assert value <= EXACT and gradient <= EXACT
    assert torch.autograd.gradcheck(lambda q, k: cross_entropy(q, k, targets), (queries, keys))


def test_control_torch_cross_entropy_reads_zero_near_zero():
    """Where ``InfoNCELoss`` is exact near 0 (the test above), ``F.cross_entropy`` of the
    same float32 logits, open_clip's and transformers' loss, reads 0: ``log(1 + eps)``
    rounds to 0 below eps = 6e-8."""
    f0, f1 = (f.float() for f in _aligned_pairs(0.01))
    logits, own = 100 * f0 @ f1.T, torch.arange(len(f0))
    reference = NEAR_ZERO["infonce"](*_aligned_pairs(0.01)).item()
    theirs = (F.cross_entropy(logits, own) + F.cross_entropy(logits.T, own)).item() / 2
    ours = cross_entropy(100 * f0, f1, own[:, None]).mean().item()
    print(f"near 0: float64 {reference:.3e}, F.cross_entropy {theirs:.3e}, ours {ours:.3e}")
    assert theirs == 0.0 < reference


def test_infonce_equals_transformers_clip_loss():
    """``VisionTextDualEncoderModel``'s loss (transformers' CLIP loss) on the logits of one
    process: the same value and input gradients as ``InfoNCELoss``."""
    clip = pytest.importorskip("transformers.models.clip.modeling_clip")
    batch = global_batch(8)
    f0, f1 = (
        torch.nn.functional.normalize(batch[k], dim=1).requires_grad_() for k in ("out0", "out1")
    )
    ours = InfoNCELoss()(f0, f1, 1 / 0.07)
    ours_grads = torch.autograd.grad(ours, (f0, f1))
    theirs = clip.image_text_contrastive_loss(f1 @ f0.T / 0.07)  # logits per text
    their_grads = torch.autograd.grad(theirs, (f0, f1))
    gradient = max((a - b).abs().max().item() for a, b in zip(ours_grads, their_grads, strict=True))
    print(
        f"infonce vs transformers: value {abs(ours - theirs).item():.1e}, gradients {gradient:.1e}"
    )
    assert abs(ours - theirs).item() <= EXACT and gradient <= EXACT
