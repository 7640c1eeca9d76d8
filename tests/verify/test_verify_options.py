"""``shardq verify``'s number options: a fault interval of 0 or below planned faults for ever
(the plan's loop never advanced, ~45 MB/s until memory ran out), and ``--duration -1`` or
``nan`` ran. Each is refused before anything starts, a UsageError naming the option (exit 2),
and the plan refuses such inputs itself. Nothing here may hang on the code before the fix:
the option checks are called directly, the plan and the command run as subprocesses with
a timeout."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shardq.errors import UsageError
from shardq.verify.options import build_parser, settle_defaults

from support.service import REPO

ENV = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.mark.parametrize("argv, said", [
    (["--duration", "2", "--fault-interval", "0"], "--fault-interval must be more than 0"),
    (["--duration", "2", "--fault-interval", "-3"], "--fault-interval must be more than 0"),
    (["--fault-interval", "nan", "--run"], "--fault-interval must be a finite number"),
    (["--fault-interval", "inf", "--run"], "--fault-interval must be a finite number"),
    (["--duration", "-1"], "--duration must be 0 or more"),
    (["--duration", "nan"], "--duration must be a finite number"),
    (["--duration", "inf"], "--duration must be a finite number"),
    (["--duration", "1e300"], "plans more than 1,000,000 faults"),
    (["--duration", "2", "--fault-interval", "1e-300"], "plans more than 1,000,000 faults"),
    (["--visibility", "0", "--run"], "--visibility must be more than 0"),
    (["--visibility", "nan", "--run"], "--visibility must be a finite number"),
    (["--health-timeout", "-1", "--run"], "--health-timeout must be more than 0"),
    (["--rate", "0", "--run"], "--rate must be more than 0"),
    (["--rate", "inf", "--run"], "--rate must be a finite number"),
    (["--drain-timeout", "-5", "--run"], "--drain-timeout must be 0 or more"),
    (["--drain-timeout", "nan", "--run"], "--drain-timeout must be a finite number"),
])
def test_a_number_option_no_run_can_use_is_a_usage_error_naming_it(argv, said):
    with pytest.raises(UsageError, match=said.replace("+", r"\+")):
        settle_defaults(build_parser().parse_args(argv))


@pytest.mark.parametrize("argv", [["--duration", "0"], ["--run", "--drain-timeout", "0"],
                                  ["--duration", "2", "--fault-interval", "0.001"]])
def test_the_edges_a_run_can_use_still_pass(argv):
    a = settle_defaults(build_parser().parse_args(argv))
    assert a.duration >= 0 and a.fault_interval > 0


@pytest.mark.parametrize("argv, said", [
    (["--duration", "2", "--fault-interval", "0"], "error: UsageError: --fault-interval must be more than 0, got 0"),
    (["--duration", "2", "--fault-interval", "-1"], "error: UsageError: --fault-interval must be more than 0, got -1"),
])
@pytest.mark.parametrize("command", [["shardq.cli", "verify"], ["shardq.verify"]], ids=["shardq", "module"])
def test_the_command_exits_2_naming_the_option_at_once(tmp_path, argv, said, command):
    # before the fix: neither ended (a timeout here; the plan is made before anything starts);
    # python -m shardq.verify then printed a traceback for the refusal
    proc = subprocess.run([sys.executable, "-m", *command, *argv], capture_output=True, text=True,
                          env=ENV, cwd=str(tmp_path), timeout=20)
    assert (proc.returncode, proc.stderr.strip()) == (2, said), proc.stderr


@pytest.mark.parametrize("duration, interval", [(2.0, 0.0), (2.0, -1.0), (2.0, float("nan")), (2.0, float("inf")),
                                                (-1.0, 3.0), (float("nan"), 3.0), (float("inf"), 3.0),
                                                (1e300, 3.0)])
def test_the_plan_refuses_inputs_it_cannot_end_on_rather_than_loop(duration, interval):
    code = ("from shardq.verify.plan import plan, SERVICE_KINDS\n"
            "try:\n"
            f"    plan(1, SERVICE_KINDS, duration_s={duration!r}, interval_s={interval!r}, shards=2, workers=2,"
            " visibility_s=1.0, health_timeout_s=3.0)\n"
            "except ValueError as e:\n"
            "    print('refused:', e)\n"
            "else:\n"
            "    print('planned')\n").replace("nan", "float('nan')").replace("inf", "float('inf')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=10)
    assert proc.stdout.startswith("refused:"), (proc.stdout, proc.stderr)


def test_a_plan_of_a_usable_interval_is_as_before():
    from shardq.verify.plan import SERVICE_KINDS, plan
    faults, end = plan(1, SERVICE_KINDS, duration_s=0.0, interval_s=0.5, shards=2, workers=2, visibility_s=1.0,
                       health_timeout_s=3.0)
    assert len(faults) == len(SERVICE_KINDS) and end > faults[-1].at_s
