"""Starts `moerun serve` on the committed chat fixture, on a free loopback port, for the tests
in this directory, and stops it (by its own pid) when they are done."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import time
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures_text" / "qwen3_moe_chat"
MODEL = "fixture"
API_KEY = "test-key"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, extra_args=()):
        binary = os.environ.get("MOERUN_BIN", str(ROOT / "target" / "release" / "moerun"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(ROOT / "target" / f"server-test-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [binary, "serve", "--model", str(FIXTURE), "--served-model-name", MODEL,
             "--port", str(self.port), "--api-key", API_KEY, *extra_args],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"moerun serve did not come up; see {self.log.name}")
            time.sleep(0.1)

    def metrics(self):
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def metric(self, prefix):
        for line in self.metrics().splitlines():
            if line.startswith(prefix):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(prefix)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="session")
def server():
    s = Server()
    yield s
    s.stop()
    assert s.proc.returncode == 0, f"moerun serve exited with {s.proc.returncode}"


@pytest.fixture(scope="session")
def reference():
    return json.loads((FIXTURE / "text_reference.json").read_text())["cases"]
