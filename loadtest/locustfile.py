"""Load test for the encoder: `locust -f loadtest/locustfile.py --host http://localhost:8000`.

Each simulated user POSTs one JPEG at a time to /embed (binary safetensors out, as a high-throughput
client would), now and then asks for JSON with pooled vectors, calls the OpenAI-compatible route, and
sends a short MP4 clip (VIDEO_WEIGHT, default 1 in 11 requests; 0 turns videos off). Images are real
photographs from scikit-image when it is installed, else random noise, resized to IMAGE_SIDE (default
448) pixels; the clip is 4 s of them panning at 24 fps (16 frames sampled at 2 fps). Each image request's bytes are
its own (a JPEG comment holding a counter, the pixels unchanged), as a stream of distinct photos is, so the run
measures encoding, not the server's embedding cache; CACHE_HITS=1 sends the same 16 images again and again instead.
429 answers count as rejected, not failed: they are the service shedding load as designed.
"""

from __future__ import annotations

import base64
import io
import itertools
import os
import random

import numpy as np
from locust import HttpUser, between, task
from PIL import Image

SIDE = int(os.environ.get("IMAGE_SIDE", "448"))
VIDEO_WEIGHT = int(os.environ.get("VIDEO_WEIGHT", "1"))
CACHE_HITS = os.environ.get("CACHE_HITS", "0") == "1"
_COUNTER = itertools.count()


def _image() -> bytes:
    """One of the images; in bytes of its own unless CACHE_HITS (a comment segment after the JPEG's first marker)."""
    jpeg = random.choice(IMAGES)
    if CACHE_HITS:
        return jpeg
    text = f"locust {os.getpid()} {next(_COUNTER)}".encode()
    return jpeg[:2] + b"\xff\xfe" + (len(text) + 2).to_bytes(2, "big") + text + jpeg[2:]


def _images(n=16):
    try:
        import skimage.data as data

        bases = [data.astronaut(), data.coffee(), data.chelsea(), data.rocket()]
    except ImportError:
        bases = [np.random.default_rng(i).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8) for i in range(4)]
    out = []
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray(bases[i % len(bases)]).resize((SIDE, SIDE)).rotate(i * 20).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def _video(seconds=4, rate=24):
    """An MP4 (H.264 when available) of the first image panning; None without PyAV."""
    try:
        import av
    except ImportError:
        return None
    base = np.asarray(Image.open(io.BytesIO(IMAGES[0])).convert("RGB"))
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264" if "libx264" in av.codecs_available else "mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = SIDE, SIDE, "yuv420p"
        for i in range(seconds * rate):
            frame = av.VideoFrame.from_ndarray(np.roll(base, 4 * i, axis=1), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


IMAGES = _images()
VIDEO = _video() if VIDEO_WEIGHT else None
API_KEY = os.environ.get("QWEN3VL_API_KEY")
HEADERS = {"Authorization": f"Bearer {API_KEY}"} if API_KEY else {}


class EncoderUser(HttpUser):
    wait_time = between(0.0, 0.05)

    def _post(self, name, **kw):
        with self.client.post(catch_response=True, name=name, headers={**HEADERS, **kw.pop("headers", {})},
                              **kw) as r:
            if r.status_code == 429:
                r.success()  # load shedding, reported separately by the service's metrics
            elif r.status_code != 200:
                r.failure(f"{r.status_code}: {r.text[:200]}")

    @task(8)
    def embed_safetensors(self):
        self._post("/embed [safetensors]", url="/embed?format=safetensors&deepstack=false",
                   data=_image(), headers={"content-type": "image/jpeg"})

    @task(1)
    def embed_json_pooled(self):
        self._post("/embed [json pooled]", url="/embed?pooling=mean&normalize=true",
                   files=[("file", ("img.jpg", _image(), "image/jpeg"))])

    @task(VIDEO_WEIGHT)
    def embed_video(self):
        if VIDEO is not None:
            self._post("/embed [video]", url="/embed?format=safetensors&deepstack=false", data=VIDEO,
                       headers={"content-type": "video/mp4"})

    @task(1)
    def openai_embeddings(self):
        uri = "data:image/jpeg;base64," + base64.b64encode(_image()).decode()
        self._post("/v1/embeddings", url="/v1/embeddings", json={"input": [uri], "model": "qwen3-vl"})
