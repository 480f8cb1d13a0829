"""The front-ends' shared account of the work outstanding at each engine (`remote.LoadBoard`), by which a request
goes to the engine with the least work ahead of it from every front-end, not from its own view alone.

Front-ends are processes: each board here is opened in a process of its own (a row's lock is per process)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import numpy as np

from service.engine.remote import EnginePool, LoadBoard, RemoteEngine


def _front_end(path: str, engines: int, loads: list[int], conn) -> None:
    board = LoadBoard.open(path, engines)
    for i, patches in enumerate(loads):
        board.set(i, patches)
    conn.send(board.row)
    conn.recv()  # hold the row until told to go


def _start(ctx, path, engines, loads):
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_front_end, args=(path, engines, loads, child))
    proc.start()
    return proc, parent, parent.recv()


def test_rows_are_claimed_once_summed_and_freed_by_a_dead_front_end(tmp_path):
    ctx = mp.get_context("spawn")
    path = str(tmp_path / "engine-loads")
    a, a_conn, a_row = _start(ctx, path, 3, [100, 0, 7])
    b, b_conn, b_row = _start(ctx, path, 3, [5, 40, 0])
    try:
        assert a_row != b_row
        me = LoadBoard.open(path, 3)  # this process is a third front-end
        assert me.row not in (a_row, b_row)
        me.set(2, 1)
        np.testing.assert_array_equal(me.loads(), [105, 40, 8])

        os.kill(a.pid, signal.SIGKILL)  # a front-end dies with work outstanding: its row stays until reclaimed
        a.join()
        c, c_conn, c_row = _start(ctx, path, 3, [0, 0, 0])
        assert c_row == a_row  # its lock went with it: the next front-end takes the row and zeroes it
        np.testing.assert_array_equal(me.loads(), [5, 40, 1])
        c_conn.send("go")
        c.join()
    finally:
        b_conn.send("go")
        b.join()


def test_a_request_goes_where_the_least_work_is_from_every_front_end(tmp_path):
    ctx = mp.get_context("spawn")
    path = str(tmp_path / "engine-loads")
    # another front-end has 5000 patches outstanding at engine 0 and none at engine 1
    other, conn, _ = _start(ctx, path, 2, [5000, 0])
    try:
        engines = [RemoteEngine(f"/nonexistent/{i}.sock", device=f"cuda:{i}") for i in range(2)]
        pool = EnginePool(engines, decoder=None, board=LoadBoard.open(path, 2))
        for e in engines:  # connected, as far as routing is concerned
            e._link = type("Link", (), {"broken": None})()
        engines[1].reported_patches = 3000  # a stale queue depth engine 1 reported to this front-end earlier
        assert pool._least_loaded() is engines[1]
        # without the board this front-end would have sent it to engine 0, which it sees as idle
        assert min(engines, key=lambda e: e.load) is engines[0]

        engines[1].sent_patches = 6000  # this front-end's own work counts on the board too
        np.testing.assert_array_equal(pool.board.loads(), [5000, 6000])
        assert pool._least_loaded() is engines[0]
    finally:
        conn.send("go")
        other.join()


def test_without_a_board_file_routing_falls_back_to_the_front_ends_view(tmp_path):
    assert LoadBoard.open(str(tmp_path / "missing-dir" / "engine-loads"), 2) is None
