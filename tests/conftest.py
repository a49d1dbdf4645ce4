import os

# Before jax is imported anywhere: 4 fake CPU devices for the data-parallel tests
# (8 on 2 cores can time out in XLA's collectives under load), and fail fast on a hang.
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=4 --xla_cpu_collective_call_terminate_timeout_seconds=6",
)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# programs run by tests compile afresh unless a test gives them a cache folder of its own
os.environ.setdefault("FLAXHEADS_COMPILE_CACHE", "0")
# programs compare against float32 references on every CPU kind (auto would pick bfloat16 on AMX hosts)
os.environ.setdefault("FLAXHEADS_PRECISION", "float32")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import warnings  # noqa: E402

import pytest  # noqa: E402

warnings.filterwarnings("ignore", message=".*TensorFlow and JAX classes are deprecated.*")

#: Per-test limits (pytest-timeout): a hang fails its test, not the run. Slow tests load real
#: models or start processes; on a busy 2-core machine they need minutes.
SLOW_TIMEOUT_S = 1800
#: What the legacy stack (`make test-legacy`: Python 3.11, jax 0.10, transformers 4.57) runs, the
#: things only it can show: import / export parity against transformers 4.57 and sentence-transformers
#: 5.x (tests/interop/), loading what older flaxheads wrote, fused attention on jax 0.10's API, and
#: of every backbone family the tests against HF's Flax models (transformers < 5 only) and the
#: forward parity against 4.57's PyTorch classes (``LEGACY_BACKBONE_TESTS``: names containing one
#: of these). Gradients, dropout, bf16, remat and export round trips of the same code are the
#: newest stack's tests.
LEGACY = ("tests/interop/", "tests/checkpoint/test_pre_layout", "tests/backbones/test_layers_fused.py")
LEGACY_BACKBONE_TESTS = ("hf_flax", "hidden_states", "logits_match", "forward_match")
#: Tests that run alone (``make test`` runs them after the parallel pass): several processes in
#: collectives whose rendezvous would time out on a loaded machine, kills timed against a save, and
#: a measurement of the process's page faults.
SERIAL = ("tests/cli/test_cli_multihost.py", "tests/cli/test_cli_streaming.py::test_two_processes", "tests/cli/test_cli_mesh.py",
          "tests/test_resume.py", "tests/test_faults.py",
          "tests/training/test_parallel.py::test_multi_host", "tests/training/test_sharding.py::test_meshes",
          "tests/training/test_sharding.py::test_restore_onto", "tests/training/test_sharding.py::test_fsdp8",
          "tests/checkpoint/test_checkpoint.py::test_killed", "tests/test_host.py::test_malloc_settings_stop")

#: The inner loop (``make test-fast``) leaves these to ``make test``: end to end through the command
#: line, subprocesses, whole training runs and checkpoints, and of each backbone family everything but
#: its forward parity (``LEGACY_BACKBONE_TESTS``): gradients, dropout, bf16, remat, export round trips.
FULL = ("tests/cli/", "tests/run/", "tests/backbones/test_onednn_gradients.py", "tests/test_pooled_token.py",
        "tests/training/test_train_steps.py", "tests/training/test_packing.py", "tests/checkpoint/test_checkpoint.py",
        "tests/training/test_features.py", "tests/training/test_sweep.py", "tests/test_resume.py", "tests/test_faults.py", "tests/test_readme.py",
        "tests/backbones/test_broken_folders.py",
        "tests/training/test_loop.py", "tests/training/test_multitask.py", "tests/predict/test_predict.py",
        "tests/test_bbc_ranking.py", "tests/ranking/test_ranking_train.py",
        "tests/test_base_dtype.py", "tests/test_remat.py", "tests/test_lazy_load.py")


def _needs_hf_flax(item) -> bool:
    """Skipped without HF's Flax models (transformers < 5): only the legacy stack runs it."""
    return any("transformers < 5" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config, items):
    root = str(config.rootpath) + os.sep
    for item in items:
        rel = str(item.path).replace(root, "").replace(os.sep, "/")
        node = rel + "::" + item.name
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
        if rel.startswith(LEGACY) or _needs_hf_flax(item) or (rel.startswith("tests/backbones/")
                                                              and any(n in item.name for n in LEGACY_BACKBONE_TESTS)):
            item.add_marker(pytest.mark.legacy)
        if node.startswith(SERIAL):
            item.add_marker(pytest.mark.serial)
        if rel.startswith(FULL) or (rel.startswith("tests/backbones/test_backbone_")
                                    and not any(n in item.name for n in LEGACY_BACKBONE_TESTS)):
            item.add_marker(pytest.mark.full)
