"""The boot record (shardq/shard/boot_fence.py): when a placed queue's lease may leave before
its fsync, and when the next start must fence placed queues because a power cut may have
taken such leases from the log. The rule is pure (:func:`decide`); the file is written
whole and read back, and a damaged one is named and taken for the worst."""
from __future__ import annotations

import json
import logging
import os

import pytest

from shardq.config import parse
from shardq.shard import boot_fence
from shardq.shard.boot_fence import BootRecord, decide

NOW = 1_000_000.0
A, B = "boot-a", "boot-b"


@pytest.mark.parametrize("prev, boot, fence, why", [
    (None, A, 0.0, False),                                     # new shard, or an older version's
    (BootRecord(A, False, 30.0, 0.0), A, 0.0, False),          # SIGKILL: the kernel kept every write
    (BootRecord(A, True, 30.0, 0.0), B, 0.0, False),           # a clean stop, then a reboot
    (BootRecord(A, False, 30.0, 0.0), B, NOW + 30, True),      # a power cut under early leases
    (BootRecord(A, False, 0.0, 0.0), B, 0.0, False),           # that run gave none early
    (BootRecord(None, False, 0.0, 0.0), None, 0.0, False),     # no boot id: every placed lease waited
    (BootRecord(A, False, 30.0, NOW + 50), A, NOW + 50, False),  # a fence in force is carried
    (BootRecord(A, True, 30.0, NOW + 50), B, NOW + 50, False),   # also by a clean stop
    (BootRecord(A, False, 30.0, NOW + 10), B, NOW + 30, True),   # a longer one replaces it
    (BootRecord(A, False, 30.0, NOW - 1), A, 0.0, False),      # one that has passed is dropped
])
def test_the_rule(prev, boot, fence, why):
    rec, reason = decide(prev, False, boot, NOW, 20.0)
    assert rec == BootRecord(boot, False, 20.0, fence)
    assert (reason is not None) == why


def test_an_unreadable_record_is_taken_for_a_power_cut_under_this_configuration():
    rec, why = decide(None, True, A, NOW, 20.0)
    assert rec.fence_until == NOW + 20.0 and "could not be read" in why


def test_the_early_visibility_is_the_longest_of_the_placed_queues_and_none_without_a_boot_id():
    cfg = parse({"queue_defaults": {"visibility_timeout": 99},
                 "queues": {"a": {"concurrency": 2, "visibility_timeout": 40},
                            "b": {"rate": "5/s", "visibility_timeout": 70}, "c": {"visibility_timeout": 500}}})
    assert boot_fence.early_visibility_s(cfg, A) == 70.0        # c and the defaults are not placed
    assert boot_fence.early_visibility_s(cfg, None) == 0.0
    placed_defaults = parse({"queue_defaults": {"concurrency": 1, "visibility_timeout": 600}})
    assert boot_fence.early_visibility_s(placed_defaults, A) == 600.0   # every queue is placed
    assert boot_fence.early_visibility_s(parse({}), A) == 0.0


def test_start_writes_the_record_and_a_clean_stop_says_so(tmp_path, caplog):
    boot = tmp_path / "boot_id"
    boot.write_text(A + "\n")
    cfg = parse({"queues": {"a": {"concurrency": 2, "visibility_timeout": 5}}})
    rec = boot_fence.start(str(tmp_path), 0, cfg, NOW, str(boot))
    assert rec == BootRecord(A, False, 5.0, 0.0)
    assert boot_fence.read(str(tmp_path)) == (rec, None)
    boot.write_text(B + "\n")                                   # the machine went down meanwhile
    with caplog.at_level(logging.WARNING, "shardq.shard"):
        again = boot_fence.start(str(tmp_path), 0, cfg, NOW + 100, str(boot))
    assert again.fence_until == NOW + 105 and "machine restarted" in caplog.text
    boot_fence.stopped_cleanly(str(tmp_path), again)
    assert boot_fence.read(str(tmp_path))[0] == BootRecord(B, True, 5.0, NOW + 105)
    assert not os.path.exists(tmp_path / (boot_fence.BOOT_RECORD + ".tmp"))


@pytest.mark.parametrize("content", [b"", b"{", b'{"boot_id": 7, "clean": false, "early_visibility_s": 1, '
                                     b'"fence_until": 0}', b'{"clean": true}', b"\xff\xfe"])
def test_a_damaged_record_is_named_and_taken_for_the_worst(tmp_path, caplog, content):
    (tmp_path / boot_fence.BOOT_RECORD).write_bytes(content)
    rec, problem = boot_fence.read(str(tmp_path))
    assert rec is None and str(tmp_path / boot_fence.BOOT_RECORD) in problem
    boot = tmp_path / "boot_id"
    boot.write_text(A)
    cfg = parse({"queues": {"a": {"concurrency": 2, "visibility_timeout": 5}}})
    with caplog.at_level(logging.WARNING, "shardq.shard"):
        got = boot_fence.start(str(tmp_path), 3, cfg, NOW, str(boot))
    assert got.fence_until == NOW + 5 and boot_fence.BOOT_RECORD in caplog.text
    assert json.loads((tmp_path / boot_fence.BOOT_RECORD).read_text())["boot_id"] == A   # rewritten whole


def test_the_boot_id_is_the_kernels_and_none_where_there_is_none(tmp_path):
    if os.path.exists(boot_fence.BOOT_ID_PATH):
        assert boot_fence.current_boot_id() == open(boot_fence.BOOT_ID_PATH).read().strip()
    assert boot_fence.current_boot_id(str(tmp_path / "missing")) is None


def test_a_record_that_cannot_be_written_starts_the_run_without_early_placed_leases(tmp_path, monkeypatch, caplog):
    """A full disk must not keep the shard down: the run starts, its placed leases wait for
    their fsync, and the fence decided from the old record (kept) holds."""
    boot = tmp_path / "boot_id"
    boot.write_text(B)
    boot_fence.write(str(tmp_path), BootRecord(A, False, 30.0, 0.0))     # a power cut under early leases

    def full(*_a, **_k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(boot_fence, "write", full)
    cfg = parse({"queues": {"a": {"concurrency": 2, "visibility_timeout": 5}}})
    with caplog.at_level(logging.ERROR, "shardq.shard"):
        rec = boot_fence.start(str(tmp_path), 0, cfg, NOW, str(boot))
    assert rec == BootRecord(B, False, 0.0, NOW + 30) and "No space left" in caplog.text
    monkeypatch.undo()
    assert boot_fence.read(str(tmp_path))[0] == BootRecord(A, False, 30.0, 0.0)   # the old one, kept
