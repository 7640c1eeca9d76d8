"""The CLI against the SQS backend: ``shardq sqs init``, and client commands with ``--connect sqs://``."""
from __future__ import annotations

import json

import pytest

from shardq.cli import exits
from shardq.cli.main import main


@pytest.fixture
def target(moto, tmp_path):
    t = moto.target()
    cfg = tmp_path / "shardq.toml"
    cfg.write_text("[queues.default]\nvisibility_timeout = 5\nmax_deliveries = 4\n")
    assert main(["sqs", "init", "--config", str(cfg), "--connect", t]) == exits.OK
    return t, str(cfg)


def test_init_prints_what_it_did_and_is_idempotent(target, capsys):
    t, cfg = target
    capsys.readouterr()
    assert main(["sqs", "init", "--config", cfg, "--connect", t]) == exits.OK
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["unchanged", "unchanged"]
    assert out[1].endswith("-default.fifo") and out[0].endswith("-default_dlq.fifo")


def test_init_needs_an_sqs_target(capsys):
    assert main(["sqs", "init", "--connect", "var/shardq"]) == exits.USAGE
    assert "needs sqs://" in capsys.readouterr().err


def test_client_commands_with_connect_sqs(target, capsys):
    t, _ = target
    capsys.readouterr()
    assert main(["enqueue", "hello", "--key", "k", "--connect", t]) == exits.OK
    job_id = capsys.readouterr().out.strip()
    assert main(["dequeue", "--wait", "1", "--connect", t]) == exits.OK
    lease = json.loads(capsys.readouterr().out)
    assert (lease["job_id"], lease["key"], lease["body"], lease["attempt"]) == (job_id, "k", "hello", 1)
    assert main(["stats", "--json", "--connect", t]) == exits.OK
    st = json.loads(capsys.readouterr().out)
    assert st["approximate"] is True and st["queues"]["default"]["in_flight"] == 1
    assert main(["stats", "--connect", t]) == exits.OK
    assert "approximate" in capsys.readouterr().out


def test_refused_features_say_so_on_the_command_line(target, capsys):
    t, _ = target
    assert main(["enqueue", "x", "--delay", "5", "--connect", t]) == exits.USAGE
    assert "error: Unsupported: per-job delay" in capsys.readouterr().err
    assert main(["workflow", "show", "wf1", "--connect", t]) == exits.USAGE  # no Results contract
    assert "error: Unsupported: SqsQueue keeps no workflow records" in capsys.readouterr().err


def test_ack_and_dead_letters_commands_with_connect_sqs(target, capsys):
    t, _ = target
    assert main(["enqueue", "poison", "--connect", t]) == exits.OK
    for _ in range(4):  # max_deliveries = 4
        capsys.readouterr()
        assert main(["dequeue", "--wait", "1", "--connect", t]) == exits.OK
        lease = json.loads(capsys.readouterr().out)
        assert main(["nack", lease["job_id"], lease["token"], "--connect", t]) == exits.OK
    assert main(["dequeue", "--connect", t]) == exits.EMPTY
    capsys.readouterr()
    assert main(["dead-letters", "list", "--connect", t]) == exits.OK
    (dead,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (dead["job_id"], dead["attempts"], dead["body"]) == (lease["job_id"], 4, "poison")
    assert main(["dead-letters", "redrive", "--connect", t]) == exits.OK
    assert "redriven: 1" in capsys.readouterr().out
    assert main(["dequeue", "--wait", "1", "--connect", t]) == exits.OK
    lease = json.loads(capsys.readouterr().out)
    assert main(["ack", lease["job_id"], lease["token"], "--connect", t]) == exits.OK
    assert main(["dequeue", "--connect", t]) == exits.EMPTY


def test_dead_letters_by_id_with_connect_sqs(target, capsys):
    """``--id`` takes an SQS job id (a message id, not a number): redrive by id works, purge
    by id is refused with one error line and exit 2 (``Unsupported``), not a traceback."""
    import shardq
    t, _ = target
    q = shardq.connect(t)
    try:
        ids = [q.enqueue(b"poison", key=k) for k in ("a", "b")]
        while True:  # max_deliveries = 4: the 5th receive moves them to the DLQ
            leases = q.dequeue_many(max_jobs=2, wait=1)
            if not leases:
                break
            for lease in leases:
                q.nack(lease)
        assert sorted(d.job_id for d in q.dead_letters()) == sorted(ids)
    finally:
        q.close()
    capsys.readouterr()
    assert main(["dead-letters", "purge", "--id", ids[0], "--connect", t]) == exits.USAGE
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "error: Unsupported: purge of dead letters by job id: not supported by the sqs backend "
        "(purge all of them, or redrive chosen ones by id)"]
    assert captured.out == ""
    assert main(["dead-letters", "redrive", "--id", ids[0], "--connect", t]) == exits.OK
    assert capsys.readouterr().out.strip() == "redriven: 1"
    assert main(["dead-letters", "list", "--connect", t]) == exits.OK
    assert [json.loads(line)["job_id"] for line in capsys.readouterr().out.splitlines()] == [ids[1]]
    assert main(["dead-letters", "purge", "--connect", t]) == exits.OK
    assert capsys.readouterr().out.strip() == "purged: 1"
