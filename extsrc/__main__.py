"""``python -m extsrc <command>``: see :mod:`extsrc.cli`."""

import io
import os
import select
import signal
import sys

from extsrc.cli import main


def _stdout_gone() -> bool:
    """Whether standard output is a pipe or socket whose reader went away."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)  # POLLERR comes whatever is asked
    return any(events & select.POLLERR for _, events in poller.poll(0))


if __name__ == "__main__":
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_gone():
            raise  # another pipe broke: that is an error of the command
        # The output's reader went away (`python -m extsrc doctor | head`): stop quietly, as
        # Unix tools do; stdout goes to /dev/null so that the flush at exit raises nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 128 + signal.SIGPIPE
    sys.exit(code)
