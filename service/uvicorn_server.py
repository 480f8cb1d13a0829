"""uvicorn's server and front-end process as `serve` runs them: a shutdown that loses no request, the one-process
server's drain on SIGTERM. A module of its own (of the service it imports only `shared_rows`, standard library
alone): the front-end process object is pickled into the spawned child, which finds its class here."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import threading
import time

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.supervisors.multiprocess import Process

from .shared_rows import claim_row


def accept_queue(sock) -> int | None:
    """Connections the kernel has queued on a listening TCP socket and no process has accepted yet (Linux: TCP_INFO
    of a listening socket holds it in `tcpi_unacked`); None where that cannot be read."""
    import socket
    import struct

    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        return struct.unpack_from("<I", info, 24)[0]
    except (AttributeError, OSError, struct.error):
        return None


def server_class(drain_s: float = 0.0, on_drain=lambda: None, one_process: bool = True):
    """uvicorn's Server with a shutdown that loses no request. `one_process`: the server of `http_workers=0`, which
    drains on the first SIGTERM itself and exits 0 (a front-end process is drained by the supervisor and keeps
    uvicorn's signal handling)."""
    import asyncio
    import threading

    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            """Stop accepting without resetting a connection the kernel has queued, and close idle connections only
            once requests already sent on newly accepted ones have arrived and started (uvicorn closes a connection
            with no request under way at once, and a client whose request was on its way gets no answer).

            Closing a listening socket resets every connection in its accept queue, each with a request already
            sent. So the loop goes on accepting until the queue is empty (Linux reports its length: `accept_queue`)
            and the socket closes in that same turn: only a connection that completes its handshake within those
            microseconds can still be reset. Where the length cannot be read, the loop gets 20 ms to accept."""
            sockets = list(sockets or [])
            deadline = asyncio.get_running_loop().time() + 1.0
            queued = [accept_queue(sock) for sock in sockets]
            if None in queued:
                await asyncio.sleep(0.02)
            while any(queued) and None not in queued and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.0005)
                queued = [accept_queue(sock) for sock in sockets]
            for server in self.servers:
                server.close()
            for sock in sockets:
                sock.close()
            await asyncio.sleep(0.5)
            await super().shutdown()

    if not one_process:
        class FrontendServer(Server):
            """A front-end's server stops on STOP_SIGNAL, which only the supervisor sends, after draining it
            (SIGUSR1). SIGTERM and SIGINT are the supervisor's to handle: sent to the whole process group (systemd's
            KillMode=control-group, Ctrl-C in a terminal) they would stop this process at once, in the middle of the
            drain the supervisor runs for everyone."""

            @contextlib.contextmanager
            def capture_signals(self):
                handlers = {signal.SIGTERM: signal.SIG_IGN, signal.SIGINT: signal.SIG_IGN,
                            STOP_SIGNAL: lambda sig, frame: self.handle_exit(signal.SIGTERM, frame)}
                previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
                try:
                    yield
                finally:
                    for sig, handler in previous.items():
                        signal.signal(sig, handler)

        return FrontendServer

    class OneProcessServer(Server):
        """The first SIGTERM (or SIGINT) drains for `drain_s` (`on_drain`: the app starts closing connections),
        then uvicorn's graceful shutdown; a second one shuts down at once."""

        draining = False

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises the captured signal after its graceful shutdown, so the process would
            # die "by SIGTERM"; a drained, clean shutdown exits 0 instead
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame):
            if drain_s > 0 and not self.draining and self.started:
                self.draining = True
                on_drain()
                threading.Timer(drain_s, super().handle_exit, (sig, None)).start()
                return
            super().handle_exit(sig, frame)

    return OneProcessServer


STOP_SIGNAL = signal.SIGUSR2  # the supervisor's "stop now" to a front-end (`FrontendServer`)


class FrontendProcess(Process):
    """A front-end process: drained by the supervisor (SIGUSR1), then stopped by it (STOP_SIGNAL); it ignores
    SIGTERM and SIGINT, which reach it only when sent to the whole process group."""

    def target(self, sockets=None):
        # in the child, before the app is imported (seconds of torch): a stop sent to the whole process group is
        # the supervisor's to handle (`FrontendServer.capture_signals` keeps it so once uvicorn runs)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        # the supervisor's health check (a ping every half second, `timeout_worker_healthcheck` to answer) is
        # answered from here on: uvicorn's own target starts its answering thread only after the import, and a
        # front-end importing for longer than the timeout (5 s: two dozen front-ends and the engines importing
        # torch at once on a node) was killed as hung and started again
        self.server  # noqa: B018 - made on this thread, before the answering thread reads it
        threading.Thread(target=self.always_pong, daemon=True, name="healthcheck").start()
        if isinstance(self.config.app, str):  # the app's module imported here, timed: what a start spends on it
            began = time.monotonic()
            try:
                importlib.import_module(self.config.app.partition(":")[0])
            except Exception:  # noqa: BLE001 - uvicorn's own load of the app reports it, as it would have
                pass
            else:
                logging.basicConfig(level=logging.INFO,
                                    format="%(asctime)s %(levelname)s %(name)s[http %(process)d]: %(message)s")
                logging.getLogger(__name__).info("front-end process: modules imported in %.1f s",
                                                 time.monotonic() - began)
        self.server.run(sockets)  # (uvicorn's `Process.target`, less its health-check thread, started above)

    def terminate(self) -> None:
        if self.process.exitcode is None and self.process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, STOP_SIGNAL)

    @property
    def server(self):
        if self._server is None:
            self._server = server_class(one_process=False)(config=self.config)
        return self._server


class ConnectionLimits:
    """What one HTTP process allows a connection (`LimitedHttpToolsProtocol`): `max_connections` open at once (the next is
    answered 503 and closed), `max_header_bytes` of request line and headers and `max_headers` headers (431),
    `header_timeout_s` from a connection's opening or a request's first byte to its last header, and `body_timeout_s`
    from there to its body's last byte (408, then closed). Idle keep-alive connections close after uvicorn's
    `timeout_keep_alive`. `balance`: the front-ends' `ConnectionBoard` (its file and how many front-ends share it),
    where there are several."""

    def __init__(self, max_connections: int, max_header_bytes: int, max_headers: int, header_timeout_s: float,
                 body_timeout_s: float, balance: tuple[str, int] | None = None):
        self.max_connections, self.max_header_bytes, self.max_headers = max_connections, max_header_bytes, max_headers
        self.header_timeout_s, self.body_timeout_s = header_timeout_s, body_timeout_s
        self.balance = balance


class ConnectionBoard:
    """The client connections each front-end holds, shared by the front-ends: a small file with a row per front-end
    (written by it alone), read when a request arrives.

    The kernel spreads new connections over the front-ends' listening sockets by a hash of their addresses, so
    keep-alive clients are spread unevenly: 256 over 24 front-ends put about 17 on the busiest and 5 on the least,
    and the busiest saturates its core while others idle, holding its clients' requests back from the GPUs. A
    front-end holding more than its share (`over`) answers a request with `Connection: close`, one every
    `SHED_INTERVAL_S` at most; the client reconnects, and its new connection lands by the hash on any front-end.

    A front-end claims a row (`shared_rows.claim_row`) and zeroes the others no live process holds, a dead
    predecessor's count among them. Where the file cannot be made or every row is held, `open` returns None and
    connections stay where the kernel put them."""

    ROWS = 128  # the most front-ends (64), twice over: a restarted one may start before its predecessor is gone
    SHED_INTERVAL_S = 0.05
    # a front-end over its share by more than this many connections, or this fraction of the share, sheds one
    SLACK, SLACK_FRACTION = 2, 0.25

    def __init__(self, fd: int, row: int, frontends: int):
        import mmap

        self._fd, self.row, self.frontends = fd, row, frontends  # the descriptor holds the row's lock
        self._map = mmap.mmap(fd, self.ROWS * 8)
        self.table = memoryview(self._map).cast("q")
        self.shed_at = 0.0

    @classmethod
    def open(cls, path: str, frontends: int) -> "ConnectionBoard | None":
        try:  # rows no live process holds are zeroed: a dead front-end's count would stay in the share
            claimed = claim_row(path, cls.ROWS, 8, clear_stale=True)
        except OSError:
            return None
        return cls(*claimed, frontends) if claimed is not None else None

    def set(self, connections: int) -> None:
        self.table[self.row] = connections

    def over(self, connections: int, now: float) -> bool:
        """Whether a front-end holding `connections` should shed one now (and, if so, that it has)."""
        if now - self.shed_at < self.SHED_INTERVAL_S:
            return False
        share = sum(self.table) / self.frontends
        if connections <= share + max(self.SLACK, self.SLACK_FRACTION * share):
            return False
        self.shed_at = now
        return True


_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}
LINGER_S = 2.0  # how long a refused connection's incoming bytes are read and dropped before it closes


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol bounded by its config's `connection_limits` (`ConnectionLimits`): without them a
    client holds memory with headers of any size (read before authentication), and descriptors with connections
    that send a byte a second, or nothing."""

    _boards: dict = {}  # this process's `ConnectionBoard` by its file, opened at its first connection (or None)

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.limits: ConnectionLimits = config.connection_limits
        self._timer = None
        self._refused = None  # (status, message): answered once the parser returns
        self._header_bytes = 0
        self._header_count = 0
        self._in_headers = True  # reading a request line and headers (or waiting for one)

    @classmethod
    def board(cls, limits: ConnectionLimits) -> "ConnectionBoard | None":
        if limits.balance is None:
            return None
        if limits.balance not in cls._boards:
            cls._boards[limits.balance] = ConnectionBoard.open(*limits.balance)
        return cls._boards[limits.balance]

    def connection_made(self, transport):
        super().connection_made(transport)
        if (board := self.board(self.limits)) is not None:
            board.set(len(self.connections))
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, f"more than {self.limits.max_connections} connections to this process",
                         retry_after=True)
            return
        self._arm(self.limits.header_timeout_s)

    def connection_lost(self, exc):
        self._cancel()
        super().connection_lost(exc)
        if (board := self.board(self.limits)) is not None:
            board.set(len(self.connections))

    def _cancel(self):
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, seconds: float):
        self._cancel()
        self._timer = self.loop.call_later(seconds, self._expired)

    def _expired(self):
        self._timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and self.cycle.response_started:  # mid-reply: nothing more can be said
            self.transport.close()
            return
        what = "headers" if self._in_headers else "body"
        self._refuse(408, f"the request's {what} did not arrive in time")

    def _refuse(self, status: int, message: str, retry_after: bool = False):
        self._refused = (status, message)
        self._cancel()
        body = ('{"error": {"type": "%s", "message": "%s"}}' % (
            {408: "request_timeout", 431: "headers_too_large", 503: "too_many_connections"}[status],
            message)).encode()
        head = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status]), b"content-type: application/json\r\n",
                b"content-length: %d\r\n" % len(body), b"connection: close\r\n"]
        if retry_after:
            head.append(b"retry-after: 1\r\n")
        self.transport.write(b"".join(head) + b"\r\n" + body)
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self._linger()

    def _linger(self):
        """Close a refused connection without resetting it under its refusal (nginx's lingering close). Its client
        may still be sending the request: a socket closed with bytes unread, or receiving bytes once closed, sends
        a reset, and a reset can discard the reply before the client has read it (it then sees 'connection reset'
        where a 503 or 431 was written). So the write side is shut after the reply (FIN), what still arrives is
        dropped (`data_received`), and the socket closes at the client's own close or after `LINGER_S`. Beyond
        `max_connections` + max(64, `max_connections`) connections a refused one closes at once: lingering must not
        cost descriptors without bound."""
        limit = self.limits.max_connections + max(64, self.limits.max_connections)
        if len(self.connections) > limit or not self.transport.can_write_eof():
            self.transport.close()
            return
        self.flow.resume_reading()
        self.transport.write_eof()
        self._timer = self.loop.call_later(LINGER_S, self.transport.close)

    def data_received(self, data):
        if self._refused is not None:  # lingering: dropped
            return
        super().data_received(data)
        if self._refused is None and self._in_headers and not self.transport.is_closing():
            # still in a request's headers after all of `data`: every byte of it was header (or waiting for
            # one), which the parser buffers until a header is whole, so it is counted here
            self._header_bytes += len(data)
            if self._header_bytes > self.limits.max_header_bytes:
                self._refuse(431, f"request line and headers over {self.limits.max_header_bytes} bytes")

    def on_message_begin(self):
        super().on_message_begin()
        if self._refused is None:  # (a request pipelined behind a refused one is dropped with it)
            self._in_headers, self._header_count = True, 0
            self._arm(self.limits.header_timeout_s)

    def on_header(self, name, value):
        if self._refused is None:
            self._header_count += 1
            if self._header_count > self.limits.max_headers:
                self._refuse(431, f"more than {self.limits.max_headers} headers")
            else:
                super().on_header(name, value)

    def on_headers_complete(self):
        if self._refused is not None:
            return
        self._in_headers, self._header_bytes = False, 0
        if len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers) > self.limits.max_header_bytes:
            self._refuse(431, f"request line and headers over {self.limits.max_header_bytes} bytes")
            return
        self._arm(self.limits.body_timeout_s)
        super().on_headers_complete()
        board = self.board(self.limits)
        if board is not None and self.cycle is not None and board.over(len(self.connections), self.loop.time()):
            self.cycle.keep_alive = False  # answered with `Connection: close`: the client reconnects elsewhere

    def on_body(self, body):
        if self._refused is None:
            super().on_body(body)

    def on_message_complete(self):
        if self._refused is None:
            self._cancel()
            super().on_message_complete()
