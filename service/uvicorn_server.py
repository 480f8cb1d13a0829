"""uvicorn's server and front-end process as `serve` runs them: a shutdown that loses no request, the one-process
server's drain on SIGTERM. A module of its own (no imports from the service): the front-end process object is
pickled into the spawned child, which finds its class here."""

from __future__ import annotations

import contextlib
import signal

from uvicorn.supervisors.multiprocess import Process


def server_class(drain_s: float = 0.0, on_drain=lambda: None, one_process: bool = True):
    """uvicorn's Server with a shutdown that loses no request. `one_process`: the server of `http_workers=0`, which
    drains on the first SIGTERM itself and exits 0 (a front-end process is drained by the supervisor and keeps
    uvicorn's signal handling)."""
    import asyncio
    import threading

    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            """Stop accepting without resetting a connection the kernel has queued (the loop accepts those first),
            and close idle connections only once requests already sent on newly accepted ones have arrived and
            started (uvicorn closes a connection with no request under way at once, and a client whose request was
            on its way gets no answer)."""
            await asyncio.sleep(0.02)
            for server in self.servers:
                server.close()
            for sock in sockets or []:
                sock.close()
            await asyncio.sleep(0.5)
            await super().shutdown()

    if not one_process:
        return Server

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


class FrontendProcess(Process):
    """A front-end process: drained by the supervisor (SIGUSR1, then SIGTERM), so uvicorn's signal handling."""

    @property
    def server(self):
        if self._server is None:
            self._server = server_class(one_process=False)(config=self.config)
        return self._server
