"""The FP8 GEMM with fused epilogues (`kernels/fp8_gemm.py`): plain (bias), residual in place, and QKV with RoPE, each
against float64 of the dequantised operands; under Triton's interpreter on the CPU, at every candidate tile on a
Hopper GPU. The e4m3 operands are the same for both sides, so what is compared is the epilogue and the accumulation:
the product of two e4m3 codes is exact in float32, so the kernel's error is float32 accumulation plus one rounding to
the output's dtype."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import E4M3_MAX, Quantizable, Quantized, quantize_quantizable, quantize_rows, row_scale
from kernels.rope import vision_rope_cos_sin, vision_rope_inv_freq

from conftest import gpu, platform_e4m3, rel_err


def operands(m, k, n, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed + m * k + n)
    x = torch.randn(m, k, device=device, generator=g)
    x[:, :3] *= 50  # outlier channels
    w = torch.randn(n, k, device=device, generator=g) / k**0.5
    return Quantized(*quantize_rows(x)), quantize_rows(w), torch.randn(n, device=device, generator=g)


def exact_product(x: Quantized, w) -> torch.Tensor:
    (xq, xs), (wq, ws) = x, w
    return (xq.double() * xs.double()[:, None]) @ (wq.double() * ws.double()[:, None]).t()


def rotated(lin: torch.Tensor, cos, sin, heads: int) -> torch.Tensor:
    """Q and K of `lin [M, 3 * heads * D]` rotated (rotate-half), in float64."""
    m = lin.shape[0]
    qkv = lin.view(m, 3, heads, -1).clone()
    half = qkv.shape[-1] // 2
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    for i in (0, 1):
        x1, x2 = qkv[:, i, :, :half].clone(), qkv[:, i, :, half:].clone()
        qkv[:, i] = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    return qkv


def rounding(exact: torch.Tensor, dtype) -> float:
    """The error of rounding `exact` to `dtype` once: what a single-rounding epilogue cannot avoid."""
    return rel_err(exact.to(dtype), exact)


TILES = [(32, 32, 32, 4, 2, False), (16, 64, 32, 4, 3, False), (32, 32, 32, 4, 2, True)]


@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (7, 96, 80), (131, 208, 112)])  # N and K tails, one row
@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("bias", [True, False])
def test_plain_interpreted(m, k, n, tile, bias):
    from kernels.fp8_gemm import fp8_gemm

    x, w, b = operands(m, k, n)
    exact = exact_product(x, w) + (b.double() if bias else 0)
    out = fp8_gemm(x, *w, b if bias else None, out_dtype=torch.float32, tile=tile)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert rel_err(out, exact) <= 1e-6


@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (7, 96, 80), (131, 208, 112)])
@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_residual_in_place_interpreted(m, k, n, tile, dtype):
    """`residual += x @ W^T` with one rounding: the residual tensor itself is returned, its error that of rounding
    the exact sum once (the unfused path, which rounds the product first, may not be better)."""
    from kernels.fp8_gemm import UNFUSED, fp8_gemm

    x, w, _ = operands(m, k, n)
    g = torch.Generator().manual_seed(m)
    residual = (torch.randn(m, n, generator=g) * 3).to(dtype)
    exact = exact_product(x, w) + residual.double()
    unfused = fp8_gemm(x, *w, residual=residual.clone(), tile=UNFUSED)
    out = fp8_gemm(x, *w, residual=residual, tile=tile)
    assert out.data_ptr() == residual.data_ptr() and out.dtype == dtype
    assert rel_err(out, exact) <= 1.5 * rounding(exact, dtype) + 1e-6
    assert rel_err(out, exact) <= rel_err(unfused, exact) + 1e-6


@pytest.mark.parametrize("m,k,heads,head_dim", [(1, 64, 2, 32), (131, 96, 2, 64), (70, 48, 4, 16)])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("into", [False, True])
def test_qkv_rope_interpreted(m, k, heads, head_dim, persistent, into):
    """The QKV projection with bias, Q and K rotated in the epilogue, against float64; into a given buffer, the
    same values in it."""
    from kernels.fp8_gemm import fp8_gemm

    n = 3 * heads * head_dim
    x, w, b = operands(m, k, n)
    b = b.half()
    cos, sin = vision_rope_cos_sin(torch.randint(0, 50, (m, 2)), vision_rope_inv_freq(head_dim))
    exact = rotated(exact_product(x, w) + b.double(), cos, sin, heads)
    buf = torch.full((m, 3, heads, head_dim), float("nan"), dtype=torch.float16) if into else None
    out = fp8_gemm(x, *w, b, out_dtype=torch.float16, rope=(cos, sin, heads), out=buf,
                   tile=(32, head_dim, 32, 4, 2, persistent))
    assert out.shape == (m, 3, heads, head_dim) and out.dtype == torch.float16
    assert buf is None or out.data_ptr() == buf.data_ptr()
    assert rel_err(out, exact) <= 1.5 * rounding(exact, torch.float16) + 1e-6


def test_unfused_and_fallbacks():
    """Where the kernel may not run (the CPU without `use_triton`, head dim 72 with RoPE) the same call runs
    `scaled_linear` and the passes, within the same error."""
    from kernels.fp8_gemm import UNFUSED, fp8_gemm, fp8_gemm_supported

    x, w, b = operands(9, 144, 3 * 144)
    cos, sin = vision_rope_cos_sin(torch.randint(0, 9, (9, 2)), vision_rope_inv_freq(72))
    exact = rotated(exact_product(x, w) + b.double(), cos, sin, 2)
    assert fp8_gemm_supported(x, w[0])  # the interpreter could, but head dim 72 has no tile
    for kw in ({}, {"use_triton": True}, {"tile": UNFUSED}):
        out = fp8_gemm(x, *w, b, out_dtype=torch.float32, rope=(cos, sin, 2), **kw)
        assert rel_err(out, exact) <= 1e-6
    with pytest.raises(ValueError, match="block_n"):
        fp8_gemm(x, *w, b, out_dtype=torch.float32, rope=(cos, sin, 2), tile=(32, 64, 32, 4, 2, False))
    with pytest.raises(ValueError, match="not two"):
        fp8_gemm(x, *w, residual=torch.zeros(9, 3 * 144), rope=(cos, sin, 2))


def test_choosing_a_tile_never_adds_into_the_residual(monkeypatch):
    """The first call of a shape class times every candidate (`runtime.choose`); in residual mode each timing run
    adds a product, so they run on scratch: the residual takes the product once, from the chosen candidate."""
    import kernels.fp8_gemm as mod

    monkeypatch.setattr(mod, "interpreting", lambda: False)  # take the tuning path, still interpreted
    monkeypatch.setattr(mod, "fp8_gemm_supported", lambda *a: True)
    timed = []

    def choose(key, candidates, launch):
        listed = candidates()
        for c in (listed[0], mod.UNFUSED):
            launch(c)
            timed.append(c)
        return listed[0]

    monkeypatch.setattr(mod, "choose", choose)
    x, w, _ = operands(7, 128, 128)
    residual = torch.randn(7, 128, generator=torch.Generator().manual_seed(1))
    exact = exact_product(x, w) + residual.double()
    mod.fp8_gemm(x, *w, residual=residual, use_triton=True)
    assert len(timed) == 2 and rel_err(residual, exact) <= 1e-6


ACTS = {"gelu_pytorch_tanh": lambda h: torch.nn.functional.gelu(h, approximate="tanh"),
        "gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu, "none": lambda h: h}


def assert_activation(got, plain: torch.Tensor, act: str, rtol: float, atol: float = 1e-7) -> None:
    """The activation epilogue's values against the activation, in float64, of the plain epilogue's output at the same
    tile (so the same product, rounded once to the output's dtype): elementwise within `rtol` of the value (one
    rounding more) and `atol` times the product (the GPU's `tanh.approx`: about 2^-11 of tanh, so of GELU's input);
    each row's absmax, gathered by atomics over the row's tiles, exactly that of the values returned."""
    want = ACTS[act](plain.double())
    err = (got.values.double() - want).abs()
    assert (err <= rtol * want.abs() + atol * plain.double().abs() + 1e-7).all(), err.max()
    assert torch.equal(got.amax, got.values.float().abs().amax(1))


@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (7, 96, 80), (131, 208, 112)])
@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "gelu", "silu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_activation_epilogue_interpreted(m, k, n, act, dtype):
    """`act=`: the activation of the biased product (rounded as the unfused GEMM stores it) in float32, rounded once
    (half a unit in the last place), at tiles with one and several column tiles per row, and unfused."""
    from kernels.fp8_gemm import UNFUSED, fp8_gemm

    x, w, b = operands(m, k, n)
    b = b.to(dtype)
    for tile in [(32, 32, 32, 4, 2, False), (16, 64, 32, 4, 3, True), UNFUSED]:
        got = fp8_gemm(x, *w, b, out_dtype=dtype, act=act, tile=tile)
        assert isinstance(got, Quantizable) and got.values.dtype == dtype and got.values.shape == (m, n)
        plain = fp8_gemm(x, *w, b, out_dtype=dtype, tile=tile)
        # (atol: torch's float32 tanh GELU, unfused, cancels in 1 + tanh for inputs below -5)
        assert_activation(got, plain, act, rtol=2**-10 if dtype == torch.float16 else 1e-6, atol=2**-22)


def deferred_operand(m, k, dtype, device="cpu"):
    """Rows in the activations' dtype (outlier channels among them) with their absmax, and the codes a kernel
    that loads them makes (the values times the reciprocal of their scale, rounded where the test runs)."""
    g = torch.Generator(device=device).manual_seed(m + k)
    v = torch.randn(m, k, device=device, generator=g)
    v[:, 1] *= 80
    v = v.to(dtype)
    x = Quantizable(v, v.float().abs().amax(1))
    scale = row_scale(x.amax)
    codes = platform_e4m3((v.float() * (1.0 / scale)[:, None]).clamp(-E4M3_MAX, E4M3_MAX))
    return x, Quantized(codes, scale)


@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (7, 96, 80), (131, 208, 112)])
@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_deferred_operand_interpreted(m, k, n, tile, dtype):
    """A `Quantizable` A operand, rounded to e4m3 in the kernel as it is loaded: the product of those codes, plain
    and into a residual; and the unfused path quantises it as `quantize_rows` does."""
    from kernels.fp8_gemm import UNFUSED, fp8_gemm

    x, codes = deferred_operand(m, k, dtype)
    _, w, b = operands(m, k, n)
    exact = exact_product(codes, w)
    got = fp8_gemm(x, *w, b, out_dtype=torch.float32, tile=tile)
    assert rel_err(got, exact + b.double()) <= 1e-6
    residual = torch.randn(m, n, generator=torch.Generator().manual_seed(n)).to(dtype)
    want = exact + residual.double()
    assert rel_err(fp8_gemm(x, *w, residual=residual, tile=tile), want) <= 1.5 * rounding(want, dtype) + 1e-6
    reference = Quantized(*quantize_rows(x.values))
    assert torch.equal(quantize_quantizable(x).codes, reference.codes)
    unfused = fp8_gemm(x, *w, b, out_dtype=torch.float32, tile=UNFUSED)
    assert rel_err(unfused, exact_product(reference, w) + b.double()) <= 1e-6


def mlp_operands(m, k, inter, device="cpu"):
    x, w1, b1 = operands(m, k, inter, device=device)
    _, w2, _ = operands(m, inter, k, device=device, seed=1)
    return x, (*w1, b1.bfloat16()), (*w2, None)


def exact_mlp(x: Quantized, fc1, fc2, act: str) -> torch.Tensor:
    """The MLP in float64 from the dequantised input and weights, its activation unquantised."""
    h = exact_product(x, fc1[:2]) + fc1[2].double()
    return exact_product(Quantized(ACTS[act](h), torch.ones(h.shape[0], dtype=torch.float64, device=h.device)),
                         fc2[:2])


@pytest.mark.parametrize("m", [1, 7, 131])
@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "silu"])
def test_mlp_chains_interpreted(m, act):
    """`fp8_mlp`: DEFERRED is fc1 with the activation epilogue, then fc2 quantising as it loads; PASS is fc1, the
    activation's e4m3 pass and fc2 on codes; either into a residual in place. Each is its composition, and the
    reference arithmetic off Triton is within e4m3's rounding of the float64 MLP."""
    from kernels.act_quant import act_quantize
    from kernels.fp8_gemm import DEFERRED, PASS, fp8_gemm, fp8_mlp

    x, fc1, fc2 = mlp_operands(m, 64, 96)
    residual = torch.randn(m, 64, generator=torch.Generator().manual_seed(m)).bfloat16()
    h = fp8_gemm(x, *fc1, act=act, use_triton=True)
    deferred = fp8_mlp(x, fc1, fc2, act, residual=residual.clone(), chain=DEFERRED, use_triton=True)
    assert torch.equal(deferred, fp8_gemm(h, *fc2, residual=residual.clone(), use_triton=True))
    q = act_quantize(fp8_gemm(x, *fc1, use_triton=True), act)
    passed = fp8_mlp(x, fc1, fc2, act, residual=residual.clone(), chain=PASS, use_triton=True)
    assert torch.equal(passed, fp8_gemm(q, *fc2, residual=residual.clone(), use_triton=True))
    exact = exact_mlp(x, fc1, fc2, act) + residual.double()
    reference = fp8_mlp(x, fc1, fc2, act, residual=residual.clone(), use_triton=False)
    assert rel_err(reference, exact) <= 0.05
    assert rel_err(passed, exact) <= 0.05


def test_choosing_a_chain_never_adds_into_the_residual(monkeypatch):
    """`fp8_mlp` times both chains on first use of a shape class into scratch: the residual takes the MLP once."""
    import kernels.fp8_gemm as mod

    monkeypatch.setattr(mod, "interpreting", lambda: False)  # take the tuning path, still interpreted
    monkeypatch.setattr(mod, "fp8_gemm_supported", lambda *a: True)
    timed = []

    def choose(key, candidates, launch):
        listed = candidates()
        if key[0] == "fp8_mlp":
            for c in listed:
                launch(c)
                timed.append(c)
        return listed[0] if key[0] == "fp8_mlp" else (32, 32, 32, 4, 2, False)

    monkeypatch.setattr(mod, "choose", choose)
    x, fc1, fc2 = mlp_operands(7, 64, 96)
    residual = torch.randn(7, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    want = mod.fp8_mlp(x, fc1, fc2, "gelu", residual=residual.clone(), chain=mod.DEFERRED, use_triton=True)
    got = mod.fp8_mlp(x, fc1, fc2, "gelu", residual=residual, use_triton=True)
    assert timed == [mod.DEFERRED, mod.PASS] and got.data_ptr() == residual.data_ptr() and torch.equal(got, want)


hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                            reason="TMA + FP8 wgmma: Hopper only")


@gpu
@hopper
@pytest.mark.parametrize("m", [1, 131, 25088])
@pytest.mark.parametrize("k,n", [(1024, 1024), (4096, 1024), (4304, 1152), (1024, 4096)])
def test_every_tile_on_the_gpu(m, k, n):
    """Residual (bf16, in place) and plain (bias) epilogues at every tile and the tuned call, against float64: one
    rounding, within 2x of the error of cuBLASLt's scaled_mm (then the add). Triton's FP8 dot on Hopper accumulates
    at the tensor cores' reduced precision, where cuBLASLt promotes to float32 every few steps: at K = 4304 and one
    row, measured 0.26% of the output's norm against cuBLASLt's 0.17% (bf16's rounding alone 0.17%); the e4m3
    rounding of the operands is 3-4%."""
    from kernels.fp8_gemm import FP8_TILES, UNFUSED, fp8_gemm

    x, w, b = operands(m, k, n, device="cuda")
    b = b.bfloat16()
    g = torch.Generator(device="cuda").manual_seed(m)
    residual = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    exact_res = exact_product(x, w) + residual.double()
    exact_plain = exact_product(x, w) + b.double()
    unfused = rel_err(fp8_gemm(x, *w, residual=residual.clone(), tile=UNFUSED), exact_res)
    unfused_plain = rel_err(fp8_gemm(x, *w, b, tile=UNFUSED), exact_plain)
    for tile in [*FP8_TILES, None]:
        got = fp8_gemm(x, *w, residual=residual.clone(), tile=tile)
        assert rel_err(got, exact_res) <= max(2 * unfused, 1.5 * rounding(exact_res, torch.bfloat16)), tile
        plain = fp8_gemm(x, *w, b, tile=tile)
        assert rel_err(plain, exact_plain) <= max(2 * unfused_plain, 1.5 * rounding(exact_plain, torch.bfloat16))


@gpu
@hopper
@pytest.mark.parametrize("m", [1, 131, 25088])
@pytest.mark.parametrize("hidden,heads", [(1024, 16), (2048, 16)])
def test_qkv_rope_every_tile_on_the_gpu(m, hidden, heads):
    from kernels.fp8_gemm import UNFUSED, _rope_tiles, fp8_gemm

    head_dim = hidden // heads
    x, w, b = operands(m, hidden, 3 * hidden, device="cuda")
    b = b.bfloat16()
    pos = torch.randint(0, 64, (m, 2), device="cuda")
    cos, sin = vision_rope_cos_sin(pos, vision_rope_inv_freq(head_dim, device="cuda"))
    exact = rotated(exact_product(x, w) + b.double(), cos, sin, heads)
    unfused = rel_err(fp8_gemm(x, *w, b, rope=(cos, sin, heads), tile=UNFUSED), exact)
    assert _rope_tiles(hidden, head_dim)
    for tile in [*_rope_tiles(hidden, head_dim), None]:
        out = torch.empty(m, 3, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        got = fp8_gemm(x, *w, b, rope=(cos, sin, heads), out=out, tile=tile)
        assert got.data_ptr() == out.data_ptr()
        assert rel_err(got, exact) <= max(2 * unfused, 1.5 * rounding(exact, torch.bfloat16)), tile


@gpu
@hopper
@pytest.mark.parametrize("m", [1, 131, 25088])
@pytest.mark.parametrize("k,n", [(1024, 4096), (1152, 4304), (4096, 1024)])
def test_activation_epilogue_and_deferred_operand_every_tile_on_the_gpu(m, k, n):
    """The activation epilogue (tanh GELU through `tanh.approx`) at every tile and the tuned one, against the plain
    epilogue's output at the same tile (`assert_activation`: two bf16 units, plus 2^-10 of the input for the
    approximate tanh). A `Quantizable` operand at every tile against the float64 product of its `quantize_rows`
    codes, within 2x cuBLASLt's error on those codes."""
    from kernels.fp8_gemm import FP8_TILES, UNFUSED, fp8_gemm

    x, w, b = operands(m, k, n, device="cuda")
    b = b.bfloat16()
    v, _ = deferred_operand(m, k, torch.bfloat16, device="cuda")
    exact = exact_product(Quantized(*quantize_rows(v.values)), w) + b.double()
    bound = max(2 * rel_err(fp8_gemm(v, *w, b, tile=UNFUSED), exact), 1.5 * rounding(exact, torch.bfloat16))
    for tile in [*FP8_TILES, None]:
        got = fp8_gemm(x, *w, b, act="gelu_pytorch_tanh", tile=tile)
        plain = fp8_gemm(x, *w, b, tile=tile if tile is not None else got_tile(x, w, b))
        assert_activation(got, plain, "gelu_pytorch_tanh", rtol=2**-7, atol=2**-10)
        assert rel_err(fp8_gemm(v, *w, b, tile=tile), exact) <= bound, tile


def got_tile(x, w, b):
    """The tile the tuner chose for the activation epilogue of this shape."""
    from kernels.runtime import tuned_choices

    m, k = x.codes.shape
    n = w[0].shape[0]
    return next(c for key, c in tuned_choices().items()
                if key[:2] == ("fp8_gemm", "gelu_pytorch_tanh") and key[4:6] == (n, k) and key[3] == _class(m))


def _class(m):
    from kernels.fp8_gemm import _size_class

    return _size_class(m)


@gpu
@hopper
@pytest.mark.parametrize("m", [1, 131, 25088])
@pytest.mark.parametrize("k,inter", [(1024, 4096), (1152, 4304)])
def test_mlp_chains_on_the_gpu(m, k, inter):
    """Both chains of `fp8_mlp` (and the chosen one) into a bf16 residual, against the float64 MLP: the same e4m3
    rounding of the activation, so within 10% of each other's error and of the reference arithmetic's."""
    from kernels.fp8_gemm import DEFERRED, PASS, fp8_mlp

    x, fc1, fc2 = mlp_operands(m, k, inter, device="cuda")
    residual = torch.randn(m, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(m)).bfloat16()
    exact = exact_mlp(x, fc1, fc2, "gelu_pytorch_tanh") + residual.double()
    reference = rel_err(fp8_mlp(x, fc1, fc2, "gelu_pytorch_tanh", residual=residual.clone(), use_triton=False), exact)
    for chain in (DEFERRED, PASS, None):
        got = fp8_mlp(x, fc1, fc2, "gelu_pytorch_tanh", residual=residual.clone(), chain=chain)
        assert rel_err(got, exact) <= 1.1 * reference, chain
