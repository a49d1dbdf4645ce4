"""examples/nnx_encoder.py: a user's NNX encoder with a flaxheads pooler and head trains, and its
head, exported, gives the same logits on the functional path."""

import importlib.util
import os

import numpy as np

EXAMPLE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "nnx_encoder.py"
)


def test_own_nnx_encoder(tmp_path):
    spec = importlib.util.spec_from_file_location("nnx_encoder", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = example.main(str(tmp_path / "head"), steps=15)
    assert out["losses"][-1] < 0.5 * out["losses"][0]
    np.testing.assert_array_equal(np.asarray(out["functional_logits"]), np.asarray(out["nnx_logits"]))
    assert os.path.isfile(tmp_path / "head" / "head_config.json")
