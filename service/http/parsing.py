"""Request bodies -> input bytes and options: multipart `file` parts, a raw image/video body, or JSON with base64
inputs (`/embed`), and the OpenAI embeddings body. Everything malformed is an `HTTPError` naming the problem (and
the input, where one is at fault)."""

from __future__ import annotations

import base64
import binascii

import orjson
import pybase64
from fastapi import Request
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from ..settings import Settings
from .output import LLM_LAYOUTS
from .schemas import EmbedJSON, EmbedOptions, OpenAIEmbeddingRequest
from .status import HTTPError


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, refused (413) as soon as it is known to exceed `max_bytes`: from its declared length, or
    while it streams in."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise HTTPError(413, "body_too_large", f"request body of {declared} bytes exceeds the limit of {max_bytes} "
                                               "bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise HTTPError(413, "body_too_large", f"request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    request._body = body  # starlette re-reads the cached body for form parsing
    return body


def check_count(n: int, settings: Settings) -> None:
    if n == 0:
        raise HTTPError(422, "no_inputs", "the request has no images or videos")
    if n > settings.max_inputs_per_request:
        raise HTTPError(413, "too_many_inputs", f"{n} inputs in one request; the limit is "
                                                f"{settings.max_inputs_per_request}")


def decode_base64_input(s: str, index: int) -> bytes:
    if s.startswith("data:"):
        head, sep, s = s.partition(",")
        if not sep or ";base64" not in head:
            raise HTTPError(422, "invalid_base64", "data: URI must be of the form data:<type>;base64,<data>", index)
    try:
        return pybase64.b64decode(s, validate=True)  # SIMD: 40x the standard library's speed on a photo
    except (binascii.Error, ValueError):
        pass  # the standard library's decoder decides (it also takes padding after a full quantum) and names why
    try:
        return base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError) as e:
        raise HTTPError(422, "invalid_base64", f"invalid base64 data ({e})", index) from e


def validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts)


def parse_options(raw: dict) -> EmbedOptions:
    try:
        return EmbedOptions(**raw)
    except ValidationError as e:
        raise HTTPError(422, "invalid_options", validation_message(e)) from e


async def parse_embed(request: Request, settings: Settings) -> tuple[list[bytes], EmbedOptions]:
    """`/embed`'s inputs and options, from any of its three body forms (options also from the query)."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    query = dict(request.query_params)
    body = await read_body(request, settings.max_body_bytes)
    if ctype == "multipart/form-data":
        return await _parse_multipart(request, settings), parse_options(query)
    if ctype.startswith(("image/", "video/")):
        check_count(1 if body else 0, settings)
        return [body], parse_options(query)
    if ctype == "application/json":
        return _parse_json(body, query, settings)
    raise HTTPError(415, "unsupported_media_type",
                    f"content type {ctype or '(none)'!r}: send multipart/form-data 'file' parts, an image/* or "
                    "video/* body, or application/json")


async def _parse_multipart(request: Request, settings: Settings) -> list[bytes]:
    try:
        form = await request.form(max_files=settings.max_inputs_per_request + 1,
                                  max_fields=settings.max_inputs_per_request + 32)
    except Exception as e:  # noqa: BLE001 - starlette raises several types for a bad form
        raise HTTPError(422, "invalid_multipart", f"malformed multipart body ({e})") from e
    files = form.getlist("file")
    not_files = [i for i, f in enumerate(files) if not isinstance(f, UploadFile)]
    if not_files:
        raise HTTPError(422, "invalid_multipart", "form field 'file' must be a file part (with a filename), not text",
                        not_files[0])
    bad = [k for k, _ in form.multi_items() if k != "file"]
    if bad:
        raise HTTPError(422, "invalid_multipart", f"unexpected form field(s) {sorted(set(bad))}; send images and "
                                                  "videos as 'file' parts and options as query parameters")
    check_count(len(files), settings)
    return [await f.read() for f in files]


def _parse_json(body: bytes, query: dict, settings: Settings) -> tuple[list[bytes], EmbedOptions]:
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise HTTPError(422, "invalid_json", f"request body is not valid JSON ({e})") from e
    if not isinstance(raw, dict) or not isinstance(raw.get("inputs"), list):
        raise HTTPError(422, "invalid_json", 'expected {"inputs": [{"image": "<base64 or data URI>"}, '
                                             '{"video": "<base64 or data URI>"}, ...]}')
    check_count(len(raw["inputs"]), settings)
    try:
        req = EmbedJSON(**{**query, **raw})
    except ValidationError as e:
        raise HTTPError(422, "invalid_json", validation_message(e)) from e
    inputs = [decode_base64_input(inp.data, i) for i, inp in enumerate(req.inputs)]
    return inputs, EmbedOptions(**req.model_dump(exclude={"inputs"}))


async def parse_openai(request: Request, settings: Settings) -> tuple[list[bytes], OpenAIEmbeddingRequest]:
    body = await read_body(request, settings.max_body_bytes)
    try:
        req = OpenAIEmbeddingRequest(**orjson.loads(body))
    except orjson.JSONDecodeError as e:
        raise HTTPError(422, "invalid_json", f"request body is not valid JSON ({e})") from e
    except ValidationError as e:
        raise HTTPError(422, "invalid_json", validation_message(e)) from e
    except TypeError as e:  # a JSON body that is not an object
        raise HTTPError(422, "invalid_json", str(e)) from e
    inputs = [req.input] if isinstance(req.input, str) else req.input
    check_count(len(inputs), settings)
    return [decode_base64_input(s, i) for i, s in enumerate(inputs)], req


def check_limits(opts: EmbedOptions, settings: Settings, max_pixels: int, max_frames: int,
                 has_deepstack: bool = True) -> None:
    """Options against the server's limits and model (`max_pixels`: the upper bound of a request's max_pixels,
    the preprocessor's, `max_frames`: the video processor's, `has_deepstack`: whether the tower has DeepStack taps)."""
    if opts.format in LLM_LAYOUTS:
        asked = [name for name, on in (("pooling=mean", opts.pooling == "mean"), ("normalize", opts.normalize),
                                       ("embeddings=false", not opts.embeddings),
                                       ("deepstack=false", opts.deepstack is False and has_deepstack),
                                       ("encoding=base64", opts.encoding == "base64")) if on]
        if asked:
            raise HTTPError(422, "invalid_options", f"format={opts.format} is that server's layout of the tokens "
                                                    f"(and DeepStack features); {', '.join(asked)} does not apply")
    if opts.format == "json" and opts.encoding == "float" and opts.dtype not in (None, "float32"):
        raise HTTPError(422, "invalid_options", f"dtype={opts.dtype} applies to encoding=base64; JSON numbers "
                                                f"(encoding=float) are float32")
    if opts.deepstack and not has_deepstack:
        raise HTTPError(422, "invalid_options", "deepstack=true: this model's tower has no DeepStack features "
                                                "(Qwen2.5-VL returns the merged tokens and the pooled vector)")
    limit = max_pixels  # the preprocessor's, which the operator's max_pixels_limit bounds (`build.apply_limits`)
    for name, v in (("min_pixels", opts.min_pixels), ("max_pixels", opts.max_pixels)):
        if v is not None and not settings.min_pixels_limit <= v <= limit:
            raise HTTPError(422, "invalid_options", f"{name}={v} outside the server's limits "
                                                    f"[{settings.min_pixels_limit}, {limit}]")
    if opts.min_pixels and opts.max_pixels and opts.min_pixels > opts.max_pixels:
        raise HTTPError(422, "invalid_options", "min_pixels > max_pixels")
    if not opts.embeddings and opts.pooling == "none" and not opts.deepstack:
        raise HTTPError(422, "invalid_options", "embeddings=false leaves nothing to return: add pooling=mean for the "
                                                "pooled vector alone")
    if opts.fps is not None and opts.num_frames is not None:
        raise HTTPError(422, "invalid_options", "fps and num_frames are mutually exclusive")
    if opts.num_frames is not None and opts.num_frames > max_frames:
        raise HTTPError(422, "invalid_options", f"num_frames={opts.num_frames} exceeds the video processor's "
                                                f"max_frames={max_frames}")
