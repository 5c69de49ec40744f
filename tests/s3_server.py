"""An S3-compatible server on 127.0.0.1 for the object-storage tests: moto's server (the S3 protocol end to end,
spoken by s3fs over HTTP), wrapped so that it counts the bytes it sends.

    python -m tests.s3_server --port 5123

Every GET response body is counted under the client's tag: the ``tag/<name>`` token a client puts in its
``User-Agent`` (s3fs: ``storage_options={"config_kwargs": {"user_agent_extra": "tag/rank-1"}}``), else ``"untagged"``.
``GET /_counts`` returns ``{tag: {"bytes": n, "requests": n, "ranged": n}}`` as JSON; ``POST /_counts/reset``
clears it. Both paths are the server's own and never reach S3.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_TAG = re.compile(r"\btag/([A-Za-z0-9_.-]+)")
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class _Counter:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, dict[str, int]] = {}

    def add(self, tag: str, nbytes: int, ranged: bool) -> None:
        with self.lock:
            entry = self.counts.setdefault(tag, {"bytes": 0, "requests": 0, "ranged": 0})
            entry["bytes"] += nbytes
            entry["requests"] += 1
            entry["ranged"] += int(ranged)


def counting_app(app: Callable, counter: _Counter) -> Callable:
    """``app`` (WSGI) with the ``/_counts`` endpoints and every GET body counted under its client's tag."""

    def wrapped(environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "")
        if path == "/_counts":
            if method == "POST":
                with counter.lock:
                    counter.counts.clear()
            with counter.lock:
                body = json.dumps(counter.counts).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        if method != "GET":
            return app(environ, start_response)
        match = _TAG.search(environ.get("HTTP_USER_AGENT", ""))
        tag = match.group(1) if match else "untagged"
        ranged = "HTTP_RANGE" in environ
        return _Counted(app(environ, start_response), lambda n: counter.add(tag, n, ranged))

    return wrapped


class _Counted:
    """A WSGI body that reports its total length once it has been sent."""

    def __init__(self, body: Iterable[bytes], report: Callable[[int], None]) -> None:
        self.body, self.report, self.sent = body, report, 0

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.body:
            self.sent += len(chunk)
            yield chunk

    def close(self) -> None:
        self.report(self.sent)
        close = getattr(self.body, "close", None)
        if close is not None:
            close()


def serve(port: int) -> None:
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    app = counting_app(DomainDispatcherApplication(create_backend_app), _Counter())
    make_server("127.0.0.1", port, app, threaded=True).serve_forever()


@dataclass
class S3Server:
    """A running server: its endpoint, and the environment a client needs (credentials, endpoint)."""

    endpoint: str
    process: subprocess.Popen

    @property
    def env(self) -> dict[str, str]:
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def counts(self) -> dict[str, dict[str, int]]:
        with urllib.request.urlopen(f"{self.endpoint}/_counts") as response:
            return json.loads(response.read())

    def reset_counts(self) -> None:
        urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/_counts", method="POST")).read()


@contextmanager
def running_s3_server(timeout: float = 60.0) -> Iterator[S3Server]:
    """Start the server in its own process on a free port of 127.0.0.1; stop it when the block ends."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    root = Path(__file__).resolve().parents[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.s3_server", "--port", str(port)], cwd=root,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **CREDENTIALS},
    )  # fmt: skip
    server = S3Server(f"http://127.0.0.1:{port}", process)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                server.counts()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the S3 test server did not start on port {port}") from None
                time.sleep(0.1)
        yield server
    finally:
        process.kill()
        process.wait()
        _forget_clients()


def _forget_clients() -> None:
    """Drop the s3fs clients this process cached: one made from the environment (the CLI's) would otherwise be reused
    against the next test server's port, this stopped server's endpoint still in it."""
    import fsspec

    for cls in fsspec.registry.values():
        cls.clear_instance_cache()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    serve(parser.parse_args().port)
