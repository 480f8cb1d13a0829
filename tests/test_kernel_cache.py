"""What the service keeps of the kernels between starts (`service.engine.build`): the tuner's choices on disk, and
Triton's compile cache in the cache directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def test_tuning_cache_round_trip(tmp_path, monkeypatch, caplog):
    """The service's on-disk cache of the tuner's choices: what one process chose, the next adopts without timing
    (keys it already chose stay); a corrupt file is ignored with a warning; no cache off the GPU or when disabled."""
    import torch

    from kernels import runtime
    from kernels.attention.tiles import GluonTile, PtrTile
    from service.engine.build import load_tuning, save_tuning, tuning_cache
    from service.settings import Settings

    key = ("gluon", 1, 1, 72, torch.bfloat16, torch.device("cuda", 0))
    other = ("ptr", 0, 0, 64, torch.float16, torch.device("cuda", 0))
    monkeypatch.setattr(runtime.TUNER, "choices", {key: GluonTile(128, 64, 8, 2)})
    path = tmp_path / "tuning" / "x.pkl"
    save_tuning(path)
    monkeypatch.setattr(runtime.TUNER, "choices", {other: PtrTile(64, 64)})
    load_tuning(path)
    assert runtime.tuned_choices() == {key: GluonTile(128, 64, 8, 2), other: PtrTile(64, 64)}
    path.write_bytes(b"not a pickle")
    load_tuning(path)
    assert "ignoring the kernel tuning cache" in caplog.text
    assert tuning_cache(Settings(cache_dir=str(tmp_path)), torch.device("cpu")) is None
    assert tuning_cache(Settings(cache_dir=""), torch.device("cuda", 0)) is None


@pytest.mark.parametrize("writable", [True, False])
def test_triton_compiles_into_the_cache_dir_or_a_temporary_one(tmp_path, monkeypatch, caplog, writable):
    """Triton fails every compile where it cannot create its cache directory: a cache volume the server cannot
    write (here a path below a regular file, which even root cannot create) costs a warning and a temporary
    directory, not the start."""
    from service.engine.build import configure_runtime
    from service.settings import Settings

    for name in ("TRITON_CACHE_DIR", "CUBLASLT_WORKSPACE_SIZE"):  # restored as they were after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    (tmp_path / "file").write_bytes(b"")
    cache = tmp_path / ("volume" if writable else "file/volume")
    configure_runtime(Settings(cache_dir=str(cache)))
    triton_dir = os.environ["TRITON_CACHE_DIR"]
    if writable:
        assert triton_dir == str(cache / "triton") and (cache / "triton").is_dir()
        assert "not writable" not in caplog.text
    else:
        assert not triton_dir.startswith(str(tmp_path))
        (Path(triton_dir) / "probe").write_bytes(b"ok")
        assert f"{cache / 'triton'} is not writable" in caplog.text
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")  # the user's own choice wins
    configure_runtime(Settings(cache_dir=str(cache)))
    assert os.environ["TRITON_CACHE_DIR"] == "/elsewhere"
