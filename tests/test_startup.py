"""What a start must not do: each of these once cost seconds of every start on the H100 host
(docs/PERFORMANCE.md, "Start-up"). The server's main process decides how many engine processes to start without
importing torch, and loading a tower (a checkpoint or a random preset) imports neither torch._dynamo nor sympy."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil

from test_engine_process import server


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _maps_torch(pid: int) -> bool:
    return any("libtorch" in m.path for m in psutil.Process(pid).memory_maps(grouped=True))


def test_the_main_process_starts_its_engines_without_torch():
    """The parent of a multi-process server never maps libtorch; its engine process does (the check can fail)."""
    with server(1) as (url, proc):
        import httpx

        engine = httpx.get(f"{url}/info").json()["engine"]["pid"]
        assert _maps_torch(engine)
        assert not _maps_torch(proc.pid)


def test_only_the_front_ends_start_a_video_sandbox():
    """Behind front-ends an engine process never decodes (the front-ends send it frames), so it starts no video
    sandbox: a forkserver importing torch, seconds of CPU in each engine just as the server turns ready. Each
    front-end starts its own (the check can fail)."""
    import time

    def forkservers(pid: int) -> int:
        return sum("multiprocessing.forkserver" in " ".join(c.cmdline()) for c in psutil.Process(pid).children())

    with server(1) as (url, proc):
        import httpx

        engine = httpx.get(f"{url}/info").json()["engine"]["pid"]
        front_end = [p.pid for p in psutil.Process(proc.pid).children()
                     if p.pid != engine and "spawn_main" in " ".join(p.cmdline()) and _maps_torch(p.pid)
                     and any(c.status == "LISTEN" for c in p.net_connections("tcp"))]
        assert len(front_end) == 1
        deadline = time.monotonic() + 30
        while forkservers(front_end[0]) == 0 and time.monotonic() < deadline:  # started in the background
            time.sleep(0.2)
        assert forkservers(front_end[0]) == 1
        assert forkservers(engine) == 0


def test_the_device_count_without_torch_is_torchs():
    """`cuda_device_count` before torch is imported (the driver's count, if torch is built with CUDA) and after
    (torch's own) agree: 0 on a CPU build, the GPUs on a GPU host."""
    code = ("import json, sys; {pre}from service.settings import cuda_device_count, Settings; "
            "print(json.dumps({{'n': cuda_device_count(), 'torch': 'torch' in sys.modules, "
            "'devices': Settings().resolved_devices()}}))")
    without = _run(code.format(pre=""))
    with_torch = _run(code.format(pre="import torch; "))
    assert not without["torch"] and with_torch["torch"]
    assert without["n"] == with_torch["n"] and without["devices"] == with_torch["devices"]


def test_loading_a_tower_imports_neither_dynamo_nor_sympy(full_checkpoint):
    """Built on the meta device and given its weights, from a checkpoint and from a random preset: torch's Python
    references of meta-device ops (nn.Embedding's normal_, Module.to_empty's empty_like) import torch._dynamo and
    sympy. transformers' config classes (which read a checkpoint's config.json) are imported first: what they
    import is theirs (some versions import both)."""
    code = ("import json, sys; from transformers import Qwen3VLConfig; from service.model.loader import load_tower; "
            "seen = lambda: {m: m in sys.modules for m in ('torch._dynamo', 'sympy')}; before = seen(); "
            f"a, _ = load_tower({str(full_checkpoint)!r}); b, _ = load_tower('random:tiny'); "
            "print(json.dumps({'before': before, 'after': seen(), "
            "'loaded': sum(p.numel() for p in a.parameters()) > 0 and not any(p.is_meta for p in b.parameters())}))")
    got = _run(code)
    assert got["loaded"] and got["after"] == got["before"], got


def test_a_front_end_answers_the_supervisors_health_check_while_it_imports(tmp_path, monkeypatch):
    """The supervisor pings each front-end every half second and kills one that does not answer within
    `timeout_worker_healthcheck` (5 s) as hung. A front-end answers from its start, not only once its app's modules
    are imported: on a node two dozen front-ends and the engines import torch at once, and one that took more than
    5 s was killed and started again. Here the import takes 3 s and each ping gets 1 s."""
    import socket
    import time

    import uvicorn

    from service.uvicorn_server import FrontendProcess

    (tmp_path / "slow_import_app.py").write_text(
        "import time\ntime.sleep(3)\n\nasync def app(scope, receive, send):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned child gets the parent's sys.path
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    process = FrontendProcess(uvicorn.Config("slow_import_app:app", log_level="warning"), [sock])
    process.start()
    try:
        began = time.monotonic()
        answers = []
        while time.monotonic() - began < 2.5:  # inside the import
            answers.append(process.ping(timeout=1.0))
            time.sleep(0.2)
        assert process.process.is_alive()
        assert answers and all(answers), answers
    finally:
        process.process.kill()
        process.process.join(10)
        sock.close()
