"""Results -> response bodies: JSON (arrays as numbers or base64), safetensors, and the OpenAI embeddings list."""

from __future__ import annotations

import functools
import io
import logging
import math
import struct
import zipfile
from typing import Any

import numpy as np
import orjson
import pybase64
import torch
from fastapi.responses import Response

from ..engine.api import EncodeResult, Preprocessed, result_tensors
from .schemas import EmbedOptions

log = logging.getLogger(__name__)


def orjson_response(content: Any, status: int = 200, headers=None) -> Response:
    body = orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def encode_array(t: torch.Tensor, encoding: str, dtype: str | None):
    """float -> numpy (serialised by orjson without Python floats); base64 -> little-endian bytes."""
    dtype = dtype or "float32"
    if encoding == "float":
        return np.ascontiguousarray(t.float().numpy())
    tt = t.to(getattr(torch, dtype)).contiguous()
    raw = (tt.view(torch.int16) if dtype == "bfloat16" else tt).numpy().tobytes()
    return pybase64.b64encode(raw).decode("ascii")


def pooled(results: list[EncodeResult], normalize: bool) -> list[torch.Tensor]:
    """Each result's mean-pooled vector (computed on the device, in float32), L2-normalised if asked: as
    `torch.nn.functional.normalize` (eps 1e-12), in numpy with the norm summed in float64 (within an ulp of torch's;
    one small array op instead of torch's dispatch on every request's way out)."""
    if not normalize:
        return [r.pooled for r in results]
    out = []
    for r in results:
        v = r.pooled.numpy()
        wide = v.astype(np.float64)
        out.append(torch.from_numpy(v / np.float32(max(math.sqrt(wide @ wide), 1e-12))))
    return out


LLM_LAYOUTS = ("vllm", "sglang")  # formats a language model's server takes as precomputed vision features


def wants_deepstack(opts: EmbedOptions, has_deepstack: bool) -> bool:
    """DeepStack features: part of the LLM layouts where the tower has them; else asked for, or by default with
    safetensors (the CLI's layout) unless the token embeddings are left out."""
    if opts.format in LLM_LAYOUTS:
        return has_deepstack
    return opts.deepstack if opts.deepstack is not None else opts.format == "safetensors" and opts.embeddings


def embed_response(results: list[EncodeResult], items: list[Preprocessed], opts: EmbedOptions, model: str,
                   out_hidden: int, headers: dict) -> Response:
    pools = pooled(results, opts.normalize) if opts.pooling == "mean" else None
    if opts.format == "safetensors":
        tensors = result_tensors(results, pooled=pools)
        if not opts.embeddings:
            tensors = {k: v for k, v in tensors.items() if not k.startswith("embeds.")}
        if opts.dtype:
            tensors = {k: v.to(getattr(torch, opts.dtype)) if v.is_floating_point() else v for k, v in tensors.items()}
        return ChunkedResponse(safetensors_chunks(tensors), media_type="application/octet-stream", headers=headers)
    data = []
    for i, (it, r) in enumerate(zip(items, results)):
        entry: dict[str, Any] = {"index": i, "type": it.kind, "grid_thw": list(r.grid_thw), "num_tokens": r.num_tokens}
        if opts.embeddings:
            entry["shape"] = list(r.embeds.shape)
            entry["embeddings"] = encode_array(r.embeds, opts.encoding, opts.dtype)
        if it.kind == "video":
            entry["video"] = {k: it.meta[k] for k in ("frame_indices", "timestamps", "source_frames", "source_fps")}
        if opts.deepstack:
            entry["deepstack"] = encode_array(r.deepstack, opts.encoding, opts.dtype)
            entry["deepstack_shape"] = list(r.deepstack.shape)
        if pools is not None:
            entry["pooled"] = encode_array(pools[i], opts.encoding, opts.dtype)
        data.append(entry)
    body = {"model": model, "encoding": opts.encoding,
            "dtype": (opts.dtype or "float32") if opts.encoding == "base64" else "float32", "data": data,
            "usage": {"images": sum(it.kind == "image" for it in items),
                      "videos": sum(it.kind == "video" for it in items),
                      "tokens": sum(r.num_tokens for r in results)},
            "out_hidden_size": out_hidden}
    return orjson_response(body, headers=headers)


def openai_response(results: list[EncodeResult], model: str, encoding_format: str, headers: dict) -> Response:
    data = [{"object": "embedding", "index": i, "embedding": encode_array(v, encoding_format, "float32")}
            for i, v in enumerate(pooled(results, normalize=True))]
    tokens = sum(r.num_tokens for r in results)
    return orjson_response({"object": "list", "data": data, "model": model,
                            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, headers=headers)


def _levels(r: EncodeResult) -> list[torch.Tensor]:
    return [r.embeds, *r.deepstack]


def _level_count(r: EncodeResult) -> int:
    return 1 + r.deepstack.shape[0]


def _numpy_of(dtype: torch.dtype):
    """A tensor -> numpy in `dtype` (bfloat16 as its bits: numpy has no bfloat16)."""
    if dtype == torch.bfloat16:
        return lambda t: t.to(dtype).view(torch.int16).numpy()
    return lambda t: t.to(dtype).numpy()


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype `_numpy_of(dtype)` gives."""
    return np.dtype(np.int16) if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype


def _write_features(r: EncodeResult, dtype: torch.dtype, out: np.ndarray) -> None:
    """`r`'s merged tokens and DeepStack levels into `out` [num_tokens, levels, out_hidden], level by level."""
    as_numpy = _numpy_of(dtype)
    for level, t in enumerate(_levels(r)):
        out[:, level] = as_numpy(t)


def llm_features(r: EncodeResult, dtype: torch.dtype) -> torch.Tensor:
    """`[num_tokens, (1 + levels) * out_hidden]` in `dtype`: the merged tokens, then each DeepStack level in order,
    along the last dimension. vLLM's and SGLang's Qwen3-VL split a precomputed feature there at out_hidden
    (Qwen2.5-VL: the merged tokens alone). Assembled in numpy (bfloat16 as its bits): torch's CPU `cat` of bfloat16
    along the last dimension is an order of magnitude slower."""
    n, width = r.embeds.shape
    out = np.empty((n, _level_count(r), width), dtype=_numpy_dtype(dtype))
    _write_features(r, dtype, out)
    features = torch.from_numpy(out.reshape(n, -1))
    return features.view(torch.bfloat16) if dtype == torch.bfloat16 else features


@functools.lru_cache(maxsize=4096)  # a shape's parts: ~1.3 KB; a shape met first costs one torch.save of its size
def _saved_around(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[bytes, bytes] | None:
    """`torch.save`'s bytes of a contiguous tensor of `shape` and `dtype`, before and after its data: the data of a
    zip record that torch stores uncompressed, found through the record's local header (30 bytes, its name, and
    the extra field torch pads so that the data start on a 64-byte boundary). The serving processes save without
    the records' CRC-32s (`service.runtime.configure_process`), and `torch.load` does not check them: so the bytes
    hold for any data put between the two parts. None where torch saves otherwise (then each reply is saved whole)."""
    raw = _plain_saved(torch.zeros(shape, dtype=dtype))
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        records = [i for i in z.infolist() if i.filename.endswith("/data/0")]
    size = math.prod(shape) * dtype.itemsize
    if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED or records[0].file_size != size:
        global _warned_layout
        if not _warned_layout:
            log.warning("torch %s saves a tensor in a layout this service does not know: vLLM-layout replies are "
                        "saved whole, at a few more ms of CPU each", torch.__version__)
            _warned_layout = True
        return None
    name_len, extra_len = struct.unpack_from("<HH", raw, records[0].header_offset + 26)
    start = records[0].header_offset + 30 + name_len + extra_len
    return raw[:start], raw[start + size:]


_warned_layout = False


def _plain_saved(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _saved_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray] | None:
    """A buffer holding `torch.save`'s bytes of a tensor of `shape` and `dtype` but its data, and the view of the
    buffer where the data go (bytes); None where `_saved_around` has no parts."""
    if (parts := _saved_around(shape, dtype)) is None:
        return None
    head, tail = parts
    size = math.prod(shape) * dtype.itemsize
    buf = np.empty(len(head) + size + len(tail), dtype=np.uint8)
    buf[:len(head)] = np.frombuffer(head, dtype=np.uint8)
    buf[len(head) + size:] = np.frombuffer(tail, dtype=np.uint8)
    return buf, buf[len(head):len(head) + size]


def torch_saved(t: torch.Tensor) -> bytes:
    """`torch.save(t)`'s bytes (read back with `torch.load(..., weights_only=True)`, how vLLM takes a precomputed
    tensor), built around a copy of `t`'s bytes: no pickling and no zip writer a call."""
    t = t.contiguous()
    if (saved := _saved_buffer(tuple(t.shape), t.dtype)) is None:
        return _plain_saved(t)
    buf, data = saved
    if t.numel():
        data[:] = t.reshape(-1).view(torch.uint8).numpy()
    return buf.tobytes()


def llm_features_saved(r: EncodeResult, dtype: torch.dtype) -> np.ndarray:
    """`torch_saved(llm_features(r, dtype))` as a buffer, the features written straight into place: one copy of
    megabytes where assembling, saving and returning the bytes took four."""
    n, width = r.embeds.shape
    levels = _level_count(r)
    if (saved := _saved_buffer((n, levels * width), dtype)) is None:
        return np.frombuffer(_plain_saved(llm_features(r, dtype)), dtype=np.uint8)
    buf, data = saved
    _write_features(r, dtype, data.view(_numpy_dtype(dtype)).reshape(n, levels, width))
    return buf


def torch_base64(t: torch.Tensor) -> bytes:
    """base64 of `torch_saved(t)`: how vLLM's embedding content parts carry a tensor."""
    return pybase64.b64encode(torch_saved(t))


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64"}


def safetensors_chunks(tensors: dict[str, torch.Tensor]) -> list:
    """A safetensors file as the chunks of its body: the length and JSON header, then each tensor's own bytes, not
    copied into one buffer first (`safetensors.torch.save` copies every tensor once more, megabytes a reply). The
    header is padded with spaces to a multiple of 8 bytes, as `safetensors` writes it, so the data stay aligned."""
    header, views, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous()
        raw = t.view(torch.uint8).numpy().reshape(-1) if t.numel() else b""
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
        if size:
            views.append(memoryview(raw).cast("B"))
    text = orjson.dumps(header)
    text += b" " * (-len(text) % 8)
    return [len(text).to_bytes(8, "little") + text, *views]


class _Blob:
    """A JSON string value written into the body as it is (base64: nothing to escape), not through orjson, which
    would scan megabytes of it again."""

    def __init__(self, data: bytes):
        self.data = data


class ChunkedResponse(Response):
    """A body sent as the chunks it was made of (megabytes of base64 among small JSON pieces), without joining
    them into one more copy first."""

    def __init__(self, chunks: list[bytes], media_type: str, headers: dict):
        self.chunks = chunks
        length = sum(len(c) for c in chunks)
        super().__init__(b"", media_type=media_type, headers={**headers, "content-length": str(length)})

    async def __call__(self, scope, receive, send):
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        last = len(self.chunks) - 1
        for i, chunk in enumerate(self.chunks):
            await send({"type": "http.response.body", "body": chunk, "more_body": i < last})


def _json_with_blobs(body: Any) -> list[bytes]:
    blobs: list[bytes] = []

    def placeholder(obj):
        if isinstance(obj, _Blob):
            blobs.append(obj.data)
            return f"\x00blob\x00{len(blobs) - 1}"
        raise TypeError(type(obj).__name__)

    pieces = orjson.dumps(body, default=placeholder, option=orjson.OPT_SERIALIZE_NUMPY).split(b'"\\u0000blob\\u0000')
    out = [pieces[0]]
    for piece in pieces[1:]:  # each starts with the blob's number and its closing quote
        number, rest = piece.split(b'"', 1)
        out += [b'"', blobs[int(number)], b'"', rest]
    return out


def llm_response(results: list[EncodeResult], items: list[Preprocessed], opts: EmbedOptions, model: str,
                 out_hidden: int, headers: dict) -> Response:
    """`format=vllm`: per input, the dict of a vLLM `image_embeds` content part (`{"image_embeds": B64,
    "image_grid_thw": B64}`, each base64 of `torch.save`; a video's `video_embeds` / `video_grid_thw`, as vLLM's
    `multi_modal_data` takes them). `format=sglang`: per input, SGLang's `precomputed_embedding` item (`feature` as
    numbers, `image_grid_thw` / `video_grid_thw` as `[[t, h, w]]`) for its `image_data` / `video_data`. Features in
    `dtype`, bfloat16 by default."""
    dtype = getattr(torch, opts.dtype or "bfloat16")
    data = []
    for i, (it, r) in enumerate(zip(items, results)):
        kind = it.kind
        n, width = r.embeds.shape
        entry: dict[str, Any] = {"index": i, "type": kind, "grid_thw": list(r.grid_thw), "num_tokens": r.num_tokens,
                                 "shape": [n, _level_count(r) * width]}
        if opts.format == "vllm":
            grid = torch.tensor([r.grid_thw], dtype=torch.int64)
            entry[f"{kind}_embeds"] = {f"{kind}_embeds": _Blob(pybase64.b64encode(llm_features_saved(r, dtype))),
                                       f"{kind}_grid_thw": _Blob(torch_base64(grid))}
        else:
            entry[f"{kind}_data"] = {"format": "precomputed_embedding",
                                     "feature": llm_features(r, dtype).float().numpy(),
                                     f"{kind}_grid_thw": [list(r.grid_thw)]}
        if kind == "video":
            entry["video"] = {k: it.meta[k] for k in ("frame_indices", "timestamps", "source_frames", "source_fps")}
        data.append(entry)
    body = {"model": model, "format": opts.format, "dtype": str(dtype).removeprefix("torch."), "data": data,
            "out_hidden_size": out_hidden, "deepstack_levels": int(results[0].deepstack.shape[0]) if results else 0,
            "usage": {"images": sum(it.kind == "image" for it in items),
                      "videos": sum(it.kind == "video" for it in items),
                      "tokens": sum(r.num_tokens for r in results)}}
    return ChunkedResponse(_json_with_blobs(body), media_type="application/json", headers=headers)
