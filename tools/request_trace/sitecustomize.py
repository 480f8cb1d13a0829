"""Timeline of one request through the server's processes, for `tools.request_trace.run` (which puts this
directory first on the server's PYTHONPATH, so every process imports it at start-up). Inactive unless TRACE_FILE
is set. It wraps the service's steps as their modules are imported and appends `ns pid tid label` lines to
TRACE_FILE (one write per mark, a few microseconds each): `label<` on entry, `label>` on exit."""

import os

if os.environ.get("TRACE_FILE"):
    import functools
    import importlib.util
    import inspect
    import sys
    import threading
    import time

    _fd = os.open(os.environ["TRACE_FILE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def mark(label):
        os.write(_fd, f"{time.perf_counter_ns()} {os.getpid()} {threading.get_native_id()} {label}\n".encode())

    def wrap(owner, name, label):
        f = getattr(owner, name, None)
        if f is None:  # another revision's server (`run --root`) may not have it
            return
        if inspect.iscoroutinefunction(f):
            async def g(*a, **k):
                mark(label + "<")
                try:
                    return await f(*a, **k)
                finally:
                    mark(label + ">")
        else:
            def g(*a, **k):
                mark(label + "<")
                try:
                    return f(*a, **k)
                finally:
                    mark(label + ">")
        setattr(owner, name, functools.wraps(f)(g))

    def after(owner, name, label):
        """Mark when `owner.name` (a coroutine function) returns."""
        f = getattr(owner, name, None)
        if f is None:
            return

        async def g(*a, **k):
            result = await f(*a, **k)
            mark(label)
            return result
        setattr(owner, name, g)

    def before(owner, name, label):
        f = getattr(owner, name, None)
        if f is None:
            return

        def g(*a, **k):
            mark(label)
            return f(*a, **k)
        setattr(owner, name, g)

    def batcher(cls):
        """The batcher's steps (`Batcher`; `Engine` in earlier revisions)."""
        for name, label in (("submit", "esubmit"), ("_launch", "elaunch"), ("_finish", "efinish"),
                            ("_complete", "complete")):
            wrap(cls, name, label)

    PATCHES = {
        "service.http.middleware": lambda m: wrap(m.ObserveMiddleware, "__call__", "http"),
        "service.http.app": lambda m: (wrap(m.Service, "encode", "encode"), wrap(m, "embed_response", "respond"),
                                       wrap(m, "openai_response", "respond"), wrap(m, "parse_embed", "parse"),
                                       wrap(m, "parse_openai", "parse")),
        "service.engine.remote": lambda m: (wrap(m.EnginePool, "preprocess", "pre"),
                                            wrap(m.RemoteEngine, "submit", "rsubmit"),
                                            after(m, "read_message", "f-read"), before(m, "write_message", "f-write")),
        "service.model.preprocess": lambda m: wrap(m.Preprocessor, "__call__", "decode"),
        "service.engine.process": lambda m: (after(m, "read_message", "e-read"),
                                             before(m, "write_message", "e-write")),
        "service.engine.batching": lambda m: batcher(getattr(m, "Batcher", None) or getattr(m, "Engine")),
        "service.model.encoder": lambda m: (wrap(m.Encoder, "launch", "launch"), wrap(m.Encoder, "finish", "finish"),
                                            wrap(m.Encoder, "pixels", "pixels")),
        "service.model.graphs": lambda m: wrap(m.BucketedTower, "frame", "frame"),
    }

    class _Hook:
        def find_spec(self, name, path, target=None):
            if name not in PATCHES:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                PATCHES[name](module)
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Hook())
