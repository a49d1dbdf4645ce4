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
#: Folders and files whose tests also run on the legacy stack (`make test-legacy`): parity against
#: transformers 4.57, HF's Flax adapter, and loading what older flaxheads wrote.
LEGACY = ("tests/backbones/", "tests/interop/", "tests/checkpoint/test_pre_layout")


def pytest_collection_modifyitems(config, items):
    root = str(config.rootpath) + os.sep
    for item in items:
        rel = str(item.path).replace(root, "").replace(os.sep, "/")
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
        if rel.startswith(LEGACY):
            item.add_marker(pytest.mark.legacy)
