"""The vLLM and SGLang layouts (`/embed?format=vllm|sglang`), proven through the language model.

Tiny random full checkpoints of both families (`save_pretrained`), served by our server from the full checkpoint.
One request carries two images of different sizes and a video. Each layout is decoded as its server decodes it
(vLLM: `torch.load(..., weights_only=True)` of each base64 part, the feature split at out_hidden into the merged
tokens and the DeepStack levels; SGLang: the `precomputed_embedding` items' `feature` numbers and grids), put in place
of transformers' own vision features (`mm_encoder_outputs`), and the logits compared with transformers' full model
computing from the pixels: float32, within 1e-5 relative.

The prompts are built by the example clients (`examples/`), so their payloads are what is tested. The images'
pixels come from transformers' image processor on the same bytes; the video's from our preprocessor (transformers'
video processors need torchvision, which CPU CI cannot install; tests/test_video.py checks those pixels against
transformers' video sampling and resizing).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import json

import httpx
import numpy as np
import pytest
import torch

from conftest import encode_bytes, hf_input, make_video, photos, rel_err
from examples import sglang_client, vllm_client
from servers import serve

TOL = 1e-5
TOKENS = dict(image_token_id=100, video_token_id=101, vision_start_token_id=102, vision_end_token_id=103)
# Text layers >= DeepStack levels, so that every level reaches the logits; text hidden = the tower's out_hidden.
TEXT = dict(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=3,
            num_key_value_heads=1, head_dim=16,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
FAMILIES = {
    "qwen3_vl": dict(
        vision=dict(depth=3, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=48,
                    num_position_embeddings=64, deepstack_visual_indexes=[0, 2]),
        preprocessor={"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                      "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                      "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor"}),
    "qwen2_5_vl": dict(
        vision=dict(depth=4, hidden_size=160, intermediate_size=96, num_heads=2, out_hidden_size=48, window_size=56,
                    fullatt_block_indexes=[1, 3], patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        preprocessor={"min_pixels": 3136, "max_pixels": 28 * 28 * 1280, "patch_size": 14, "temporal_patch_size": 2,
                      "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                      "image_std": [0.26862954, 0.26130258, 0.27577711],
                      "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"}),
}


class CharTokenizer:
    """Stands in for the checkpoint's tokenizer in the clients: text -> ids below the special tokens."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [3 + ord(c) % 90 for c in text]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, checkpoint directory, transformers' full model) of one family."""
    import transformers

    name = request.param
    spec = FAMILIES[name]
    config_cls, model_cls = ((transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration)
                             if name == "qwen3_vl" else
                             (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration))
    torch.manual_seed(0)
    model = model_cls(config_cls(vision_config=spec["vision"], text_config=TEXT, **TOKENS))
    with torch.no_grad():  # transformers initialises biases and norms to 0/1: random values make the test bite
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname or "ln_q" in pname:
                p.add_(0.05 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path, safe_serialization=True)
    (path / "preprocessor_config.json").write_text(json.dumps(spec["preprocessor"]))
    return name, path, model.eval()


@pytest.fixture(scope="module")
def inputs():
    """Two photos of different sizes and a short clip, as the bytes a client sends."""
    ph = photos()
    return [encode_bytes(ph["chelsea"].resize((150, 110)), "JPEG", quality=90),
            encode_bytes(ph["rgba"], "PNG"),
            make_video(10, 64, 48, "mp4", "libx264", 8, seed=5)]


@pytest.fixture(scope="module")
def served(family, inputs):
    """The vLLM and SGLang replies of our server (float32, for the comparison) to one request of all inputs, and
    the engine's preprocessing of the video."""
    name, path, _ = family
    with serve(model=str(path), dtype="float32", max_inputs_per_request=8) as (url, app):
        replies = {fmt: client.encode(url, inputs, dtype="float32")
                   for fmt, client in (("vllm", vllm_client), ("sglang", sglang_client))}
        video_item = app.state.service.model.preprocessor(inputs[2])
    return replies, video_item


def _hf_pixels(name, model, inputs, video_item):
    """transformers' image processor on the image bytes; the video's patch rows from our preprocessor."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    spec = FAMILIES[name]["preprocessor"]
    processor = Qwen2VLImageProcessorPil(**{k: v for k, v in spec.items() if "type" not in k and k != "processor_class"})
    images = processor(images=[hf_input(Image.open(io.BytesIO(b))) for b in inputs[:2]], return_tensors="pt")
    from service.model.preprocess import lut_table, patchify

    t, h, w = video_item.grid_thw
    rows = torch.empty(t * h * w, 3 * video_item.config.temporal_patch_size * video_item.config.patch_size ** 2)
    patchify(torch.from_numpy(video_item.frames), lut_table(video_item.lut, torch.float32), video_item.config, rows)
    return images["pixel_values"], images["image_grid_thw"], rows, torch.tensor([video_item.grid_thw])


def _logits(model, input_ids, encoded=None, **kw):
    """The logits of the prompt `input_ids`; `mm_token_type_ids` marked as transformers' processors mark them.
    `encoded` ({"image": ..., "video": ...}, `_mm_outputs`): what the model's encoder steps return in place of
    what they compute from the pixels, in the form those take in the installed release (a DeepStack level as one
    tensor in 5.17, a tuple per item in 5.23). Every release this service supports takes features this way; 5.23's
    `mm_encoder_outputs` keyword is unknown to 5.17, which ignores it."""
    ids = torch.tensor([input_ids])
    types = (ids == TOKENS["image_token_id"]).long() + 2 * (ids == TOKENS["video_token_id"]).long()
    inner = model.model

    inside = []  # 5.23's video step calls the image step: the nested call computes, as the model's would

    def replacing(step, ours):
        def replaced(*args, **kwargs):
            if inside:
                return step(*args, **kwargs)
            inside.append(step)
            try:
                computed = step(*args, **kwargs)
            finally:
                inside.pop()
            assert len(computed.pooler_output) == len(ours.pooler_output)
            levels = getattr(computed, "deepstack_features", None) or []
            assert len(levels) == len(ours.deepstack_features or [])
            if not levels:
                return ours
            return dataclasses.replace(ours, deepstack_features=[
                torch.cat(level) if isinstance(like, torch.Tensor) else level
                for like, level in zip(levels, ours.deepstack_features)])
        return replaced

    with contextlib.ExitStack() as stack, torch.no_grad():
        for kind, output in (encoded or {}).items():
            name = f"get_{kind}_features"
            setattr(inner, name, replacing(getattr(inner, name), output))
            stack.callback(delattr, inner, name)  # the class's method again
        return model(input_ids=ids, mm_token_type_ids=types, **kw).logits[0]


def _mm_outputs(levels: int, features: list[torch.Tensor], out_hidden: int):
    """transformers' encoder output from per-item features `[n, (1 + levels) * out_hidden]`: split as vLLM's
    Qwen3-VL splits them, merged tokens first, then each DeepStack level."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    merged = tuple(f[:, :out_hidden] for f in features)
    deepstack = [tuple(f[:, out_hidden * (1 + k):out_hidden * (2 + k)] for f in features) for k in range(levels)]
    for f in features:
        assert f.shape[1] == out_hidden * (1 + levels), f.shape
    return BaseModelOutputWithDeepstackFeatures(pooler_output=merged, deepstack_features=deepstack or None)


def _torch_load(b64: str) -> torch.Tensor:
    return torch.load(io.BytesIO(base64.b64decode(b64)), weights_only=True)


def _decode_vllm(reply: dict):
    """What vLLM reads from the parts the vLLM client builds: per modality, the embeddings and grids."""
    out = {"image": [], "video": []}
    for kind, parts in vllm_client.embedding_parts(reply).items():
        for part in parts:
            feature, grid = _torch_load(part[f"{kind}_embeds"]), _torch_load(part[f"{kind}_grid_thw"])
            assert grid.dtype == torch.int64 and grid.shape == (1, 3)
            assert feature.shape[0] == int(grid.prod()) // 4  # vLLM's split of the concatenation by the grids
            out[kind].append((feature, grid))
    return out


def _decode_sglang(payload: dict):
    """What SGLang reads from the `image_data` / `video_data` items of the SGLang client's /generate payload (sent as
    JSON: the numbers come back as lists)."""
    payload = json.loads(json.dumps(payload))
    out = {"image": [], "video": []}
    for kind in ("image", "video"):
        for item in payload.get(f"{kind}_data") or []:
            assert item["format"] == "precomputed_embedding"
            out[kind].append((torch.tensor(item["feature"], dtype=torch.float32),
                              torch.tensor(item[f"{kind}_grid_thw"], dtype=torch.int64)))
    return out, payload["input_ids"]


@pytest.mark.parametrize("layout", ["vllm", "sglang"])
def test_layout_through_the_language_model(family, inputs, served, layout):
    name, _, model = family
    replies, video_item = served
    reply = replies[layout]
    out_hidden, levels = reply["out_hidden_size"], reply["deepstack_levels"]
    assert levels == (2 if name == "qwen3_vl" else 0)
    assert [d["type"] for d in reply["data"]] == ["image", "image", "video"]
    prompt = "Compare the two pictures with the clip."
    if layout == "vllm":
        decoded = _decode_vllm(reply)
        images_only = {**reply, "data": [d for d in reply["data"] if d["type"] == "image"]}
        chat = vllm_client.chat_request("m", prompt, images_only)["messages"][0]["content"]
        assert [p["image_embeds"] for p in chat[:-1]] == vllm_client.embedding_parts(reply)["image"]
        input_ids = sglang_client.input_ids(CharTokenizer(), model.config, prompt, reply)  # vLLM expands its own
    else:
        payload = sglang_client.generate_payload(CharTokenizer(), model.config, prompt, reply)
        decoded, input_ids = _decode_sglang(payload)
    pixels, image_grid, video_rows, video_grid = _hf_pixels(name, model, inputs, video_item)
    assert torch.cat([g for _, g in decoded["image"]]).tolist() == image_grid.tolist()
    assert torch.cat([g for _, g in decoded["video"]]).tolist() == video_grid.tolist()

    reference = _logits(model, input_ids, pixel_values=pixels, image_grid_thw=image_grid,
                        pixel_values_videos=video_rows, video_grid_thw=video_grid)
    as_reference = dict(pixel_values=pixels, image_grid_thw=image_grid, pixel_values_videos=video_rows,
                        video_grid_thw=video_grid)
    ours = _logits(model, input_ids, {kind: _mm_outputs(levels, [f for f, _ in decoded[kind]], out_hidden)
                                      for kind in ("image", "video")}, **as_reference)
    assert rel_err(ours, reference) <= TOL
    # and the test bites: the DeepStack levels swapped, or two images' features swapped, move the logits
    wrong = []
    if levels:
        swapped = [torch.cat([f[:, :out_hidden], f[:, 2 * out_hidden:], f[:, out_hidden:2 * out_hidden]], dim=1)
                   for f, _ in decoded["image"]]
        wrong.append({"image": _mm_outputs(levels, swapped, out_hidden)})
    a, b = decoded["image"][0][0], decoded["image"][1][0]
    wrong.append({"image": _mm_outputs(levels, [torch.cat([a[1:], a[:1]]), b], out_hidden)})  # tokens out of order
    for outputs in wrong:
        outputs["video"] = _mm_outputs(levels, [f for f, _ in decoded["video"]], out_hidden)
        assert rel_err(_logits(model, input_ids, outputs, **as_reference), reference) > 100 * TOL


def test_bfloat16_by_default_and_options_checked(family, inputs):
    name, path, _ = family
    with serve(model=str(path), dtype="float32") as (url, _):
        reply = vllm_client.encode(url, inputs[:1])
        assert reply["dtype"] == "bfloat16"
        part = reply["data"][0]["image_embeds"]
        assert _torch_load(part["image_embeds"]).dtype == torch.bfloat16
        sg = sglang_client.encode(url, inputs[:1])
        feature = np.asarray(sg["data"][0]["image_data"]["feature"], dtype=np.float32)
        assert np.array_equal(feature, torch.from_numpy(feature).bfloat16().float().numpy())  # bf16 values
        for bad in ("pooling=mean", "embeddings=false", "encoding=base64"):
            r = httpx.post(f"{url}/embed?format=vllm&{bad}", content=inputs[0], headers={"content-type": "image/jpeg"})
            assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_options", (bad, r.text)


def test_the_example_clients_say_in_one_line_when_the_encoder_is_not_there(tmp_path):
    import subprocess
    import sys

    from servers import free_port

    image = tmp_path / "a.png"
    image.write_bytes(b"\x89PNG")
    # (the SGLang client loads its checkpoint's tokenizer first, which needs a model here)
    for module in ("examples.vllm_client",):
        out = subprocess.run([sys.executable, "-m", module, "--encoder", f"http://127.0.0.1:{free_port()}",
                              "--model", "x", str(image)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert "cannot reach" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("crc32", [False, True])
def test_torch_saved_loads_back_as_torch_save_s_bytes_do(crc32):
    """`torch_saved` (torch.save's bytes built around a copy of the data) loads with `torch.load(...,
    weights_only=True)`, as vLLM loads a part, to the same tensor as `torch.save`'s own bytes, for the shapes and
    dtypes a reply holds and awkward ones; the process's CRC option is left as it was."""
    from service.http import output
    from service.http.output import llm_features, llm_features_saved, torch_saved
    from service.model.results import EncodeResult

    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(crc32)
    try:
        g = torch.Generator().manual_seed(7)
        cases = [torch.randn(196, 8192, generator=g).bfloat16(), torch.randn(5, 3, generator=g),
                 torch.randn(1, 7, generator=g).half(), torch.tensor([[1, 34, 46]]), torch.tensor(2.5),
                 torch.empty(0, 11), torch.rand(4, 4, generator=g) > 0.5, torch.randn(6, 10, generator=g)[:, ::3]]
        for t in cases:
            buf = io.BytesIO()
            torch.save(t, buf)
            reference = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
            got = torch.load(io.BytesIO(torch_saved(t)), weights_only=True)
            assert got.dtype == reference.dtype and got.shape == reference.shape and torch.equal(got, reference)
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            for levels in (0, 3):
                r = EncodeResult(embeds=torch.randn(13, 24, generator=g), grid_thw=(1, 2, 26), num_tokens=13,
                                 deepstack=torch.randn(levels, 13, 24, generator=g), pooled=torch.randn(24))
                got = torch.load(io.BytesIO(llm_features_saved(r, dtype).tobytes()), weights_only=True)
                assert got.dtype == dtype and torch.equal(got, llm_features(r, dtype))
                assert torch.equal(got[:, :24], r.embeds.to(dtype))
                for level in range(levels):
                    assert torch.equal(got[:, 24 * (level + 1):24 * (level + 2)], r.deepstack[level].to(dtype))
        assert torch.serialization.get_crc32_options() == crc32
        # this torch's layout is the one the parts are cut from (else replies are saved whole: correct, but slower)
        assert output._saved_around((196, 8192), torch.bfloat16) is not None
    finally:
        torch.serialization.set_crc32_options(before)


def test_a_save_layout_it_does_not_know_falls_back_to_saving_whole(monkeypatch, caplog):
    """Where torch's zip layout is not the one `_saved_around` knows (here: no record named as a tensor's data), each
    reply is saved whole by `torch.save`, with one warning: same tensors back, never an error."""
    import types
    import zipfile

    from service.http import output
    from service.model.results import EncodeResult

    class Renamed(zipfile.ZipFile):
        def infolist(self):
            return [types.SimpleNamespace(filename=i.filename + ".moved", compress_type=i.compress_type,
                                          file_size=i.file_size) for i in super().infolist()]

    output._saved_around.cache_clear()
    monkeypatch.setattr(output, "zipfile", types.SimpleNamespace(ZipFile=Renamed, ZIP_STORED=zipfile.ZIP_STORED))
    monkeypatch.setattr(output, "_warned_layout", False)
    try:
        r = EncodeResult(embeds=torch.randn(5, 8), deepstack=torch.randn(2, 5, 8), grid_thw=(1, 2, 10),
                         num_tokens=5, pooled=torch.randn(8))
        with caplog.at_level("WARNING", logger="service.http.output"):
            got = torch.load(io.BytesIO(output.llm_features_saved(r, torch.bfloat16).tobytes()), weights_only=True)
            grid = torch.load(io.BytesIO(output.torch_saved(torch.tensor([[1, 2, 10]]))), weights_only=True)
        assert torch.equal(got, output.llm_features(r, torch.bfloat16)) and grid.tolist() == [[1, 2, 10]]
        assert sum("layout this service does not know" in m for m in caplog.messages) == 1
    finally:
        output._saved_around.cache_clear()
