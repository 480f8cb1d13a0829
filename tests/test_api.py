"""The HTTP API end to end on loopback: every input form and option, and agreement with the encoder,
the CLI and the OpenAI client."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load, load_file

from conftest import encode_bytes, make_video, photos, rel_err
from servers import serve
from service.cli import main as cli_main
from service.model.encoder import Encoder


@pytest.fixture(scope="module")
def encoder(full_checkpoint):
    return Encoder.load(str(full_checkpoint))


@pytest.fixture(scope="module")
def server(encoder, full_checkpoint):
    with serve(encoder, model=str(full_checkpoint), max_wait_ms=20) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def images():
    pics = photos()
    return {name: encode_bytes(pics[name], "PNG") for name in ("chelsea", "camera_gray", "rgba", "aspect_1x20")}


def unbatched(encoder, data, **kw):
    return encoder.encode([encoder.preprocess(data, **kw)])[0]


def test_multipart_matches_unbatched_encoder(server, encoder, images):
    url, _ = server
    names = list(images)
    r = httpx.post(f"{url}/embed", files=[("file", (n, images[n], "image/png")) for n in names], timeout=60)
    assert r.status_code == 200, r.text
    for h in ("x-queue-time-ms", "x-inference-time-ms", "x-total-time-ms"):
        assert float(r.headers[h]) >= 0
    body = r.json()
    assert [d["index"] for d in body["data"]] == list(range(len(names)))
    for d, n in zip(body["data"], names):
        ref = unbatched(encoder, images[n])
        assert d["grid_thw"] == list(ref.grid_thw) and d["num_tokens"] == ref.num_tokens
        assert rel_err(torch.tensor(d["embeddings"]), ref.embeds) <= 1e-5
        assert "deepstack" not in d and "pooled" not in d


def test_raw_body_and_json_forms_agree(server, encoder, images):
    url, _ = server
    data = images["chelsea"]
    raw = httpx.post(f"{url}/embed", content=data, headers={"content-type": "image/png"}, timeout=60).json()
    b64 = base64.b64encode(data).decode()
    js = httpx.post(f"{url}/embed", json={"inputs": [{"image": b64}, {"image": f"data:image/png;base64,{b64}"}]},
                    timeout=60).json()
    ref = unbatched(encoder, data).embeds
    for emb in (raw["data"][0]["embeddings"], js["data"][0]["embeddings"], js["data"][1]["embeddings"]):
        assert rel_err(torch.tensor(emb), ref) <= 1e-5


@pytest.mark.parametrize("dtype,torch_dtype,tol", [("float32", torch.float32, 1e-7), ("float16", torch.float16, 1e-3),
                                                    ("bfloat16", torch.bfloat16, 1e-2)])
def test_base64_encoding_and_options(server, encoder, images, dtype, torch_dtype, tol):
    url, _ = server
    data = images["rgba"]
    r = httpx.post(f"{url}/embed", params={"encoding": "base64", "dtype": dtype, "deepstack": "true",
                                           "pooling": "mean", "normalize": "true"},
                   files=[("file", ("x.png", data, "image/png"))], timeout=60)
    assert r.status_code == 200, r.text
    d = r.json()["data"][0]
    ref = unbatched(encoder, data)

    def decode(s, shape):
        raw = torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.int16 if dtype == "bfloat16" else torch_dtype)
        return (raw.view(torch.bfloat16) if dtype == "bfloat16" else raw).reshape(shape).float()

    assert rel_err(decode(d["embeddings"], d["shape"]), ref.embeds) <= tol
    assert rel_err(decode(d["deepstack"], d["deepstack_shape"]), ref.deepstack) <= tol
    pooled = decode(d["pooled"], (ref.embeds.shape[1],))
    assert rel_err(pooled, torch.nn.functional.normalize(ref.embeds.mean(0), dim=0)) <= tol
    assert abs(pooled.norm().item() - 1) <= 10 * tol


@pytest.mark.parametrize("fmt", ["json", "safetensors"])
def test_pooled_vector_alone(server, encoder, images, fmt):
    """`embeddings=false&pooling=mean`: the pooled vectors of a pack of different sizes and nothing per token, equal
    to the mean of the tokens an unbatched encode returns; without anything left to return, a 422 naming the fix."""
    url, _ = server
    names = ["chelsea", "aspect_1x20", "camera_gray"]
    r = httpx.post(f"{url}/embed", params={"embeddings": "false", "pooling": "mean", "format": fmt},
                   files=[("file", (n, images[n], "image/png")) for n in names], timeout=60)
    assert r.status_code == 200, r.text
    if fmt == "json":
        got = [torch.tensor(d["pooled"]) for d in r.json()["data"]]
        assert all("embeddings" not in d and "deepstack" not in d for d in r.json()["data"])
    else:
        tensors = load(r.content)
        assert sorted(tensors) == sorted([f"{k}.{i}" for i in range(3) for k in ("pooled", "grid_thw")])
        got = [tensors[f"pooled.{i}"] for i in range(3)]
    for g, n in zip(got, names):
        ref = unbatched(encoder, images[n])
        assert rel_err(g, ref.embeds.float().mean(0)) <= 1e-6
        assert rel_err(g, ref.pooled) <= 1e-6
    bad = httpx.post(f"{url}/embed", params={"embeddings": "false"}, content=images["chelsea"],
                     headers={"content-type": "image/png"}, timeout=60)
    assert bad.status_code == 422 and "pooling=mean" in bad.json()["error"]["message"]


def test_min_max_pixels_per_request(server, encoder, images):
    url, _ = server
    data = images["chelsea"]
    r = httpx.post(f"{url}/embed", params={"min_pixels": 4096, "max_pixels": 20000},
                   files=[("file", ("c.png", data, "image/png"))], timeout=60)
    ref = unbatched(encoder, data, min_pixels=4096, max_pixels=20000)
    assert r.json()["data"][0]["grid_thw"] == list(ref.grid_thw)
    assert ref.grid_thw != unbatched(encoder, data).grid_thw
    assert rel_err(torch.tensor(r.json()["data"][0]["embeddings"]), ref.embeds) <= 1e-5


def test_safetensors_response_equals_cli(server, images, full_checkpoint, tmp_path):
    url, _ = server
    names = list(images)
    paths = []
    for n in names:
        p = tmp_path / f"{n}.png"
        p.write_bytes(images[n])
        paths.append(str(p))
    out = tmp_path / "cli.safetensors"
    assert cli_main(["encode", "--model", str(full_checkpoint), "--output", str(out), "--quiet", *paths]) == 0
    cli = load_file(str(out))
    r = httpx.post(f"{url}/embed", params={"format": "safetensors"},
                   files=[("file", (n, images[n], "image/png")) for n in names], timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    got = load(r.content)
    assert set(got) == set(cli)
    for key in cli:
        if key.startswith("grid_thw"):
            assert torch.equal(got[key], cli[key])
        else:
            assert rel_err(got[key], cli[key]) <= 1e-5, key
    pooled = load(httpx.post(f"{url}/embed", params={"format": "safetensors", "pooling": "mean"},
                             content=images["chelsea"], headers={"content-type": "image/png"}, timeout=60).content)
    assert pooled["pooled.0"].shape == (cli["embeds.0"].shape[1],)


@pytest.fixture(scope="module")
def videos():
    return {"mp4": make_video(75, 130, 50, "mp4", "libx264", rate=30, seed=1),  # 5 frames sampled at 2 fps
            "webm": make_video(40, 64, 48, "webm", "libvpx-vp9", rate=25, seed=2)}


def test_videos_and_images_in_one_request(server, encoder, images, videos):
    url, _ = server
    parts = [("file", ("a.mp4", videos["mp4"], "video/mp4")), ("file", ("c.png", images["chelsea"], "image/png")),
             ("file", ("b.webm", videos["webm"], "video/webm"))]
    r = httpx.post(f"{url}/embed", files=parts, params={"deepstack": "true"}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["type"] for d in body["data"]] == ["video", "image", "video"]
    assert body["usage"]["images"] == 1 and body["usage"]["videos"] == 2
    for d, (_, (_, data, _)) in zip(body["data"], parts):
        ref = unbatched(encoder, data)
        assert d["grid_thw"] == list(ref.grid_thw)
        assert rel_err(torch.tensor(d["embeddings"]), ref.embeds) <= 1e-5
        assert rel_err(torch.tensor(d["deepstack"]), ref.deepstack) <= 1e-5
    mp4 = body["data"][0]
    assert mp4["grid_thw"][0] == 3 and mp4["video"]["frame_indices"] == [0, 18, 37, 56, 74]
    assert mp4["video"]["source_frames"] == 75 and mp4["video"]["source_fps"] == 30.0
    assert mp4["video"]["timestamps"] == pytest.approx([0.3, 1.55, 2.4667], abs=1e-3)
    assert "video" not in body["data"][1]


def test_video_raw_body_json_and_sampling_options(server, encoder, videos):
    url, _ = server
    data = videos["mp4"]
    raw = httpx.post(f"{url}/embed", content=data, params={"num_frames": 6},
                     headers={"content-type": "video/mp4"}, timeout=60).json()["data"][0]
    ref = unbatched(encoder, data, num_frames=6)
    assert raw["grid_thw"][0] == 3 and len(raw["video"]["frame_indices"]) == 6
    assert rel_err(torch.tensor(raw["embeddings"]), ref.embeds) <= 1e-5
    b64 = base64.b64encode(data).decode()
    js = httpx.post(f"{url}/embed", json={"inputs": [{"video": f"data:video/mp4;base64,{b64}"}], "fps": 4},
                    timeout=60).json()["data"][0]
    ref = unbatched(encoder, data, fps=4)
    assert len(js["video"]["frame_indices"]) == 10 and js["grid_thw"] == list(ref.grid_thw)
    assert rel_err(torch.tensor(js["embeddings"]), ref.embeds) <= 1e-5


def test_video_safetensors_equals_cli(server, videos, full_checkpoint, tmp_path):
    url, _ = server
    path = tmp_path / "clip.webm"
    path.write_bytes(videos["webm"])
    out = tmp_path / "cli.safetensors"
    assert cli_main(["encode", "--model", str(full_checkpoint), "--output", str(out), "--quiet", "--num-frames", "8",
                     str(path)]) == 0
    cli = load_file(str(out))
    got = load(httpx.post(f"{url}/embed", params={"format": "safetensors", "num_frames": 8},
                          content=videos["webm"], headers={"content-type": "video/webm"}, timeout=60).content)
    assert set(got) == set(cli) and torch.equal(got["grid_thw.0"], cli["grid_thw.0"]) and cli["grid_thw.0"][0] == 4
    for key in ("embeds.0", "deepstack.0"):
        assert rel_err(got[key], cli[key]) <= 1e-5, key


def test_openai_client(server, encoder, images):
    from openai import OpenAI

    url, _ = server
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    uris = [f"data:image/png;base64,{base64.b64encode(images[n]).decode()}" for n in ("chelsea", "rgba")]
    res = client.embeddings.create(model="qwen3-vl", input=uris)
    assert len(res.data) == 2 and res.usage.total_tokens > 0
    for item, n in zip(res.data, ("chelsea", "rgba")):
        ref = torch.nn.functional.normalize(unbatched(encoder, images[n]).embeds.mean(0), dim=0)
        assert rel_err(torch.tensor(item.embedding), ref) <= 1e-5
    # the client asks for base64 by default under the hood when numpy is present; check both explicitly
    raw = httpx.post(f"{url}/v1/embeddings", json={"input": uris[0], "encoding_format": "base64"}, timeout=60).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert raw["object"] == "list" and raw["data"][0]["object"] == "embedding"
    assert rel_err(torch.from_numpy(vec.copy()), torch.tensor(res.data[0].embedding)) <= 1e-6


def test_health_ready_info_docs(server, full_checkpoint):
    url, _ = server
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{url}/ready").json() == {"ready": True}
    info = httpx.get(f"{url}/info").json()
    assert info["model"] == str(full_checkpoint) and info["random_weights"] is False
    assert info["attention_backend"] == "sdpa" and info["device"] == "cpu"
    assert info["architecture"]["out_hidden_size"] == 48 and info["limits"]["max_batch_patches"] == 32768
    assert info["quantization"] == "none"
    # the engine in one shape, this process's: one device, up, its counters, no Triton launch on the CPU
    engine = info["engine"]
    assert engine["state"] == "up" and engine["process"] == "this" and engine["pid"] == engine["engines"][0]["pid"]
    assert [e["device"] for e in engine["engines"]] == ["cpu"] and engine["engines"][0]["lean_launch"] is None
    assert engine["forwards"] == engine["engines"][0]["forwards"] and engine["restarts"] == 0
    assert httpx.get(f"{url}/openapi.json").json()["paths"]["/embed"]["post"]
    assert httpx.get(f"{url}/docs").status_code == 200


def test_random_preset_warns_in_info():
    with serve() as (url, _):
        info = httpx.get(f"{url}/info").json()
        assert info["random_weights"] is True and "meaningless" in info["warning"]
