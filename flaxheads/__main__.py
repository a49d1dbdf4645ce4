"""``python -m flaxheads ...``: the same as the ``flaxheads`` command (:func:`flaxheads.cli.entry`)."""

import sys

from flaxheads.cli import entry

sys.exit(entry())
