"""`no_sync()` for the data-parallel wrappers (DataParallel, ZeRO): one definition."""

from __future__ import annotations

import contextlib


class LocalAccumulation:
    """Mixin: while `no_sync()` is active, `self._sync` is False and the wrapper keeps
    gradients local; the next backward outside it reduces the accumulated sum."""

    _sync = True

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the next backward outside reduces the accumulated sum."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True
