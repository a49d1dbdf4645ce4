"""PEFT LoRA adapters in: a ``SEQ_CLS`` adapter folder saved by peft itself (classifier through
``modules_to_save``) loads on its base folder with ``PeftModel``'s logits, a BERT-like and a
left-padded decoder family; it exports back to PEFT with the same logits; an adapter whose base
is missing says so."""

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft", reason="peft is not installed on this stack")

from hf_tiny import padded_batch, tiny_torch_model  # noqa: E402
from transformers import AutoModelForSequenceClassification  # noqa: E402

import flaxheads as fh  # noqa: E402

pytestmark = pytest.mark.legacy

TARGETS = {"bert": ["query", "value", "output.dense"], "qwen3": ["q_proj", "v_proj", "down_proj"]}


def _logits(m, ids, mask):
    with torch.no_grad():
        return m.eval()(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()


@pytest.fixture(scope="module", params=sorted(TARGETS))
def adapter(request, tmp_path_factory):
    """``(arch, base folder, adapter folder, PeftModel)``: adapters and classifier moved off their init."""
    arch = request.param
    d = tmp_path_factory.mktemp(f"peft_{arch}")
    tiny_torch_model(arch, num_labels=2, seed=3).save_pretrained(d / "base", safe_serialization=True)
    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(d / "base", num_labels=3, ignore_mismatched_sizes=True)
    model = peft.get_peft_model(
        base, peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS[arch])
    )
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(d / "adapter")
    return arch, d / "base", d / "adapter", model.eval()


def test_logits_equal_peft_and_export_round_trips(adapter, tmp_path):
    arch, base, folder, pm = adapter
    side = "left" if arch == "qwen3" else "right"
    ids, mask = padded_batch(arch, pm.config, side)
    ref = _logits(pm, ids, mask)
    model = fh.interop.load_peft(folder)
    assert model.lora is not None and model.lora.rank == 4 and model.num_labels == 3
    ours = np.asarray(model.apply(model.params, ids, mask))
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)
    plain = fh.from_pretrained(base, num_labels=3, ignore_mismatched_sizes=True)
    assert np.abs(np.asarray(plain.apply(plain.params, ids, mask)) - ref).max() > 1e-3  # adapters and head matter

    fh.interop.export_peft(model, tmp_path / "again")
    cfg = json.loads((tmp_path / "again" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(base)
    fresh = AutoModelForSequenceClassification.from_pretrained(base, num_labels=3, ignore_mismatched_sizes=True)
    np.testing.assert_allclose(
        _logits(peft.PeftModel.from_pretrained(fresh, tmp_path / "again"), ids, mask), ref, atol=1e-5, rtol=0
    )


def test_base_from_option_and_missing_base(adapter, tmp_path):
    arch, base, folder, pm = adapter
    moved = shutil.copytree(folder, tmp_path / "adapter")
    cfg = json.loads((moved / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(tmp_path / "gone")
    (moved / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(fh.FlaxheadsError, match="base model .*gone.* missing here.*backbone"):
        fh.interop.load_peft(moved)
    ids, mask = padded_batch(arch, pm.config)
    model = fh.interop.load_transformers(moved, backbone=base)  # the transformers import routes adapters here too
    np.testing.assert_allclose(
        np.asarray(model.apply(model.params, ids, mask)), _logits(pm, ids, mask), atol=1e-5, rtol=0
    )
