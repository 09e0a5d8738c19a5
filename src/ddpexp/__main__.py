"""`python -m ddpexp` and the `ddpexp` command: ddpexp.cli.main, in a process of its own that ends as soon as the
command is done (ddpexp.job.end_process)."""

import sys

from ddpexp.cli.main import main as _command
from ddpexp.job import end_process


def main() -> None:
    try:
        _command()
    except SystemExit as e:  # sys.exit(code or message), as Python's own exit reports it
        if e.code is None or isinstance(e.code, int):
            end_process(e.code or 0)
        print(e.code, file=sys.stderr)
        end_process(1)
    end_process(0)


if __name__ == "__main__":
    main()
