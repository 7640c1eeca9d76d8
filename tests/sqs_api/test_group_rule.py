"""The FIFO group rule as a property, against a real ``shardq serve`` over the SQS API:
whatever the interleaving of sends, receives, deletes, visibility changes and expiries,
a receive never hands out a message of a group while an earlier one of that group is in
flight, and a group's messages come out in the order they were sent.

The model keeps, per group, the messages sent and not deleted (in order) and the one
received and still held (its receipt handle). A receive may hand out fewer messages than
it could (AWS may too); every message it does hand out must be its group's oldest, of a
group with nothing held."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tests.support.sqs_listener import client, sqs_service, sqs_url

GROUPS = ["a", "b", "c"]
_names = itertools.count()


@pytest.fixture(scope="module")
def sqs():
    with sqs_service(shards=2) as svc:
        yield client(sqs_url(svc))


def test_no_later_message_of_a_group_while_one_is_in_flight(sqs):
    class GroupRule(RuleBasedStateMachine):
        @initialize()
        def queue(self):
            self.url = sqs.create_queue(QueueName=f"rule{next(_names)}.fifo",
                                        Attributes={"FifoQueue": "true"})["QueueUrl"]
            self.pending: dict[str, list[str]] = {g: [] for g in GROUPS}  # sent, not deleted, in order
            self.held: dict[str, str] = {}  # group -> receipt handle of its message in flight
            self.n = 0

        @rule(group=st.sampled_from(GROUPS), count=st.integers(1, 3))
        def send(self, group, count):
            entries = []
            for _ in range(count):
                self.n += 1
                entries.append({"Id": str(self.n), "MessageBody": f"{group}-{self.n}", "MessageGroupId": group,
                                "MessageDeduplicationId": str(self.n)})
            out = sqs.send_message_batch(QueueUrl=self.url, Entries=entries)
            assert len(out["Successful"]) == count
            self.pending[group] += [e["MessageBody"] for e in entries]

        def _received(self, msgs, expiring: bool):
            for m in msgs:
                group = m["Body"].split("-")[0]
                assert group not in self.held, f"{m['Body']} handed out while {group} has one in flight"
                assert self.pending[group] and m["Body"] == self.pending[group][0], \
                    f"{m['Body']} handed out before {self.pending[group][:1]}"
                if not expiring:
                    self.held[group] = m["ReceiptHandle"]

        @rule(n=st.integers(1, 10))
        def receive(self, n):
            self._received(sqs.receive_message(QueueUrl=self.url, MaxNumberOfMessages=n).get("Messages", []), False)

        @rule(n=st.integers(1, 10))
        def receive_expiring(self, n):
            """VisibilityTimeout 0: each message's lease ends at once (an expiry)."""
            got = sqs.receive_message(QueueUrl=self.url, MaxNumberOfMessages=n, VisibilityTimeout=0)
            self._received(got.get("Messages", []), True)

        @rule(group=st.sampled_from(GROUPS))
        def delete(self, group):
            handle = self.held.pop(group, None)
            if handle is not None:
                sqs.delete_message(QueueUrl=self.url, ReceiptHandle=handle)
                self.pending[group].pop(0)

        @rule(group=st.sampled_from(GROUPS))
        def release(self, group):
            handle = self.held.pop(group, None)
            if handle is not None:
                sqs.change_message_visibility(QueueUrl=self.url, ReceiptHandle=handle, VisibilityTimeout=0)

        @rule(group=st.sampled_from(GROUPS), seconds=st.integers(1, 43000))
        def extend(self, group, seconds):
            handle = self.held.get(group)
            if handle is not None:
                sqs.change_message_visibility(QueueUrl=self.url, ReceiptHandle=handle, VisibilityTimeout=seconds)

        @invariant()
        def held_only_what_is_pending(self):
            for group in self.held:
                assert self.pending[group]

    GroupRule.TestCase.settings = settings(max_examples=15, stateful_step_count=25, deadline=None)
    GroupRule.TestCase().runTest()
