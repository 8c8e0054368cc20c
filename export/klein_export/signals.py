"""The signals that stop a command: Ctrl-C (SIGINT), `kill` (SIGTERM) and the terminal closing
(SIGHUP). SIGTERM and SIGHUP are raised as Ctrl-C is, a KeyboardInterrupt (`Stopped`) in the main
thread, so that each removes the output in progress (atomic.atomic_directory) and ends an export's
worker process (convert._export_isolated)."""

import contextlib
import signal
import threading

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
RAISED = STOP_SIGNALS[1:]  # SIGINT is Python's own KeyboardInterrupt


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived (`signum`)."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum, _frame):
    for other in RAISED:  # a second signal does not cut the clean-up short
        signal.signal(other, signal.SIG_IGN)
    raise Stopped(signum)


@contextlib.contextmanager
def _handling(signums, handler):
    """`handler` for `signums` in the block (in the main thread; elsewhere Python cannot change
    handlers), the previous ones restored after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, handler) for signum in signums}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def stops_raised():
    """SIGTERM and SIGHUP raise `Stopped` in the block."""
    return _handling(RAISED, _stop)


def stops_ignored():
    """Every stop signal ignored in the block: a process started in it keeps them ignored (through
    exec; Python then installs no SIGINT handler), and leaves them to its parent."""
    return _handling(STOP_SIGNALS, signal.SIG_IGN)
