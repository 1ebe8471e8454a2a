"""Same results before and after a restructure: a fixed command set trained by two
checkouts, their ``final/`` folders compared tensor by tensor (``ckpt-diff``).

    python -m benchmarks.same_results OLD_CHECKOUT NEW_CHECKOUT [--out DIR]

Each checkout trains every command of ``COMMANDS`` from its own ``trainer.py`` (its
own code first on the path), on the offline digits and on the tiny towers and data
that the tests make (``tests/launch.py``), all written under ``--out``; then every
tensor of every safetensors file of each run's ``final/`` is compared, and the table
printed: the largest absolute difference per command, 0.0 expected, since a
restructure changes no arithmetic. A command that one checkout refuses or fails is
reported as such, with its last line. The set is issue 57's: each ``--loss``; each
``--method`` (the mlp in float64 on 1 and 2 processes, ResNet-18 with SyncBatchNorm on
3); text pairs with a hard negative, one and two towers, LoRA; image-text InfoNCE and
SigLIP with a scratch tower, an ``--image-model`` and a ``--clip-model``; ``--fsdp``;
a stream and a mixture; a mid-epoch resume of each method. Each resume is run once more
by the new checkout from the old checkout's checkpoint and compared with the old
checkout's resume of it: checkpoints written before the change resume after it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from contrastive_accelerate.ckpt_diff import compare  # noqa: E402

from launch import (  # noqa: E402 - the tests' data makers
    TEST_ENVIRONMENT,
    make_dual_encoder,
    make_sentence_pairs,
    make_text_model,
    make_text_pair_shards,
    make_vision_model,
    small_labelled_dataset,
)

LOSSES = ("ntxent", "dcl", "dclw", "supcon", "infonce", "siglip", "barlowtwins", "vicreg")
IMAGES = ("--model", "mlp", "--image-size", "8", "--dropout", "0.1", "--dtype", "float64",
          "--batch-size", "16", "--max-steps", "4", "--save-every", "2", "--knn-k", "0",
          "--num-workers", "0", "--lr", "0.1")  # fmt: skip
METHOD_FLAGS = {"simclr": (), "moco": ("--queue-size", "32"), "byol": (),
                "dino": ("--dino-out-dim", "64")}  # fmt: skip
PAIRS = ("--dtype", "float64", "--batch-size", "6", "--max-steps", "4", "--save-every", "2",
         "--max-length", "8", "--num-workers", "0", "--lr", "1e-3", "--knn-k", "0")  # fmt: skip


def commands(data: dict[str, str]) -> dict[str, tuple[int, tuple[str, ...]]]:
    """Each command's name: its number of processes and its flags (the output folder and
    a resume's checkpoint are added by ``run``)."""
    text = ("--dataset", data["pairs"], "--text-model", data["bert"],
            "--columns", "anchor,positive,negative_1", *PAIRS)  # fmt: skip
    image_text = ("--dataset", data["captioned"], "--columns", "image,caption",
                  "--image-size", "8", *PAIRS)  # fmt: skip
    scratch_tower = ("--text-model", "scratch", "--model", "mlp", "--dropout", "0.1")
    table: dict[str, tuple[int, tuple[str, ...]]] = {}
    for loss in LOSSES:
        table[f"simclr --loss {loss}"] = (1, (*IMAGES, "--loss", loss))
    table["simclr --queue-size"] = (1, (*IMAGES, "--queue-size", "32"))
    for method, flags in METHOD_FLAGS.items():
        for processes in (1, 2):
            table[f"{method}, {processes} processes"] = (processes, (*IMAGES, "--method", method,
                                                                      *flags))  # fmt: skip
    table["simclr resnet18 SyncBatchNorm, 3 processes"] = (
        3, ("--model", "resnet18", "--image-size", "8", "--dtype", "float64", "--batch-size",
            "12", "--max-steps", "2", "--knn-k", "0", "--num-workers", "0"),
    )  # fmt: skip
    table["text pairs, hard negative, 2 processes"] = (2, text)
    table["text pairs, two towers"] = (1, (*text, "--two-towers"))
    table["text pairs, LoRA, 2 processes"] = (2, (*text, "--lora-rank", "4"))
    for loss in ("infonce", "siglip"):
        table[f"image-text {loss}, scratch, 2 processes"] = (
            2, (*image_text, *scratch_tower, "--loss", loss))  # fmt: skip
        table[f"image-text {loss}, --image-model"] = (
            1, (*image_text, "--text-model", "scratch", "--image-model", data["vit"], "--loss",
                loss),
        )  # fmt: skip
    table["image-text --clip-model, 2 processes"] = (2, (*image_text, "--clip-model", data["clip"]))
    table["text pairs --fsdp, 2 processes"] = (2, (*text, "--fsdp"))
    table["text pairs, a stream, 2 processes"] = (
        2, ("--streaming", "--dataset", data["shards"], "--text-model", data["bert"], "--columns",
            "anchor,positive,negative_1", *PAIRS, "--shuffle-buffer", "4"),
    )  # fmt: skip
    table["text pairs, a mixture, 2 processes"] = (
        2, ("--dataset", data["pairs"], "--dataset", data["pairs2"], "--text-model", data["bert"],
            "--columns", "anchor,positive,negative_1", *PAIRS),
    )  # fmt: skip
    for method, flags in METHOD_FLAGS.items():
        table[f"{method}, resumed at step 2 on 1 process"] = (
            1, (*IMAGES, "--method", method, *flags, "--resume-from", f"@{method}, 2 processes"),
        )  # fmt: skip
    table["text pairs, resumed at step 2 on 1 process"] = (
        1, (*text, "--resume-from", "@text pairs, hard negative, 2 processes"))  # fmt: skip
    return table


def make_data(root: Path) -> dict[str, str]:
    """The tiny towers and data, made once and used by both checkouts."""
    import datasets  # noqa: F401 - the captioned dataset is written by datasets

    from launch import WORDS

    dataset = small_labelled_dataset(count=20, size=10)
    captions = [f"{WORDS[(3 * i) % len(WORDS)]} {WORDS[i % len(WORDS)]} cat"
                for i in range(len(dataset))]  # fmt: skip
    dataset.add_column("caption", captions).save_to_disk(str(root / "captioned"))
    return {
        "bert": str(make_text_model(root / "bert", dropout=0.1)),
        "vit": str(make_vision_model(root / "vit", dropout=0.1)),
        "clip": str(make_dual_encoder(root / "clip", "clip")),
        "pairs": str(make_sentence_pairs(root / "pairs.jsonl", 25)),
        "pairs2": str(make_sentence_pairs(root / "pairs2.jsonl", 17, seed=1)),
        "shards": str(make_text_pair_shards(root / "shards", [7, 11, 5, 9])),
        "captioned": str(root / "captioned"),
    }


def run(checkout: Path, name: str, processes: int, flags: tuple[str, ...], out: Path) -> str:
    """Train ``name`` with ``checkout``'s trainer.py into ``out/<name>``; its last line if
    it failed, else ""."""
    flags = tuple(str(out / value[1:] / "checkpoint-2") if value.startswith("@") else value
                  for value in flags)  # fmt: skip
    script = str(checkout / "trainer.py")
    if processes == 1:
        launcher = [sys.executable, script]
    else:
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                    "--num_processes", str(processes), "--num_machines", "1",
                    "--main_process_port", "0", script]  # fmt: skip
    environment = {**os.environ, **TEST_ENVIRONMENT, "PYTHONPATH": str(checkout)}
    result = subprocess.run(
        [*launcher, *flags, "--output-dir", str(out / name)], cwd=checkout, env=environment,
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if result.returncode:
        lines = (result.stdout + result.stderr).strip().splitlines()
        return next((line for line in reversed(lines) if line.startswith("error")), lines[-1])
    return ""


def largest_difference(a: Path, b: Path) -> float | str:
    """The largest absolute difference over every tensor of every safetensors file of two
    ``final/`` folders, or what keeps them from comparing."""
    files = {p.relative_to(a) for p in a.rglob("*.safetensors")}
    others = {p.relative_to(b) for p in b.rglob("*.safetensors")}
    if files != others:
        return f"other files: {sorted(map(str, files ^ others))}"
    worst = 0.0
    for name in sorted(files):
        for diff in compare(str(a / name), str(b / name)):
            if diff.problem is not None:
                return f"{name}: {diff.name}: {diff.problem}"
            worst = max(worst, diff.max_abs)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--only", default=None, help="commands whose name contains this")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="same-results-"))
    data = make_data(out / "data")
    table = commands(data)
    print("| command | processes | max abs difference |\n|---|---|---|")
    for name, (processes, flags) in table.items():
        if args.only and args.only not in name:
            continue
        failures = [run(checkout.resolve(), name, processes, flags, out / side)
                    for side, checkout in (("old", args.old), ("new", args.new))]  # fmt: skip
        if any(failures):
            sides = zip(("old", "new"), failures, strict=True)
            result = " / ".join(f"{side}: {failure or 'trained'}" for side, failure in sides)
        else:
            result = largest_difference(out / "old" / name / "final", out / "new" / name / "final")
        print(f"| {name} | {processes} | {result} |", flush=True)
        if not any(value.startswith("@") for value in flags):
            continue
        # The old checkout's checkpoint resumed by the new code, against the old code's
        # resume of it.
        across = out / "across"
        cited = tuple(str(out / "old" / value[1:] / "checkpoint-2") if value.startswith("@")
                      else value for value in flags)  # fmt: skip
        failure = run(args.new.resolve(), name, processes, cited, across)
        result = failure or largest_difference(out / "old" / name / "final",
                                               across / name / "final")  # fmt: skip
        print(f"| {name}: the old checkpoint resumed by the new code | {processes} | {result} |",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
