"""The FP8 tower (`QUANTIZATION=fp8`, `service/model/quant.py`) on the CPU, where its GEMMs compute in float32 what the
GPU's FP8 GEMMs do: which layers it quantises, its error against the unquantised tower (also with outlier channels
planted in the residual stream), serving it from a checkpoint, and `quant-check`."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
import torch
import torch.nn as nn

from service.model.config import preset
from service.model.encoder import Encoder
from service.model.loader import random_tower
from service.model.quant import Fp8Linear
from service.model.quant_check import all_tokens, compare, fp8_copy
from tools.synthetic import plant_outliers, unit_gain
from service.model.tower import TowerOptions, VisionTower

from conftest import gpu, random_pngs, rel_err
from servers import serve


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2.5"])
def test_fp8_replaces_the_blocks_linear_layers_only(name):
    cfg = preset(name)
    tower = random_tower(cfg, "cpu", torch.float32, options=TowerOptions(quantization="fp8"))
    per_block = 4 if cfg.windowed else 3  # qkv, fc1, fc2 (SwiGLU: gate, up, down); proj stays (FP8_LINEARS)
    fp8 = [n for n, m in tower.named_modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == per_block * cfg.depth and all(n.startswith("blocks.") for n in fp8)
    assert isinstance(tower.merger.linear_fc1 if not cfg.windowed else tower.merger.mlp[0], nn.Linear)
    assert all(type(block.attn.proj) is nn.Linear for block in tower.blocks)
    with pytest.raises(ValueError, match="quantization"):
        TowerOptions(quantization="int8")


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2.5"])
@pytest.mark.parametrize("outliers", [False, True])
def test_fp8_tower_error_against_the_unquantised_one(name, outliers):
    """Per-token cosine of the merged tokens, the DeepStack features and the residual stream after each block,
    against the float32 tower with unit-gain block weights (each block moves the stream as trained ones do), with
    and without outlier channels of 50-200x planted before the projections (`plant_outliers`: the float function
    unchanged). The bounds are what e4m3's rounding leaves on this 4-block tower (measured: mean 0.995-0.998, worst
    0.990-0.995); activations quantised without their per-token scale land at 0.977-0.983 / 0.953-0.961 with the
    outliers and fail them. The
    issue's targets (mean >= 0.999, worst >= 0.99) are for the real presets and checkpoints: fp8_error.json and
    `quant-check`."""
    cfg = preset(name)
    encoder = Encoder.load(f"random:{name}")
    unit_gain(encoder.tower)
    items = [encoder.preprocess(data) for data in random_pngs(4)]
    if outliers:
        with torch.inference_mode():
            before = encoder.encode(items[:1])[0].embeds
        plant_outliers(encoder.tower)
        with torch.inference_mode():
            after = encoder.encode(items[:1])[0].embeds
        assert rel_err(after, before) <= 1e-5  # the float function is unchanged
    report = compare(encoder, fp8_copy(encoder.tower), items)
    overall = all_tokens(report)
    assert overall["mean_token_cosine"] >= 0.99 and overall["min_token_cosine"] >= 0.98, report
    assert len(report["layers"]) == cfg.depth and min(l["min_token_cosine"] for l in report["layers"]) >= 0.98
    assert len(report["deepstack"]) == len(cfg.deepstack_visual_indexes)
    assert not any(isinstance(m, Fp8Linear) for m in encoder.tower.modules())  # the copy is quantised, not it


def test_served_fp8_from_a_checkpoint(full_checkpoint):
    """QUANTIZATION=fp8 on a real checkpoint directory: /info says so, and the embeddings stay close to the
    unquantised server's."""
    images = random_pngs(2, seed=5)
    files = [("file", (f"{i}.png", b, "image/png")) for i, b in enumerate(images)]
    got = {}
    for quantization in ("none", "fp8"):
        with serve(model=str(full_checkpoint), quantization=quantization) as (url, _):
            info = httpx.get(f"{url}/info").json()
            assert info["quantization"] == quantization
            r = httpx.post(f"{url}/embed", files=files, timeout=60)
            assert r.status_code == 200
            got[quantization] = [torch.tensor(d["embeddings"]) for d in r.json()["data"]]
    for a, b in zip(got["none"], got["fp8"]):
        assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() >= 0.99
        assert 0 < rel_err(b, a) <= 0.1  # quantised: close, not equal


def test_quant_check_command(tmp_path):
    paths = []
    for i, data in enumerate(random_pngs(2)):
        paths.append(tmp_path / f"{i}.png")
        paths[-1].write_bytes(data)
    out = tmp_path / "report.json"
    run = subprocess.run([sys.executable, "-m", "service.cli", "quant-check", "--model", "random:tiny", "--device",
                          "cpu", "--dtype", "float32", "--json", str(out), *map(str, paths)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "merged tokens" in run.stdout and "after block 0" in run.stdout and "within the targets" in run.stdout
    report = json.loads(out.read_text())
    assert report["inputs"] == 2 and len(report["layers"]) == preset("tiny").depth
    assert report["all_tokens"]["min_token_cosine"] >= 0.99


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2.5"])
def test_norms_hand_the_fp8_gemms_quantised_rows(name, monkeypatch):
    """The inputs of qkv and of the MLP's first GEMMs come out of their norm's pass as `Quantized` rows, fc2's (or
    down_proj's) out of the activation's, and the tower computes bit for bit what it computes when each FP8 layer
    quantises its own input (on the CPU both are `quantize_rows` of the same tensor)."""
    import service.model.tower as tower_module
    from kernels.fp8 import Quantized

    encoder = Encoder.load(f"random:{name}")
    fp8 = fp8_copy(encoder.tower)
    items = [encoder.preprocess(data) for data in random_pngs(2, seed=4)]
    pixels = encoder.pixels(items)
    plan = fp8.plan([it.grid_thw for it in items])
    seen = []
    forward = Fp8Linear.forward
    monkeypatch.setattr(Fp8Linear, "forward", lambda self, x, *a, **k: seen.append(type(x)) or forward(self, x, *a,
                                                                                                         **k))
    with torch.inference_mode():
        handed = fp8(pixels, plan)
        assert seen == [Quantized] * (4 if fp8.config.windowed else 3) * len(fp8.blocks)
        monkeypatch.setattr(tower_module, "_reads_fp8", lambda part: False)
        monkeypatch.setattr(tower_module, "_quantizes_activation", lambda output, act: False)
        own = fp8(pixels, plan)
    assert all(torch.equal(a, b) for a, b in zip(handed, own))


@gpu
@pytest.mark.parametrize("rows", [1, 784, 25088])
def test_fp8_linear_on_the_gpu_quantises_in_one_pass_as_quantize_rows(rows):
    """On a GPU an FP8 layer given bf16 rows quantises them with `act_quantize(x, "none")` (one pass) rather than
    `quantize_rows`: the outputs agree up to the codes on rounding boundaries, with and without a residual."""
    from kernels.fp8 import fp8_linear

    g = torch.Generator(device="cuda").manual_seed(rows)
    linear = nn.Linear(1024, 1024).cuda().bfloat16()
    layer = Fp8Linear.from_linear(linear)
    x = torch.randn(rows, 1024, generator=g, device="cuda").bfloat16()
    x[:, ::101] *= 80
    want = fp8_linear(x.cpu(), layer.qweight.cpu(), layer.scale.cpu(), layer.bias.cpu())  # quantize_rows, float32 GEMM
    assert rel_err(layer(x).float().cpu(), want.float()) <= 1e-2
    residual = torch.randn(rows, 1024, generator=g, device="cuda").bfloat16()
    got = layer(x, residual=residual.clone(), add_bias=False)
    assert rel_err(got.float().cpu(), (residual.cpu().float() + want.float() - layer.bias.cpu().float())) <= 1e-2


@pytest.mark.parametrize("intermediate", [120, 3420])
def test_an_mlp_the_fp8_gemm_cannot_take_is_padded_to_one_it_can(intermediate):
    """The FP8 GEMM takes only dimensions that are multiples of 16 (TMA's 16-byte rows in e4m3, cuBLASLt's rule), and
    Qwen2.5-VL's MLP is 3420 wide (every size of that family): gate, up and down are padded with zeros to the next
    multiple, which computes the same function in float32, then quantised like every other block's; the tower stays
    close to the unquantised one, every FP8 GEMM fed quantised rows (the attention's output projection stays bf16)."""
    from dataclasses import replace

    from kernels.fp8 import Quantized, fp8_gemm_shape
    from service.model.tower import pad_mlp

    assert not fp8_gemm_shape(1280, 3420) and fp8_gemm_shape(1152, 4304)
    cfg = replace(preset("tiny-qwen2.5"), intermediate_size=intermediate)
    padded = random_tower(cfg, "cpu", torch.float32, seed=3)  # the loader pads
    ref = VisionTower(cfg).eval()
    ref.load_state_dict(padded.state_dict())  # state_dict() keeps the checkpoint's shapes
    grids = [(1, 8, 12), (1, 4, 4)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), cfg.patch_dim, generator=torch.Generator().manual_seed(1))
    assert not any(pad_mlp(block.mlp, 16) for block in padded.blocks)  # padded already, by the loader
    assert padded.blocks[0].mlp.down_proj.in_features == intermediate + (-intermediate % 16)
    assert ref.blocks[0].mlp.down_proj.in_features == intermediate
    with torch.inference_mode():
        want = ref(pixels, ref.plan(grids))[0]
        torch.testing.assert_close(padded(pixels, padded.plan(grids))[0], want, rtol=1e-5, atol=1e-6)
    tower = random_tower(cfg, "cpu", torch.float32, seed=3, options=TowerOptions(quantization="fp8"))
    for block in tower.blocks:
        assert all(type(getattr(block.mlp, n)) is Fp8Linear for n in ("gate_proj", "up_proj", "down_proj"))
        assert block.mlp.down_proj.in_features % 16 == 0
    seen = []
    forward = Fp8Linear.forward
    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(Fp8Linear, "forward", lambda self, x, *a, **k: seen.append(type(x)) or forward(self, x, *a, **k))
        got = tower(pixels, tower.plan(grids))[0]
    # qkv, gate, up, down from their norms and activation (proj stays in the tower's dtype)
    assert seen == [Quantized] * 4 * len(tower.blocks)
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() >= 0.99 and 0 < rel_err(got, want) <= 0.1


@gpu
def test_fp8_qwen2_5_vl_7b_blocks_run_on_the_gpu():
    """Qwen2.5-VL-7B's widths through the FP8 tower on a GPU (two blocks, one full-attention): the 3420-wide MLP
    padded to 3424, every block GEMM in FP8, close to the bf16 tower."""
    from dataclasses import replace

    cfg = replace(preset("qwen2.5-vl-7b"), depth=2, fullatt_block_indexes=(1,))
    ref = random_tower(cfg, "cuda", torch.bfloat16, seed=2)
    tower = random_tower(cfg, "cuda", torch.bfloat16, seed=2, options=TowerOptions(quantization="fp8"))
    grids = [(1, 32, 32), (1, 16, 24)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), cfg.patch_dim, device="cuda").bfloat16()
    with torch.inference_mode():
        got, want = tower(pixels, tower.plan(grids))[0].float(), ref(pixels, ref.plan(grids))[0].float()
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() >= 0.99


def test_fused_fp8_epilogues_in_the_tower(monkeypatch):
    """The served FP8 forward on the Triton backend (interpreted here): qkv with RoPE in its epilogue into the
    forward's buffer, fc1 with its bias and the GELU handed to fc2 in e4m3, fc2 adding the residual in place, every
    one the fused kernel; against the
    FP8 tower without them (cuBLASLt's arithmetic and the passes) and the float one. Head dim 64 (a tile covers whole
    heads), an MLP 200 wide (padded to 208)."""
    from dataclasses import replace

    import kernels.fp8_gemm as fp8_gemm_module

    cfg = replace(preset("tiny"), hidden_size=128, num_heads=2, intermediate_size=200)
    ref = random_tower(cfg, "cpu", torch.float32, seed=5)
    unfused = random_tower(cfg, "cpu", torch.float32, seed=5, options=TowerOptions(quantization="fp8"))
    fused = random_tower(cfg, "cpu", torch.float32, seed=5,
                         options=TowerOptions(attention_backend="triton", quantization="fp8"))
    launched = []
    launch = fp8_gemm_module.launch
    monkeypatch.setattr(fp8_gemm_module, "launch",
                        lambda fn, grid, *a, **k: launched.append(k) or launch(fn, grid, *a, **k))
    grids = [(1, 6, 10), (1, 4, 4)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), cfg.patch_dim, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = ref(pixels, ref.plan(grids))
        plain = unfused(pixels, unfused.plan(grids))
        assert not launched
        got = fused(pixels, fused.plan(grids))
    modes = [(k["ROPE"], k["HAS_BIAS"], k["HAS_RES"], k["ACT_FN"] >= 0) for k in launched]
    # qkv with RoPE; fc1 with its bias and the GELU, written in e4m3 for fc2; fc2 adding into the residual
    assert modes == [(True, True, False, False), (False, True, False, True), (False, False, True, False)] * cfg.depth
    cos = torch.nn.functional.cosine_similarity
    for a, b, c in zip(got, plain, want):  # merged tokens, then DeepStack
        a, b, c = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]), c.reshape(-1, c.shape[-1])
        assert cos(a, b, dim=-1).min() >= 0.9999 and cos(a, c, dim=-1).min() >= 0.99
        assert 0 < rel_err(a, c) <= 0.1


def test_handing_the_gelu_on_costs_no_accuracy(monkeypatch):
    """fc1 hands fc2 its GELU in e4m3 at scales bounded from its input (`fp8.act_row_scales`, many times the rows'
    absmax) with fc2's weight carrying fc1's channel norms: against the float tower, within 5% of the 1 - cosine of
    the same tower quantising the GELU at absmax / 448 in `act_quant`'s pass (e4m3's relative error does not depend
    on the scale while values stay in its normal range)."""
    from dataclasses import replace

    import service.model.quant as quant_module

    cfg = replace(preset("tiny"), hidden_size=256, num_heads=4, intermediate_size=1024, depth=4)
    ref = random_tower(cfg, "cpu", torch.float32, seed=7)
    handed = random_tower(cfg, "cpu", torch.float32, seed=7, options=TowerOptions(quantization="fp8"))
    assert all(block.mlp.linear_fc1.act_inv_norm is not None for block in handed.blocks)
    monkeypatch.setattr(quant_module, "ACT_HANDED", ())
    passed = random_tower(cfg, "cpu", torch.float32, seed=7, options=TowerOptions(quantization="fp8"))
    assert all(block.mlp.linear_fc1.act_inv_norm is None for block in passed.blocks)
    grids = [(1, 16, 20), (2, 8, 8)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), cfg.patch_dim, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = ref(pixels, ref.plan(grids))[0]
        loss = {name: 1 - torch.nn.functional.cosine_similarity(t(pixels, t.plan(grids))[0], want, dim=-1).mean()
                for name, t in (("handed", handed), ("passed", passed))}
    assert 0 < loss["handed"] <= 1.05 * loss["passed"], loss
