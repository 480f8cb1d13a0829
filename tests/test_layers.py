"""The architecture as a test: imports point one way, kernels -> model -> engine -> http, with no import circle,
and neither the kernels nor the engine process's modules reach up into a layer above them."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# rank of each first-party package: a module may import its own rank or lower. `service.errors` (and the package
# itself, which holds the version) is shared by every
# service layer; `service.settings` is read by the engine and the HTTP layer, never by the model.
RANKS = {"kernels": 0, "service.errors": 1, "service.model": 1, "service.settings": 2, "service.engine": 2,
         "service.http": 3, "service.dataset": 3, "service.server": 4, "service.cli": 4, "service": 1}


def _rank(module: str) -> int | None:
    for prefix in sorted(RANKS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return RANKS[prefix]
    return None


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """First-party modules imported by the file at `path`, relative imports resolved, at any depth of the file
    (imports inside functions count: they run too)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)  # `from pkg import module`
    return {m for m in found if _rank(m) is not None and (m.split(".")[0] in ("kernels", "service"))}


def _first_party() -> dict[str, set[str]]:
    modules = {}
    for top in ("kernels", "service"):
        for path in sorted((ROOT / top).rglob("*.py")):
            modules[_module_name(path)] = _imports(path)
    known = set(modules)
    # keep only imports that name a module (drop `from pkg.module import function` names)
    return {m: {i for i in imps if i in known} for m, imps in modules.items()}


GRAPH = _first_party()


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_upward_import(module):
    upward = [i for i in GRAPH[module] if _rank(i) > _rank(module)]
    assert not upward, f"{module} (rank {_rank(module)}) imports {upward} from a layer above it"


# the layered packages, top down: each imports only its own package and the next one down (what crosses from the
# model to the HTTP layer is re-exported by `service.engine.api`, the kernels' runtime by `service.model`)
LAYERS = ("service.http", "service.engine", "service.model", "kernels")


def _layer(module: str) -> int | None:
    return next((i for i, p in enumerate(LAYERS) if module == p or module.startswith(p + ".")), None)


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if _layer(m) is not None))
def test_a_layer_imports_only_the_next_one_down(module):
    mine = _layer(module)
    skipped = [i for i in GRAPH[module] if _layer(i) is not None and _layer(i) > mine + 1]
    assert not skipped, f"{module} imports {skipped}, below the layer under it ({LAYERS[mine + 1]})"


def test_the_layer_rule_sees_a_skipped_layer():
    assert _layer("service.http.output") == 0 and _layer("kernels.runtime") == 3
    assert _layer("service.settings") is None  # shared by the layers, outside the stack


def test_no_import_circle():
    """Module-level and function-level imports together form no cycle (packages importing their own submodules
    aside: `pkg/__init__` re-exporting `pkg.mod` is not a circle unless `pkg.mod` imports `pkg` back)."""
    def edges(m):
        return {i for i in GRAPH[m] if i != m}

    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(edges(m)):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                if not all(a.startswith(b + ".") or b.startswith(a + ".") for a, b in zip(cycle, cycle[1:])):
                    raise AssertionError("import circle: " + " -> ".join(cycle))
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_engine_process_never_loads_the_http_layer():
    """What the engine process imports (its entry module, transitively) holds no HTTP module, FastAPI or
    Prometheus."""
    seen, todo = set(), ["service.engine.process"]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(GRAPH[m])
    assert not [m for m in seen if m.startswith("service.http")], sorted(seen)
    for m in seen:
        path = ROOT / (m.replace(".", "/") + ".py")
        if not path.exists():
            path = ROOT / m.replace(".", "/") / "__init__.py"
        names = {n.split(".")[0] for n in _all_imports(path)}
        assert not names & {"fastapi", "starlette", "prometheus_client", "uvicorn"}, (m, names)


def _all_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.add(node.module)
    return out


def test_the_checker_sees_an_upward_import(tmp_path):
    """The rank table catches what it is for: the model importing the engine is upward."""
    assert _rank("service.engine.batching") > _rank("service.model.encoder")
    assert _rank("service.http.app") > _rank("service.engine.remote") > _rank("kernels.attention.launch")
    assert "service.model.encoder" in GRAPH["service.engine.batching"]


def test_no_test_imports_benchmarks():
    for path in (ROOT / "tests").rglob("*.py"):
        assert not any(i.split(".")[0] == "benchmarks" for i in _all_imports(path)), path


PROCESS_WIDE = ("setswitchinterval(", "set_num_threads(", "set_crc32_options(", "gc.freeze(")


def test_process_wide_state_is_set_only_where_a_process_starts():
    """The interpreter's switch interval, PyTorch's thread count and its save options are set by
    `service.runtime.configure_process` alone, which each kind of process calls at its start."""
    setters = sorted(f"{path.relative_to(ROOT)}: {call}" for top in ("kernels", "service")
                     for path in (ROOT / top).rglob("*.py") if path.name != "runtime.py"
                     for call in PROCESS_WIDE if call in path.read_text())
    assert not setters, setters


@pytest.mark.parametrize("role,threads,interval,crc32,returns", [("engine", 4, 0.0005, True, False),
                                                                 ("frontend", 1, None, False, True),
                                                                 ("local", None, 0.0005, False, True)])
def test_each_kind_of_process_gets_its_state(role, threads, interval, crc32, returns):
    """Each role's threads, switch interval and save options; glibc's thresholds fixed (`return_freed_memory`) where
    the process decodes, not in an engine, whose forwards' blocks would be mapped and unmapped at every pack."""
    import subprocess
    import sys

    code = ("import sys, torch; import service.runtime as runtime; default = sys.getswitchinterval(); "
            "n = torch.get_num_threads(); fixed = []; "
            "runtime.return_freed_memory = lambda *a: fixed.append(1) or True; runtime.configure_process(%r); "
            "print(torch.get_num_threads(), n, sys.getswitchinterval(), default, "
            "torch.serialization.get_crc32_options(), bool(fixed))" % role)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    got_threads, default_threads, got_interval, default_interval, got_crc32, got_returns = out.split()
    assert int(got_threads) == (threads if threads is not None else int(default_threads))
    assert float(got_interval) == (interval if interval is not None else float(default_interval))
    assert got_crc32 == str(crc32)
    assert got_returns == str(returns)


def test_settle_process_collects_start_up_s_garbage_and_freezes_the_rest():
    """What a process holds when it starts serving leaves the collector's generations (a full collection then walks
    only what serving made); start-up's garbage cycles are collected first, not frozen for good."""
    import subprocess
    import sys

    code = ("import gc, weakref; from service.runtime import settle_process\n"
            "class Node: pass\n"
            "kept = [Node() for _ in range(20000)]\n"
            "a, b = Node(), Node(); a.other, b.other = b, a; gone = weakref.ref(a); del a, b\n"
            "before = gc.get_freeze_count(); settle_process()\n"
            "print(before, gc.get_freeze_count(), gone() is None, len(gc.get_objects()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    before, frozen, collected, tracked = out.split()
    assert int(before) == 0 and int(frozen) >= 20000 and collected == "True"
    assert int(tracked) < 100  # the collector's generations are all but empty


def test_the_servers_settle_once_ready():
    """`on_ready` (`runtime.settle_process` in `serve` and in each front-end) runs once, when start-up is done: after
    /ready turns 200, not before."""
    import httpx

    from conftest import random_pngs
    from tests.servers import serve

    calls = []
    with serve(on_ready=lambda: calls.append(time.monotonic())) as (url, app):
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/ready").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert app.state.service.ready and len(calls) == 1
        httpx.post(f"{url}/embed", content=random_pngs(1)[0], headers={"content-type": "image/png"},
                   params={"embeddings": "false", "pooling": "mean"})
        assert len(calls) == 1


def test_an_unknown_role_is_refused():
    from service.runtime import configure_process

    with pytest.raises(ValueError, match="unknown process role"):
        configure_process("gpu")


def test_the_operator_s_settings_hold_no_process_wiring():
    """How `serve`'s processes find each other travels in `Wiring`, not in `Settings` (whose every field is an
    operator's setting, a flag and a variable)."""
    from service.engine.wiring import Wiring
    from service.settings import Settings

    assert not [f for f in Settings.model_fields if "socket" in f or f.endswith("_path")]
    wiring = Wiring(engine_sockets=("/run/q/engine-0.sock", "/run/q/engine-1.sock"), cache_dir="/dev/shm/c")
    assert Wiring.from_env(wiring.to_env()) == wiring and wiring.frontend and wiring.workdir == "/run/q"
    assert Wiring.from_env({}) == Wiring() and not Wiring().frontend
