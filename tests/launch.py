"""Run trainer.py, in the session's worker pools or under a real ``accelerate launch``,
and make small offline datasets.

``train_pooled`` is how tests train: the run goes to W persistent worker processes
(``contrastive_accelerate.workers.run_in_workers``) that call ``trainer.main`` as a
launched process would, with the launcher's environment and a rendezvous of its own,
so a run costs its training, not W interpreter starts and imports. ``launch`` goes
through ``accelerate launch`` and is kept for what only the launcher proves (see
tests/README.md for the list).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from session_checks import SESSION_MARK  # noqa: F401 - in os.environ before ENV is built

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "accelerate_configs"
# Generous for a loaded 2-core CI machine; a hung collective fails one test, not CI.
LAUNCH_TIMEOUT_S = 300
#: The tower from scratch that a method's quick tests train where the others train the
#: mlp: DINOv2 masks the patches of a ViT.
QUICK_TOWERS = {"dinov2": "vit_micro"}


def quick_tower(method: str) -> str:
    """The tower from scratch of ``method``'s quick tests."""
    return QUICK_TOWERS.get(method, "mlp")


def launch(
    num_processes: int,
    *trainer_args: str,
    timeout: int = LAUNCH_TIMEOUT_S,
    check: bool = True,
    launcher_flags: list[str] | None = None,
    environment: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """``accelerate launch trainer.py ARGS`` on ``num_processes`` CPU processes;
    ``environment``: variables added to ``ENV``."""
    return launch_script(
        num_processes,
        REPO / "trainer.py",
        *trainer_args,
        timeout=timeout,
        check=check,
        launcher_flags=launcher_flags,
        environment=environment,
    )


def final_difference(a: Path, b: Path) -> float:
    """Max abs difference of two runs' ``final/`` models."""
    from contrastive_accelerate.ckpt_diff import max_abs_diff

    return max_abs_diff(str(a / "final"), str(b / "final"))


def final_files_difference(a: Path, b: Path) -> float:
    """Max abs difference over every tensor of every safetensors file of two runs'
    ``final/`` folders (the model, the method's state, the exports); the two must hold
    the same files and tensors."""
    from contrastive_accelerate.ckpt_diff import compare

    files = {path.relative_to(a / "final") for path in (a / "final").rglob("*.safetensors")}
    others = {path.relative_to(b / "final") for path in (b / "final").rglob("*.safetensors")}
    assert files == others, f"final/ holds other files: {sorted(files ^ others)}"
    worst = 0.0
    for name in files:
        for diff in compare(str(a / "final" / name), str(b / "final" / name)):
            assert diff.problem is None, f"{name}: {diff.name}: {diff.problem}"
            worst = max(worst, diff.max_abs)
    return worst


def one_chunk(flags: tuple[str, ...]) -> tuple[str, ...]:
    """``flags`` without ``--accumulation-chunks K``: the 1-process reference of a K-chunk run."""
    kept = list(flags)
    if "--accumulation-chunks" in kept:
        at = kept.index("--accumulation-chunks")
        del kept[at : at + 2]
    return tuple(kept)


class TrainerRuns:
    """Trainer runs made once per (processes, flags) and shared by a module's tests
    (a module-scoped fixture returns one): ``runs(2, "--flag")`` is the run's output
    directory, ``runs.output(2, "--flag")`` what it printed."""

    def __init__(self, tmp_path_factory, *common_args: str) -> None:
        self.tmp_path_factory, self.common_args = tmp_path_factory, common_args
        self.runs: dict[tuple, tuple[Path, str]] = {}

    def __call__(self, processes: int, *flags: str) -> Path:
        key = (processes, flags)
        if key not in self.runs:
            directory = self.tmp_path_factory.mktemp("run")
            result = train_pooled(
                processes, *self.common_args, *flags, "--output-dir", str(directory)
            )
            self.runs[key] = directory, result.stdout + result.stderr
        return self.runs[key][0]

    def output(self, processes: int, *flags: str) -> str:
        self(processes, *flags)
        return self.runs[(processes, flags)][1]


def resumed_differences(
    runs: TrainerRuns, step: int, tmp_path: Path, workers: tuple[int, int]
) -> tuple[float, float]:
    """The exact and the elastic resume of ``runs``' command line (which needs no epochs:
    a stream, a mixture): the 1-process straight run's checkpoint at ``step`` resumed on 1
    process, and a 2-process run's resumed on 3 (with ``workers`` loader workers each),
    each final/ against the 1-process straight run's."""
    straight = runs(1, "--num-workers", "0", "--save-every", str(step))
    two = runs(2, "--num-workers", "0", "--save-every", str(step))
    differences = []
    for processes, run, count in ((1, straight, workers[0]), (3, two, workers[1])):
        output = tmp_path / f"resumed-on-{processes}"
        train_pooled(processes, *runs.common_args, "--num-workers", str(count), "--output-dir",
                     str(output), "--resume-from", str(run / f"checkpoint-{step}"))  # fmt: skip
        differences.append(final_files_difference(straight, output))
    return differences[0], differences[1]


def train_pooled(
    num_processes: int,
    *trainer_args: str,
    timeout: int = LAUNCH_TIMEOUT_S,
    check: bool = True,
    environment: dict[str, str] | None = None,
    within: Callable[[], contextlib.AbstractContextManager] | None = None,
    command: str = "trainer",
) -> subprocess.CompletedProcess:
    """``trainer.py ARGS`` on ``num_processes`` ranks of the session's worker pool: what
    ``launch`` returns (the exit code of the first rank that failed, every rank's output
    in rank order) without starting a process. A run that hangs fails after ``timeout``
    seconds, naming the ranks that never returned, and the next run gets fresh workers.
    ``environment``: what the launcher's flags would add to ``ENV`` (``accelerate launch
    --mixed_precision bf16`` sets ``ACCELERATE_MIXED_PRECISION=bf16``). ``within``: a
    picklable context manager factory that each rank enters around the run, and leaves
    the worker as it found it (a project's own row in a table). ``command``: the module
    whose ``main`` the ranks run (``contrastive_accelerate.mine``), the trainer's by
    default."""
    from contrastive_accelerate.workers import free_port, run_in_workers

    with tempfile.TemporaryDirectory(prefix="pooled-run-") as captured:
        try:
            per_rank = run_in_workers(
                _command_main, num_processes, free_port(), command, list(trainer_args),
                {**ENV, **(environment or {})}, os.getcwd(), within, captured,
                timeout_s=timeout,
            )  # fmt: skip
        except ChildProcessError as died:  # a rank killed by a signal: its last words
            raise ChildProcessError(f"{died}\n{_last_words(Path(captured))}") from None
    codes = [code for code, _, _ in per_rank]
    result = subprocess.CompletedProcess(
        [command, *trainer_args],
        next((code for code in codes if code), 0),
        "".join(stdout for _, stdout, _ in per_rank),
        "".join(stderr for _, _, stderr in per_rank),
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"pooled {command} {' '.join(trainer_args)} on {num_processes} process(es) "
            f"exited {codes}:\n{result.stdout}\n{result.stderr}"
        )
    return result


def _command_main(
    rank: int,
    world_size: int,
    port: int,
    command: str,
    argv: list[str],
    environment: dict[str, str],
    working_directory: str,
    within: Callable[[], contextlib.AbstractContextManager] | None,
    captured: str,
) -> tuple[int, str, str]:
    """One rank of a pooled run: ``command.main(argv)`` from a fresh process's state, in
    the caller's working directory (where a launch would start), with its exit code and
    what it wrote to stdout and stderr (kept in ``captured``, where the caller still finds
    it if the process dies)."""
    import importlib

    main = importlib.import_module(command).main
    fresh_process_state(rank, world_size, port, environment)
    os.chdir(working_directory)
    files = Path(captured) / f"rank{rank}.out", Path(captured) / f"rank{rank}.err"
    with _captured_output(*files) as output, within() if within else contextlib.nullcontext():
        try:
            main(argv)
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        except BaseException:  # noqa: BLE001 - what an uncaught error does to a process
            traceback.print_exc()
            code = 1
    return code, *output


def _last_words(captured: Path) -> str:
    """The end of what each rank of a pooled run wrote to stderr."""
    return "".join(
        f"{path.stem} stderr: ...{path.read_text(errors='replace')[-1500:]}\n"
        for path in sorted(captured.glob("rank*.err"))
    )


_FRESH: dict = {}


def fresh_process_state(rank: int, world_size: int, port: int, environment: dict[str, str]) -> None:
    """Put this worker back where a process that torchrun (or, for one process, python)
    starts would be: ``environment`` plus the launcher's rank variables, no process
    group, no Accelerate state, torch's global defaults, the seeds, signal handlers and
    multiprocessing start method of a new interpreter. Everything the trainer keeps in
    module-level state lives only for one run (``StepChecks``, ``StopSignals``).
    ``tests/test_pool.py`` proves it: a run repeated in one worker equals a fresh
    process's, 0.0."""
    import torch

    from contrastive_accelerate.compat import reset_accelerate_state
    from contrastive_accelerate.ranks import end_process_group

    if not _FRESH:  # the first call: the worker as spawned
        _FRESH.update(
            threads=torch.get_num_threads(),
            dtype=torch.get_default_dtype(),
            signals={s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)},
            warnings=list(warnings.filters),
        )
    end_process_group()
    reset_accelerate_state()
    os.environ.clear()
    os.environ.update(environment)
    if world_size > 1:  # what torchrun sets for each worker
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
    # A process that multiprocessing spawned defaults to spawning its own children: the
    # loader's workers would import torch and pytest again (6 s a run). A new interpreter
    # forks them (the platform's default start method is the first listed).
    multiprocessing.set_start_method(multiprocessing.get_all_start_methods()[0], force=True)
    torch.set_num_threads(_FRESH["threads"])
    torch.set_default_dtype(_FRESH["dtype"])
    torch.set_grad_enabled(True)
    torch.seed()  # a new interpreter seeds from the OS: so does this
    random.seed()
    np.random.seed()
    for number, handler in _FRESH["signals"].items():
        signal.signal(number, handler)
    warnings.filters[:] = _FRESH["warnings"]


@contextlib.contextmanager
def _captured_output(stdout: Path, stderr: Path) -> Iterator[list[str]]:
    """What the run writes to file descriptors 1 and 2 (the trainer's one-line errors
    write to the descriptor), into the files ``stdout`` and ``stderr`` and as ``[stdout,
    stderr]`` once the block ends."""
    output: list[str] = []
    with open(stdout, "w+") as out, open(stderr, "w+") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            yield output
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for descriptor in saved:
                os.close(descriptor)
            for file in (out, err):
                file.seek(0)
                output.append(file.read())


def readme_commands() -> list[str]:
    """The README's two commands as a user copies them: the lines of its first ``bash``
    block that are not comments (install and train, install and test)."""
    block = (REPO / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def launch_command(
    num_processes: int, script: Path, *args: str, launcher_flags: list[str] | None = None
) -> list[str]:
    """``accelerate launch`` on ``num_processes`` CPU processes; one process without
    launcher flags runs ``python SCRIPT`` directly, which is what the launcher runs for
    the single-process config (it sets nothing else): 2-3 s less per launch. Pass
    ``launcher_flags=[]`` to go through the launcher anyway."""
    if num_processes == 1 and launcher_flags is None:
        return [sys.executable, str(script), *args]
    if num_processes == 1:
        launcher = ["--config_file", str(CONFIGS / "single_process.yaml")]
    else:
        launcher = [
            "--config_file",
            str(CONFIGS / "cpu_2_processes.yaml"),
            "--num_processes",
            str(num_processes),
            "--main_process_port",
            "0",
        ]
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *launcher,
        *(launcher_flags or []),
        str(script),
        *args,
    ]


#: What every process the suite starts runs with (``conftest.py`` puts it into the
#: session's environment, so that pooled workers start with it whichever call starts them):
#: nothing downloads, one thread per process, no progress bars and no warnings in the
#: output that tests read.
TEST_ENVIRONMENT = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "TQDM_DISABLE": "1",
    "PYTHONWARNINGS": "ignore",
}
ENV = {**os.environ, **TEST_ENVIRONMENT}
#: What ``accelerate launch --mixed_precision bf16`` adds to the environment of the
#: processes it starts (``train_pooled(..., environment=LAUNCHER_BF16)``);
#: ``test_mixed_precision.py`` checks that the two train the same model.
LAUNCHER_BF16 = {"ACCELERATE_MIXED_PRECISION": "bf16"}


def launch_script(
    num_processes: int,
    script: Path,
    *args: str,
    timeout: int = LAUNCH_TIMEOUT_S,
    check: bool = True,
    launcher_flags: list[str] | None = None,
    environment: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """``accelerate launch SCRIPT ARGS`` (a trainer or a user's script) on CPU processes, in
    the current working directory: the session's own (``tests/conftest.py``), never the
    checkout."""
    command = launch_command(num_processes, script, *args, launcher_flags=launcher_flags)
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                            env={**ENV, **(environment or {})})  # fmt: skip
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        )
    return result


#: The longest line a refused run may print: an error quotes a short preview of a value.
MAX_OUTPUT_LINE = 2000


def one_line_errors(result: subprocess.CompletedProcess, expected: str, num_processes: int):
    """Assert a failed launch in which every rank printed one ``error:`` line containing
    ``expected``, and none of our code printed a traceback."""
    # A rank's line may follow the main process's progress bar on the shared terminal.
    errors = [
        line[line.index("error: ") :] for line in result.stderr.splitlines() if "error: " in line
    ]
    assert result.returncode != 0
    assert len(errors) == num_processes, result.stderr  # every rank says it, once
    assert all(expected in line for line in errors), errors
    longest = max((len(line) for line in (result.stdout + result.stderr).splitlines()), default=0)
    assert longest <= MAX_OUTPUT_LINE, f"a line of {longest:,} characters"
    # Accelerate's launcher reports the failed child with its own traceback; ours must not.
    for source in ('trainer.py", line', "contrastive_accelerate", "losses", "models"):
        assert source not in result.stderr, result.stderr
    return errors


def make_image_folder(root: Path, count: int, size: int = 12, classes: int = 2) -> Path:
    """An ``imagefolder`` dataset of ``count`` random PNGs in ``classes`` label folders."""
    from PIL import Image

    generator = np.random.default_rng(0)
    for index in range(count):
        folder = root / "train" / f"class{index % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = generator.integers(0, 256, (size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{index}.png")
    return root


def add_unusual_images(root: Path, size: int = 12) -> tuple[Path, Path]:
    """Add to an image folder one truncated PNG and one RGBA PNG; returns their paths."""
    from PIL import Image

    generator = np.random.default_rng(1)
    folder = root / "train" / "class0"
    folder.mkdir(parents=True, exist_ok=True)
    rgba = folder / "rgba.png"
    Image.fromarray(generator.integers(0, 256, (size, size, 4), dtype=np.uint8)).save(rgba)
    truncated = folder / "truncated.png"
    Image.fromarray(generator.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(truncated)
    truncated.write_bytes(truncated.read_bytes()[:-60])  # cut into the image data
    return truncated, rgba


def small_labelled_dataset(count: int = 12, size: int = 12):
    """A ``datasets.Dataset`` of ``count`` random RGB images with labels 0/1."""
    import datasets

    generator = np.random.default_rng(2)
    images = [generator.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(count)]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    return datasets.Dataset.from_dict(
        {"image": images, "label": [i % 2 for i in range(count)]}, features=features
    )


#: Words of the generated sentence pairs: the tokenizer is trained on them.
WORDS = ("red green blue small large quick slow cat dog bird fish tree river stone cloud "
         "runs jumps sleeps sings swims over under near the a").split()  # fmt: skip


def make_sentence_pairs(path: Path, count: int, negatives: int = 1, seed: int = 0) -> Path:
    """A JSON-lines file of ``count`` rows: an anchor, a paraphrase as its positive (the
    same words shuffled) and ``negatives`` unrelated sentences, of varied lengths, so
    that every rank pads to a different longest text."""
    import json

    generator = np.random.default_rng(seed)

    def sentence() -> list[str]:
        return list(generator.choice(WORDS, size=int(generator.integers(2, 9))))

    with open(path, "w") as file:
        for _ in range(count):
            anchor = sentence()
            row = {"anchor": " ".join(anchor), "positive": " ".join(generator.permutation(anchor))}
            for k in range(negatives):
                row[f"negative_{k + 1}"] = " ".join(sentence())
            file.write(json.dumps(row) + "\n")
    return path


def make_beir(root: Path, queries: int, distractors: int, seed: int = 7) -> Path:
    """A retrieval benchmark in BEIR's format in ``root``: ``queries`` queries, each
    relevant to its paraphrase in the corpus (every third one to the next query's too, a
    score of 2; one judged 0), beside ``distractors`` unrelated documents with titles."""
    import json

    generator = np.random.default_rng(seed)

    def sentence() -> list[str]:
        return list(generator.choice(WORDS, size=int(generator.integers(3, 9))))

    texts = [sentence() for _ in range(queries)]
    corpus = [{"_id": f"d{i:03d}", "title": "", "text": " ".join(generator.permutation(t))}
              for i, t in enumerate(texts)]  # fmt: skip
    corpus += [{"_id": f"x{i:03d}", "title": str(generator.choice(WORDS)),
                "text": " ".join(sentence())} for i in range(distractors)]  # fmt: skip
    qrels = [(f"q{i:03d}", f"d{i:03d}", 1) for i in range(queries)]
    qrels += [(f"q{i:03d}", f"d{i + 1:03d}", 2) for i in range(0, queries - 1, 3)]
    qrels.append(("q000", "x000", 0))
    (root / "qrels").mkdir(parents=True, exist_ok=True)
    for name, rows in (("corpus", corpus),
                       ("queries", [{"_id": f"q{i:03d}", "text": " ".join(t)}
                                    for i, t in enumerate(texts)])):  # fmt: skip
        (root / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    lines = ["query-id\tcorpus-id\tscore", *("\t".join(map(str, row)) for row in qrels)]
    (root / "qrels" / "test.tsv").write_text("\n".join(lines) + "\n")
    return root


def make_text_pair_shards(root: Path, sizes: list[int], format: str = "jsonl") -> Path:
    """``root`` holding one shard per entry of ``sizes`` (that many rows of
    ``make_sentence_pairs``, each shard its own seed), as jsonl or parquet files."""
    import json

    root.mkdir(parents=True, exist_ok=True)
    for number, size in enumerate(sizes):
        path = make_sentence_pairs(root / f"part-{number:05d}.jsonl", size, seed=number)
        if format == "parquet":
            import pyarrow as arrow
            import pyarrow.parquet as parquet

            rows = [json.loads(line) for line in path.read_text().splitlines()]
            parquet.write_table(arrow.Table.from_pylist(rows), path.with_suffix(".parquet"))
            path.unlink()
    return root


DIGIT_NAMES = "zero one two three four five six seven eight nine".split()


def make_digit_tar_shards(root: Path, sizes: list[int], *, start: int = 0) -> Path:
    """``root`` holding one webdataset tar shard per entry of ``sizes``: scikit-learn's
    8x8 digits from row ``start`` on, each sample ``KEY.png`` (greyscale), ``KEY.txt``
    (a caption naming the digit) and ``KEY.cls`` (the label), as webdataset writes them."""
    import io
    import tarfile

    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images * (255 / 16)).astype(np.uint8)
    root.mkdir(parents=True, exist_ok=True)
    row = start
    for number, size in enumerate(sizes):
        with tarfile.open(root / f"shard-{number:05d}.tar", "w") as archive:
            for _ in range(size):
                png = io.BytesIO()
                Image.fromarray(images[row]).save(png, format="PNG")
                label = int(digits.target[row])
                caption = f"the digit {DIGIT_NAMES[label]}"
                for extension, data in (("png", png.getvalue()), ("txt", caption.encode()),
                                        ("cls", str(label).encode())):  # fmt: skip
                    member = tarfile.TarInfo(f"{row:06d}.{extension}")
                    member.size = len(data)
                    archive.addfile(member, io.BytesIO(data))
                row += 1
    return root


def make_captioned_digits(root: Path, count: int, *, start: int = 0) -> Path:
    """A ``save_to_disk`` folder of ``count`` of scikit-learn's 8x8 digits from row
    ``start`` on, in ``make_digit_tar_shards``' columns: ``png`` (an ``Image``), ``txt``
    (its caption) and ``label`` (a ``ClassLabel`` of the digits' names)."""
    import datasets
    from sklearn.datasets import load_digits

    digits = load_digits()
    rows = range(start, start + count)
    features = datasets.Features({"png": datasets.Image(), "txt": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=DIGIT_NAMES)})  # fmt: skip
    table = datasets.Dataset.from_dict(
        {"png": [(digits.images[row] * (255 / 16)).astype(np.uint8) for row in rows],
         "txt": [f"the digit {DIGIT_NAMES[digits.target[row]]}" for row in rows],
         "label": [int(digits.target[row]) for row in rows]},
        features=features,
    )  # fmt: skip
    table.save_to_disk(str(root))
    return root


def make_digit_parquet(path: Path, count: int, *, start: int = 0) -> Path:
    """A parquet file of ``count`` of scikit-learn's 8x8 digits from row ``start`` on:
    an ``image`` column of ``{"bytes", "path"}`` records (PNG bytes, as ``datasets``
    stores images in parquet) and a ``label`` column."""
    import io

    import pyarrow as arrow
    import pyarrow.parquet as parquet
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images * (255 / 16)).astype(np.uint8)
    rows = []
    for row in range(start, start + count):
        png = io.BytesIO()
        Image.fromarray(images[row]).save(png, format="PNG")
        rows.append({"image": {"bytes": png.getvalue(), "path": f"{row:06d}.png"},
                     "label": int(digits.target[row])})  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    parquet.write_table(arrow.Table.from_pylist(rows), path)
    return path


def make_teacher(root: Path, seed: int = 0, double: bool = False):
    """A distillation teacher as our image methods save one: an 8-px mlp's SimCLR model
    (``save_pretrained``: ``config.json`` and ``model.safetensors``, float64 if
    ``double``) in ``root``; the model."""
    import torch

    from models import SimCLR

    torch.manual_seed(seed)
    model = SimCLR(backbone="mlp", image_size=8).to(torch.float64 if double else torch.float32)
    model.save_pretrained(root)
    return model


def make_timm_model(
    root: Path, architecture: str = "vit_tiny_patch16_224", *, dropout: float = 0.1, **model_args
) -> Path:
    """A tiny timm model (by default a 2-block ViT of width 16 on 8 px with patches of 4,
    dropout ``dropout``; any timm architecture and arguments) with random weights, saved
    in timm's hub layout: ``config.json`` (architecture, model arguments, a normalisation)
    and ``model.safetensors`` with its classifier, as timm's hub repositories hold them."""
    import json

    import timm
    import torch
    from safetensors.torch import save_file

    if architecture == "vit_tiny_patch16_224" and not model_args:
        model_args = {"img_size": 8, "patch_size": 4, "depth": 2, "embed_dim": 16,
                      "num_heads": 2}  # fmt: skip
    model_args = {**model_args, "drop_rate": dropout} if dropout else model_args
    torch.manual_seed(0)
    model = timm.create_model(architecture, pretrained=False, num_classes=5, **model_args)
    root.mkdir(parents=True, exist_ok=True)
    weights = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    save_file(weights, root / "model.safetensors")
    normalisation = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
    config = {"architecture": architecture, "num_classes": 5, "model_args": model_args,
              "pretrained_cfg": normalisation}  # fmt: skip
    (root / "config.json").write_text(json.dumps(config))
    return root


def make_text_model(
    root: Path, *, dropout: float = 0.1, pad_token: bool = True, vocab_size: int | None = None
) -> Path:
    """A tiny BERT from a ``BertConfig`` (random weights) and a WordPiece tokenizer that
    ``tokenizers`` trains on ``WORDS`` (``make_tokenizer``), saved together with
    ``save_pretrained``: what ``--text-model`` loads, with nothing downloaded.
    ``vocab_size``: the model's, if not the tokenizer's."""
    import torch
    from transformers import BertConfig, BertModel

    tokenizer = make_tokenizer(pad_token=pad_token)
    config = BertConfig(
        vocab_size=vocab_size or len(tokenizer), hidden_size=16, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=32, max_position_embeddings=64,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )  # fmt: skip
    torch.manual_seed(0)
    BertModel(config, add_pooling_layer=False).save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def make_word_level_model(root: Path, max_length: int = 64) -> Path:
    """A BERT of another vocabulary than ``make_text_model``'s: ``--text-model scratch``'s
    (``models.text.scratch_text_encoder``: a word-level vocabulary of ``WORDS``, random
    weights of seed 1), saved with ``save_pretrained``."""
    import torch

    from models.text import scratch_text_encoder

    torch.manual_seed(1)
    encoder, tokenizer = scratch_text_encoder([" ".join(WORDS)], max_length, torch.float32)
    encoder.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def make_sentence_transformer(root: Path, pooling: str = "cls", activation: str = "tanh") -> Path:
    """The tiny BERT (dropout 0) under ``pooling``, a Dense of 16 -> 8 (``activation``:
    tanh or identity) and Normalize, 16 tokens at most and a "query: " prompt, saved by
    sentence-transformers in ``root``."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Dense,
        Normalize,
        Pooling,
        Transformer,
    )

    bert = make_text_model(root / "bert", dropout=0.0)
    torch.manual_seed(0)
    activation_function = {"tanh": torch.nn.Tanh(), "identity": torch.nn.Identity()}[activation]
    modules = [Transformer(str(bert), max_seq_length=16), Pooling(16, pooling),
               Dense(16, 8, activation_function=activation_function), Normalize()]  # fmt: skip
    model = SentenceTransformer(modules=modules, device="cpu", prompts={"query": "query: "})
    model.save(str(root / "sentence-transformer"))
    return root / "sentence-transformer"


def make_tokenizer(*, pad_token: bool = True):
    """A WordPiece tokenizer of a fixed vocabulary: the specials, ``WORDS``' letters as
    pieces and continuations, and each word whole; ``[CLS] text [SEP]``. Fixed, not
    trained: ``tokenizers``' trainer breaks frequency ties in no fixed order, which gave
    the tests' models other ids, and so other printed figures, in every session."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = sorted(set("".join(WORDS)))
    pieces = [*specials, *letters, *(f"##{letter}" for letter in letters), *sorted(set(WORDS))]
    vocabulary = {piece: i for i, piece in enumerate(dict.fromkeys(pieces))}
    tokenizer = Tokenizer(models.WordPiece(vocabulary, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", tokenizer.token_to_id("[CLS]")),
                        ("[SEP]", tokenizer.token_to_id("[SEP]"))],
    )  # fmt: skip
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", **({"pad_token": "[PAD]"} if pad_token else {}),
    )  # fmt: skip


def make_dual_encoder(root: Path, kind: str = "clip", *, dropout: float = 0.1) -> Path:
    """A tiny ``CLIPModel`` or ``SiglipModel`` from its config (two 2-layer towers of width
    16, images of 8 px in patches of 4, attention dropout ``dropout``), the test's
    tokenizer (CLIP pools each text at its ``[SEP]``) and an image processor, configured in
    code and saved together: what ``--clip-model`` loads."""
    import torch
    from transformers import (
        CLIPConfig,
        CLIPImageProcessor,
        CLIPModel,
        SiglipConfig,
        SiglipImageProcessor,
        SiglipModel,
    )

    tokenizer = make_tokenizer()
    special = {"bos_token_id": tokenizer.cls_token_id, "eos_token_id": tokenizer.sep_token_id,
               "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    tower = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 2, "attention_dropout": dropout}  # fmt: skip
    text = {**tower, **special, "vocab_size": len(tokenizer), "max_position_embeddings": 32}
    vision = {**tower, "image_size": 8, "patch_size": 4}
    mean, std = [0.4815, 0.4578, 0.4082], [0.2686, 0.2613, 0.2758]
    torch.manual_seed(0)
    if kind == "clip":
        model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8))
        processor = CLIPImageProcessor(size={"shortest_edge": 8}, image_mean=mean, image_std=std,
                                       crop_size={"height": 8, "width": 8})  # fmt: skip
    else:
        model = SiglipModel(SiglipConfig(text_config=text, vision_config=vision))
        processor = SiglipImageProcessor(size={"height": 8, "width": 8}, image_mean=mean,
                                         image_std=std)  # fmt: skip
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    processor.save_pretrained(root)
    return root


def make_vision_model(
    root: Path, *, dropout: float = 0.1, image_size: int = 8, kind: str = "vit",
    drop_path: float = 0.0,
) -> Path:  # fmt: skip
    """A tiny ``ViTModel`` (or ``Dinov2Model``: ``kind`` "dinov2", with stochastic depth
    ``drop_path``; or a convolutional ``ConvNextModel`` or ``ResNetModel``, with
    BatchNorm: ``kind`` "convnext", "resnet", two stages of 8 and 16 channels) from its
    config (random weights, patches of 4 pixels, a pooler) and an image processor with
    CLIP's mean and standard deviation, configured in code and saved together: what
    ``--image-model`` loads, with nothing downloaded."""
    import torch
    from transformers import (
        BitImageProcessor,
        ConvNextConfig,
        ConvNextImageProcessor,
        ConvNextModel,
        Dinov2Config,
        Dinov2Model,
        ResNetConfig,
        ResNetModel,
        ViTConfig,
        ViTImageProcessor,
        ViTModel,
    )

    sizes = {"image_size": image_size, "patch_size": 4, "hidden_size": 16,
             "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_dropout_prob": dropout,
             "attention_probs_dropout_prob": dropout}  # fmt: skip
    normalisation = {"image_mean": [0.4815, 0.4578, 0.4082],
                     "image_std": [0.2686, 0.2613, 0.2758]}  # fmt: skip
    torch.manual_seed(0)
    if kind in ("convnext", "resnet"):
        stages = {"hidden_sizes": [8, 16], "depths": [1, 1]}
        model = (
            ConvNextModel(ConvNextConfig(**stages, num_stages=2, patch_size=2))
            if kind == "convnext"
            else ResNetModel(ResNetConfig(**stages, embedding_size=8))
        )
        model.save_pretrained(root)
        processor = ConvNextImageProcessor(size={"shortest_edge": image_size},
                                           crop_pct=1.0, **normalisation)  # fmt: skip
    elif kind == "dinov2":
        Dinov2Model(Dinov2Config(**sizes, mlp_ratio=2, drop_path_rate=drop_path)).save_pretrained(
            root
        )
        processor = BitImageProcessor(size={"shortest_edge": image_size}, do_center_crop=True,
                                      crop_size={"height": image_size, "width": image_size},
                                      **normalisation)  # fmt: skip
    else:
        ViTModel(ViTConfig(**sizes, intermediate_size=32)).save_pretrained(root)
        processor = ViTImageProcessor(size={"height": image_size, "width": image_size},
                                      **normalisation)  # fmt: skip
    processor.save_pretrained(root)
    return root


def start(
    num_processes: int, *trainer_args: str, launcher_flags: list[str] | None = None
) -> subprocess.Popen:
    """Start ``accelerate launch trainer.py ARGS`` in a process group of its own, as a
    scheduler runs a job, so that a test can signal the whole job."""
    command = launch_command(
        num_processes, REPO / "trainer.py", *trainer_args, launcher_flags=launcher_flags
    )
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )


def logged_steps(output_dir: Path) -> int:
    """The last step written to ``metrics.jsonl`` (0 before the first)."""
    import json

    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line]
    return max(steps, default=0)


def wait_until(condition, timeout: float = LAUNCH_TIMEOUT_S, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout} s")
        time.sleep(interval)


def finish(process: subprocess.Popen, timeout: float = LAUNCH_TIMEOUT_S) -> tuple[str, str]:
    """Wait for the launcher and for every process of its group (an orphaned worker too);
    kills the group if it outlives ``timeout``. Returns (stdout, stderr)."""
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        wait_until(lambda: not _group_alive(process.pid), timeout=timeout)
    finally:
        if _group_alive(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
    return stdout, stderr


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True
