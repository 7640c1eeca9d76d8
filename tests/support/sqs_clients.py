"""What the tests of SQS clients that no one here wrote need beside ``support.sqs_listener``
(tests/sqs_clients/: the AWS SDK for JavaScript v3, Celery on kombu's SQS transport, boto3
against the native client): the JS SDK's npm project, installed from its lock file, and the
environment every SDK reads its region and (dummy) key pair from."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess

import pytest

from support.service import REPO

JS_DIR = os.path.join(REPO, "tests", "sqs_clients", "js")
# A listener with no keys takes any signature; the SDKs still sign, and refuse to run without a pair.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


def js_sdk_installed() -> str:
    """``npm ci`` the JS project once per lock file (a stamp in node_modules says which);
    returns the ``node`` to run. Skips with setup-system's message when node or npm is
    missing; fails when they are there and the install fails."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        pytest.skip("node and npm are not installed: run `bash .ci/setup-system` (apt-get install nodejs npm)")
    with open(os.path.join(JS_DIR, "package-lock.json"), "rb") as f:
        lock = hashlib.sha256(f.read()).hexdigest()
    stamp = os.path.join(JS_DIR, "node_modules", ".shardq-lock-sha256")
    try:
        with open(stamp) as f:
            if f.read() == lock:
                return node
    except OSError:
        pass
    r = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel", "error"], cwd=JS_DIR,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"npm ci failed in {JS_DIR}:\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
    with open(stamp, "w") as f:
        f.write(lock)
    return node


GO_DIR = os.path.join(REPO, "tests", "sqs_clients", "go")
# Debian's packaged AWS SDK for Go v2 (golang-github-aws-aws-sdk-go-v2-dev): GOPATH mode, offline
GO_PATH = "/usr/share/gocode"
GO_SQS = os.path.join(GO_PATH, "src", "github.com", "aws", "aws-sdk-go-v2", "service", "sqs")


def go_sdk_binary(out_dir: str) -> str:
    """Build tests/sqs_clients/go/check_sqs.go into ``out_dir`` with Debian's Go toolchain and
    its packaged SDK (no network: GOPATH mode, GOPROXY off); returns the binary. Skips with
    setup-system's message when go or the SDK is missing; fails when the build does."""
    go = shutil.which("go")
    if not go or not os.path.isdir(GO_SQS):
        pytest.skip("go or the AWS SDK for Go v2 is not installed: run `bash .ci/setup-system` "
                    "(apt-get install golang-go golang-github-aws-aws-sdk-go-v2-dev)")
    binary = os.path.join(out_dir, "check_sqs")
    env = dict(os.environ, GO111MODULE="off", GOPATH=GO_PATH, GOPROXY="off", GOFLAGS="")
    # Go's own build cache (keyed by content: sharing it is safe), which the Go block of
    # docs/sqs-clients.md uses too: the SDK's packages compile once on a machine, not in
    # every session (about 6 s on the 2-CPU VM). A private one only where there is no home.
    if not env.get("GOCACHE") and not os.access(os.path.expanduser("~"), os.W_OK):
        env["GOCACHE"] = os.path.join(out_dir, "go-build")
    r = subprocess.run([go, "build", "-o", binary, "check_sqs.go"], cwd=GO_DIR, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, f"go build failed in {GO_DIR}:\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
    return binary
