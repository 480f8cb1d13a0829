"""Shared fixtures: small but genuine Qwen3-VL checkpoints written by transformers' own save_pretrained,
and test images (real photographs from scikit-image plus awkward synthetic ones)."""

from __future__ import annotations

import functools
import io
import json
import logging
from pathlib import Path

import os

import numpy as np
import pytest
import torch
from PIL import Image

# Without a GPU the Triton kernels run in Triton's interpreter. The switch is read when a kernel is
# decorated, so it must be set before anything imports `kernels`.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _mend_interpreter_scalars() -> None:
    """Let this Triton's interpreter use a loaded scalar as a loop bound, as compiled code does.

    Triton 3.6's interpreter (the H100/H200 machines' release, which the package allows) holds a scalar as a
    one-element array and takes its index with `int(array)`, which NumPy 2.4 refuses: every varlen kernel's
    `range(0, n, BLOCK)` over a segment's loaded length then fails there, while 3.9's runs it. Only where a
    one-kernel probe shows the failure is the interpreter's `__index__` replaced, by `int(array.item())`: the same
    value, and the kernels stay tested rather than skipped."""
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    @triton.jit
    def bound(P, O):
        n = tl.load(P)
        acc = 0
        for _ in range(0, n, 2):
            acc += 1
        tl.store(O, acc)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        bound[(1,)](torch.tensor([5], dtype=torch.int32), out)
        return
    except Exception:  # noqa: BLE001 - the interpreter wraps the TypeError in its own error
        pass
    set_attr = interpreter._LangPatchScope.set_attr

    def mended(scope, obj, name, value):
        if name == "__index__":
            value = lambda t: int(t.handle.data.item())  # noqa: E731
        set_attr(scope, obj, name, value)

    interpreter._LangPatchScope.set_attr = mended
    bound[(1,)](torch.tensor([5], dtype=torch.int32), out)
    assert out.item() == 3, out


if os.environ.get("TRITON_INTERPRET") == "1":
    _mend_interpreter_scalars()


# A tower that exercises everything of the real ones: several blocks, two DeepStack taps, a
# non-square learned position grid resampled to non-square images, head_dim 16.
TINY_VISION = dict(
    depth=3, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=48,
    num_position_embeddings=64, deepstack_visual_indexes=[0, 2],
)
TINY_TEXT = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
)
QWEN3VL_PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
}


def _save_full(path: Path, max_shard_size=None, seed=0) -> Path:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(vision_config=TINY_VISION, text_config=TINY_TEXT))
    _randomize_biases(model)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kw)
    (path / "preprocessor_config.json").write_text(json.dumps(QWEN3VL_PREPROCESSOR))
    return path


def _randomize_biases(model):
    # transformers initialises biases and LayerNorms to 0/1; random values make the parity tests bite
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name and (name.endswith("bias") or "norm" in name):
                p.add_(0.05 * torch.randn_like(p))


@pytest.fixture(scope="session")
def full_checkpoint(tmp_path_factory) -> Path:
    """A full Qwen3VLForConditionalGeneration checkpoint in one safetensors file."""
    return _save_full(tmp_path_factory.mktemp("qwen3vl_full"))


@pytest.fixture(scope="session")
def sharded_checkpoint(tmp_path_factory) -> Path:
    """The same architecture, sharded into many files with model.safetensors.index.json."""
    path = _save_full(tmp_path_factory.mktemp("qwen3vl_sharded"), max_shard_size="50KB", seed=1)
    assert (path / "model.safetensors.index.json").is_file()
    return path


@pytest.fixture(scope="session")
def hf_model(full_checkpoint):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(full_checkpoint, attn_implementation="sdpa").eval()


@pytest.fixture(scope="session")
def hf_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**{k: v for k, v in QWEN3VL_PREPROCESSOR.items() if "type" not in k
                                       and k != "processor_class"})


@functools.cache
def _transformers_composites_alpha() -> bool:
    """Whether the installed transformers' processors put a transparent image on white (5.23 does, as this service
    does) rather than drop its alpha channel (5.17 does)."""
    from transformers.image_transforms import convert_to_rgb

    return np.asarray(convert_to_rgb(Image.new("RGBA", (1, 1), (0, 0, 0, 0)))).reshape(-1)[:3].tolist() == [255] * 3


def hf_input(img: Image.Image) -> Image.Image:
    """`img` as the reference processor is given it: unchanged where transformers composites transparency on white;
    composited here as 5.23 composites it where the installed release drops the alpha channel, so that the parity
    tests hold over the supported releases (the service follows 5.23: README). Written here rather than calling the
    service's `preprocess.to_rgb`: the reference must not be the code it checks."""
    if ("A" not in img.getbands() and img.info.get("transparency") is None) or _transformers_composites_alpha():
        return img
    rgba = img.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def encode_bytes(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def photos() -> dict[str, Image.Image]:
    """Real photographs shipped with scikit-image, and awkward images in every PIL mode we convert."""
    import skimage.data as data

    rng = np.random.default_rng(1234)
    rgba = rng.integers(0, 256, (37, 53, 4), dtype=np.uint8)
    rgba[..., 3] = np.linspace(0, 255, 53, dtype=np.uint8)[None, :]  # graded transparency
    return {
        "astronaut": Image.fromarray(data.astronaut()),
        "coffee": Image.fromarray(data.coffee()),
        "chelsea": Image.fromarray(data.chelsea()),
        "camera_gray": Image.fromarray(data.camera()),  # mode L
        "rgba": Image.fromarray(rgba, "RGBA"),
        "tiny_3x2": Image.fromarray(rng.integers(0, 256, (2, 3, 3), dtype=np.uint8)),
        "aspect_1x20": Image.fromarray(rng.integers(0, 256, (40, 800, 3), dtype=np.uint8)),
    }


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture(autouse=True)
def _quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)


def hf_tower_outputs(visual, pixel_values, grid_thw):
    """(merged [T/4, out], [deepstack [T/4, out], ...]) from transformers' vision tower, whichever
    output type this transformers release returns (a tuple in older ones, a dataclass in newer)."""
    with torch.no_grad():
        out = visual(pixel_values.to(visual.dtype), grid_thw=grid_thw)
    if isinstance(out, tuple):
        return out[0], list(out[1])
    return out.pooler_output, list(out.deepstack_features)


def make_video(n_frames: int, width: int, height: int, fmt: str = "mp4", codec: str = "mpeg4", rate: int = 24,
               seed: int = 0, faststart: bool = False) -> bytes:
    """A real encoded video: a random background with a moving bright square, so frames differ.
    `faststart` (MP4): the index, with its frame count, before the data."""
    from tools.synthetic import encode_video

    rng = np.random.default_rng(seed)
    background = rng.integers(0, 200, (height, width, 3), dtype=np.uint8)
    frames = []
    for i in range(n_frames):
        frame = background.copy()
        x = (i * 5) % max(1, width - 8)
        frame[: min(8, height), x:x + 8] = 255
        frames.append(frame)
    return encode_video(frames, rate, fmt, codec, faststart)


def hf_tower(cfg, state: dict, dtype: torch.dtype, device: str = "cuda"):
    """transformers' vision tower of `cfg`'s family and shape (`Qwen3VLVisionModel`, or
    `Qwen2_5_VisionTransformerPretrainedModel` for a windowed tower) holding `state` (our tower's state dict: the
    parameter names are the same), in `dtype` and eval mode: the GPU tests' reference."""
    if cfg.windowed:
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        hf_cfg, cls = Qwen2_5_VLVisionConfig(
            depth=cfg.depth, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_heads=cfg.num_heads, out_hidden_size=cfg.out_hidden_size, window_size=cfg.window_size,
            fullatt_block_indexes=list(cfg.fullatt_block_indexes),
            patch_size=cfg.patch_size), Qwen2_5_VisionTransformerPretrainedModel
    else:
        from transformers import Qwen3VLVisionConfig, Qwen3VLVisionModel

        hf_cfg, cls = Qwen3VLVisionConfig(
            depth=cfg.depth, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_heads=cfg.num_heads, out_hidden_size=cfg.out_hidden_size,
            deepstack_visual_indexes=list(cfg.deepstack_visual_indexes),
            num_position_embeddings=cfg.num_position_embeddings), Qwen3VLVisionModel
    with torch.device(device):
        model = cls(hf_cfg)
    model.load_state_dict(state)
    return model.to(dtype).eval()


# -- kernels ------------------------------------------------------------------------------------------------------

# Attention packs of awkward shapes: lone tokens, odd lengths, many segments; head dims 64, 72, 80, 128 and 16
ATTENTION_CASES = [
    ([1], 64), ([7], 72), ([131], 80), ([1, 7, 131, 16, 33], 64), ([5] * 24, 72),
    ([40, 1, 17], 128), ([23, 9], 16),
]


def make_inputs(lengths, heads, head_dim, dtype, seed=0, device="cpu"):
    """q, k, v as strided views of one fused QKV buffer, as the tower produces them, and cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lengths), 3, heads, head_dim, generator=g).to(device=device, dtype=dtype)
    q, k, v = qkv.unbind(1)
    cu = torch.tensor([0] + lengths).cumsum(0).to(device=device, dtype=torch.int32)
    return q, k, v, cu


def gpu(test):
    """Marks a test that needs a CUDA GPU (`-m gpu` on the GPU machine; skipped in CI)."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


# full-size packs for the GPU tests: lone tokens to 4096, many segments, a mixed pack of image sizes
GPU_LENGTHS = [[1], [7], [131], [1023], [4096], [1, 7, 131, 1023, 4096], [64] * 100,
               [3, 256, 784, 1, 1024, 2304, 17]]


def check_attention_configs(q, k, v, cu, configs) -> None:
    """Each attention configuration (None: the tuned call) into a NaN-poisoned output: nothing left unwritten, and
    within 2x the error of PyTorch's own math in the inputs' dtype against float32 (flash-attention's rule)."""
    from kernels.attention.launch import triton_varlen_attention
    from kernels.attention.reference import reference_varlen_attention

    max_seqlen = int((cu[1:] - cu[:-1]).max())
    ref = reference_varlen_attention(q, k, v, cu)
    torch_err = rel_err(reference_varlen_attention(q, k, v, cu, upcast=False), ref)
    for cfg in configs:
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
        triton_varlen_attention(q, k, v, cu, max_seqlen, out=out, config=cfg)
        torch.cuda.synchronize()
        assert not out.isnan().any(), f"unwritten output elements with {cfg}"
        assert rel_err(out, ref) <= 2 * torch_err, (cfg, rel_err(out, ref), torch_err)


def random_pngs(n: int, seed: int = 0) -> list[bytes]:
    """`n` PNGs of random pixels, 20-89 px a side, each its own size."""
    rng = np.random.default_rng(seed)
    return [encode_bytes(Image.fromarray(rng.integers(0, 256, (int(rng.integers(20, 90)), int(rng.integers(20, 90)), 3),
                                                      dtype=np.uint8))) for _ in range(n)]


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def as_hardware_would(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Triton's interpreter converts float32 to e4m3 wrongly in three cases (pinned by
    `kernels/test_add_layernorm.py::test_interpreter_e4m3_conversion`): a value that rounds up to a power of two
    comes out as half of it, subnormals (below 2^-6) are rounded toward zero, one step (2^-9) short of
    the nearest, and a float32 subnormal (below 2^-126, which rounds to zero) comes out as some e4m3 subnormal.
    Under the interpreter, codes that are exactly those errors of the expected ones count as the expected ones; on a
    GPU the codes are taken as they are."""
    if not interpreted():
        return got
    g, w = got.float(), want.float()
    power_of_two = (w != 0) & (torch.frexp(w.abs()).mantissa == 0.5)
    truncated = (w.abs() <= 2 ** -6) & (g.abs() < w.abs()) & ((w - g).abs() == 2 ** -9)
    underflow = (w == 0) & (g.abs() <= 2 ** -6)
    defect = (power_of_two & (g == w / 2)) | truncated | underflow
    return torch.where(defect, want, got)


def exact_e4m3_rows(y: torch.Tensor, act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows computed in float64, rounded to the activations' dtype, quantised per row in float64 (absmax / 448):
    the codes and scales a fused FP8 epilogue should give."""
    from kernels.fp8 import E4M3, E4M3_MAX

    y = y.to(act_dtype).double()
    scale = (y.abs().amax(-1) / E4M3_MAX).clamp_min(1e-12)
    return (y / scale[:, None]).to(E4M3), scale


def assert_e4m3_rows(q, scale, want_q, want_scale) -> None:
    """A fused FP8 epilogue's e4m3 rows against `exact_e4m3_rows`: scales within float32 rounding (1e-5); codes (the
    interpreter's known conversion errors aside, `as_hardware_would`) at most one e4m3 step off, on at most 1% of
    values (those on a rounding boundary, where float32 arithmetic and float64 part)."""
    from kernels.fp8 import E4M3

    assert q.dtype == E4M3 and torch.allclose(scale.double().cpu(), want_scale, rtol=1e-5, atol=0)
    # same sign: the distance between codes is the distance between their bytes
    steps = (as_hardware_would(q.cpu(), want_q).view(torch.uint8).int() - want_q.view(torch.uint8).int()).abs()
    assert steps.max() <= 1 and (steps > 0).float().mean() <= 0.01, (steps.max(), (steps > 0).float().mean())
