"""Suite-wide set-up: Ctrl-C is deliverable in every test process, however the suite was started."""

import signal


def pytest_configure(config):
    """A shell without job control starts background jobs (``make test &``) with SIGINT ignored.

    Python then keeps it ignored and so would every ``poet`` child, and the tests of Ctrl-C (in this
    process and in children) would wait for a signal that never lands. Restore Python's own handler here,
    in every test worker: children start with the default disposition and install theirs.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
