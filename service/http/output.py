"""Results -> response bodies: JSON (arrays as numbers or base64), safetensors, and the OpenAI embeddings list."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson
import pybase64
import torch
from fastapi.responses import Response
from safetensors.torch import save as safetensors_save

from ..model.encoder import EncodeResult, result_tensors
from ..model.preprocess import Preprocessed
from .schemas import EmbedOptions


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


def wants_deepstack(opts: EmbedOptions) -> bool:
    """DeepStack features: asked for, or by default with safetensors (the CLI's layout) unless the token embeddings
    are left out."""
    return opts.deepstack if opts.deepstack is not None else opts.format == "safetensors" and opts.embeddings


def embed_response(results: list[EncodeResult], items: list[Preprocessed], opts: EmbedOptions, model: str,
                   out_hidden: int, headers: dict) -> Response:
    pools = pooled(results, opts.normalize) if opts.pooling == "mean" else None
    if opts.format == "safetensors":
        tensors = result_tensors(results, pooled=pools)
        dropped = (() if wants_deepstack(opts) else ("deepstack.",)) + (() if opts.embeddings else ("embeds.",))
        tensors = {k: v for k, v in tensors.items() if not k.startswith(dropped)}
        if opts.dtype:
            tensors = {k: v.to(getattr(torch, opts.dtype)) if v.is_floating_point() else v for k, v in tensors.items()}
        return Response(safetensors_save(tensors), media_type="application/octet-stream", headers=headers)
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
