"""An idempotency store belongs to one shardq service: job ids start again in every new data
dir, so a store holding another service's marks is refused instead of skipping new jobs."""
import pytest

from support.fakes import FakeQueue
from shardq.clock import FakeClock
from shardq.datadir import DataDir
from shardq.errors import InvalidConfig
from shardq.consumer.idempotency import MemoryStore, SqliteStore
from shardq.consumer.worker import Worker


def test_each_new_data_dir_gets_its_own_service_id(tmp_path):
    a, b = DataDir(tmp_path / "a"), DataDir(tmp_path / "b")
    a.init(2)
    b.init(2)
    assert a.service_id() and b.service_id() and a.service_id() != b.service_id()
    a.init(2)  # reopening keeps it
    assert a.service_id() == DataDir(tmp_path / "a").service_id()


def test_sqlite_store_binds_once_and_refuses_another_service(tmp_path):
    path = tmp_path / "effects.sqlite"
    store = SqliteStore(path)
    store.bind("svc-1")
    store.bind("svc-1")
    with pytest.raises(InvalidConfig, match="svc-1"):
        store.bind("svc-2")
    store.close()
    reopened = SqliteStore(path)
    with pytest.raises(InvalidConfig):
        reopened.bind("svc-2")
    reopened.bind("svc-1")
    reopened.close()


def test_memory_store_binds_too():
    store = MemoryStore()
    store.bind("x")
    with pytest.raises(InvalidConfig):
        store.bind("y")


def test_worker_refuses_a_store_of_another_service():
    q = FakeQueue(FakeClock())
    q.service_id = "svc-new"
    store = MemoryStore()
    store.bind("svc-old")
    with pytest.raises(InvalidConfig, match="svc-old"):
        Worker(q, lambda ctx: None, idempotency=store)
    fresh = MemoryStore()
    Worker(q, lambda ctx: None, idempotency=fresh)  # binds it
    with pytest.raises(InvalidConfig):
        fresh.bind("svc-old")
