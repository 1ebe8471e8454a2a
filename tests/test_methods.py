"""The SimCLR family's loss table: every row is complete and covered by the suite.

A row of ``LOSSES`` is all a new loss needs in the trainer; these tests make the rest
of its obligations mechanical: its option fields exist and say which loss reads them,
it has a float64 exactness case on W = 2 and W = 3 (test_losses, with its negative
controls), and a launch case on 1 and 2 processes (test_trainer_losses).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from torch import nn

from contrastive_accelerate.methods import LOSSES, PAIR_LOSSES
from trainer import TrainConfig

import loss_cases
import test_losses
import test_trainer_losses

FIELDS = {field.name: field for field in dataclasses.fields(TrainConfig)}
#: Options every loss takes: its tiles and the --no-gather control.
SHARED = {"loss_tile_rows", "gather"}


def _losses_named_in_help(name: str) -> set[str]:
    """The losses an option's help names before its colon, e.g. "dclw: ..." -> {dclw}."""
    head = re.match(r"([a-z0-9, ]+):", FIELDS[name].metadata["help"])
    named = {word.strip() for word in head.group(1).split(",")} if head else set()
    return named & set(LOSSES)


@pytest.mark.parametrize("loss", list(LOSSES))
def test_every_row_reads_options_that_name_it(loss):
    for name in LOSSES[loss].options:
        assert name in FIELDS, f"--loss {loss} reads {name!r}, which TrainConfig lacks"
        assert loss in _losses_named_in_help(name), f"the help of {name!r} omits {loss}"
    for name in LOSSES[loss].defaults:
        assert FIELDS[name].default is None, f"{loss} defaults {name!r}, which is never None"


def test_every_loss_specific_option_belongs_to_the_rows_it_names():
    for name in FIELDS:
        for loss in _losses_named_in_help(name):
            assert name in LOSSES[loss].options, f"{name!r} names {loss}, whose row omits it"


@pytest.mark.parametrize("loss", list(LOSSES))
def test_every_row_builds_its_criterion_from_the_default_options(loss):
    config = TrainConfig(loss=loss).resolved()
    assert isinstance(LOSSES[loss].make(config), nn.Module)
    assert all(getattr(config, name) is not None for name in LOSSES[loss].options)


@pytest.mark.parametrize("loss", list(LOSSES))
def test_every_row_has_an_exactness_case_and_a_launch_case(loss):
    assert loss in loss_cases.CASES, f"{loss}: no float64 case in tests/loss_cases.py"
    assert set(test_losses.SPLITS) == {2, 3}  # each case runs on W = 2 and W = 3
    assert loss_cases.CASES[loss].controls, f"{loss}: no negative control"
    assert loss in test_trainer_losses.MODELS, f"{loss}: no launch case"


def test_the_cli_offers_exactly_the_rows():
    assert FIELDS["loss"].metadata["choices"] == tuple(dict.fromkeys((*LOSSES, *PAIR_LOSSES)))
