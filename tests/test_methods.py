"""The loss table (``methods.loss_table.LOSSES``): every ``--loss`` of every method is
one row, and a row's obligations are found from the table.

- Every row is taken by a family (``Family.losses``), and ``--loss`` offers exactly the
  rows.
- A row's options are fields; each is accepted with exactly the losses whose rows read
  it, for every family that takes them (no list, no help text decides it).
- A row builds its criterion from the default options; it has a float64 exactness case
  on W = 2 and W = 3 with negative controls (``test_losses``), and a trainer case: the
  two-view family's in ``test_trainer_losses``, the others' in the composition test,
  which trains each family's default loss.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from torch import nn

from contrastive_accelerate.config import ConfigError
from contrastive_accelerate.methods import LOSSES, METHODS, SIMCLR_LOSSES
from contrastive_accelerate.methods.loss_table import LOSS_OPTIONS
from trainer import TrainConfig

import loss_cases
import test_losses
import test_trainer_losses

FIELDS = {field.name: field for field in dataclasses.fields(TrainConfig)}
FAMILIES = [family for row in METHODS.values() for family in row.families if family.losses]
#: What each family needs besides --loss to be chosen by the options alone.
CHOSEN_BY = {
    "--method simclr": {},
    "--method pairs (text pairs)": {"columns": "anchor,positive"},
    "--method pairs (image-text)": {"columns": "image,caption"},
}
#: The text rows trained besides the family's first, each by a test of its own (a module
#: that needs transformers, so named, not imported).
PAIR_TRAINER_CASES = {"gist": ("test_trainer_pairs.py", "def test_gist_trains_alike_on_1_and_n_")}


def _pair_trainer_case(loss: str) -> bool:
    module, test = PAIR_TRAINER_CASES.get(loss, ("", None))
    return test is not None and test in (Path(__file__).parent / module).read_text()


#: What a row needs besides --loss: GISTEmbed, its guide.
NEEDS = {"gist": {"gist_guide": "guide"}}


def _other_value(name: str):
    """A valid value of ``name`` other than its default."""
    field = FIELDS[name]
    if field.metadata.get("choices"):
        return next(choice for choice in field.metadata["choices"] if choice != field.default)
    if field.type == "bool":
        return not field.default
    return "other" if "str" in str(field.type) else (field.default or 1.0) / 2


def test_every_row_is_taken_by_a_family_and_the_cli_offers_exactly_the_rows():
    assert {loss for family in FAMILIES for loss in family.losses} == set(LOSSES)
    assert FIELDS["loss"].metadata["choices"] is LOSSES
    assert {family.name for family in FAMILIES} == set(CHOSEN_BY)


@pytest.mark.parametrize("loss", list(LOSSES))
def test_every_row_has_its_options_an_exactness_case_and_a_trainer_case(loss):
    row = LOSSES[loss]
    for name in row.options:
        assert name in FIELDS, f"--loss {loss} reads {name!r}, which TrainConfig lacks"
    for name in row.defaults:
        assert FIELDS[name].default is None, f"{loss} defaults {name!r}, which is never None"
    assert loss in loss_cases.CASES, f"{loss}: no float64 case in tests/loss_cases.py"
    assert set(test_losses.SPLITS) == {2, 3}  # each case runs on W = 2 and W = 3
    assert loss_cases.CASES[loss].controls, f"{loss}: no negative control"
    first = any(family.losses[0] == loss for family in FAMILIES)  # trained by the composition
    trained = loss in test_trainer_losses.MODELS or _pair_trainer_case(loss)
    assert trained or first, f"{loss}: no trainer case"
    assert set(test_trainer_losses.MODELS) == set(SIMCLR_LOSSES)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_a_loss_option_is_taken_exactly_with_the_losses_whose_rows_read_it(family):
    for loss in family.losses:
        for name in LOSS_OPTIONS:
            options = {**CHOSEN_BY[family.name], "loss": loss, **NEEDS.get(loss, {}),
                       name: _other_value(name)}  # fmt: skip
            if name in LOSSES[loss].options:
                assert getattr(TrainConfig(**options), name) == options[name]
            else:
                with pytest.raises(ConfigError, match="does not apply"):
                    TrainConfig(**options)


@pytest.mark.parametrize("loss", list(SIMCLR_LOSSES))
def test_every_row_builds_its_criterion_from_the_default_options(loss):
    config = TrainConfig(loss=loss).resolved()
    assert isinstance(LOSSES[loss].make(config), nn.Module)
    assert all(getattr(config, name) is not None for name in LOSSES[loss].options)


def test_the_pair_rows_build_their_criteria_from_the_default_options():
    for family in FAMILIES:
        for loss in family.losses:
            config = TrainConfig(**CHOSEN_BY[family.name], loss=loss, **NEEDS.get(loss, {}))
            config = config.resolved()
            assert isinstance(LOSSES[loss].make(config), nn.Module)
