"""A job's stored options on their way to the trainer (issue 42): validated where they enter
(the submission; a run's config file, when its process reads it), not again by the service's
race or the workers that place them into a run's config. A stored option that today's rules
refuse does not make the service raise; the run's process refuses it once, naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.service.test_api import OPTION_CHECKS, counting_option_checks
from zoopick.service import race as races
from zoopick.service.db.models import Job
from zoopick.training import launch
from zoopick.training.config import FinetuneConfig, FinetuneOptions
from zoopick.training.race import SelectionOptions

# a job stored before today's rules: a hook option since removed, a range since narrowed
STORED_FINETUNE = {"epochs": 1, "compressor": "spardl", "hook_options": {"retired": 1}}
STORED_SELECTION = {"shortlist": 100, "budget_epochs": 3.0, "validation_fraction": 0.2}


def test_the_race_and_a_run_config_place_stored_options_without_validating(
    monkeypatch, tmp_path: Path, capsys
):
    with pytest.raises(ValueError):  # today's rules refuse both
        FinetuneOptions.model_validate(STORED_FINETUNE)
    with pytest.raises(ValueError):
        SelectionOptions.model_validate(STORED_SELECTION)
    job = Job(finetune=STORED_FINETUNE, selection=STORED_SELECTION)
    calls = counting_option_checks(monkeypatch)

    selection = SelectionOptions.stored(job.selection)
    assert selection.shortlist == 100
    candidate = races.race_options(job)  # what every candidate of the race trains with
    assert (candidate.workers, candidate.compressor, candidate.hook_options) == (1, "dense", {})
    assert candidate.epochs == 1 and candidate.recipe == "fixed"  # stored before the recipe
    final = FinetuneConfig.for_run(
        FinetuneOptions.stored(job.finetune), zoo="z", model="m", data="d", out=str(tmp_path)
    )
    assert final.hook_options == {"retired": 1} and final.out == str(tmp_path)
    rung = FinetuneConfig.for_run(
        candidate, zoo="z", model="m", data="d", out=str(tmp_path), max_steps=4, decay_from=0,
        validation_fraction=selection.validation_fraction,
    )  # fmt: skip
    assert (rung.max_steps, rung.validation_fraction, rung.workers) == (4, 0.2, 1)
    assert calls == dict.fromkeys(OPTION_CHECKS, 0)
    with pytest.raises(TypeError, match="max_step"):  # a misspelt placement is no silent no-op
        FinetuneConfig.for_run(candidate, zoo="z", model="m", data="d", out="o", max_step=4)

    # the rung's config is valid today; the final run's is refused once, by its process
    assert launch.parse_args(["--config", str(launch.write_config(rung))]) == rung
    with pytest.raises(SystemExit):
        launch.parse_args(["--config", str(launch.write_config(final))])
    assert "retired" in capsys.readouterr().err
