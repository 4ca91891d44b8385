"""moto's standalone S3 server on 127.0.0.1, for tests and benchmarks: started and stopped here."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# moto accepts any credentials; these are what every test client uses.
KEY, SECRET = "testing-key", "testing-secret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class S3Server:
    endpoint: str
    port: int
    proc: subprocess.Popen[bytes] | None

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        """s3fs options for this server: few retries and short timeouts, so a stopped server
        fails an upload in seconds, not minutes."""
        return {
            "key": KEY,
            "secret": SECRET,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
            "config_kwargs": {
                "connect_timeout": 2,
                "read_timeout": 10,
                "retries": {"max_attempts": 1},
            },
            **extra,
        }

    def fs(self) -> Any:
        import s3fs

        opts = self.storage_options()
        return s3fs.S3FileSystem(
            key=KEY,
            secret=SECRET,
            client_kwargs=opts["client_kwargs"],
            config_kwargs=opts["config_kwargs"],
            skip_instance_cache=True,
        )

    def make_bucket(self, name: str) -> None:
        import boto3

        boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=KEY,
            aws_secret_access_key=SECRET,
            region_name="us-east-1",
        ).create_bucket(Bucket=name)

    def stop(self) -> None:
        """Stop the server (and every process it started); safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)


@contextlib.contextmanager
def s3_server(timeout_s: float = 60.0) -> Iterator[S3Server]:
    """A moto S3 server on a free loopback port, stopped on exit."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: stop() ends it and nothing else
    )
    server = S3Server(f"http://127.0.0.1:{port}", port, proc)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            with socket.socket() as s:
                s.settimeout(0.5)
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto S3 server did not start on port {port}")
            time.sleep(0.2)
        yield server
    finally:
        server.stop()
