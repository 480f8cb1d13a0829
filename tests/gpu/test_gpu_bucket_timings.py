"""Start-up's bucket timings on a GPU: timed once, kept in the cache directory, taken by the next start."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from service.engine import build
from service.settings import Settings

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_a_second_start_takes_the_first_starts_bucket_timings(tmp_path, caplog, monkeypatch):
    """The first start captures its buckets and times their forwards into `<cache_dir>/buckets/`; a second start on
    the same cache takes those timings (its log says so, its buckets as the first placed them, its timings and routes
    the first's to the bit), and a start with other buckets times its own into another file."""
    # the kernels compile where they did (Triton's default, unless set): `configure_runtime` would point this
    # process's Triton at tmp_path for good
    monkeypatch.setenv("TRITON_CACHE_DIR", os.environ.get("TRITON_CACHE_DIR")
                       or os.path.join(os.path.expanduser("~"), ".triton", "cache"))

    def start(buckets: str):
        settings = Settings(model="random:qwen3-vl-2b", device="cuda", cache_dir=str(tmp_path), cuda_graphs=True,
                            cuda_graph_buckets=buckets, max_batch_patches=8192)
        enc = build.load_encoder(settings)
        with caplog.at_level(logging.INFO, logger="service.model.graphs"):
            caplog.clear()
            build.warmup(enc, settings)
            kept = "the timings of an earlier start" in caplog.text
        return enc.forward, kept

    first, kept = start("1024,4096,8192")
    # 1,024 may have moved off a costly row count (`off_steps`: at most 64 rows up); 4,096 cannot, 8,192 is above
    assert not kept and sorted(first.bucket_ms) == list(first.buckets) and first.buckets[1:] == (4096, 8192)
    assert 1024 <= first.buckets[0] <= 1088 and all(ms > 0 for ms in first.bucket_ms.values())
    assert len(list((tmp_path / "buckets").glob("*.json"))) == 1
    second, kept = start("1024,4096,8192")
    assert kept and second.buckets == first.buckets  # the placement the first start's timings hold
    assert second.bucket_ms == first.bucket_ms and second.routes == first.routes
    other, kept = start("2048,8192")
    assert not kept and sorted(other.bucket_ms) == list(other.buckets) and other.buckets[1] == 8192
    assert len(list((tmp_path / "buckets").glob("*.json"))) == 2
