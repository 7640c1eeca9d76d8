"""The shard process's cyclic GC (process.py ``tune_gc``): after every collection its
survivors leave the collector's view, so no collection scans the live state, and each
scans at most about ``GC_YOUNG_MAX`` young objects (docs/performance.md, "The shard's
collections"). In this process, undone after each test."""
from __future__ import annotations

import gc

import pytest

from shardq.shard.process import GC_YOUNG_MAX, tune_gc, untune_gc


@pytest.fixture
def tuned():
    tune_gc()
    yield
    untune_gc()


def test_what_survives_a_collection_is_frozen_and_the_older_generations_stay_empty(tuned):
    frozen = gc.get_freeze_count()
    kept = [[i] for i in range(4 * GC_YOUNG_MAX)]  # long-lived containers, as jobs are
    assert gc.get_freeze_count() >= frozen + 3 * GC_YOUNG_MAX  # young collections froze them
    assert len(gc.get_objects(generation=1)) + len(gc.get_objects(generation=2)) < GC_YOUNG_MAX // 10
    assert len(gc.get_objects(generation=0)) <= GC_YOUNG_MAX + 100
    assert len(kept) == 4 * GC_YOUNG_MAX


def test_untune_gives_the_defaults_back(tuned):
    untune_gc()
    assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0
    kept = [[i] for i in range(2 * GC_YOUNG_MAX)]
    assert gc.get_freeze_count() == 0 and len(kept) == 2 * GC_YOUNG_MAX
