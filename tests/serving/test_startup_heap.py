"""freeze_startup_heap (serving/server.py): what a server process holds once ready is out of the collector's walks,
so a full collection while streams run does not walk torch and the model (0.3 s of an API server's CPU at 256
streams); the start-up's garbage is collected first, not kept for good, and what comes later is collected as before."""

from __future__ import annotations

import gc
import weakref

from gpuformers.serving.server import freeze_startup_heap


class _Node:
    def __init__(self):
        self.other = self  # a reference cycle: only the collector frees it


def test_the_startup_heap_is_frozen_after_its_garbage_is_collected():
    kept = _Node()  # alive at start-up: frozen
    garbage = _Node()
    dead = weakref.ref(garbage)
    del garbage  # start-up garbage: must not be frozen with the rest
    gc.disable()  # no automatic collection between here and the call (the test's point is the call's own)
    try:
        frozen_before = gc.get_freeze_count()
        freeze_startup_heap()
        assert dead() is None, "garbage made before the freeze was kept for good"
        assert gc.get_freeze_count() > frozen_before
        assert not any(obj is kept for obj in gc.get_objects()), "an object of the start-up is still walked"
        later = _Node()  # made after it: walked and collected as usual
        after = weakref.ref(later)
        assert any(obj is later for obj in gc.get_objects())
        del later
        gc.collect()
        assert after() is None
    finally:
        gc.unfreeze()  # this test process's objects back in the generations (others' tests expect that)
        gc.enable()
