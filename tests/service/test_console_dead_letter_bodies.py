"""The console's dead-letter browser shows a task body decoded (issue 44, item 7): the API's
page carries ``task`` (name and arguments) made by the same decoder as the job look-up
(``console.api._task``), not the body's msgpack bytes only; any other body has ``task``
null. In-process, over a stand-in router: what is checked is the API's reply."""
from __future__ import annotations

import jsonschema

from shardq.service.console import openapi
from shardq.service.console.api import ConsoleApi, _task
from shardq.tasks import body as taskbody
from shardq.types import DeadLetter, DeadLetterPage

DOC = openapi.document()


class _Router:
    def __init__(self, letters):
        self.letters = letters

    def dead_letters_page(self, queue, limit, cursor, skip_unavailable=False):
        return DeadLetterPage(self.letters, None, [])


def test_a_dead_task_reads_as_its_name_and_arguments():
    task_body = taskbody.encode("myapp.tasks.send_welcome", (42,), {"template": "short"})
    letters = [DeadLetter(1024, "user-42", task_body, "mail", 5, "SMTPError: 550"),
               DeadLetter(1025, None, b'{"to": "a@example.com"}', "mail", 5, None)]
    page = ConsoleApi(_Router(letters)).dead_letters("mail")
    jsonschema.validate(page, {"$ref": "#/components/schemas/DeadLetterPage", "components": DOC["components"]})
    task, text = page["items"]
    assert task["task"]["name"] == "myapp.tasks.send_welcome"
    assert task["task"]["args"] == '{"args": [42], "kwargs": {"template": "short"}}'
    assert task["task"] == _task(task_body)  # the job panel's decoder, not a second one
    assert task["body_bytes"] == len(task_body)
    assert text["task"] is None and text["body"] == '{"to": "a@example.com"}'
