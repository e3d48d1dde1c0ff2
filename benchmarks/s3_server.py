"""An S3-compatible object store on loopback (moto's server mode), in a process of its own.

For tests, benchmarks and tutorials that read a bucket through the clients
users use (``boto3``, ``aiobotocore``) without a network or an account:
``with S3Server() as s3: s3.client()`` gives a boto3 client for it;
:attr:`S3Server.endpoint_url` and :data:`CREDENTIALS` are what any other
client needs. Needs ``moto[server]`` and ``boto3`` (``extsrc[test]``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Dict

from benchmarks.object_server import STOP_GRACE_S, stop_process

# moto accepts any credentials; clients refuse to sign without some.
CREDENTIALS: Dict[str, str] = {
    "aws_access_key_id": "testing",
    "aws_secret_access_key": "testing",
    "region_name": "us-east-1",
}
STARTUP_S = 60.0  # moto imports much on its first start
POLL_S = 0.1


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class S3Server:
    """``python -m moto.server`` on 127.0.0.1 (a context manager); ``stop()`` is idempotent.

    Raises ``RuntimeError`` with the server's output if it is not answering
    after :data:`STARTUP_S` seconds.
    """

    def __init__(self) -> None:
        self.port = _free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        deadline = time.monotonic() + STARTUP_S
        while True:
            try:
                urllib.request.urlopen(self.endpoint_url + "/moto-api/", timeout=POLL_S * 10).close()
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the S3 server (moto) did not start: {self._output()}")
            time.sleep(POLL_S)

    def _output(self) -> str:
        try:
            return (self.process.communicate(timeout=STOP_GRACE_S)[1] or "")[-2000:]
        except Exception:
            return ""

    def client(self) -> Any:
        """A boto3 S3 client for this server."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint_url, **CREDENTIALS)

    def stop(self) -> None:
        stop_process(self.process)
        if self.process.stderr is not None:
            self.process.stderr.close()

    def __enter__(self) -> "S3Server":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
