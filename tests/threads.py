"""Running a test's workers on threads of their own, all at once."""

import threading
from collections.abc import Callable, Iterable


def run_threads(fn: Callable, args: Iterable) -> list[str]:
    """fn(a) for each a of args, each on a thread of its own, started together and joined; the repr of every
    exception they raised (none: an empty list)."""
    errors: list[str] = []

    def run(a):
        try:
            fn(a)
        except Exception as e:  # noqa: BLE001 - returned to the test
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(a,)) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors
