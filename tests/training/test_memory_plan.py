"""The memory plan from a config.json alone (``flaxheads plan``): the base's and the adapters' bytes
are transformers' and peft's parameter counts, and XLA's figures for the deep model (compiled at 1
and 2 layers and extended) match those of the loaded model's own compiled train step; bad input is
one line, exit 2."""

import json

import numpy as np
import pytest

pytest.importorskip("torch")

import jax  # noqa: E402
from hf_tiny import tiny_config  # noqa: E402

import flaxheads as fh  # noqa: E402
from flaxheads.cli.main import main  # noqa: E402
from flaxheads.training.loop import TrainConfig, Trainer  # noqa: E402
from flaxheads.training.memory import memory_report  # noqa: E402
from flaxheads.training.memory_plan import EXTRAPOLATE_ABOVE, plan_batch  # noqa: E402
from flaxheads.training.optim import OptimConfig  # noqa: E402

pytestmark = pytest.mark.full
LAYERS = EXTRAPOLATE_ABOVE + 1


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A config-only folder and a folder with the same config and random weights."""
    import torch
    from transformers import AutoModelForSequenceClassification

    cfg = tiny_config("llama", num_labels=2, num_hidden_layers=LAYERS)
    d = tmp_path_factory.mktemp("plan")
    cfg.save_pretrained(d / "config_only")
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(d / "weights")
    return cfg, d / "config_only", d / "weights"


def test_plan_of_a_config_only_folder(llama, capsys):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel, AutoModelForSequenceClassification

    cfg, folder, weights = llama
    assert (
        main(["plan", "--model", str(folder), "--batch-size", "4", "--max-length", "32", "--lora-rank", "4", "--json"])
        == 0
    )
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    base = sum(p.numel() for p in AutoModel.from_config(cfg).parameters())
    assert plan["base"] == 4 * base
    peft = get_peft_model(
        AutoModelForSequenceClassification.from_config(cfg),
        LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj", "v_proj"]),
    )
    lora = sum(p.numel() for n, p in peft.named_parameters() if "lora_" in n)
    assert plan["adapters"] == 4 * lora
    assert plan["opt_state"] >= 2 * (plan["adapters"] + plan["head"])  # AdamW's two moments of what trains
    assert plan["peak"] > plan["base"] + plan["opt_state"] and plan["fits"]["TPU v5e 16GB"]

    # the loaded model's own compiled step (every layer compiled): XLA's figures within 5% of the plan's
    model = fh.from_pretrained(weights).with_lora(rank=4, alpha=8.0)
    trainer = Trainer.build(model, OptimConfig(), TrainConfig(batch_size=4))
    real = memory_report(trainer, plan_batch(model, 4, 32))
    assert real.params == plan["base"] + plan["adapters"] + plan["head"]
    np.testing.assert_allclose(plan["peak"], real.xla_total, rtol=0.05)
    np.testing.assert_allclose(plan["activations"], real.xla_temp, rtol=0.1)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mesh", f"fsdp={jax.device_count() * 2}", "--batch-size", "3"], "does not split over|needs .* devices"),
        (["--quantize", "nf4"], "quantised base cannot be fine-tuned"),
    ],
)
def test_bad_plans_are_one_line_exit_2(llama, capsys, argv, message):
    import re

    assert main(["plan", "--model", str(llama[1]), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err


def test_a_quantisation_the_family_cannot_take(tiny_bert, capsys):
    assert main(["plan", "--model", str(tiny_bert), "--quantize", "int8", "--lora-rank", "4"]) == 2
    assert "not available for model_type 'bert'" in capsys.readouterr().err
