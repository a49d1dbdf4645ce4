"""Params read tensor by tensor onto a mesh of 4 CPU devices (tests/conftest.py makes them): equal to
the eager loader's, on the layout's shardings (really split), in the asked dtype, and the host
holds about one tensor at a time, not the model (tracemalloc, which numpy reports to); the same
through ``from_pretrained(mesh=...)``, head included, and quantised while reading. The reader: the
stored bytes of every dtype, boxes read in the fewest runs, each process's box, damaged files."""

import json
import os
import struct
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hf_tiny import save_tiny  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import flaxheads as fh  # noqa: E402
from flaxheads.backbones.base import BackboneError, HFConfig  # noqa: E402
from flaxheads.backbones.lazy import _box, param_shapes, param_sources, read_params_sharded  # noqa: E402
from flaxheads.backbones.registry import family_for  # noqa: E402
from flaxheads.backbones.safetensors_file import SafetensorsFile, bytes_read  # noqa: E402
from flaxheads.backbones.weights import WeightsError, read_state_dict  # noqa: E402
from flaxheads.layers.quantized import is_quantized  # noqa: E402
from flaxheads.model.abstract import abstract_model  # noqa: E402
from flaxheads.runtime.sharding import Layout, make_mesh  # noqa: E402

pytestmark = [pytest.mark.full, pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake CPU) devices")]


def _load(path, dtype=jnp.float32):
    """Eager model, lazily read backbone params on an fsdp=4 mesh, and the peak traced host bytes."""
    model = fh.from_pretrained(path)
    mesh = make_mesh("fsdp=4")
    layout = Layout.for_model(mesh, model)
    fam = family_for(model.model_type)
    cfg = fam.complete_config(HFConfig.from_folder(path))
    tracemalloc.start()
    try:
        lazy = read_params_sharded(
            path,
            fam,
            cfg,
            dtype=dtype,
            shardings=lambda p, s: NamedSharding(mesh, layout.spec_of(("backbone",) + p, s)),
        )
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
    bf16 = read_params_sharded(
        path,
        family_for(arch),
        HFConfig.from_folder(path),
        lambda p, s: NamedSharding(layout.mesh, layout.spec_of(("backbone",) + p, s)),
        dtype=jnp.bfloat16,
    )
    for a, b in zip(jax.tree.leaves(bf16), jax.tree.leaves(eager), strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)))
    # the same tree from the headers alone: shapes as loaded, dtypes as stored
    shapes = param_shapes(path, family_for(arch), HFConfig.from_folder(path))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == jax.tree.map(lambda x: (x.shape, x.dtype), eager)


def test_host_memory_is_one_tensor_not_the_model(tmp_path):
    path, _ = save_tiny(
        tmp_path / "bert", "bert", seed=0, layers=2, vocab_size=4096, hidden_size=256, intermediate_size=1024
    )
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


def test_from_pretrained_onto_a_mesh_reads_tensors_not_the_model(tmp_path):
    path, _ = save_tiny(
        tmp_path / "llama",
        "llama",
        seed=2,
        vocab_size=512,
        hidden_size=128,
        intermediate_size=512,
        head_dim=32,
        num_hidden_layers=4,
    )
    eager = fh.from_pretrained(path, num_labels=3, ignore_mismatched_sizes=True)
    sizes = [x.nbytes for x in jax.tree.leaves(eager.params["backbone"])]
    before = bytes_read()
    tracemalloc.start()
    try:
        lazy = fh.from_pretrained(
            path, num_labels=3, ignore_mismatched_sizes=True, mesh="fsdp=4", base_dtype=jnp.bfloat16
        )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # one float32 tensor and its bfloat16 copy at a time, beside the load's own Python objects (~0.5 MB on a
    # first load: layout, traced shapes); the model is 16 such tensors
    assert peak < 1.5 * max(sizes) + (512 << 10) and peak < 0.25 * sum(sizes), (peak, max(sizes), sum(sizes))
    # every backbone tensor read once, and of the other tensors the one the head looks up (score.weight)
    assert bytes_read() - before == sum(sizes) + 3 * 128 * 4
    split = 0
    for a, b in zip(jax.tree.leaves(lazy.params), jax.tree.leaves(eager.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(a.dtype)))
        split += len(a.sharding.device_set) == 4 and any(s is not None for s in a.sharding.spec)
    assert split > 4 and lazy.params["backbone"]["norm"]["scale"].dtype == jnp.bfloat16


# ---- the reader ------------------------------------------------------------------------------------
DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A file with a 3-D tensor of every dtype (and a scalar, an empty one), and safetensors' own reading."""
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(0)
    tensors = {
        name: (rng.standard_normal((5, 6, 7)) if name[0] == "F" else rng.integers(0, 100, (5, 6, 7))).astype(dt)
        for name, dt in DTYPES.items()
    }
    tensors.update(scalar=np.array(2.5, np.float32), empty=np.zeros((0, 3), np.int32))
    path = str(tmp_path_factory.mktemp("stored") / "t.safetensors")
    save_file(tensors, path, metadata={"format": "np"})
    return path, load_file(path)


def test_the_reader_returns_the_stored_bytes_of_every_dtype(stored):
    path, ref = stored
    with SafetensorsFile(path) as f:
        assert set(f.keys()) == set(ref) and f.metadata == {"format": "np"}
        for name, want in ref.items():
            got = f.read(name)
            assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes(), name


@pytest.mark.parametrize(
    "box, reads",
    [
        ((slice(1, 4),), 1),  # rows: the leading axis cut, one contiguous read
        ((slice(None), slice(2, 5)), 5),  # columns: a read per row
        ((slice(1, 3), slice(0, 6), slice(4, 7)), 2 * 6),  # 3-D: a read per row segment
        ((slice(2, 3), slice(1, 2)), 1),  # one row of one plane: contiguous again
    ],
)
def test_a_box_is_read_in_its_contiguous_runs(stored, monkeypatch, box, reads):
    path, ref = stored
    calls = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset: calls.append(offset) or real(fd, bufs, offset))
    with SafetensorsFile(path) as f:
        for name in ("BF16", "F64", "BOOL"):
            calls.clear()
            before = bytes_read()
            got = f.read(name, box)
            assert got.tobytes() == ref[name][box].tobytes(), name
            assert len(calls) == reads and bytes_read() - before == got.nbytes


class _Held:
    """A stand-in sharding: the index boxes of the devices one process holds."""

    def __init__(self, *boxes):
        self.boxes = boxes

    def addressable_devices_indices_map(self, shape):
        return dict(enumerate(self.boxes))


def test_a_process_reads_the_box_around_its_devices_shards():
    # the second of two processes on fsdp=4: devices 2 and 3 hold columns 8..16 of a [6, 16] kernel
    assert _box(_Held((slice(None), slice(8, 12)), (slice(None), slice(12, 16))), (6, 16)) == ((0, 6), (8, 16))
    assert _box(_Held((slice(0, 2),), (slice(4, 6),)), (6, 16)) == ((0, 6), (0, 16))  # a box, not the union
    assert _box(_Held((), ()), (6, 16)) == ((0, 6), (0, 16))  # replicated
    assert _box(_Held(), (6, 16)) is None  # nothing here: nothing read


def _damage(path, how):
    raw = bytearray(open(path, "rb").read())
    (n,) = struct.unpack("<Q", raw[:8])
    if how == "header past the end":
        raw[:8] = struct.pack("<Q", len(raw))
    elif how == "offsets out of bounds":
        header = json.loads(raw[8 : 8 + n])
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"][1] += 1 << 20
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (n - len(text))
        assert len(text) == n
        raw[8 : 8 + n] = text
    else:  # the data cut: the offsets lie past the end of what is left
        del raw[len(raw) - 100 :]
    open(path, "wb").write(bytes(raw))


@pytest.mark.parametrize("how", ["header past the end", "offsets out of bounds", "truncated data"])
def test_a_damaged_file_is_one_error_naming_it(tmp_path, how):
    path, _ = save_tiny(tmp_path / "llama", "llama", seed=0)
    file = os.path.join(path, "model.safetensors")
    _damage(file, how)
    with pytest.raises(WeightsError, match="truncated or corrupt") as err:
        fh.from_pretrained(path, mesh="fsdp=4")
    assert str(err.value).startswith(file) and "\n" not in str(err.value)


def test_a_damaged_file_closes_its_descriptor_once(stored, tmp_path):
    """The refused file's half-made reader, collected later, must not close a descriptor number that
    another file has taken since (a later read would fail with EBADF)."""
    import gc

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 16)
    with pytest.raises(WeightsError) as err:  # keeps the half-made reader alive until the other opens
        SafetensorsFile(bad)
    with SafetensorsFile(stored[0]) as good:
        del err
        gc.collect()
        assert good.read("F32").tobytes() == stored[1]["F32"].tobytes()


# ---- quantised while reading -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    # hidden 128: the 4-bit schemes' blocks of 64 inputs are used, not one block per channel. On fsdp=4
    # o_proj and down_proj (split by outputs) are quantised shard by shard, the others (inputs split
    # in 32s, less than a block) as one program: both ways are compared with the eager model
    path, _ = save_tiny(
        tmp_path_factory.mktemp("q") / "llama",
        "llama",
        seed=3,
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        head_dim=32,
        num_hidden_layers=1,
        num_key_value_heads=4,
    )
    return path


@pytest.mark.parametrize("qtype, base_dtype", [("int8", None), ("nf4", jnp.bfloat16)])
def test_quantised_while_reading_is_the_eager_quantised_model(llama_folder, qtype, base_dtype):
    eager = fh.from_pretrained(llama_folder, quantize=qtype, base_dtype=base_dtype)
    lazy = fh.from_pretrained(llama_folder, quantize=qtype, base_dtype=base_dtype, mesh="fsdp=4")
    want = jax.tree_util.tree_leaves_with_path(eager.params)
    got = jax.tree_util.tree_leaves_with_path(lazy.params)
    assert [p for p, _ in got] == [p for p, _ in want]
    for (p, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype, p
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(p))
    layout = Layout.for_model(make_mesh("fsdp=4"), abstract_model(llama_folder, base_dtype=base_dtype, quantize=qtype))
    kernels = [
        (p, k)
        for p, k in jax.tree_util.tree_leaves_with_path(lazy.params["backbone"], is_leaf=is_quantized)
        if is_quantized(k)
    ]
    assert len(kernels) == 7  # q, k, v, o, gate, up, down of the one layer
    split = 0
    for p, k in kernels:
        names = ("backbone",) + tuple(str(x.key) for x in p)
        for part in ("qvalue", "scale"):
            x = getattr(k, part)
            assert x.sharding.spec == layout.spec_of(names + (part,), x.shape), (names, part)
        split += "fsdp" in str(k.qvalue.sharding.spec)
    assert split == 7


def test_a_folder_unlike_its_config_is_refused_before_any_tensor_is_read(tmp_path):
    import json

    path, _ = save_tiny(tmp_path / "llama", "llama", seed=0)
    cfg = json.loads(open(os.path.join(path, "config.json")).read())
    cfg["intermediate_size"] += 8  # the stored MLP kernels no longer have the config's shapes
    open(os.path.join(path, "config.json"), "w").write(json.dumps(cfg))
    before = bytes_read()
    with pytest.raises(BackboneError, match="mismatched shapes: .*mlp.* config.json") as err:
        fh.from_pretrained(path, mesh="fsdp=4")
    assert bytes_read() == before and str(err.value).startswith(path)
