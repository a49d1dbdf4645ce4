"""Orbax checkpoints: heads saved apart from backbones, with the meta that checks compatibility."""
from .core import *  # noqa: F401,F403
from .core import (CheckpointError, CorruptCheckpointError, FitCheckpointing, HeadCheckpoint, HeadMismatchError,
                   IncompatibleCheckpointError, RunCheckpointer, attach_head, changed_settings, format_listing,
                   format_meta, list_checkpoints, load_backbone_params, load_head, make_meta, read_meta, save_head,
                   verify_checkpoint)
