"""An HTTP object server on loopback, with a set time to first byte and bandwidth per connection.

Stands in for an object store (S3, GCS, an HTTP server) so that loading
that waits on storage can be measured and tested without a network:
``GET /objects/<index>`` answers, after ``ttfb_s`` seconds, an object of
``size`` bytes whose content is a function of ``index`` alone
(:func:`object_bytes`), sent at no more than ``bandwidth`` bytes/s on each
connection (0: as fast as loopback goes). ``GET /objects/<index>?size=N``
asks for another size. Object indices in ``missing`` answer 404; ``GET
/hang/<index>`` never answers (a request that hangs).

Run it in its own process with :class:`ObjectServer` (``with
ObjectServer(...) as server: server.url``), or from the command line:
``python -m benchmarks.object_server --port 0 --ttfb-ms 20`` prints
``listening on http://127.0.0.1:PORT`` once ready. Needs ``aiohttp``
(``extsrc[remote]``); imported only in the server's process.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

import numpy as np

PATTERN_BYTES = 1 << 22  # objects are windows of one pseudo-random block (no work per request)
CHUNK_BYTES = 256 << 10  # bandwidth is paced per chunk of this size (smaller: the server spends its CPU pacing)
STARTUP_S = 30.0  # a server that is not listening after this long failed to start
STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this long


def stop_process(process: subprocess.Popen) -> None:
    """Ends a server process: SIGTERM, then SIGKILL after :data:`STOP_GRACE_S`; waits for it."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _pattern() -> np.ndarray:
    return np.random.default_rng(20).integers(0, 256, PATTERN_BYTES, dtype=np.uint8)


def object_bytes(index: int, size: int, pattern: Optional[np.ndarray] = None) -> np.ndarray:
    """The content of object ``index`` at ``size`` bytes (what the server sends), uint8."""
    pattern = _pattern() if pattern is None else pattern
    offset = (index * 7919) % PATTERN_BYTES
    reps = -(-(offset + size) // PATTERN_BYTES)
    if reps == 1:
        return pattern[offset:offset + size].copy()
    return np.tile(pattern, reps)[offset:offset + size]


def _app(size: int, ttfb_s: float, bandwidth: float, missing: Sequence[int]):
    import asyncio

    from aiohttp import web

    pattern = _pattern()
    gone = set(missing)

    async def get_object(request: "web.Request") -> "web.StreamResponse":
        index = int(request.match_info["index"])
        if index in gone:
            raise web.HTTPNotFound(text=f"no object {index}")
        length = int(request.query.get("size", size))
        if ttfb_s:
            await asyncio.sleep(ttfb_s)
        body = object_bytes(index, length, pattern)
        if not bandwidth:
            return web.Response(body=body.tobytes(), content_type="application/octet-stream")
        response = web.StreamResponse(headers={"Content-Length": str(length),
                                               "Content-Type": "application/octet-stream"})
        await response.prepare(request)
        view = memoryview(body)
        loop = asyncio.get_running_loop()
        began = loop.time()
        for start in range(0, length, CHUNK_BYTES):
            await response.write(view[start:start + CHUNK_BYTES])
            ahead = began + (start + CHUNK_BYTES) / bandwidth - loop.time()
            if ahead > 0:
                await asyncio.sleep(ahead)
        await response.write_eof()
        return response

    async def hang(request: "web.Request") -> "web.Response":
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    app = web.Application()
    app.router.add_get(r"/objects/{index:\d+}", get_object)
    app.router.add_get(r"/hang/{index:\d+}", hang)
    return app


def serve(port: int, size: int, ttfb_s: float, bandwidth: float, missing: Sequence[int]) -> None:
    """Serves until SIGTERM/SIGINT; prints ``listening on URL`` once ready."""
    import asyncio

    from aiohttp import web

    async def main() -> None:
        runner = web.AppRunner(_app(size, ttfb_s, bandwidth, missing), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port, backlog=1024)
        await site.start()
        bound = runner.addresses[0][1]
        print(f"listening on http://127.0.0.1:{bound}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(main())


class ObjectServer:
    """The server in a process of its own (a context manager): :attr:`url`, :attr:`pid`.

    Raises ``RuntimeError`` (with the server's output) if it does not start.
    ``stop()`` (or leaving the ``with``) ends it; idempotent.
    """

    def __init__(self, size: int = 100 << 10, ttfb_s: float = 0.0, bandwidth: float = 0.0,
                 missing: Sequence[int] = ()):
        command = [sys.executable, "-m", "benchmarks.object_server", "--port", "0",
                   "--size", str(size), "--ttfb-ms", str(ttfb_s * 1e3),
                   "--bandwidth", str(bandwidth)]
        if missing:
            command += ["--missing", ",".join(str(m) for m in missing)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        # Its errors (clients that went away mid-object) go to a file: a pipe nobody reads
        # would fill up and stop the server.
        self._log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._log,
                                        text=True, env=env, start_new_session=True)
        self.url = self._wait_ready()

    def _wait_ready(self) -> str:
        import selectors

        assert self.process.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(self.process.stdout, selectors.EVENT_READ)
        seen = ""
        if selector.select(STARTUP_S):
            seen = self.process.stdout.readline()
            found = re.search(r"listening on (\S+)", seen)
            if found:
                selector.close()
                return found.group(1)
        selector.close()
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait()
        output = self._rest()
        self.stop()
        raise RuntimeError(f"the object server did not start: {seen}{output}")

    def _rest(self) -> str:
        try:
            self._log.seek(0)
            return self._log.read()[-4000:]
        except Exception:
            return ""

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        stop_process(self.process)
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._log.close()

    def __enter__(self) -> "ObjectServer":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.object_server",
                                     description="An HTTP object server on 127.0.0.1.")
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--size", type=int, default=100 << 10, help="object size in bytes")
    parser.add_argument("--ttfb-ms", type=float, default=0.0, help="time to first byte")
    parser.add_argument("--bandwidth", type=float, default=0.0,
                        help="bytes/s per connection (0: unlimited)")
    parser.add_argument("--missing", default="", help="comma-separated indices answering 404")
    args = parser.parse_args(argv)
    missing = [int(m) for m in args.missing.split(",") if m]
    serve(args.port, args.size, args.ttfb_ms / 1e3, args.bandwidth, missing)


if __name__ == "__main__":
    main()
