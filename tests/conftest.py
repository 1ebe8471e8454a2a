"""Session-wide test data, built once and shared by every module that trains on it.

Each fixture writes its files under pytest's temporary root and returns their path as a
string, as a command line takes it. Tests must not modify them: copy first.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from session_checks import (  # noqa: F401 - its hooks: the session checks what it leaves
    pytest_addoption,
    pytest_sessionfinish,
    pytest_sessionstart,
)

from contrastive_accelerate.checkpoint import FINAL_DIR
from contrastive_accelerate.methods import METHODS

from launch import (
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


def pytest_configure(config: pytest.Config) -> None:
    """The processes the suite starts inherit ``TEST_ENVIRONMENT``: the launches, and the
    pooled workers, whether a check or a trainer run starts them."""
    os.environ.update(TEST_ENVIRONMENT)


@pytest.fixture(scope="session", autouse=True)
def working_directory(tmp_path_factory) -> Iterator[Path]:
    """Where every test of the session runs, and every process it starts: a folder of its
    own, never the checkout, where each method's default output folder (``runs/<method>``)
    already holds a finished run, as after a user's own runs. A test that trains without
    ``--output-dir`` is refused here, as it would be in a user's checkout."""
    path = tmp_path_factory.mktemp("working-directory")
    for method in METHODS:
        os.makedirs(path / "runs" / method / FINAL_DIR)
    previous = os.getcwd()
    os.chdir(path)
    yield path
    os.chdir(previous)


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
