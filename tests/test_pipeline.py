"""The trainer inside a user's world: their script, their module names, their data, their flags."""

from __future__ import annotations

import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from launch import (
    ENV,
    LAUNCH_TIMEOUT_S,
    REPO,
    launch,
    launch_script,
    one_line_errors,
    readme_commands,
    small_labelled_dataset,
    train_pooled,
)

MLP = ["--model", "mlp", "--batch-size", "8", "--knn-k", "0"]

USER_SCRIPT = """
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator

from trainer import TrainConfig, train

output = sys.argv[1]
accelerator = Accelerator(cpu=True)  # the user's own, as in their pipeline
config = TrainConfig(model="mlp", max_steps=2, batch_size=8, knn_k=0, output_dir=output + "/a")
first = train(config, accelerator)
# Again in the same launch, with an accelerator of train()'s own this time.
config = TrainConfig(model="mlp", max_steps=3, batch_size=8, knn_k=0, output_dir=output + "/b")
second = train(config)
total = torch.tensor([accelerator.process_index + 1.0])
dist.all_reduce(total)  # a collective of the user's own: the process group is still there
reloaded = type(first.model).from_pretrained(first.final_model_dir)
same = all(torch.equal(a, b) for a, b in zip(first.model.state_dict().values(),
                                              reloaded.state_dict().values()))
rank, steps = accelerator.process_index, f"{first.step},{second.step}"
print(f"rank {rank}: all_reduce={total.item()} steps={steps} reloaded_equal={same}", flush=True)
accelerator.end_training()  # the script's own process group, ended by the script
"""


def test_train_twice_in_a_users_two_process_script_then_a_collective(tmp_path):
    script = tmp_path / "pipeline.py"
    script.write_text(USER_SCRIPT)
    result = launch_script(2, script, str(tmp_path / "runs"))
    for rank in (0, 1):
        assert f"rank {rank}: all_reduce=3.0 steps=2,3 reloaded_equal=True" in result.stdout
    assert (tmp_path / "runs" / "a" / "final" / "model.safetensors").exists()
    assert (tmp_path / "runs" / "b" / "final" / "model.safetensors").exists()


USER_PROJECT = {
    "data.py": 'raise RuntimeError("the user\'s data.py was imported")\n',
    "utils.py": 'raise RuntimeError("the user\'s utils.py was imported")\n',
    "config.py": 'raise RuntimeError("the user\'s config.py was imported")\n',
    "losses.py": "WHOSE = 'user'\n",
    "models/__init__.py": "WHOSE = 'user'\n",
}
OURS = [
    "contrastive_accelerate.data",
    "contrastive_accelerate.optim",
    "contrastive_accelerate.ckpt_diff",
    "contrastive_accelerate.config",
    "contrastive_accelerate.checkpoint",
    "contrastive_accelerate.knn",
    "contrastive_accelerate.preemption",
    "contrastive_accelerate.ranks",
    "contrastive_accelerate.collectives",
    "contrastive_accelerate.compat",
    "contrastive_accelerate.launch",
    "contrastive_accelerate.testing",
]


def test_user_modules_do_not_shadow_the_projects_own(tmp_path):
    """A user project with data.py, utils.py, config.py, losses.py and models/ first on
    sys.path: every module under contrastive_accelerate still imports ours. The design
    card's names (trainer, losses, models) are shadowable by design, as any top-level
    package is: the user's losses.py wins, and trainer.py, which imports losses and
    models, then fails to import."""
    for name, text in USER_PROJECT.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    check = textwrap.dedent(
        f"""
        import importlib
        for name in {OURS!r}:
            module = importlib.import_module(name)
            assert module.__file__.startswith({str(REPO)!r}), (name, module.__file__)
        from contrastive_accelerate.data import GlobalBatchSampler, TwoViews, load_image_dataset
        from contrastive_accelerate.optim import LARS
        from contrastive_accelerate.ckpt_diff import max_abs_diff
        import losses, models
        print("ours import; card names are the user's:", losses.WHOSE, models.WHOSE)
        try:
            import trainer
        except ImportError as error:
            print("trainer shadowed:", type(error).__name__)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "ours import; card names are the user's: user user" in result.stdout
    assert "trainer shadowed: ImportError" in result.stdout


def test_a_parquet_dataset_from_the_command_line_states_its_holdout(tmp_path):
    small_labelled_dataset(20).to_parquet(str(tmp_path / "images.parquet"))
    args = ["--dataset", str(tmp_path / "images.parquet"), "--image-size", "12"]
    result = train_pooled(
        1,
        "--model",
        "mlp",
        "--batch-size",
        "8",
        "--max-steps",
        "2",
        "--knn-k",
        "3",
        *args,
        "--output-dir",
        str(tmp_path / "run"),
    )
    assert (
        "kNN evaluation: 4 images held out of split 'train' (--eval-holdout 0.2); "
        "training on the other 16" in result.stdout
    )
    assert "trained" in result.stdout


@pytest.mark.parametrize("report_to", ["tensorboard", "none"])
def test_trackers_only_when_asked(tmp_path, report_to):
    train_pooled(
        1,
        *MLP,
        "--max-steps",
        "2",
        "--log-every",
        "1",
        "--report-to",
        report_to,
        "--output-dir",
        str(tmp_path),
    )
    events = list(tmp_path.rglob("events.out.tfevents.*"))
    assert bool(events) == (report_to == "tensorboard"), events
    assert (tmp_path / "metrics.jsonl").exists()  # always, whatever the trackers


@pytest.mark.parametrize(
    ("launcher_flags", "message"),
    [
        (
            ["--gradient_accumulation_steps", "4"],
            "gradient accumulation (4 steps) is not supported",
        ),
        (["--mixed_precision", "fp16"], "--mixed_precision fp16 needs a GPU"),
    ],
    ids=["gradient-accumulation", "fp16-on-cpu"],
)
def test_accelerate_options_the_trainer_cannot_honour_are_refused(
    tmp_path, launcher_flags, message
):
    result = launch(
        2,
        *MLP,
        "--max-steps",
        "2",
        "--output-dir",
        str(tmp_path),
        launcher_flags=launcher_flags,
        check=False,
    )
    one_line_errors(result, message, 2)


def test_an_image_run_never_imports_transformers(tmp_path):
    """transformers is the optional [text] extra: an image run imports none of it (nor
    sentence-transformers or tokenizers), so image-only installs need none of them."""
    script = textwrap.dedent(f"""
        import sys
        from trainer import TrainConfig, train
        train(TrainConfig(model="mlp", max_steps=1, knn_k=0, output_dir={str(tmp_path)!r}))
        print(sorted(m for m in ("transformers", "sentence_transformers", "tokenizers")
                     if m in sys.modules))
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout


def test_the_readmes_first_command_run_twice_ends_with_its_one_line_refusal(tmp_path):
    """The README's first command as written (shortened to one step), twice, through
    ``accelerate launch``, in a folder that holds what the command names (the checkout's
    ``trainer.py`` and ``accelerate_configs``): the second run meets the first's
    ``runs/simclr`` and the last line it prints is the refusal, no traceback under it."""
    install, train = readme_commands()[0].split(" && ")
    assert install == "pip install -e ."
    for name in ("trainer.py", "accelerate_configs"):
        (tmp_path / name).symlink_to(REPO / name)
    launcher = Path(sys.executable).with_name("accelerate")
    command = [str(launcher), *shlex.split(train)[1:], "--max-steps", "1", "--knn-k", "0"]
    runs = [subprocess.run(command, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=LAUNCH_TIMEOUT_S)
            for _ in range(2)]  # fmt: skip
    print(f"the second run, exit {runs[1].returncode}, printed:\n{runs[1].stdout}")
    assert runs[0].returncode == 0, runs[0].stdout[-3000:]
    assert (tmp_path / "runs" / "simclr" / "final" / "model.safetensors").is_file()
    assert runs[1].returncode != 0
    last = runs[1].stdout.strip().splitlines()[-1]
    assert last.startswith("error: --output-dir 'runs/simclr' already holds another run"), last
    assert "Traceback" not in runs[1].stdout
