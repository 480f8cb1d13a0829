"""The tower in bfloat16 on a CUDA GPU against transformers, at the 2B and 8B presets' dimensions.

Tolerance rule (../shared/STYLE.md): our error against a float32 reference may be at most 2x the
error of transformers' own bfloat16 tower against the same reference.
"""

from __future__ import annotations

import pytest
import torch

from conftest import encode_bytes, hf_tower, hf_tower_outputs, make_video, photos, rel_err
from service.model.config import preset
from service.model.encoder import Encoder
from service.model.loader import random_tower
from service.model.tower import TowerOptions
from service.model.preprocess import Preprocessor, PreprocessConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module", params=["qwen3-vl-2b", "qwen3-vl-8b"])
def towers(request):
    cfg = preset(request.param)
    ours32 = random_tower(cfg, "cuda", torch.float32, seed=1)
    state = {k: v.clone() for k, v in ours32.state_dict().items()}
    ours = random_tower(cfg, "cuda", torch.bfloat16, seed=1)
    ref = hf_tower(cfg, state, torch.float32)
    hf_bf16 = hf_tower(cfg, state, torch.bfloat16)
    yield cfg, ours, ref, hf_bf16
    del ours32, ours, ref, hf_bf16
    torch.cuda.empty_cache()


def _pack():
    """Real photos at their native sizes, a tiny and a 1:20 image, packed together."""
    pre = Preprocessor(PreprocessConfig())
    return [pre(encode_bytes(img)) for img in photos().values()]


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
def test_tower_bf16_parity(towers, backend):
    cfg, ours, ref, hf_bf16 = towers
    items = _pack()
    grids = torch.tensor([it.grid_thw for it in items], device="cuda")
    pixels = torch.cat([torch.from_numpy(it.pixel_values) for it in items]).cuda()
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_m, ref_ds = hf_tower_outputs(ref, pixels, grids)
    hf_m, hf_ds = hf_tower_outputs(hf_bf16, pixels, grids)
    ours._backend = backend
    with torch.inference_mode():
        m, ds = ours(pixels, ours.plan([it.grid_thw for it in items]))
    err, hf_err = rel_err(m, ref_m), rel_err(hf_m, ref_m)
    print(f"{cfg.source} {backend}: merged rel err {err:.3e} (transformers bf16 {hf_err:.3e})")
    assert err <= 2 * hf_err
    for level in range(len(ref_ds)):
        e, h = rel_err(ds[level], ref_ds[level]), rel_err(hf_ds[level], ref_ds[level])
        print(f"  deepstack {level}: {e:.3e} (transformers bf16 {h:.3e})")
        assert e <= 2 * h


def test_video_grid_and_backends_agree(towers):
    cfg, ours, ref, _ = towers
    grids = [(8, 28, 28), (1, 32, 20)]
    n = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(n, cfg.patch_dim, device="cuda")
    plan = ours.plan(grids)
    outs = {}
    with torch.inference_mode():
        for backend in ("triton", "sdpa"):
            ours._backend = backend
            outs[backend] = ours(pixels, plan)
    ref_m, _ = hf_tower_outputs(ref, pixels, torch.tensor(grids, device="cuda"))
    e_t, e_s = rel_err(outs["triton"][0], ref_m), rel_err(outs["sdpa"][0], ref_m)
    print(f"{cfg.source} video: triton {e_t:.3e}, sdpa {e_s:.3e}, between {rel_err(outs['triton'][0], outs['sdpa'][0]):.3e}")
    assert e_t <= 2 * e_s and e_t < 2e-2


def test_encoder_end_to_end_bf16(towers):
    """Each item through the encoder (patchify kernel, pack, split, pooled mean), packed with the others and alone:
    within 2x transformers' bfloat16 error of its float32 tower on that item, tokens and pooled vector alike."""
    cfg, ours, ref, hf_bf16 = towers
    enc = Encoder(ours, Preprocessor(PreprocessConfig()))
    items = _pack()
    packed = enc.encode(items)
    torch.backends.cuda.matmul.allow_tf32 = False
    for it, r in zip(items, packed):
        alone = enc.encode([it])[0]
        pixels = torch.from_numpy(it.pixel_values).cuda()
        grid = torch.tensor([it.grid_thw], device="cuda")
        ref_m, _ = hf_tower_outputs(ref, pixels, grid)
        hf_m, _ = hf_tower_outputs(hf_bf16, pixels, grid)
        hf_err = rel_err(hf_m, ref_m)
        hf_pooled_err = rel_err(hf_m.float().mean(0), ref_m.mean(0))
        for name, result in (("packed", r), ("alone", alone)):
            err = rel_err(result.embeds.float().cuda(), ref_m)
            pooled_err = rel_err(result.pooled.cuda(), ref_m.mean(0))
            print(f"{cfg.source} {it.grid_thw} {name}: tokens {err:.3e}, pooled {pooled_err:.3e} (transformers bf16 "
                  f"{hf_err:.3e}, {hf_pooled_err:.3e})")
            assert err <= 2 * hf_err and pooled_err <= 2 * hf_pooled_err


def test_video_end_to_end_bf16(towers):
    """Videos (MP4 and WebM) packed with images through the served path: the uint8 frames are normalised
    and patchified on the GPU exactly as on the CPU, and the embeddings meet the tolerance rule against
    transformers' float32 tower on the same patches."""
    cfg, ours, ref, hf_bf16 = towers
    pre = Preprocessor(PreprocessConfig())
    clips = [make_video(75, 320, 240, "mp4", "libx264", rate=30, seed=1),
             make_video(40, 200, 360, "webm", "libvpx-vp9", rate=25, seed=2)]
    items = [pre(c) for c in clips] + _pack()[:2]
    assert [it.meta["kind"] for it in items] == ["video", "video", "image", "image"] and items[0].grid_thw[0] == 3
    enc = Encoder(ours, pre)
    cpu = torch.cat([torch.from_numpy(it.pixel_values) for it in items])
    with torch.inference_mode():
        on_device = enc.pixels(items)
    assert torch.equal(on_device.cpu(), cpu.to(torch.bfloat16))
    grids = torch.tensor([it.grid_thw for it in items], device="cuda")
    ref_m, _ = hf_tower_outputs(ref, cpu.cuda(), grids)
    hf_m, _ = hf_tower_outputs(hf_bf16, cpu.cuda(), grids)
    merged = torch.cat([r.embeds for r in enc.encode(items)]).cuda()
    err, hf_err = rel_err(merged, ref_m), rel_err(hf_m, ref_m)
    print(f"{cfg.source} video+image pack: merged rel err {err:.3e} (transformers bf16 {hf_err:.3e})")
    assert err <= 2 * hf_err


@pytest.mark.parametrize("name", ["qwen3-vl-2b", "qwen3-vl-8b"])
def test_bucketed_graphs_equal_eager_for_any_mix(name):
    """The served path: packs of any grids padded to a token bucket and replayed through the bucket's graph pieces
    (the attention eager between them) compute what the eager forward does: bit for bit where cuBLAS runs the same
    kernels at the bucket's token count, else within the eager forward's own bf16 error (against the float32 tower
    with the same weights) times 2, the bar the tower meets against transformers. A small pack after a large one in
    the same bucket reads stale padding rows, which must not leak; a pack beyond every bucket runs eagerly, and a lone
    image within one as the bucket's whole-forward graph."""
    from service.model.graphs import BucketedTower

    cfg = preset(name)
    tower = random_tower(cfg, "cuda", torch.bfloat16, seed=4)
    ref = random_tower(cfg, "cuda", torch.float32, seed=4, options=TowerOptions(attention_backend="sdpa"))
    bucketed = BucketedTower(tower, (256, 800, 2048))
    packs = [[(1, 28, 28)], [(1, 16, 40), (2, 8, 8)], [(1, 4, 4)], [(1, 8, 12)] * 7 + [(1, 4, 4)] * 9,
             [(1, 40, 48)], [(1, 20, 20)], [(1, 64, 64)], [(1, 28, 28)]]
    with torch.inference_mode():
        bucketed.capture()
        assert bucketed.captured
        for grids in packs:
            tokens = sum(t * h * w for t, h, w in grids)
            pixels = torch.randn(tokens, cfg.patch_dim, device="cuda", dtype=torch.bfloat16)
            merged, ds = bucketed(pixels, grids)
            e_merged, e_ds = tower(pixels, tower.plan(grids))
            r_merged, r_ds = ref(pixels.float(), ref.plan(grids))
            assert merged.shape == e_merged.shape and ds.shape == e_ds.shape
            err, e_err = rel_err(merged.float(), r_merged), rel_err(e_merged.float(), r_merged)
            ds_err, e_ds_err = rel_err(ds.float(), r_ds), rel_err(e_ds.float(), r_ds)
            print(f"{name} {tokens} tokens -> bucket {bucketed.bucket_for(tokens)}: rel err {err:.2e} "
                  f"(eager {e_err:.2e}), deepstack {ds_err:.2e} (eager {e_ds_err:.2e}), "
                  f"equal {torch.equal(merged, e_merged)}")
            assert err <= 2 * e_err and ds_err <= 2 * e_ds_err, grids
    assert bucketed.eager == 1 and bucketed.bucketed == len(packs) - 1  # only the 4096-token pack is beyond 2048
    assert bucketed.whole_forwards == 5  # the lone images within a bucket ran as one graph


def test_capture_times_an_eager_forward_and_larger_packs_run_eagerly():
    """`BucketedTower.capture` with an `eager_margin` captures every bucket and times one eager forward (`eager_costs`: its
    host time issuing the launches, and the GPU's time running them, queued behind a wait); packs from the size whose
    GPU time is `EAGER_MARGIN` times that host time run eagerly, compute what the eager forward does, and their host
    time as served feeds the choice. The GPU time is the GPU's, not the host's: within a third of the same pack's
    graph replay (the bucket that holds it exactly)."""
    from triton.testing import do_bench

    from service.model.graphs import EAGER_MARGIN, BucketedTower, cheapest_buckets, typical_grids

    cfg = preset("qwen3-vl-2b")
    tower = random_tower(cfg, "cuda", torch.bfloat16, seed=5)
    buckets = (1024, 4096, 8192, 16384, 32768)
    measured, every = BucketedTower(tower, buckets), BucketedTower(tower, buckets, eager_margin=None)
    with torch.inference_mode():
        measured.capture()
        every.capture()
        choice = measured.eager_choice
        host_ms, gpu_ms = choice.host_ms, choice.gpu_ms_per_token * 32768
        print(f"eager forward of 32768 tokens: host {host_ms:.1f} ms, GPU {gpu_ms:.1f} ms -> limit {choice.limit}")
        assert host_ms > 0 and gpu_ms > 0 and every.eager_choice is None
        assert choice.limit == int(EAGER_MARGIN * host_ms * 32768 / gpu_ms)
        # 1,024 may move up off a costly row count (`off_steps`), each tower by its own timings; the others cannot
        assert measured.buckets[1:] == every.buckets[1:] == buckets[1:] and measured.captured
        assert all(1024 <= b.buckets[0] <= 1088 for b in (measured, every))
        # each bucket's forward timed after capture (`time_buckets`): the largest within a third of its replay below
        assert sorted(measured.bucket_ms) == list(measured.buckets)
        assert all(ms > 0 for ms in measured.bucket_ms.values())
        assert measured.routes == cheapest_buckets(measured.bucket_ms)  # routed where a larger bucket timed faster
        for small, large in measured.routes.items():
            assert measured.bucket_for(small) == large
            if not measured.eager_choice.runs_eagerly(small, probe=False):
                assert measured.forward_ms(small) == measured.bucket_ms[large]
        grids = typical_grids(32768, cfg.spatial_merge_size)
        pixels = torch.randn(32768, cfg.patch_dim, device="cuda", dtype=torch.bfloat16)
        replay_ms = do_bench(lambda: every(pixels, grids), warmup=20, rep=200, return_mode="median")
        assert 0.67 * replay_ms <= gpu_ms <= 1.5 * replay_ms, (gpu_ms, replay_ms)
        assert 0.67 * replay_ms <= measured.bucket_ms[32768] <= 1.5 * replay_ms, (measured.bucket_ms, replay_ms)
        # eager where the limit is within the buckets, else 32768: graphs; whole merge windows (a grid's sides are even)
        unit = cfg.spatial_merge_size**2
        tokens = min(max(-(-choice.limit // unit) * unit, 8192), 32768)
        grids = typical_grids(tokens, cfg.spatial_merge_size)
        eager = choice.runs_eagerly(tokens)
        before = measured.eager
        merged, ds = measured(pixels[:tokens], grids)
        e_merged, e_ds = tower(pixels[:tokens], tower.plan(grids))
        assert measured.eager - before == eager
        if eager:
            assert torch.equal(merged, e_merged) and torch.equal(ds, e_ds)
            assert len(choice._issued) == 2
        else:
            assert rel_err(merged.float(), e_merged.float()) < 2e-2


def test_capture_keeps_every_bucket_when_the_eager_forward_cannot_be_timed(monkeypatch):
    """An eager forward that runs out of memory while start-up times it leaves every pack within a bucket to its
    graphs, not a failed start."""
    from service.model import graphs

    def oom(*_):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(graphs.EagerChoice, "measure", oom)
    tower = random_tower(preset("qwen3-vl-2b"), "cuda", torch.bfloat16, seed=6)
    bucketed = graphs.BucketedTower(tower, (1024, 8192))
    with torch.inference_mode():
        bucketed.capture()
    assert bucketed.buckets[1] == 8192 and 1024 <= bucketed.buckets[0] <= 1088  # (1,024 may move: `off_steps`)
    assert bucketed.captured and bucketed.eager_choice is None


def test_buckets_move_only_within_their_span():
    """On a GPU, start-up moves each bucket up to 4,096 tokens at most 64 rows up, in 16s (`off_steps`, costed by
    the blocks' own work after attention), short of the next bucket and not past 4,096; larger ones stay. Which move
    is the GPU's and cuBLAS's (on an H200 fc2 costs more at 800 rows than at 848: gemm_rows.json); printed."""
    from service.model.graphs import BucketedTower

    nominal = (256, 320, 400, 512, 640, 800, 1024, 1280, 1600, 2048, 2560, 3200, 4096, 8192)
    tower = random_tower(preset("qwen3-vl-2b"), "cuda", torch.bfloat16, seed=6)
    bucketed = BucketedTower(tower, nominal)
    with torch.inference_mode():
        bucketed.capture()
    print("buckets moved:", {a: b for a, b in zip(nominal, bucketed.buckets) if a != b})
    assert len(bucketed.buckets) == len(nominal) and sorted(bucketed.bucket_ms) == list(bucketed.buckets)
    for i, (asked, placed) in enumerate(zip(nominal, bucketed.buckets)):
        if asked > 4096:
            assert placed == asked
        else:
            assert asked <= placed <= min(asked + 64, 4096, nominal[i + 1] - 16) and placed % 16 == 0
