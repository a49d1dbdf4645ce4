"""The ``flaxheads`` command:
``flaxheads train | plan | export | checkpoints | predict | embed | evaluate | rank | serve``
(also ``python -m flaxheads``).

Each subcommand module has an ``add_<name>_command(subparsers)`` that registers its parser and
sets ``func`` (``func(args) -> exit code``); :data:`SUBCOMMANDS` lists them.

Output: what a command tells goes through the ``flaxheads`` logger (:mod:`flaxheads.runtime.logs`)
at INFO, so ``flaxheads train`` says as it goes what it does (the run folder, the plans, each
evaluation, the per-class tables, timings); ``-q`` / ``--quiet`` keeps warnings and errors only,
``-v`` / ``--verbose`` adds the DEBUG lines. A command's results (``predict``'s table, ``plan``'s
plan, ``export``'s folder) and the progress bar are not log lines.

Error policy: a user's mistake (a :class:`~flaxheads.errors.FlaxheadsError`, bad flags included)
prints exactly one line ``error: <message>`` to stderr and exits 2, with no traceback; any
other exception is a bug in flaxheads and keeps its traceback.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Sequence

from flaxheads.cli.checkpoints import add_checkpoints_command, add_report_command
from flaxheads.cli.export import add_export_command
from flaxheads.cli.flags import Parser, Program
from flaxheads.cli.plan import add_plan_command
from flaxheads.cli.predict import add_predict_commands
from flaxheads.cli.rank import add_rank_command
from flaxheads.cli.serve import add_serve_command
from flaxheads.cli.train import add_train_command
from flaxheads.disk import checksums
from flaxheads.errors import FlaxheadsError, WriteFailedError, one_line
from flaxheads.runtime.compile_cache import enable_compile_cache
from flaxheads.runtime.logs import quiet_background_saves, verbosity
from flaxheads.runtime.malloc import configure_malloc
from flaxheads.runtime.phases import watch_signals
from flaxheads.runtime.xla_flags import configure_xla
from flaxheads.training.preemption import Interrupted, exit_code

#: Errors only a write meets (a full or read-only disk, a quota or file size limit): one line, exit 1.
REFUSED_WRITES = (errno.ENOSPC, errno.EFBIG, errno.EROFS, errno.EDQUOT)

SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    add_train_command,
    add_export_command,
    add_checkpoints_command,
    add_predict_commands,
    add_rank_command,
    add_serve_command,
    add_report_command,
    add_plan_command,
)
#: What ``-q`` / ``-v`` make of the command's log (its default: INFO, the run told as it goes).
VERBOSITY_HELP = {
    "quiet": "tell nothing but warnings and errors (the log level WARNING)",
    "verbose": "also tell the debug lines: the memory plan on a CPU host, ... (the log level DEBUG; default: INFO)",
}
#: The subcommands that read model folders or checkpoints, and take ``--verify``.
READERS = ("train", "export", "checkpoints", "predict", "embed", "evaluate", "rank", "serve")


def build_parser() -> Parser:
    """The ``flaxheads`` parser with every subcommand."""
    parser = Parser(
        prog="flaxheads",
        description="flaxheads command-line tools: train heads on transformer "
        "encoders, predict and embed with them, export them, "
        "inspect checkpoints",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for add in SUBCOMMANDS:
        add(sub)
    for name in READERS:
        sub.choices[name].add_argument("--verify", action="store_true", help=checksums.VERIFY_HELP)
    for command in sub.choices.values():
        loud = command.add_mutually_exclusive_group()
        loud.add_argument("-q", "--quiet", action="store_true", help=VERBOSITY_HELP["quiet"])
        loud.add_argument("-v", "--verbose", action="store_true", help=VERBOSITY_HELP["verbose"])
    parser.set_defaults(verify=False, quiet=False, verbose=False)
    return parser


def log_level(args: argparse.Namespace) -> str:
    """The command's log level: ``-q`` WARNING, ``-v`` DEBUG, else INFO."""
    return "warning" if args.quiet else "debug" if args.verbose else "info"


def _prepare_process() -> None:
    """Process settings every subcommand wants, before JAX or transformers start."""
    # table files are read locally; model hub ids are fetched only by flaxheads.model.hub (HF_HUB_OFFLINE=1: cache only)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", message=".*TensorFlow and JAX classes are deprecated.*")
    quiet_background_saves()
    configure_malloc()  # before JAX starts its threads; reasons in flaxheads/runtime/malloc.py
    configure_xla()


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``flaxheads <subcommand> ...``; returns the exit code (2 for a user's mistake)."""
    started = time.perf_counter()
    if argv is None:  # the process's own command: a signal in any phase ends it in one line (phases.py)
        watch_signals()
    try:
        _prepare_process()
        args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
        # a second identical run loads its programs from the compile cache
        with checksums.full(args.verify), verbosity(log_level(args)):
            return int(args.func(args, Program(started, enable_compile_cache())) or 0)
    except WriteFailedError as e:
        print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
        if argv is None:  # the process's own command: Orbax's and tensorstore's writer threads of the failed
            sys.stdout.flush()  # save would print their own failures while Python shuts down; end here
            os._exit(e.exit_code)
        return e.exit_code
    except FlaxheadsError as e:  # a damaged file (checksum) is not the command's mistake: exit 1
        print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
        return getattr(e, "exit_code", 2)
    except OSError as e:
        if e.errno not in REFUSED_WRITES:
            raise
        # a log, table or plot the disk refused (checkpoints and exports report their own, with what is kept)
        print(
            f"error: could not write {e.filename or 'a file'}: {os.strerror(e.errno)}; free some space or fix the "
            "disk and rerun",
            file=sys.stderr,
            flush=True,
        )
        return 1
    except Interrupted as e:  # SIGTERM / SIGINT during training: the step reached is saved
        print(e.line(), file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C before or after training: nothing in flight to keep
        print("interrupted; nothing was being saved", file=sys.stderr, flush=True)
        return exit_code(signal.SIGINT)


if __name__ == "__main__":
    sys.exit(main())
