"""Session-wide test data, built once and shared by every module that trains on it.

Each fixture writes its files under pytest's temporary root and returns their path as a
string, as a command line takes it. Tests must not modify them: copy first.
"""

from __future__ import annotations

import os
import time

import psutil
import pytest

# Every process the session starts inherits this mark (launch.ENV is built from the
# environment at import): what is still alive with it at the end was left behind.
SESSION_MARK = "CONTRASTIVE_ACCELERATE_TEST_SESSION"
os.environ.setdefault(SESSION_MARK, str(os.getpid()))

from launch import (  # noqa: E402
    TEST_ENVIRONMENT,
    WORDS,
    make_dual_encoder,
    make_image_folder,
    make_sentence_pairs,
    make_text_model,
    make_vision_model,
    small_labelled_dataset,
)

#: The modules that take minutes, in the order pytest-xdist hands them out first (whole
#: modules, ``--dist loadfile --no-loadscope-reorder``): the longest started first, the
#: short ones fill in, so the two pytest processes end together. Order only: a module
#: missing here runs all the same, after these.
LONGEST_FIRST = [
    "test_trainer_momentum.py",
    "test_trainer_fsdp.py",
    "test_invariance_kit.py",
    "test_fault_tolerance.py",
    "test_pool.py",
    "test_host_syncs.py",
    "test_invariance.py",
    "test_compile.py",
    "test_trainer.py",
    "test_pipeline.py",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each module keeps its own order


def processes_left_behind() -> list[str]:
    """This session's processes that are still alive, but for this one."""
    mark, left = os.environ[SESSION_MARK], []
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if process.pid != os.getpid() and process.environ().get(SESSION_MARK) == mark:
                left.append(f"{process.pid}: {' '.join(process.info['cmdline'] or [])[:200]}")
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return left


#: A pool's workers exit within 5 s of their pytest process; xdist's take a moment too.
LEFT_BEHIND_GRACE_S = 20.0


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """No test may leave processes behind: the session fails if one outlives it."""
    if hasattr(session.config, "workerinput"):  # an xdist worker: its controller checks
        return
    from contrastive_accelerate.workers import close_workers

    close_workers()  # this process's own pool (a run without xdist)
    deadline = time.monotonic() + LEFT_BEHIND_GRACE_S
    while (left := processes_left_behind()) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        print("\nprocesses left behind by the tests:\n" + "\n".join(left), flush=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    """The processes the suite starts inherit ``TEST_ENVIRONMENT``: the launches, and the
    pooled workers, whether a check or a trainer run starts them."""
    os.environ.update(TEST_ENVIRONMENT)


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> str:
    """20 random 10x10 images in 2 classes: with global batches of 6, each epoch ends with
    a batch of 2, which 3 processes split 1 + 1 + 0 (an idle rank)."""
    return str(make_image_folder(tmp_path_factory.mktemp("images"), count=20, size=10))


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> str:
    """A 2-layer BERT (hidden 16, dropout 0.1) and its tokenizer, trained on ``WORDS``."""
    return str(make_text_model(tmp_path_factory.mktemp("bert"), dropout=0.1))


@pytest.fixture(scope="session")
def tiny_vit(tmp_path_factory) -> str:
    """A 2-layer ViT (hidden 16, dropout 0.1, 8 px) and its image processor."""
    return str(make_vision_model(tmp_path_factory.mktemp("vit"), dropout=0.1))


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory) -> str:
    """A tiny CLIPModel (two 2-layer towers, attention dropout 0.1), its tokenizer and processor."""
    return str(make_dual_encoder(tmp_path_factory.mktemp("clip"), "clip"))


@pytest.fixture(scope="session")
def tiny_siglip(tmp_path_factory) -> str:
    """A tiny SiglipModel, its tokenizer and processor."""
    return str(make_dual_encoder(tmp_path_factory.mktemp("siglip"), "siglip"))


@pytest.fixture(scope="session")
def tiny_bert_without_pad(tmp_path_factory) -> str:
    """The tiny BERT with a tokenizer that has no padding token."""
    return str(make_text_model(tmp_path_factory.mktemp("bert-no-pad"), pad_token=False))


@pytest.fixture(scope="session")
def sentence_pairs(tmp_path_factory) -> str:
    """25 rows of anchor, positive and one hard negative, of varied lengths."""
    return str(make_sentence_pairs(tmp_path_factory.mktemp("text") / "pairs.jsonl", 25))


@pytest.fixture(scope="session")
def captioned_images(tmp_path_factory) -> str:
    """20 labelled 10x10 images, each with a list of 3 captions (a ``save_to_disk`` folder)."""
    root = tmp_path_factory.mktemp("image-text")
    dataset = small_labelled_dataset(count=20, size=10)
    captions = [[f"{WORDS[(3 * i + k) % len(WORDS)]} {WORDS[(i + 2 * k) % len(WORDS)]} cat"
                 for k in range(3)] for i in range(len(dataset))]  # fmt: skip
    dataset.add_column("caption", captions).save_to_disk(str(root / "data"))
    return str(root / "data")
