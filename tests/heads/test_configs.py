"""Pooler and head configs are plain frozen dataclasses apart from their modules, and the JSON on
disk did not change when they were split off: every form and preset serialises to the bytes the
code before the split wrote (tests/fixtures/configs_before_split.json), and the files of
tests/fixtures/pre_layout load and write back byte for byte."""

import dataclasses
import json
import os

import flax.linen as nn
import pytest
from hf_tiny import head_specs, pooler_specs, tiny_config

import flaxheads as fh
from flaxheads.checkpoint import read_meta
from flaxheads.errors import ConfigError
from flaxheads.heads import linen
from flaxheads.heads.presets import PRESETS, preset_for
from flaxheads.interop.head_files import HEAD_CONFIG, HEAD_WEIGHTS, export_head, load_head_export

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")


@pytest.fixture(scope="module")
def before():
    with open(os.path.join(FIXTURES, "configs_before_split.json")) as f:
        return json.load(f)


def test_every_form_writes_the_json_of_before(before):
    forms = [fh.SequenceHead(fh.make_pooler(p), h) for p in pooler_specs() for h in head_specs()]
    assert [fh.config.to_json(s) for s in forms] == before["forms"]
    assert [fh.config.to_json(fh.config.from_json(t)) for t in before["forms"]] == before["forms"]


def test_every_preset_writes_the_json_of_before(before):
    pytest.importorskip("transformers")
    got = {}
    for arch in sorted(a for a in PRESETS if a in before["presets"]):  # presets added since have no JSON of before
        p = preset_for(tiny_config(arch), 3)
        got[arch] = fh.config.to_json(fh.SequenceHead(p.pooler, p.head))
    assert got == before["presets"]


def test_configs_are_plain_frozen_dataclasses():
    for cfg in [fh.make_pooler(p) for p in pooler_specs()] + head_specs():
        assert dataclasses.is_dataclass(cfg) and not isinstance(cfg, nn.Module)
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.mode = "max"
        back = fh.config.from_dict(fh.config.to_dict(cfg))
        assert hash(cfg) == hash(back) and cfg == back
        assert isinstance(linen.module(cfg), nn.Module)  # the module is built from the config
    # lists given where tuples belong keep the config hashable (a jit static argument)
    assert hash(fh.MLPHead(3, hidden_dims=[8, None])) == hash(fh.MLPHead(3, hidden_dims=(8, None)))
    with pytest.raises(ConfigError, match="pooler config"):
        fh.SequenceHead(linen.module(fh.make_pooler("mean")), fh.LinearHead(3))


def test_pre_layout_head_export_writes_back_byte_identical(tmp_path):
    src = os.path.join(FIXTURES, "pre_layout", "head_export")
    head, params, cfg = load_head_export(src)
    own = {"format", "flaxheads_version", "sequence_head", "hf_names", "params"}
    out = export_head(
        head,
        tmp_path / "again",
        params=params,
        hf_names=cfg["hf_names"],
        meta={k: v for k, v in cfg.items() if k not in own},
    )
    with open(os.path.join(src, HEAD_CONFIG)) as f:
        old = f.read()
    with open(os.path.join(out, HEAD_CONFIG)) as f:
        new = f.read()
    old_version = f'"flaxheads_version": "{cfg["flaxheads_version"]}"'
    assert old_version in old
    assert new == old.replace(old_version, f'"flaxheads_version": "{fh.__version__}"')
    with open(os.path.join(src, HEAD_WEIGHTS), "rb") as a, open(os.path.join(out, HEAD_WEIGHTS), "rb") as b:
        assert a.read() == b.read()


def test_pre_layout_checkpoint_meta_round_trips():
    meta, _, _ = read_meta(os.path.join(FIXTURES, "pre_layout", "head"))
    stored = meta["head_config"]
    assert fh.config.to_dict(fh.config.from_dict(stored)) == stored
    assert fh.config.to_json(fh.config.from_dict(stored)) == json.dumps(stored)
