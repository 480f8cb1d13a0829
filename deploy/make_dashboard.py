"""Writes deploy/grafana/dashboards/qwen3vl-encoder.json. The dashboard is generated so that every
panel follows one layout and one datasource; tests/test_deploy.py runs each query through Prometheus.

Usage: python deploy/make_dashboard.py
"""

from __future__ import annotations

import json
from pathlib import Path

DS = {"type": "prometheus", "uid": "prometheus"}
P = "qwen3vl"
RATE = "$__rate_interval"


def q(p: float, metric: str, selector: str = "") -> str:
    return f"histogram_quantile({p}, sum by (le) (rate({P}_{metric}_bucket{selector}[{RATE}])))"


EMBED = '{route="/embed"}'


PANELS = [
    # (title, unit, [(expr, legend)], kind)
    ("Request rate by route and status", "reqps",
     [(f"sum by (route, status) (rate({P}_requests_total[{RATE}]))", "{{route}} {{status}}")], "timeseries"),
    ("/embed latency p50 / p95 / p99", "s",
     [(q(p, "request_duration_seconds", EMBED), f"p{round(p * 100)}") for p in (0.5, 0.95, 0.99)],
     "timeseries"),
    ("Queue vs preprocessing vs forward time (p50, p99)", "s",
     [(q(0.5, "queue_seconds"), "queue p50"), (q(0.99, "queue_seconds"), "queue p99"),
      (q(0.5, "preprocess_seconds"), "preprocess p50"), (q(0.5, "forward_seconds"), "forward p50"),
      (q(0.99, "forward_seconds"), "forward p99")], "timeseries"),
    ("Throughput: images/s and video frames/s", "none",
     [(f"sum(rate({P}_images_total[{RATE}]))", "images/s"),
      (f"sum(rate({P}_video_frames_total[{RATE}]))", "video frames/s")], "timeseries"),
    ("Throughput: output tokens/s", "none",
     [(f"sum(rate({P}_output_tokens_total[{RATE}]))", "tokens/s")], "timeseries"),
    ("Batch size (images per forward)", "none",
     [(f"sum(rate({P}_batch_items_sum[{RATE}])) / sum(rate({P}_batch_items_count[{RATE}]))", "mean"),
      (q(0.99, "batch_items"), "p99")], "timeseries"),
    ("Batch fill (patches / budget) and forwards/s", "percentunit",
     [(f"sum(rate({P}_batch_fill_ratio_sum[{RATE}])) / sum(rate({P}_batch_fill_ratio_count[{RATE}]))", "mean fill"),
      (f"sum(rate({P}_batch_patches_count[{RATE}]))", "forwards/s")], "timeseries"),
    ("Queue depth per engine and requests in flight", "none",
     [(f"{P}_queue_depth", "queued images {{device}}"), (f"{P}_queued_patches", "queued patches {{device}}"),
      (f"sum({P}_in_flight_requests)", "in-flight requests")], "timeseries"),
    ("HTTP front-ends: event-loop lag p50 / p99 (over ~50 ms: saturated, add HTTP_WORKERS)", "s",
     [(q(0.5, "event_loop_lag_seconds"), "p50"), (q(0.99, "event_loop_lag_seconds"), "p99")], "timeseries"),
    ("Errors by reason", "reqps",
     [(f"sum by (reason) (rate({P}_errors_total[{RATE}]))", "{{reason}}")], "timeseries"),
    ("GPU busy, and waiting for the engine's host side (over a few percent: CPU-starved)", "percentunit",
     [(f"rate({P}_gpu_busy_seconds[{RATE}])", "busy {{device}}"),
      (f"rate({P}_gpu_launch_wait_seconds[{RATE}])", "waiting for launches {{device}}")], "timeseries"),
    ("Embedding cache: inputs by outcome, and large results left unwritten by its write rate", "reqps",
     [(f"sum by (result) (rate({P}_embedding_cache_items_total[{RATE}]))", "{{result}}"),
      (f"sum(rate({P}_embedding_cache_unwritten_total[{RATE}]))", "unwritten")], "timeseries"),
    ("GPU memory", "bytes",
     [(f"{P}_gpu_memory_allocated_bytes", "allocated {{device}}"),
      (f"{P}_gpu_memory_reserved_bytes", "reserved {{device}}")],
     "timeseries"),
    ("Model and attention backend", "none",
     [(f"{P}_model_info", "{{model}} {{dtype}} {{device}} attention={{attention_backend}}")], "table"),
]


def build() -> dict:
    panels = []
    for i, (title, unit, targets, kind) in enumerate(PANELS):
        panel = {
            "id": i + 1, "title": title, "type": kind, "datasource": DS,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(65 + j), "datasource": DS, "expr": expr, "legendFormat": legend,
                         **({"format": "table", "instant": True} if kind == "table" else {})}
                        for j, (expr, legend) in enumerate(targets)],
        }
        panels.append(panel)
    return {
        "uid": "qwen3vl-encoder", "title": "Qwen3-VL vision encoder", "schemaVersion": 39, "version": 1,
        "refresh": "10s", "time": {"from": "now-30m", "to": "now"}, "tags": ["qwen3vl", "inference"],
        "panels": panels, "templating": {"list": []}, "annotations": {"list": []},
    }


if __name__ == "__main__":
    out = Path(__file__).parent / "grafana" / "dashboards" / "qwen3vl-encoder.json"
    out.write_text(json.dumps(build(), indent=1) + "\n")
    print(f"wrote {out}")
