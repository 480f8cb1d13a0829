"""Several engine processes behind the front-ends (`QWEN3VL_DEVICES`), on the CPU: two engines on `cpu,cpu`.

Requests spread over both engines and their results are those of encoding alone; /ready turns 200 only once every
engine is up; killing one engine under load leaves the other serving and the server ready, and the dead one is
restarted without stopping it. An engine that cannot start is retried, then the server exits with code 2."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import torch

from conftest import rel_err
from conftest import random_pngs
from servers import free_port
from test_engine_process import _metric, _post_all, server
from service.engine.supervisor import engine_environment
from service.model.encoder import Encoder


def _engines(url) -> list[dict]:
    return httpx.get(f"{url}/info").json()["engine"]["engines"]


def test_two_engines_share_the_load_and_survive_each_other():
    tiny = Encoder.load("random:tiny")
    images = random_pngs(24, seed=31)
    with server(2, engines=2, QWEN3VL_DEVICES="cpu,cpu", QWEN3VL_MAX_WAIT_MS="20") as (url, proc):
        engines = _engines(url)  # /ready said 200: every engine is up
        assert [e["state"] for e in engines] == ["up", "up"], engines
        assert [e["device"] for e in engines] == ["cpu", "cpu"] and engines[0]["pid"] != engines[1]["pid"]
        assert _metric(url, "qwen3vl_engines") == 2

        responses = asyncio.run(_post_all(url, images, {"format": "json"}))
        assert [r.status_code for r in responses] == [200] * len(images)
        for img, r in zip(images, responses):
            ref = tiny.encode([tiny.preprocess(img)])[0]
            assert rel_err(torch.tensor(r.json()["data"][0]["embeddings"]), ref.embeds) <= 1e-5
        forwards = [e["forwards"] for e in _engines(url)]
        assert all(f > 0 for f in forwards), forwards  # both engines served

        # kill engine 0 under load: the other keeps serving; the dead one comes back
        victim = _engines(url)[0]["pid"]

        async def load_while_killing():
            async with httpx.AsyncClient(timeout=60) as c:
                async def one(body):
                    return await c.post(f"{url}/embed", content=body, headers={"content-type": "image/png"})

                first = [asyncio.create_task(one(b)) for b in images[:12]]
                await asyncio.sleep(0.05)
                os.kill(victim, signal.SIGKILL)
                during = await asyncio.gather(*first)
                await asyncio.sleep(0.3)  # the front-ends have seen the connection close
                after = await asyncio.gather(*(one(b) for b in images[12:]))
                return during, after

        readiness: list[int] = []
        watching = threading.Event()

        def watch_ready():  # while engine 0 restarts, engine 1 keeps the server ready
            with httpx.Client(timeout=5) as c:
                while not watching.is_set():
                    readiness.append(c.get(f"{url}/ready").status_code)
                    time.sleep(0.02)

        watcher = threading.Thread(target=watch_ready)
        watcher.start()
        during, after = asyncio.run(load_while_killing())
        info = httpx.get(f"{url}/info").json()["engine"]
        capacity_during = (info["engines_up"], info["engines_configured"])
        assert {r.status_code for r in during} <= {200, 503}, [r.text for r in during if r.status_code not in (200, 503)]
        assert [r.status_code for r in after] == [200] * len(after)  # the surviving engine took them all
        deadline = time.time() + 60
        while True:
            engines = _engines(url)
            if all(e["state"] == "up" for e in engines) and engines[0].get("pid") not in (None, victim):
                break
            assert time.time() < deadline, engines
            time.sleep(0.1)
        watching.set()
        watcher.join()
        assert readiness and set(readiness) == {200}, readiness
        assert capacity_during in ((1, 2), (2, 2)), capacity_during
        assert httpx.get(f"{url}/info").json()["engine"]["engines_up"] == 2
        assert engines[0]["restarts"] == 1 and engines[1]["restarts"] == 0
        metrics = httpx.get(f"{url}/metrics").text
        assert 'qwen3vl_engine_restarts_total{device="cpu"} 1.0' in metrics
    assert proc.returncode == 0


def test_an_engine_that_cannot_start_is_retried_then_the_server_exits_2():
    """Two engines, one on a device that cannot start (cuda:0 on a CPU build of torch): it is retried with the
    backoff; /ready never says 200 meanwhile although the other engine is up (a pod at half its capacity is not
    ready); after its retries the server exits with code 2 and names the engine's error in one line."""
    port = free_port()
    env = {**os.environ, "QWEN3VL_MODEL": "random:tiny", "QWEN3VL_DEVICES": "cpu,cuda:0", "QWEN3VL_DEVICE": "cpu",
           "QWEN3VL_PORT": str(port), "QWEN3VL_HOST": "127.0.0.1", "QWEN3VL_HTTP_WORKERS": "1",
           "QWEN3VL_ENGINE_MAX_RESTARTS": "2", "QWEN3VL_ENGINE_RESTART_BACKOFF_S": "0.5"}
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    statuses = set()
    try:
        with httpx.Client(timeout=5) as c:
            while proc.poll() is None:
                try:
                    statuses.add(c.get(f"http://127.0.0.1:{port}/ready").status_code)
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    out = "".join(lines)
    assert proc.returncode == 2, out[-3000:]
    assert 200 not in statuses and 503 in statuses, statuses
    assert any("engine on cpu ready" in line or "engine process" in line and "on cpu ready" in line for line in lines)
    retried = [line for line in lines if "on cuda:0 failed to start" in line]
    assert len(retried) == 2, out[-3000:]  # two restarts, then the third failure gives up
    final = [line for line in lines if "service.server" in line and "could not start" in line]
    assert len(final) == 1 and "cuda:0" in final[0] and "CUDA" in final[0], out[-3000:]


def test_each_gpu_engine_sees_only_its_own_gpu(monkeypatch):
    """cuda:N names the Nth GPU this process sees: an orchestrator's CUDA_VISIBLE_DEVICES still applies, and the
    engine sees that one GPU alone, as cuda:0."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert engine_environment("cuda:3") == {"CUDA_VISIBLE_DEVICES": "3", "QWEN3VL_DEVICE": "cuda:0"}
    assert engine_environment("cuda") == {"CUDA_VISIBLE_DEVICES": "0", "QWEN3VL_DEVICE": "cuda:0"}
    assert engine_environment("cpu") == {"QWEN3VL_DEVICE": "cpu"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5, GPU-8d1e")
    assert engine_environment("cuda:1")["CUDA_VISIBLE_DEVICES"] == "5"
    assert engine_environment("cuda:2")["CUDA_VISIBLE_DEVICES"] == "GPU-8d1e"
    try:
        engine_environment("cuda:3")
    except ValueError as e:
        assert "3 GPUs visible" in str(e)
    else:
        raise AssertionError("cuda:3 of three visible GPUs was accepted")


def test_a_front_end_is_started_once_it_reached_every_engine_or_found_it_restarting(tmp_path, monkeypatch):
    """`EnginePool.started` with the server's start-up marker present: a front-end connected to one engine while
    another is listening but not yet connected to is not started (the 4-GPU warm start at 3f1bffc answered /ready
    200 with a front-end on 2 of 4 engines); one whose other engine is not listening (restarting) is started once it
    has tried it, and says so through `on_change`."""
    from service.engine.api import Decoder
    from service.engine.remote import EnginePool, RemoteEngine

    class _Up:
        broken = None

    slow = {"engine-1"}
    listening = {"engine-0", "engine-1"}

    async def connect(self, timeout_s=5.0):
        name = os.path.basename(self.path)
        if name in slow:
            await asyncio.sleep(0.4)
        if name not in listening:
            raise OSError("not listening")
        self._link = _Up()

    async def disconnected(self):
        await asyncio.Event().wait()

    monkeypatch.setattr(RemoteEngine, "connect", connect)
    monkeypatch.setattr(RemoteEngine, "disconnected", disconnected)
    marker = tmp_path / "started"
    marker.touch()

    class _Sandbox:  # what the front-end's video sandbox is told: start its forkserver once serving, not before
        def __init__(self):
            self.prepared = 0

        def prepare(self):
            self.prepared += 1

        def close(self):
            pass

    async def run(names):
        changes = []
        sandbox = _Sandbox()
        pool = EnginePool([RemoteEngine(str(tmp_path / n), device=n) for n in names], Decoder(1, sandbox),
                          on_change=lambda device, up: changes.append((device, up, pool.started)),
                          started_marker=str(marker))
        await pool.start()
        await asyncio.sleep(0.2)
        early = pool.started, pool.capacity
        assert bool(sandbox.prepared) == pool.started, sandbox.prepared
        await asyncio.sleep(0.5)
        late = pool.started, pool.capacity
        assert bool(sandbox.prepared) == pool.started, sandbox.prepared
        for task in pool._links:
            task.cancel()
        pool._decode.close()
        return early, late, changes

    # engine-1 listens but takes 0.4 s to answer: not started until it is connected
    early, late, changes = asyncio.run(run(["engine-0", "engine-1"]))
    assert early == (False, (1, 2)) and late == (True, (2, 2)), (early, late)
    assert changes[-1] == ("engine-1", True, True), changes
    # engine-2 is not listening (restarting after start-up): started once it was tried, told through on_change
    slow.clear()
    early, late, changes = asyncio.run(run(["engine-0", "engine-2"]))
    assert early == (True, (1, 2)) and late == (True, (1, 2)), (early, late)
    assert ("engine-2", False, True) in changes, changes
    # without the marker (the server's start-up is not over), a missing engine holds the front-end back
    marker.unlink()
    early, late, changes = asyncio.run(run(["engine-0", "engine-2"]))
    assert (early[0], late[0]) == (False, False), (early, late)


def test_a_gpu_engine_that_serves_at_once_opens_its_gpu_while_it_imports_and_a_standby_does_not(monkeypatch):
    """`open_device_early`: the driver's primary context of the engine's one GPU is retained on a thread, with
    CUDA_VISIBLE_DEVICES already the engine's when the driver starts. The supervisor asks it of the engine it starts
    to serve, never of a standby (the GPU still belongs to the engine serving there)."""
    import ctypes
    import multiprocessing
    import multiprocessing.connection

    from service.engine import supervisor

    calls = []

    class Driver:
        def cuInit(self, flags):
            calls.append(("cuInit", os.environ.get("CUDA_VISIBLE_DEVICES")))
            return 0

        def cuDeviceGet(self, handle, index):
            calls.append(("cuDeviceGet", index))
            return 0

        def cuDevicePrimaryCtxRetain(self, context, handle):
            calls.append(("cuDevicePrimaryCtxRetain",))
            return 0

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Driver())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert supervisor.open_device_early(engine_environment("cpu")) is None and not calls
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    env = engine_environment("cuda:1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    supervisor.open_device_early(env).join(5)
    assert calls == [("cuInit", "5"), ("cuDeviceGet", 0), ("cuDevicePrimaryCtxRetain",)]

    spawned = []  # open_device of each engine process, in order

    class Child:
        """An engine process as the supervisor sees it: ready once told to go, dead once `die()` is called."""

        def __init__(self, target, args, name):
            # the supervisor closes its copy of the child's end once the process started: keep one of our own
            self.conn = multiprocessing.connection.Connection(os.dup(args[0].fileno()))
            self.open_device = args[2]
            self.exitcode, self.pid = None, 1000 + len(spawned)
            self._r, self._w = os.pipe()
            self.sentinel = self._r
            spawned.append(self)

        def start(self):
            def run():
                try:
                    if self.conn.recv()[0] == "go":
                        self.conn.send(("ready", None))
                except (EOFError, OSError):
                    pass
            threading.Thread(target=run, daemon=True).start()

        def die(self):
            self.exitcode = -9
            os.close(self._w)

        def join(self, timeout=None):
            if self.exitcode is None:
                self.die()

        def is_alive(self):
            return self.exitcode is None

        kill = die

    class Context:
        Pipe = staticmethod(multiprocessing.Pipe)
        Process = Child

    sup = supervisor.EngineSupervisor({"QWEN3VL_DEVICE": "cuda:0"}, backoff_s=0.01, standby=True, name="cuda:0")
    sup._ctx = Context()
    sup.start()
    deadline = time.monotonic() + 10
    while len(spawned) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sup.ready.is_set()
    spawned[0].die()  # the serving engine dies: the standby takes over, and a new standby is spawned
    while len(spawned) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    sup._stopping.set()
    spawned[1].die()
    sup._thread.join(5)
    assert not sup._thread.is_alive()
    assert [c.open_device for c in spawned] == [True, False, False]
