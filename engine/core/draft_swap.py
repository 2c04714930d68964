"""Replacing a pool's draft while it serves: a new draft is loaded off the engine thread and
installed between two steps, so no step ever sees half of one draft and half of another.

Exactness does not depend on the draft (verification accepts only what the target would
emit), so a swap changes no stream's text; a draft head simply has no states for running
sequences yet and starts drafting for them from the next step's states on.

`DraftFileWatcher` is how a pool learns of a new draft: `splitserve draft gate` replaces the
served file atomically (write, then rename) once a candidate passed, and the watcher sees the
file change (size or mtime), loads it, and offers it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.speculative.proposer import DraftProposer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftOffer:
    draft: DraftProposer
    version: str


class DraftSwap:
    """Offers from any thread; the engine thread takes the latest one before a step."""

    def __init__(self) -> None:
        self._offers: queue.SimpleQueue[DraftOffer] = queue.SimpleQueue()

    def offer(self, draft: DraftProposer, version: str) -> None:
        self._offers.put(DraftOffer(draft, version))

    def take(self) -> DraftOffer | None:
        latest = None
        while True:
            try:
                latest = self._offers.get_nowait()
            except queue.Empty:
                return latest


Loader = Callable[[Path], tuple[DraftProposer | None, str | None]]


class DraftFileWatcher:
    """Polls `path` every `interval_s`; a changed file is loaded with `load` (draft, or None
    and why) and offered to `swap`. A file that fails to load is logged and skipped: the pool
    keeps serving the draft it has."""

    def __init__(self, path: str | Path, load: Loader, swap: DraftSwap, interval_s: float = 2.0):
        self.path = Path(path).expanduser()
        self.load = load
        self.swap = swap
        self.interval_s = interval_s
        self._seen = self._signature()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="draft-watcher", daemon=True)

    def start(self) -> DraftFileWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _signature(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def poll(self) -> bool:
        """One check; True when a new draft was offered."""
        signature = self._signature()
        if signature is None or signature == self._seen:
            return False
        self._seen = signature
        draft, reason = self.load(self.path)
        if draft is None:
            log.warning("draft file %s changed but was not installed: %s", self.path, reason)
            return False
        version = getattr(draft, "version", None) or f"{signature[0]}-{signature[1]}"
        self.swap.offer(draft, version)
        log.info("draft %s version %s loaded; installed before the next step", self.path, version)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # a watcher that dies silently would freeze the draft forever
                log.exception("draft watcher for %s failed one poll", self.path)
