"""A spec resolved into the library's settings: one set of defaults (``RunSpec()`` gives the
``TrainConfig`` and ``OptimConfig`` their own defaults), the learning rates a run picks, and the
run folder's default name."""

from __future__ import annotations

import dataclasses

from flaxheads.run.program import optim_config, train_config
from flaxheads.run.spec import RunSpec
from flaxheads.training.optim import DEFAULT_HEAD_LR, DEFAULT_LR, LORA_LR, PROBE_LR, OptimConfig
from flaxheads.training.trainer import TrainConfig


def test_one_set_of_defaults():
    spec = RunSpec()
    assert train_config(spec) == TrainConfig()
    # what a run derives beside the defaults: the schedule's length and warmup, the fine-tune's head rate
    optim = optim_config(spec, 1000)
    assert (optim.total_steps, optim.warmup_steps, optim.head_learning_rate) == (1000, 100, DEFAULT_HEAD_LR)
    assert dataclasses.replace(optim, warmup_steps=0, head_learning_rate=None) == OptimConfig()


def test_the_learning_rates_a_run_picks():
    assert RunSpec().learning_rates == (DEFAULT_LR, DEFAULT_HEAD_LR)
    assert RunSpec.from_kwargs(freeze_backbone=True).learning_rates == (PROBE_LR, PROBE_LR)
    assert RunSpec.from_kwargs(lora_rank=4).learning_rates == (LORA_LR, DEFAULT_HEAD_LR)
    assert RunSpec.from_kwargs(lr=1e-2, head_lr=1e-1, sweep=2).learning_rates == (1e-2, 1e-1)
    # accumulation: the schedule counts optimizer steps
    assert optim_config(RunSpec.from_kwargs(accumulation_steps=4), 10).total_steps == 2


def test_the_run_folder_is_named_by_its_data_and_objective():
    assert RunSpec.from_kwargs(output_dir="x").run_folder().name == "x"
    assert RunSpec.from_kwargs(data="a/news.csv").run_folder().name.endswith("-news")
    assert RunSpec.from_kwargs(data="a/pref.csv", objective="pairwise").run_folder().name.endswith("-pref-pairwise")


def test_what_a_ranking_task_refuses_are_run_settings():
    from flaxheads.tasks.ranking.task import Ranking

    assert set(Ranking.refuses) <= set(RunSpec().flat())
