"""``python -m flaxheads ...``: the same as the ``flaxheads`` command."""
import sys

try:
    from flaxheads.cli.main import main
except KeyboardInterrupt:  # Ctrl-C while the libraries load: nothing started, nothing to keep
    print("interrupted; nothing was being saved", file=sys.stderr, flush=True)
    sys.exit(130)

sys.exit(main())
