"""Request models of the API (and their JSON schemas in the OpenAPI document)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class EmbedOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # vllm / sglang: per input, the precomputed-feature layout that server takes (service.http.output.llm_response)
    format: str = Field("json", pattern="^(json|safetensors|vllm|sglang)$")
    encoding: str = Field("float", pattern="^(float|base64)$")
    dtype: str | None = Field(None, pattern="^(float32|float16|bfloat16)$")
    deepstack: bool | None = None  # default: false for JSON, true for safetensors (the CLI's layout)
    pooling: str = Field("none", pattern="^(none|mean)$")
    normalize: bool = False
    embeddings: bool = True  # false: no token embeddings, only what else is asked for (the pooled vector: TEI's /embed)
    min_pixels: int | None = Field(None, ge=1)  # images
    max_pixels: int | None = Field(None, ge=1)  # images
    fps: float | None = Field(None, gt=0, le=240)  # videos: frames sampled per second of video
    num_frames: int | None = Field(None, ge=2)  # videos: frames sampled in all (exclusive with fps)


class JSONInput(BaseModel):
    """One input: base64 bytes or a data: URI. Images and videos are told apart by their bytes, so the
    key only documents intent."""

    model_config = ConfigDict(extra="forbid")
    image: str | None = None
    video: str | None = None

    @model_validator(mode="after")
    def _one(self):
        if (self.image is None) == (self.video is None):
            raise ValueError('each input needs exactly one of "image" or "video"')
        return self

    @property
    def data(self) -> str:
        return self.image if self.image is not None else self.video


class EmbedJSON(EmbedOptions):
    inputs: list[JSONInput]


class OpenAIEmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input: str | list[str]
    model: str | None = None
    encoding_format: str = Field("float", pattern="^(float|base64)$")
