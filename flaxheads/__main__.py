"""``python -m flaxheads ...``: the same as the ``flaxheads`` command."""
import sys

from .cli.main import main

sys.exit(main())
