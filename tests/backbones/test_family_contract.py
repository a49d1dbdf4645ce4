"""What every registered family declares on its Backbone class (the facts other modules ask it for)."""

import pytest

from flaxheads.backbones.base import BackboneError, HFConfig
from flaxheads.backbones.registry import FAMILIES, family_for
from flaxheads.heads.presets import PRESETS, preset_for


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.__name__)
def test_a_model_type_the_family_does_not_serve_is_refused(fam):
    with pytest.raises(BackboneError, match=rf"flaxheads' {fam.family} backbone serves model_type .*not 'xlnet'"):
        fam.check_config(HFConfig({"model_type": "xlnet"}))


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.__name__)
def test_every_family_names_itself_its_prefix_and_lora_targets(fam):
    assert fam.family and fam.base_model_prefix and fam.lora_targets and fam.model_types


@pytest.mark.parametrize("arch", [a for a in PRESETS if family_for(a) is not None])
def test_the_preset_reads_the_dropout_key_the_export_writes(arch):
    """A transformers export writes the head's dropout to the family's ``classifier_dropout_key``;
    the preset must read it from there, so the exported folder imports with the same head."""
    fam = family_for(arch)
    key = fam.classifier_dropout_key
    cfg = fam.complete_config(HFConfig({"model_type": arch, "pad_token_id": 0, **({key: 0.37} if key else {})}))
    assert preset_for(cfg, 2).head.dropout == pytest.approx(0.37 if key else 0.0)


def test_a_model_type_without_a_family_is_named_when_hf_flax_is_missing(tmp_path):
    """Without HF's Flax models (transformers 5) the error names the folder's model_type and the
    native ones, instead of only suggesting an extra."""
    import transformers

    from flaxheads.backbones.base import BackboneError
    from flaxheads.backbones.registry import load_backbone

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers < 5 still has HF's Flax models")
    (tmp_path / "config.json").write_text('{"model_type": "xlnet"}')
    with pytest.raises(BackboneError, match=r"model_type 'xlnet' has no native flaxheads backbone.*bert, roberta"):
        load_backbone(tmp_path)
