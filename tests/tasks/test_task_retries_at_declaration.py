"""``retries`` past what the queue's ``max_deliveries`` lets run is refused at ``@app.task``
when the app knows the service's config (issue 44, item 11): a typed error naming the most
allowed, instead of a job that dead-letters with retries left. In-process: nothing connects."""
from __future__ import annotations

import pytest

import shardq
from shardq.tasks.app import RETRIES_MAX


def declare(app, queue: str, retries):
    @app.task(queue=queue, retries=retries, name=f"t.{queue}.{retries}")
    def t(ctx):
        return None
    return t


def test_retries_past_max_deliveries_are_refused_naming_the_most_allowed():
    app = shardq.App("var/none", config={"queues": {"mail": {"max_deliveries": 5}}})
    with pytest.raises(shardq.InvalidConfig, match=r"retries=9 .*max_deliveries = 5.*the most allowed is retries=4"):
        declare(app, "mail", 9)
    with pytest.raises(shardq.InvalidConfig, match="retries=4"):
        declare(app, "mail", 5)
    assert declare(app, "mail", 4).retries == 4       # the first delivery and four retries: five
    assert declare(app, "mail", None).retries is None  # the queue's limit decides
    assert set(app.tasks) == {"t.mail.4", "t.mail.None"}  # nothing refused was registered


def test_an_undeclared_queue_takes_the_queue_defaults_and_the_config_may_be_a_path(tmp_path):
    path = tmp_path / "shardq.toml"
    path.write_text("[queue_defaults]\nmax_deliveries = 3\n")
    app = shardq.App("var/none", config=str(path))
    with pytest.raises(shardq.InvalidConfig, match="the most allowed is retries=2"):
        declare(app, "anything", 3)
    assert declare(app, "anything", 2).retries == 2


def test_at_the_largest_max_deliveries():
    top = 1_000_000  # config.py's bound for max_deliveries
    app = shardq.App("var/none", config={"queues": {"big": {"max_deliveries": top}}})
    assert declare(app, "big", top - 1).retries == top - 1
    assert RETRIES_MAX == top - 1  # the two limits agree: no retries that no queue could let run
    with pytest.raises(shardq.InvalidConfig, match=f"retries must be None or an int in \\[0, {top - 1}\\]"):
        declare(app, "big", top)
    app = shardq.App("var/none", config={"queues": {"big": {"max_deliveries": top - 1}}})
    with pytest.raises(shardq.InvalidConfig, match=f"the most allowed is retries={top - 2} .*to {top} "):
        declare(app, "big", top - 1)  # the value it says to raise max_deliveries to is one the config takes


def test_without_the_config_nothing_is_known_at_declaration():
    app = shardq.App("var/none")
    assert declare(app, "mail", 9).retries == 9  # the worker warns at start instead
