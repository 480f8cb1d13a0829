"""Load test for the encoder: `locust -f loadtest/locustfile.py --host http://localhost:8000`.

Each simulated user POSTs one JPEG at a time to /embed (binary safetensors out, as a high-throughput
client would), now and then asks for JSON with pooled vectors, and calls the OpenAI-compatible route.
Images are real photographs from scikit-image when it is installed, else random noise, resized to
IMAGE_SIDE (default 448) pixels. 429 answers count as rejected, not failed: they are the service
shedding load as designed.
"""

from __future__ import annotations

import base64
import io
import os
import random

import numpy as np
from locust import HttpUser, between, task
from PIL import Image

SIDE = int(os.environ.get("IMAGE_SIDE", "448"))


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


IMAGES = _images()
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
                   data=random.choice(IMAGES), headers={"content-type": "image/jpeg"})

    @task(1)
    def embed_json_pooled(self):
        self._post("/embed [json pooled]", url="/embed?pooling=mean&normalize=true",
                   files=[("file", ("img.jpg", random.choice(IMAGES), "image/jpeg"))])

    @task(1)
    def openai_embeddings(self):
        uri = "data:image/jpeg;base64," + base64.b64encode(random.choice(IMAGES)).decode()
        self._post("/v1/embeddings", url="/v1/embeddings", json={"input": [uri], "model": "qwen3-vl"})
