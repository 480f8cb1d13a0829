"""The whole path -- bytes -> CLI -> safetensors -- against transformers' processor + get_image_features."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import encode_bytes, hf_input, hf_tower_outputs, photos, rel_err
from service.model.encoder import Encoder
from service.model.tower import TowerOptions

TOL = 1e-5  # float32 on CPU


@pytest.fixture(scope="module")
def photo_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("photos")
    files = {}
    for name, img in photos().items():
        fmt = "JPEG" if name in ("astronaut", "coffee") else "PNG"
        path = d / f"{name}.{fmt.lower()}"
        path.write_bytes(encode_bytes(img, fmt, **({"quality": 92} if fmt == "JPEG" else {})))
        files[name] = path
    return files


def _reference(hf_model, hf_processor, images):
    inputs = hf_processor(images=[hf_input(img) for img in images], return_tensors="pt")
    grids = inputs["image_grid_thw"]
    with torch.no_grad():
        out = hf_model.model.get_image_features(inputs["pixel_values"], grids)
    embeds, deepstack = (out[0], out[1]) if isinstance(out, tuple) else (out.pooler_output, out.deepstack_features)
    sizes = (grids.prod(-1) // 4).tolist()
    # some releases return per-image tuples, others the packed tensors
    embeds = list(torch.split(embeds, sizes)) if torch.is_tensor(embeds) else list(embeds)
    deepstack = [list(torch.split(f, sizes)) if torch.is_tensor(f) else list(f) for f in deepstack]
    return grids, embeds, deepstack


def test_cli_matches_transformers(full_checkpoint, hf_model, hf_processor, photo_files, tmp_path):
    from PIL import Image

    names = list(photo_files)
    out_file = tmp_path / "out.safetensors"
    cmd = [sys.executable, "-m", "service.cli", "encode", "--model", str(full_checkpoint), "--device", "cpu",
           "--dtype", "float32", "--max-batch-patches", "2048", "--output", str(out_file),
           *[str(photo_files[n]) for n in names]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = load_file(str(out_file))

    # transformers decodes what the CLI decoded: the same files, opened by PIL
    images = [Image.open(photo_files[n]) for n in names]
    grids, embeds, deepstack = _reference(hf_model, hf_processor, images)
    assert len(deepstack) == 2
    for i, name in enumerate(names):
        assert got[f"grid_thw.{i}"].tolist() == grids[i].tolist(), name
        assert got[f"embeds.{i}"].shape == embeds[i].shape, name
        assert rel_err(got[f"embeds.{i}"], embeds[i]) <= TOL, name
        assert got[f"deepstack.{i}"].shape == (len(deepstack), *embeds[i].shape)
        for level, feats in enumerate(deepstack):
            assert rel_err(got[f"deepstack.{i}"][level], feats[i]) <= TOL, (name, level)


def test_packing_invariance(full_checkpoint):
    enc = Encoder.load(str(full_checkpoint))
    items = [enc.preprocess(encode_bytes(img)) for img in photos().values()]
    together = enc.encode(items)
    for item, packed in zip(items, together):
        alone = enc.encode([item])[0]
        assert alone.grid_thw == packed.grid_thw
        assert rel_err(packed.embeds, alone.embeds) <= TOL
        assert rel_err(packed.deepstack, alone.deepstack) <= TOL
    # and in reverse order, which moves every image to another offset of the pack
    reverse = enc.encode(items[::-1])[::-1]
    for a, b in zip(together, reverse):
        assert rel_err(a.embeds, b.embeds) <= TOL


def test_video_shaped_grid_matches_transformers(full_checkpoint, hf_model):
    """t > 1: every frame pair is its own attention segment; compared with the reference tower."""
    enc = Encoder.load(str(full_checkpoint))
    grids = [(3, 4, 6), (1, 8, 2)]
    n = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(n, enc.config.patch_dim)
    plan = enc.tower.plan(grids)
    with torch.no_grad():
        merged, ds = enc.tower(pixels, plan)
    ref_merged, ref_ds = hf_tower_outputs(hf_model.model.visual, pixels, torch.tensor(grids))
    assert rel_err(merged, ref_merged) <= TOL
    for level, feats in enumerate(ref_ds):
        assert rel_err(ds[level], feats) <= TOL


@pytest.mark.parametrize("fused_qkv,residual_in_gemm", [(True, True), (False, True), (True, False)])
def test_fused_triton_tower_matches_transformers(full_checkpoint, hf_model, fused_qkv, residual_in_gemm,
                                                 monkeypatch):
    """The whole Triton path (QKV projection with RoPE in its epilogue, or the projection and the
    in-place RoPE pass; varlen attention; the residual added by the output projections and the bias
    sums by the LayerNorm pass, or add+LayerNorm) in the interpreter, fp32."""
    import kernels.qkv_rope

    enc = Encoder.load(str(full_checkpoint), options=TowerOptions(attention_backend="triton", fused_qkv_rope=fused_qkv,
                                                                  residual_in_gemm=residual_in_gemm))
    for p in enc.tower.parameters():
        p.data = p.data.clone()  # weights mapped from the file may be unaligned; tensor descriptors need 16 B
    launches = []
    monkeypatch.setattr(kernels.qkv_rope, "_qkv_rope_gemm", _Spy(kernels.qkv_rope._qkv_rope_gemm, launches))
    grids = [(1, 6, 10), (2, 4, 4), (1, 2, 2)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), enc.config.patch_dim)
    with torch.no_grad():
        merged, ds = enc.tower(pixels, enc.tower.plan(grids))
    ref_merged, ref_ds = hf_tower_outputs(hf_model.model.visual, pixels, torch.tensor(grids))
    assert rel_err(merged, ref_merged) <= TOL
    for level, feats in enumerate(ref_ds):
        assert rel_err(ds[level], feats) <= TOL
    assert len(launches) == (enc.config.depth if fused_qkv else 0)


@pytest.mark.parametrize("backend,attention", [("triton", "sdpa"), ("sdpa", "triton")])
def test_attention_backend_per_forward(full_checkpoint, hf_model, backend, attention, monkeypatch):
    """`forward(..., attention=)` runs that attention backend and leaves the rest of the tower's path (the
    fused projection goes with the tower's backend): both mixes match transformers (interpreter, fp32)."""
    from kernels.attention import launch, pointer

    enc = Encoder.load(str(full_checkpoint), options=TowerOptions(attention_backend=backend))
    for p in enc.tower.parameters():
        p.data = p.data.clone()  # weights mapped from the file may be unaligned; tensor descriptors need 16 B
    launches = []
    monkeypatch.setattr(launch, "_varlen_attn_fwd", _Spy(pointer._varlen_attn_fwd, launches))
    grids = [(1, 6, 10), (2, 4, 4), (1, 2, 2)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), enc.config.patch_dim)
    with torch.no_grad():
        merged, ds = enc.tower(pixels, enc.tower.plan(grids), attention)
    ref_merged, ref_ds = hf_tower_outputs(hf_model.model.visual, pixels, torch.tensor(grids))
    assert rel_err(merged, ref_merged) <= TOL
    for level, feats in enumerate(ref_ds):
        assert rel_err(ds[level], feats) <= TOL
    assert len(launches) == (enc.config.depth if attention == "triton" else 0)


class _Spy:
    """Counts the launches of a Triton kernel (`kernel[grid](...)`) and passes them through."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]
