"""A real ``warmspec serve`` subprocess for tests: its own runtime directory and prefix-cache
directory, the HTTP port on a free port, ``warmspec stop`` to end it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from warmspec.client import Client
from warmspec_protocol import rpc as wire

READY = re.compile(r"ready: .*HTTP on (http://\S+?)(?:,| |$)", re.M)


class Daemon:
    def __init__(self, root: Path, *args: str, speculate: bool = False, timeout: float = 300):
        self.root = root
        self.env = dict(os.environ, WARMSPEC_RUNTIME_DIR=str(root / "rt"))
        self.env.pop("WARMSPEC_API_KEY", None)
        self.log = root / f"serve-{time.monotonic_ns()}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "warmspec", "serve", *([] if speculate else ["--no-speculate"]),
                 "--port", "0",
                 "--prefix-disk-dir", str(root / "prefix"), *args],
                env=self.env, stdout=out, stderr=out)
        deadline = time.monotonic() + timeout
        while not (ready := READY.search(self.log.read_text())):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.1)
        self.url = ready.group(1)
        self.socket = root / "rt" / "warmspec.sock"

    def client(self) -> Client:
        c = Client.unix(self.socket)
        c.initialize()
        return c

    def status(self) -> wire.Status:
        with self.client() as c:
            return c.call("warmspec/status", None, wire.Status)

    def wait_for(self, predicate, timeout: float = 180) -> wire.Status:
        deadline = time.monotonic() + timeout
        while not predicate(st := self.status()):
            assert time.monotonic() < deadline, f"daemon never reached the state; last status {st}"
            time.sleep(0.2)
        return st

    def stop(self) -> None:
        """``warmspec stop``, as a user runs it; returns once the process has exited."""
        result = subprocess.run([sys.executable, "-m", "warmspec", "stop"], env=self.env,
                                capture_output=True, text=True, timeout=180)
        assert result.returncode == 0, result.stderr
        self.proc.wait(60)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
