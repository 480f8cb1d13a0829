"""A small file shared by a server's processes, a row each: `claim_row` locks the first row no live process holds.

The lock is a POSIX record lock on the row's byte, released when its holder exits however it exits, so a row is free
again the moment its process is gone; what the row says may then be stale, and the next process to claim it zeroes
it. The front-ends' engine loads (`engine.remote.LoadBoard`) and their connection counts
(`uvicorn_server.ConnectionBoard`) are such files. Standard library only: the HTTP supervisor's module imports it."""

from __future__ import annotations

import fcntl
import os


def claim_row(path: str, rows: int, row_bytes: int, clear_stale: bool = False) -> tuple[int, int] | None:
    """Open the file at `path` (made, zero-filled, where there is none: `rows` rows of `row_bytes` each) and lock the
    first of its rows no live process holds, zeroing it: (the open descriptor, which holds the lock for the process's
    life; the row), or None where every row is held; `OSError` where the file cannot be made. `clear_stale`: also
    zero every other row no live process holds, each locked for that moment only (so that processes claiming rows
    at once each find one)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < rows * row_bytes:
            os.ftruncate(fd, rows * row_bytes)  # zeros; the same size whichever process comes first
        mine = None
        for row in range(rows):
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, row)
            except OSError:
                continue
            os.pwrite(fd, bytes(row_bytes), row * row_bytes)
            if mine is None:
                mine = row
                if not clear_stale:
                    break
            else:
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, row)
    except BaseException:
        os.close(fd)
        raise
    if mine is None:
        os.close(fd)
        return None
    return fd, mine
