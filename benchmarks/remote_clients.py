"""Callbacks that read objects over HTTP, as a user's would: one async, one blocking.

Both load ``{url}/objects/{record}`` (see :mod:`benchmarks.object_server`)
and return its bytes as a uint8 array; both end the epoch (``StopIteration``)
at ``count`` samples when given, and raise ``FileNotFoundError`` naming the
object for a 404 and ``ConnectionError`` naming the server when it cannot be
reached. They keep their connections per worker process (async: one
``aiohttp`` session on the worker's event loop; blocking: one keep-alive
connection per thread), made on first use, so they fork and pickle cleanly.
"""

from __future__ import annotations

import http.client
import os
import threading
import urllib.parse
from typing import Any, Dict, Optional

import numpy as np

REQUEST_TIMEOUT_S = 60.0  # the client's own limit; a loader's timeout= is usually the shorter one


class _Base:
    def __init__(self, url: str, count: Optional[int] = None, path: str = "objects",
                 size: Optional[int] = None):
        self.url = url.rstrip("/")
        self.count = count
        self.path = path
        self.size = size

    def _target(self, info: Any) -> str:
        if self.count is not None and info.idx_in_epoch >= self.count:
            raise StopIteration
        query = "" if self.size is None else f"?size={self.size}"
        record = getattr(info, "record", info.idx_in_epoch)  # DALI's SampleInfo has no record
        return f"{self.url}/{self.path}/{record}{query}"

    def __getstate__(self) -> Dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


class AsyncHttpObjects(_Base):
    """``async def __call__(info)``: GET the sample's object with aiohttp."""

    async def __call__(self, info: Any) -> np.ndarray:
        import aiohttp

        target = self._target(info)
        session = self._session_for_loop()
        try:
            async with session.get(target) as response:
                if response.status == 404:
                    raise FileNotFoundError(f"{target}: no such object (HTTP 404)")
                if response.status != 200:
                    raise OSError(f"{target}: HTTP {response.status}")
                data = await response.read()
        except aiohttp.ClientConnectionError as exc:
            raise ConnectionError(f"{target}: the server cannot be reached ({exc})") from None
        return np.frombuffer(data, np.uint8)

    async def aclose(self) -> None:
        """Closes this process's session (a worker's ends with the worker)."""
        session = self.__dict__.pop("_session", None)
        if session is not None:
            await session.close()

    def _session_for_loop(self) -> Any:
        import asyncio

        import aiohttp

        loop = asyncio.get_running_loop()
        key = (os.getpid(), id(loop))
        session = self.__dict__.get("_session")
        if session is None or self.__dict__.get("_key") != key:
            connector = aiohttp.TCPConnector(limit=0)
            timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
            session = aiohttp.ClientSession(connector=connector, timeout=timeout)
            self.__dict__["_session"], self.__dict__["_key"] = session, key
        return session


class BlockingHttpObjects(_Base):
    """``__call__(info)``: GET the sample's object with ``http.client`` (blocks its thread)."""

    def __call__(self, info: Any) -> np.ndarray:
        target = self._target(info)
        parts = urllib.parse.urlsplit(target)
        local = self.__dict__.get("_local")
        if local is None or self.__dict__.get("_pid") != os.getpid():
            local = self.__dict__["_local"] = threading.local()
            self.__dict__["_pid"] = os.getpid()
        for attempt in range(2):  # a kept-alive connection the server closed: reconnect once
            connection = getattr(local, "connection", None)
            if connection is None:
                connection = local.connection = http.client.HTTPConnection(
                    parts.hostname, parts.port, timeout=REQUEST_TIMEOUT_S)
            try:
                connection.request("GET", f"{parts.path}?{parts.query}" if parts.query else parts.path)
                response = connection.getresponse()
                data = response.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                connection.close()
                local.connection = None
                if attempt:
                    raise ConnectionError(f"{target}: the server closed the connection") from None
            except ConnectionRefusedError as exc:
                connection.close()
                local.connection = None
                raise ConnectionError(f"{target}: the server cannot be reached ({exc})") from None
        if response.status == 404:
            raise FileNotFoundError(f"{target}: no such object (HTTP 404)")
        if response.status != 200:
            raise OSError(f"{target}: HTTP {response.status}")
        return np.frombuffer(data, np.uint8)
