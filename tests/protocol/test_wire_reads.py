"""wire.read_frames and split_frames: what one read of a socket takes, and how frames
larger than a read are put back together (the shard reads 1 MiB at a time, a router
256 KiB)."""
from __future__ import annotations

import os
import socket
import threading

import pytest

from shardq import limits
from shardq.errors import ProtocolError
from shardq.protocol.wire import READ_BYTES, read_frames, split_frames


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big", signed=True) + payload


def test_frames_larger_than_the_scratch_buffer_come_back_whole_and_in_order():
    a, b = socket.socketpair()
    frames = [os.urandom(600 * 1024), b"small", os.urandom(3 * READ_BYTES + 17)]
    data = b"".join(_frame(f) for f in frames)
    writer = threading.Thread(target=lambda: (a.sendall(data), a.close()))
    writer.start()
    scratch = bytearray(256 * 1024)
    buf = bytearray()
    got, reads = [], 0
    try:
        while True:
            try:
                taken = read_frames(b.fileno(), buf, scratch)
            except EOFError:
                break
            reads += 1
            got += [bytes(f) for f in taken]  # a frame may be a view of scratch: copied now
    finally:
        writer.join()
        b.close()
    assert got == frames and not buf
    assert reads >= len(data) // len(scratch)


def test_a_read_appends_to_a_partial_frame_already_buffered():
    a, b = socket.socketpair()
    try:
        whole = _frame(b"hello world")
        buf = bytearray(whole[:6])
        a.sendall(whole[6:10])
        assert read_frames(b.fileno(), buf, bytearray(4)) == [] and buf == whole[:10]
        a.sendall(whole[10:])
        assert [bytes(f) for f in read_frames(b.fileno(), buf, bytearray(64))] == [b"hello world"]
        assert not buf
    finally:
        a.close()
        b.close()


def test_a_non_blocking_read_with_nothing_there_raises_like_os_read():
    a, b = socket.socketpair()
    try:
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            read_frames(b.fileno(), bytearray(), bytearray(16))
    finally:
        a.close()
        b.close()


def test_a_frame_announced_over_the_limit_is_refused_before_its_bytes_arrive():
    buf = bytearray((limits.FRAME_BYTES_MAX + 1).to_bytes(4, "big", signed=True) + b"x")
    with pytest.raises(ProtocolError):
        split_frames(buf)


def test_read_frames_gives_a_lone_whole_frame_without_buffering_it():
    a, b = socket.socketpair()
    try:
        scratch, buf = bytearray(64), bytearray()
        a.sendall(_frame(b"one"))
        frames = read_frames(b.fileno(), buf, scratch)
        assert [bytes(f) for f in frames] == [b"one"] and not buf
    finally:
        a.close()
        b.close()


def test_read_frames_buffers_a_partial_frame_and_splits_several():
    a, b = socket.socketpair()
    try:
        scratch, buf = bytearray(64), bytearray()
        whole = _frame(b"first") + _frame(b"second")
        a.sendall(whole[:7])
        assert read_frames(b.fileno(), buf, scratch) == [] and buf == whole[:7]
        a.sendall(whole[7:] + _frame(b"third")[:2])
        assert [bytes(f) for f in read_frames(b.fileno(), buf, scratch)] == [b"first", b"second"]
        assert buf == _frame(b"third")[:2]  # a frame's start stays buffered, not taken as a view
        a.sendall(_frame(b"third")[2:])
        assert [bytes(f) for f in read_frames(b.fileno(), buf, scratch)] == [b"third"] and not buf
        a.close()
        with pytest.raises(EOFError):
            read_frames(b.fileno(), buf, scratch)
    finally:
        b.close()


def test_read_frames_refuses_a_lone_frame_over_the_limit():
    a, b = socket.socketpair()
    try:
        a.sendall((limits.FRAME_BYTES_MAX + 1).to_bytes(4, "big", signed=True) + b"x")
        with pytest.raises(ProtocolError):
            read_frames(b.fileno(), bytearray(), bytearray(64))
    finally:
        a.close()
        b.close()
