"""Keep-alive connections spread evenly over the front-ends: the kernel places each new connection on a front-end by
a hash of its addresses, so a few dozen clients land unevenly, and the busiest front-end saturates while others
idle. Front-ends share their connection counts (`uvicorn_server.ConnectionBoard`); one over its share answers a
request with `Connection: close` now and then, and the client's new connection lands elsewhere."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import time

import psutil

from service.uvicorn_server import ConnectionBoard
from servers import free_port
from tools.ready import wait_until_ready

_HOLDER = """
import sys
from service.uvicorn_server import ConnectionBoard
board = ConnectionBoard.open(sys.argv[1], 4)
board.set(int(sys.argv[2]))
print(board.row, flush=True)
sys.stdin.readline()
"""


def test_a_front_end_over_its_share_sheds_one_connection_at_a_time(tmp_path):
    board = ConnectionBoard.open(str(tmp_path / "board"), frontends=4)
    others = [r for r in range(ConnectionBoard.ROWS) if r != board.row][:3]

    def place(mine: int, *theirs: int):
        board.set(mine)
        for row, n in zip(others, theirs):
            board.table[row] = n

    place(16, 8, 8, 8)  # 40 over 4 front-ends: a share of 10, a slack of max(2, 2.5)
    assert board.over(16, now=100.0)
    assert not board.over(16, now=100.0 + ConnectionBoard.SHED_INTERVAL_S / 2)  # one at a time
    place(13, 9, 9, 9)  # the shed connection landed elsewhere
    assert board.over(13, now=101.0)
    place(12, 9, 9, 10)
    assert not board.over(12, now=102.0)  # within the slack: kept
    place(3, 0, 0, 0)  # few connections: a slack of 2 over a share of 3/4
    assert not board.over(2, now=103.0) and board.over(3, now=103.0)


def test_a_front_end_claims_a_free_row_and_clears_the_rows_of_the_dead(tmp_path):
    """Rows are claimed by a lock that goes with its holder, however it exits; the next front-end to open the board
    zeroes every row no live process holds, so a dead front-end's count does not stay in the share."""
    path = str(tmp_path / "board")
    holders = []
    for count in (3, 7, 9):
        p = subprocess.Popen([sys.executable, "-c", _HOLDER, path, str(count)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
        holders.append((p, int(p.stdout.readline())))
    assert [row for _, row in holders] == [0, 1, 2]
    for p, _ in holders[1:]:  # the last two exit; the first lives on
        p.communicate("\n", timeout=30)
    board = ConnectionBoard.open(path, 4)
    try:
        assert board.row == 1
        assert list(board.table[:4]) == [3, 0, 0, 0]
    finally:
        holders[0][0].communicate("\n", timeout=30)


def test_front_ends_opening_the_board_at_once_each_get_a_row_of_their_own(tmp_path):
    """A front-end opens the board at its first connection, and a load that starts with hundreds of connections
    opens it in every front-end at once: each finds a row (a scan holds at most one row besides its own), no two
    the same."""
    path = str(tmp_path / "board")
    holders = [subprocess.Popen([sys.executable, "-c", _HOLDER, path, str(n + 1)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, cwd=os.getcwd()) for n in range(8)]
    try:
        rows = [int(p.stdout.readline()) for p in holders]
        assert sorted(rows) == list(range(8))
        with open(path, "rb") as f:
            assert sorted(memoryview(f.read()).cast("q")[:8]) == list(range(1, 9))
    finally:
        for p in holders:
            p.communicate("\n", timeout=30)


def _frontend_connections(server_pid: int, port: int) -> dict[int, int]:
    out = {}
    for p in psutil.Process(server_pid).children(recursive=True):
        conns = p.net_connections("tcp")
        if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns):
            out[p.pid] = sum(c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port for c in conns)
    return out


def test_keep_alive_clients_end_up_spread_over_the_front_ends():
    """24 keep-alive clients on 2 front-ends, each sending requests back to back and reconnecting when told to
    close (as HTTP clients do): every request is answered 200, and at the end each front-end holds its share within
    the slack (12 + 3), as its row in the board says."""
    port = free_port()
    env = {**os.environ, "QWEN3VL_MODEL": "random:tiny", "QWEN3VL_DEVICE": "cpu", "QWEN3VL_HOST": "127.0.0.1",
           "QWEN3VL_PORT": str(port), "QWEN3VL_HTTP_WORKERS": "2"}
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        assert wait_until_ready(f"http://127.0.0.1:{port}", proc, timeout_s=120, interval_s=0.1)
        clients = [http.client.HTTPConnection("127.0.0.1", port, timeout=10) for _ in range(24)]
        initial = None
        closes, statuses = 0, []
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            for i, c in enumerate(clients):
                c.request("GET", "/health")
                r = c.getresponse()
                r.read()
                statuses.append(r.status)
                if r.getheader("connection", "").lower() == "close":
                    closes += 1
                    c.close()
                    clients[i] = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            if initial is None:
                initial = sorted(_frontend_connections(proc.pid, port).values())
            time.sleep(0.02)
        counts = _frontend_connections(proc.pid, port)
        assert set(statuses) == {200}
        assert len(counts) == 2 and sum(counts.values()) == 24, counts
        assert max(counts.values()) <= 12 + 3, (initial, counts, closes)
        if initial[-1] > 15:  # the hash placed them unevenly: shed until within the slack
            assert closes > 0
        # each front-end's row holds its count (the board is the file every front-end maps)
        board = next(f.path for pid in counts for f in psutil.Process(pid).open_files()
                     if f.path.endswith("frontend-connections"))
        with open(board, "rb") as f:
            rows = memoryview(f.read()).cast("q")
        assert sorted(n for n in rows if n) == sorted(counts.values())
        for c in clients:
            c.close()
    finally:
        proc.terminate()
        proc.wait(60)
