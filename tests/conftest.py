import os

# Before jax is imported anywhere: 4 fake CPU devices for the data-parallel tests
# (8 on 2 cores can time out in XLA's collectives under load), and fail fast on a hang.
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=4 --xla_cpu_collective_call_terminate_timeout_seconds=6",
)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import warnings  # noqa: E402

warnings.filterwarnings("ignore", message=".*TensorFlow and JAX classes are deprecated.*")
