"""`python -m engine.run --decoder lookahead --prompt "..."`: the command line, whose code is
engine/doors/cli.py (`--help` says everything it does)."""
import os
import signal
import sys

if __name__ == "__main__":
    # subtle: Ctrl-C while torch imports (seconds) would print a traceback from the import
    # machinery; until main() takes over, it ends the process quietly with 130
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))

from engine.doors.cli import main  # noqa: E402

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)   # KeyboardInterrupt from here on
    sys.exit(main())
