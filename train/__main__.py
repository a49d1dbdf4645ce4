"""``python -m train``: the flaxheads training program (see ``train/cli.py``)."""
import sys

from train.cli import main

sys.exit(main())
