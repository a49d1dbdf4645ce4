"""The ``flaxheads`` command line: ``flaxheads train | export | checkpoints``."""
