"""contrastive_accelerate.testing, the invariance kit users run on their own code.

Known-good losses pass; each known-bad pattern is caught with its diagnosis (the
negative controls: a kit that passes everything is worthless); the peers' losses
give the rows of the README's table; invariance-check exits 0, 1 and 2 on training
scripts written here; a loss that hangs on one rank fails within the timeout.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from functools import partial

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from contrastive_accelerate import collectives, invariance_check
from contrastive_accelerate.testing import assert_loss_invariant, default_splits
from losses import (
    BarlowTwinsLoss,
    DCLLoss,
    DCLWLoss,
    InfoNCELoss,
    NTXentLoss,
    SigLIPLoss,
    SupConLoss,
    VICRegLoss,
)

from launch import ENV, REPO, wait_until
from loss_cases import Patched, local_slice_gather, no_grad_all_reduce, no_grad_gather

ROWS, FEATURES = 12, 6


def two_views(labels: bool = False):
    generator = torch.Generator().manual_seed(3)
    out0 = torch.randn(ROWS, FEATURES, generator=generator, dtype=torch.float64)
    out1 = out0 + 0.5 * torch.randn(ROWS, FEATURES, generator=generator, dtype=torch.float64)
    if labels:
        return out0, out1, torch.arange(ROWS) % 3
    return out0, out1


class LearnedScale(nn.Module):
    """A CLIP-style loss with its learnable log-scale (and bias) as parameters of the module."""

    def __init__(self, loss: nn.Module, bias: bool = False) -> None:
        super().__init__()
        self.loss = loss
        self.log_scale = nn.Parameter(torch.tensor(1.0))
        self.bias = nn.Parameter(torch.tensor(-1.0)) if bias else None

    def forward(self, out0, out1):
        z0, z1 = F.normalize(out0, dim=1), F.normalize(out1, dim=1)
        scale = self.log_scale.exp()
        return (
            self.loss(z0, z1, scale) if self.bias is None else self.loss(z0, z1, scale, self.bias)
        )


OURS = {
    "ntxent": (partial(NTXentLoss, 0.3), two_views),
    "dcl": (partial(DCLLoss, 0.3), two_views),
    "dclw": (partial(DCLWLoss, 0.3), two_views),
    "supcon": (partial(SupConLoss, 0.3), partial(two_views, labels=True)),
    "infonce": (lambda: LearnedScale(InfoNCELoss()), two_views),
    "siglip": (lambda: LearnedScale(SigLIPLoss(), bias=True), two_views),
    "barlowtwins": (partial(BarlowTwinsLoss, 0.1), two_views),
    "vicreg": (VICRegLoss, two_views),
}


def _make_ours(name: str):
    return OURS[name][0]()


@pytest.mark.parametrize("name", list(OURS))
def test_every_loss_of_losses_passes(name):
    started = time.perf_counter()
    report = assert_loss_invariant(partial(_make_ours, name), OURS[name][1])
    seconds = time.perf_counter() - started
    print(f"{name}: worst {report.worst:.1e} over {len(report.splits)} splits in {seconds:.1f} s")
    assert len(report.splits) == 6  # W = 2 and 3: even, uneven, an empty rank
    assert report.worst <= 1e-10


class TwoViewNTXent(nn.Module):
    """NT-Xent written the way the peers write it, with a pluggable gather and offsets."""

    def __init__(self, gather=None, equal_batches: bool = False) -> None:
        super().__init__()
        self.gather, self.equal_batches = gather, equal_batches

    def forward(self, out0, out1):
        z = F.normalize(torch.cat([out0, out1]), dim=1)
        rank, world_size, sizes = 0, 1, [len(z)]
        if dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
            sizes = collectives.all_gather_sizes(z)[0]
        keys = (self.gather or collectives.gather)(z, sizes=sizes) if world_size > 1 else z
        # The peers' arange(n) + rank * n: right only when every rank holds len(z) rows.
        offset = rank * len(z) if self.equal_batches else sum(sizes[:rank])
        n = len(out0)
        rows = torch.arange(len(z))
        logits = (z @ keys.T / 0.3).index_put((rows, offset + rows), z.new_tensor(-torch.inf))
        positives = offset + (rows + n) % (2 * n)
        local_sum = F.cross_entropy(logits, positives, reduction="sum")
        return local_sum * world_size / sum(sizes)


class PlainAllReduceBarlowTwins(BarlowTwinsLoss):
    """Barlow Twins whose statistics cross ranks by a plain all_reduce (lightly #1977)."""

    def forward(self, z_a, z_b):
        with Patched("all_reduce", no_grad_all_reduce):
            return super().forward(z_a, z_b)


def _torch_all_gather(x, sizes=None):
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(x))


def _open_clip_loss():
    from open_clip.loss import ClipLoss

    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return LearnedScale(ClipLoss(local_loss=True, gather_with_grad=True, rank=rank,
                                 world_size=world_size))  # fmt: skip


class _FromEmbeddings(nn.Module):
    """sentence-transformers' MNRL on given embeddings (anchor, positive): its model is only
    the encoder, which the kit replaces by the inputs themselves."""

    def __init__(self) -> None:
        super().__init__()
        try:
            from sentence_transformers.sentence_transformer.losses import (
                MultipleNegativesRankingLoss,
            )
        except ImportError:  # sentence-transformers < 6
            from sentence_transformers.losses import MultipleNegativesRankingLoss
        self.loss = MultipleNegativesRankingLoss(nn.Identity(), gather_across_devices=True)

    def forward(self, anchor, positive):
        return self.loss.compute_loss_from_embeddings([anchor, positive], None)


def _lightly(name: str):
    from lightly.loss import BarlowTwinsLoss as LightlyBarlowTwins
    from lightly.loss import DCLWLoss as LightlyDCLW

    if name == "dclw":
        return LightlyDCLW(temperature=0.3, sigma=0.5, gather_distributed=True)
    return LightlyBarlowTwins(lambda_param=0.1, gather_distributed=True)


#: name: (make_loss, world sizes, expected diagnosis, or None where it passes)
KNOWN = {
    "ours (NT-Xent)": (TwoViewNTXent, (2, 3), None),
    "classic GatherLayer": (partial(TwoViewNTXent, local_slice_gather), (2, 3), "local slice"),
    "all-gather without gradient": (partial(TwoViewNTXent, no_grad_gather), (2, 3), "local slice"),
    "rank * n offsets": (partial(TwoViewNTXent, equal_batches=True), (2, 3), "rank * n"),
    "plain all_reduce (Barlow Twins)": (partial(PlainAllReduceBarlowTwins, 0.1), (2, 3), "1/W"),
    # W = 2 only: its gather raises on every uneven split, and each costs a new group.
    "lightly DCLWLoss": (partial(_lightly, "dclw"), (2,), "per-rank"),
    "lightly BarlowTwinsLoss": (partial(_lightly, "barlowtwins"), (2, 3), "per-rank"),
}
DIAGNOSES = {
    "local slice": "the classic GatherLayer",
    "rank * n": "rank * n",
    "1/W": "times 1/W",
    "per-rank": "per-rank",
}


@pytest.mark.parametrize("name", list(KNOWN))
def test_known_implementations_are_diagnosed(name):
    make_loss, world_sizes, expected = KNOWN[name]
    if expected is None:
        report = assert_loss_invariant(make_loss, two_views, world_sizes)
        print(f"{name}: passes, worst {report.worst:.1e}")
        return
    with pytest.raises(AssertionError) as failure:
        assert_loss_invariant(make_loss, two_views, world_sizes)
    message = str(failure.value)
    print(f"{name}: {message.splitlines()[0]} | {message.splitlines()[1]}")
    assert "diagnosis: " in message and DIAGNOSES[expected] in message, message


def _even_only(world_size: int):
    return {world_size: [default_splits(ROWS, world_size)[0]]}


@pytest.mark.parametrize(
    "name, make_loss",
    [
        ("open_clip ClipLoss(local_loss=True, gather_with_grad=True)", _open_clip_loss),
        ("torch.distributed.nn.all_gather", partial(TwoViewNTXent, _torch_all_gather)),
        ("sentence-transformers MNRL(gather_across_devices=True)", _FromEmbeddings),
    ],
)
def test_equal_size_gathers_are_exact_on_even_splits_and_refuse_uneven_ones(name, make_loss):
    """Gathers that need equal sizes: exact when the ranks hold equal batches; an uneven
    split raises on a rank, which the kit reports as a failure instead of hanging."""
    report = assert_loss_invariant(make_loss, two_views, (2,), splits=_even_only(2))
    print(f"{name}, even: worst {report.worst:.1e}")
    with pytest.raises(AssertionError, match="a rank raised") as failure:
        assert_loss_invariant(make_loss, two_views, (2,), splits={2: [[7, 5]]})
    assert "needs equal sizes" in str(failure.value)
    print(f"{name}, uneven: {str(failure.value).splitlines()[0][:120]}")


class HangsOnTheLastRank(NTXentLoss):
    def forward(self, out0, out1):
        if dist.is_initialized() and dist.get_rank() == dist.get_world_size() - 1:
            time.sleep(3600)  # never joins the gather
        return super().forward(out0, out1)


def test_a_loss_that_hangs_on_one_rank_fails_within_the_timeout():
    started = time.perf_counter()
    with pytest.raises(AssertionError, match="a rank raised|did not finish"):
        assert_loss_invariant(
            partial(HangsOnTheLastRank, 0.3), two_views, (2,), {2: [[6, 6]]}, timeout_s=5
        )
    seconds = time.perf_counter() - started
    print(f"a hanging rank failed the check in {seconds:.1f} s (timeout 5 s)")
    assert seconds < 60


SCRIPT = """
import os, sys
import torch
from accelerate import Accelerator
from contrastive_accelerate import collectives, invariance_check
from contrastive_accelerate.testing import run_on_ranks
{gather}
output = sys.argv[sys.argv.index("--output-dir") + 1]
accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Linear(6, 4).double()
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
model, optimizer = accelerator.prepare(model, optimizer)
data = torch.randn(12, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
share = data.tensor_split(accelerator.num_processes)[accelerator.process_index]
for step in range(3):
    z = model(share)
    everyone = gather(z) if accelerator.num_processes > 1 else z
    loss = torch.logsumexp(z @ everyone.T, dim=1).sum() * accelerator.num_processes / len(data)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
if {save} and accelerator.is_main_process:
    os.makedirs(output, exist_ok=True)
    torch.save(accelerator.unwrap_model(model).state_dict(), os.path.join(output, "model.pt"))
accelerator.wait_for_everyone()
del model, optimizer  # DDP holds the group: gloo can abort an exit that frees it after
accelerator.free_memory()
accelerator.end_training()
"""
GATHERS = {
    "ours": "gather = collectives.gather",
    "local slice": "from loss_cases import local_slice_gather as gather",
}


def _invariance_check(tmp_path, gather: str, save: bool = True) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(gather=GATHERS[gather], save=save)))
    env = {**ENV, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    command = [sys.executable, "-m", "contrastive_accelerate.invariance_check",
               "--processes", "1,2", "--atol", "1e-12", "--", str(script)]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


def test_invariance_check_passes_a_script_with_our_gather(tmp_path):
    result = _invariance_check(tmp_path, "ours")
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 vs 2 processes: max abs diff" in result.stdout


def test_invariance_check_fails_a_script_with_the_classic_gather_layer(tmp_path):
    result = _invariance_check(tmp_path, "local slice")
    print(result.stdout)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "tensor 'weight' differs by" in result.stdout or "tensor 'bias'" in result.stdout


def test_invariance_check_without_a_checkpoint_is_exit_2_with_one_line(tmp_path):
    result = _invariance_check(tmp_path, "ours", save=False)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "wrote no checkpoint" in errors[0], result.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--atol", "-1"], "expected a finite number >= 0, got '-1'"),
        (["--atol", "nan"], "expected a finite number >= 0, got 'nan'"),
        (["--processes", "1,1"], "two or more different counts like 1,2, got '1,1'"),
        (["--timeout", "-1"], "expected a finite number of seconds > 0, got '-1'"),
        (
            ["--processes", f"1,{invariance_check.most_processes() + 1}"],
            f"at most {invariance_check.most_processes()} processes (4 per core",
        ),
    ],
    ids=["negative-atol", "nan-atol", "equal-counts", "negative-timeout", "too-many-processes"],
)
def test_invariance_check_refuses_bad_options_in_one_line(capfd, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        invariance_check.main([*argv, "--", "train.py"])
    assert exit_info.value.code == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


HANGS = """
import os, sys, time
open(sys.argv[1], "a").write(f"{os.getpid()}\\n")
time.sleep(600)
"""
FAILS_ON_RANK_1 = """
import os, sys
import torch
if int(os.environ.get("RANK", "0")) == 1:
    raise ValueError("planted failure on rank 1")
output = sys.argv[sys.argv.index("--output-dir") + 1]
os.makedirs(output, exist_ok=True)
torch.save({"w": torch.zeros(1)}, os.path.join(output, "model.pt"))
"""


def test_invariance_check_on_a_hanging_script_is_exit_2_and_leaves_no_process(tmp_path):
    script, pids = tmp_path / "hangs.py", tmp_path / "pids"
    script.write_text(HANGS)
    command = [sys.executable, "-m", "contrastive_accelerate.invariance_check",
               "--processes", "2,1", "--timeout", "20", "--", str(script), str(pids)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(errors) == 1 and "did not finish within 20 s" in errors[0], result.stderr
    started = [int(pid) for pid in pids.read_text().split()]
    assert len(started) == 2  # both ranks ran, and both are gone
    wait_until(lambda: not any(psutil.pid_exists(pid) for pid in started), timeout=30)


def test_invariance_check_shows_a_ranks_own_error(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(FAILS_ON_RANK_1)
    # 2 processes first: the failing launch is the only one.
    command = [sys.executable, "-m", "contrastive_accelerate.invariance_check",
               "--processes", "2,1", "--", str(script)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(errors) == 1, result.stderr
    assert "2 process(es): exited 1: ValueError: planted failure on rank 1" in errors[0], errors


STDIN_CHECK = """
import torch
from contrastive_accelerate.testing import assert_loss_invariant
from losses import NTXentLoss

def make_inputs():
    return torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)

assert_loss_invariant(NTXentLoss, make_inputs, world_sizes=(2,))
"""


def test_the_kit_from_standard_input_says_its_workers_cannot_start():
    """Spawned workers import the caller's __main__ again, which a script read from
    standard input does not have: the check says so at once, not after its timeouts."""
    result = subprocess.run([sys.executable, "-"], input=STDIN_CHECK, capture_output=True,
                            text=True, env=ENV, timeout=120)  # fmt: skip
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "WorkerStartError: the worker process of rank" in last, result.stderr[-2000:]
    assert "before it could serve" in last
