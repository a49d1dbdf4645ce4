"""Params read slice by slice onto a mesh of 4 CPU devices (tests/conftest.py makes them): equal to
the eager loader's, on the layout's shardings (really split), in the asked dtype, and the host
holds about one tensor at a time, not the model (tracemalloc, which numpy reports to); the same
through ``from_pretrained(mesh=...)``, head included."""
import tracemalloc

import numpy as np
import pytest

pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import flaxheads as fh  # noqa: E402
from flaxheads.backbones.base import HFConfig  # noqa: E402
from flaxheads.backbones.lazy import param_sources, read_params_sharded  # noqa: E402
from flaxheads.backbones.registry import family_for  # noqa: E402
from flaxheads.backbones.weights import read_state_dict  # noqa: E402
from flaxheads.sharding import Layout, make_mesh  # noqa: E402
from hf_tiny import save_tiny  # noqa: E402

pytestmark = [pytest.mark.full,
              pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake CPU) devices")]


def _load(path, dtype=jnp.float32):
    """Eager model, lazily read backbone params on an fsdp=4 mesh, and the peak traced host bytes."""
    model = fh.from_pretrained(path)
    mesh = make_mesh("fsdp=4")
    layout = Layout.for_model(mesh, model)
    fam = family_for(model.model_type)
    cfg = fam.complete_config(HFConfig.from_folder(path))
    tracemalloc.start()
    try:
        lazy = read_params_sharded(path, fam, cfg, dtype=dtype,
                                   shardings=lambda p, s: NamedSharding(mesh, layout.spec_of(("backbone",) + p, s)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return model, layout, lazy, peak


@pytest.mark.parametrize("arch", ["bert", "gpt2"])  # transposed Linear kernels; GPT-2's Conv1D kept as stored
def test_sharded_params_equal_the_eager_loaders(tmp_path, arch):
    path, _ = save_tiny(tmp_path / arch, arch, seed=1)
    model, layout, lazy, _ = _load(path)
    eager = model.params["backbone"]
    assert jax.tree.structure(lazy) == jax.tree.structure(eager)
    split = 0
    for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(lazy), jax.tree.leaves(eager), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        names = tuple(str(k.key) for k in p)
        assert a.sharding.spec == layout.spec_of(("backbone",) + names, a.shape)
        split += any(s is not None for s in a.sharding.spec)
    assert split > 4  # kernels and tables really are split over the devices
    bf16 = read_params_sharded(path, family_for(arch), HFConfig.from_folder(path),
                               lambda p, s: NamedSharding(layout.mesh, layout.spec_of(("backbone",) + p, s)),
                               dtype=jnp.bfloat16)
    for a, b in zip(jax.tree.leaves(bf16), jax.tree.leaves(eager), strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)))


def test_host_memory_is_one_tensor_not_the_model(tmp_path):
    path, _ = save_tiny(tmp_path / "bert", "bert", seed=0, vocab_size=4096, hidden_size=256, intermediate_size=1024)
    model, _, lazy, peak = _load(path)
    sizes = [x.nbytes for x in jax.tree.leaves(model.params["backbone"])]
    tracemalloc.start()
    try:
        read_state_dict(path)
        eager_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert eager_peak > 0.9 * sum(sizes)  # the eager reader holds the whole model: the measure sees it
    assert peak < 1.5 * max(sizes), (peak, max(sizes), sum(sizes))
    assert peak < 0.5 * sum(sizes)


def test_a_param_computed_from_several_tensors_is_refused():
    from flaxheads.backbones.base import Backbone, BackboneError

    class Fused(Backbone):
        model_types = ("fused",)

        @classmethod
        def params_from_state(cls, config, state):
            return {"qkv": {"kernel": np.concatenate([state["q.weight"], state["k.weight"]], axis=0).T}}

    with pytest.raises(BackboneError, match="computed from several tensors"):
        param_sources(Fused, HFConfig({"model_type": "fused"}), {"q.weight": (4, 4), "k.weight": (4, 4)})


def test_from_pretrained_onto_a_mesh_reads_slices_not_the_model(tmp_path):
    path, _ = save_tiny(tmp_path / "llama", "llama", seed=2, vocab_size=2048, hidden_size=128, intermediate_size=512,
                        head_dim=32)
    eager = fh.from_pretrained(path, num_labels=3, ignore_mismatched_sizes=True)
    size = sum(x.nbytes for x in jax.tree.leaves(eager.params["backbone"]))
    tracemalloc.start()
    try:
        lazy = fh.from_pretrained(path, num_labels=3, ignore_mismatched_sizes=True, mesh="fsdp=4",
                                  base_dtype=jnp.bfloat16)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 0.5 * size, (peak, size)
    split = 0
    for a, b in zip(jax.tree.leaves(lazy.params), jax.tree.leaves(eager.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(a.dtype)))
        split += len(a.sharding.device_set) == 4 and any(s is not None for s in a.sharding.spec)
    assert split > 4 and lazy.params["backbone"]["norm"]["scale"].dtype == jnp.bfloat16
