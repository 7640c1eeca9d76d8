"""Which declared contract (shardq/client/contracts.py, and the Queue protocol) each client
class offers. A worker, the tasks layer and the command line choose their path by
``isinstance(q, Contract)`` (a bury or a nack for ``Fail``, reports with the acks, a client for
a job's own calls, results and workflows or ``Unsupported``, the control calls or
``Unsupported``, a worker's check of its queues), so a class that gains or loses one of these
methods changes what they do: the table below says what each class is meant to offer, and
a class that differs from its row fails here, where the class is named. mypy checks the
signatures of the local shards' two clients (the ``TYPE_CHECKING`` blocks of router.py and
aio.py); this checks SqsQueue's by inspection."""
from __future__ import annotations

import inspect
from typing import Protocol
from unittest import mock

import pytest

import shardq
from shardq.backends.sqs import SqsQueue
from shardq.client import contracts
from shardq.client.aio import AsyncQueue
from shardq.client.contracts import Buries, Control, JobCalls, Results, Settles
from shardq.client.router import Router
from shardq.cli import common
from shardq.cli.worker import check_queues
from shardq.clock import FakeClock
from shardq.consumer.aioworker import LoopCalls
from shardq.errors import Unsupported

from support.fakes import AsyncFacade, BuryingQueue, FakeQueue, PlainQueue

SYNC = [shardq.Queue, Control, Results, JobCalls, Settles, Buries]
ASYNC = [contracts.AsyncQueue, contracts.AsyncResults]

#: client class -> the contracts it offers (every other one of its kind it must not)
TABLE: dict[type, set[type]] = {
    Router: {shardq.Queue, Control, Results, JobCalls, Settles, Buries},
    SqsQueue: {shardq.Queue, Buries},
    LoopCalls: {JobCalls},  # the asyncio runner's blocking calls about a job
    FakeQueue: {JobCalls, Settles},
    BuryingQueue: {JobCalls, Settles, Buries},
    PlainQueue: {Buries},  # what SQS offers of these
    AsyncQueue: {contracts.AsyncQueue, contracts.AsyncResults},
    AsyncFacade: set(),  # the asyncio runner's fake: the few calls it makes
}


def methods(proto: type) -> set[str]:
    """The methods a protocol declares, its bases' included (data members, such as
    ``service_id``, are set on instances: mypy checks those)."""
    return {name for base in proto.__mro__ if base not in (object, Protocol) and Protocol in base.__bases__
            for name, value in vars(base).items() if callable(value) and not name.startswith("_")}


def has(cls: type, name: str) -> bool:
    """A method, or a descriptor that makes one (an entry of the clients' call table); a
    method set to None is absent, as ``isinstance`` against a protocol counts it."""
    attr = getattr(cls, name, None)
    return attr is not None and (callable(attr) or hasattr(type(attr), "__get__"))


@pytest.mark.parametrize("cls", list(TABLE), ids=lambda c: c.__name__)
def test_each_client_class_offers_exactly_the_contracts_of_its_row(cls):
    kind = ASYNC if cls in (AsyncQueue, AsyncFacade) else SYNC
    for proto in kind:
        missing = sorted(name for name in methods(proto) if not has(cls, name))
        if proto in TABLE[cls]:
            assert not missing, f"{cls.__name__} is meant to offer {proto.__name__} but lacks {missing}"
        else:
            assert missing, f"{cls.__name__} offers {proto.__name__}, which its row says it does not"


def test_the_fakes_answer_isinstance_as_their_rows_say():
    """The runtime check the worker makes (a method set to None is absent)."""
    checkable = [shardq.Queue, Control, Results, JobCalls, Settles, Buries]
    for cls in (FakeQueue, BuryingQueue, PlainQueue):
        q = cls(FakeClock())
        assert {p for p in checkable if isinstance(q, p)} == TABLE[cls]


def params(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def test_the_capabilities_are_declared_as_the_calls_they_name():
    """JobCalls, Settles and Buries name calls of Results and Queue: the same parameters,
    so that a client offering the larger contract offers the smaller one as declared."""
    assert {"enqueue", "bury", "close"} <= methods(shardq.Queue) and len(methods(Results)) == 15
    for proto, whole in ((JobCalls, Results), (Settles, Results), (Buries, shardq.Queue)):
        assert methods(proto) <= methods(whole), proto.__name__
        for name in methods(proto):
            assert params(getattr(proto, name)) == params(getattr(whole, name)), (proto.__name__, name)


def test_sqs_queue_takes_every_call_of_the_queue_protocol_as_declared():
    for name in methods(shardq.Queue):
        assert params(getattr(SqsQueue, name)) == params(getattr(shardq.Queue, name)), name


def test_the_command_line_chooses_by_the_declared_contracts():
    """The control calls (``queue pause``, ``job cancel``, ``dead-letters list --cursor``...)
    go to a client that declares Control, whole; one that does not (SQS, a stand-in with a
    few of the calls) gets Unsupported naming the call asked and the backend. A worker
    checks its queues on a whole Queue only: a stand-in is not asked for its counts."""
    router = mock.create_autospec(Router, instance=True)
    assert common.control_call(router, "pause") is router
    partial = type("Partial", (), {"pause": lambda self, queue="default": 1})()
    for q in (PlainQueue(FakeClock()), partial):
        with pytest.raises(Unsupported, match=f"^pause: not supported by the {type(q).__name__} backend$"):
            common.control_call(q, "pause")
    stand_in = mock.Mock(spec=["stats", "queue_config"])
    assert check_queues(stand_in, ["default"], None, ["m:f"]) == [] and not stand_in.method_calls
