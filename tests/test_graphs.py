"""Bucketed forwards on the CPU: the pieces that become CUDA graphs on a GPU run eagerly here over the same padded
static buffers, so the padding, the split around the attention and the plan cache are checked against the plain
forward in float32 (the GPU test, tests/gpu, checks the captured graphs)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch

from conftest import rel_err
from service.model.config import preset
from service.model.graphs import BucketedTower
from service.model.loader import random_tower
from service.model.tower import TowerOptions
from service.settings import Settings, parse_buckets

PACKS = [
    [(1, 2, 2)],  # one merged token
    [(1, 4, 14), (1, 2, 2)],
    [(2, 6, 4), (1, 10, 2)],  # a video's two frames, a flat image
    [(1, 4, 4)] * 7 + [(1, 2, 6)],  # many segments
    [(1, 14, 20)],  # beyond every bucket: eager
    [(1, 2, 2)],  # small after large in the same bucket: stale padding rows
]


@pytest.fixture(scope="module")
def tower():
    return random_tower(preset("tiny"), "cpu", torch.float32, seed=2)


def test_padded_pieces_equal_the_plain_forward(tower):
    bucketed = BucketedTower(tower, (16, 64, 128))
    bucketed.capture()
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for grids in PACKS + PACKS:
            tokens = sum(t * h * w for t, h, w in grids)
            pixels = torch.randn(tokens, tower.config.patch_dim, generator=gen)
            merged, ds = bucketed(pixels, grids)
            ref_merged, ref_ds = tower(pixels, tower.plan(grids))
            assert merged.shape == ref_merged.shape and ds.shape == ref_ds.shape
            assert rel_err(merged, ref_merged) <= 1e-5 and rel_err(ds, ref_ds) <= 1e-5, grids
    assert bucketed.eager == 2 and bucketed.bucketed == 10
    assert bucketed.padded_tokens == 2 * sum(bucketed.bucket_for(n) - n for n in (4, 60, 68, 124, 4))
    assert len(bucketed._plans) == len({tuple(p) for p in PACKS})  # a repeated signature reuses its plan


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_one_frame_packs_run_whole_over_the_bucket(backend):
    """A lone image within WHOLE_MAX_TOKENS runs the whole forward over its bucket's rows, its attention told where
    the frame ends by a device-side segment (the captured graph on a GPU; here the same calls eagerly, the Triton
    kernel interpreted): equal to the plain forward after packs that left other values in the padding rows."""
    tower = random_tower(preset("tiny"), "cpu", torch.float32, seed=3, options=TowerOptions(attention_backend=backend))
    bucketed = BucketedTower(tower, (16, 64, 128))
    bucketed.capture()
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        # the same grids twice in a row: the second finds its positions in the buffers already
        for grids in ([(1, 8, 14)], [(1, 8, 14)], [(1, 2, 2)], [(1, 4, 10), (1, 2, 2)], [(1, 6, 2)], [(2, 4, 4)],
                      [(1, 10, 6)]):
            tokens = sum(t * h * w for t, h, w in grids)
            pixels = torch.randn(tokens, tower.config.patch_dim, generator=gen)
            merged, ds = bucketed(pixels, grids)
            ref_merged, ref_ds = tower(pixels, tower.plan(grids))
            assert rel_err(merged, ref_merged) <= 1e-5 and rel_err(ds, ref_ds) <= 1e-5, grids
    assert bucketed.whole_forwards == 5 and bucketed.bucketed == 7  # two packs of two frames ran the pieces


def test_a_lone_frame_enters_from_its_frames_and_equals_the_plain_encoder(monkeypatch):
    """`Encoder.launch` of one frame within a whole-forward bucket goes in through `BucketedTower.frame` (its uint8
    frames copied to the static buffer, patchified with their shape read from there), never `Encoder.pixels`, and
    gives what an encoder without buckets gives: tokens, DeepStack features and the pooled vector, for images of
    other sizes one after another (the shape, positions and table in the buffers replaced or kept), a two-frame
    video, and a pack of two, which takes the pixel rows' way."""
    from PIL import Image

    from service.model.encoder import Encoder

    plain = Encoder.load("random:tiny")
    enc = Encoder.load("random:tiny", graph_buckets=(256, 512, 1024, 2048))
    enc.forward.capture()
    calls = []
    pixels = enc.pixels
    monkeypatch.setattr(enc, "pixels", lambda items: calls.append(len(items)) or pixels(items))
    rng = np.random.default_rng(4)

    def image(h, w):
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))

    # two frames of a video: one temporal patch, one segment
    video = enc.preprocessor.item(rng.integers(0, 256, (2, 64, 96, 3), dtype=np.uint8), (1, 4, 6), {"kind": "video"})
    # another normalisation (another checkpoint's preprocessor would have one): another lookup table
    other = dataclasses.replace(enc.preprocess(image(64, 96)), lut=enc.preprocessor.lut * 0.5 + 0.25)
    shots = [[image(64, 96)], [image(64, 96)], [image(200, 40)], [image(128, 128)], [other], [image(32, 32)], [video],
             [image(64, 64), image(32, 96)], [image(64, 96)]]
    with torch.inference_mode():
        for shot in shots:
            items = [x if not isinstance(x, Image.Image) else enc.preprocess(x) for x in shot]
            got, want = enc.encode(items), plain.encode(items)
            for g, w in zip(got, want):
                assert g.grid_thw == w.grid_thw and g.num_tokens == w.num_tokens
                assert rel_err(g.embeds, w.embeds) <= 1e-5 and rel_err(g.deepstack, w.deepstack) <= 1e-5, g.grid_thw
                assert rel_err(g.pooled, w.pooled) <= 1e-5
    assert calls == [2]  # only the pack of two made pixel rows on the host
    assert enc.forward.whole_forwards == len(shots) - 1


def test_without_capture_or_buckets_every_pack_runs_eagerly(tower):
    bucketed = BucketedTower(tower, (64,))
    pixels = torch.randn(16, tower.config.patch_dim)
    with torch.inference_mode():
        merged, _ = bucketed(pixels, [(1, 4, 4)])
        assert torch.equal(merged, tower(pixels, tower.plan([(1, 4, 4)]))[0])
    assert bucketed.eager == 1 and bucketed.bucketed == 0


def test_unfused_residual_option_runs_bucketed():
    """Without the residual in the GEMMs (Qwen2.5-VL's default) the buckets run the unfused pieces: the same result
    as the plain forward."""
    tower = random_tower(preset("tiny"), "cpu", torch.float32, seed=2, options=TowerOptions(residual_in_gemm=False))
    bucketed = BucketedTower(tower, (64,))
    bucketed.capture()
    pixels = torch.randn(16, tower.config.patch_dim)
    with torch.inference_mode():
        merged, ds = bucketed(pixels, [(1, 4, 4)])
        want, want_ds = tower(pixels, tower.plan([(1, 4, 4)]))
    assert bucketed.bucketed == 1 and bucketed.eager == 0
    assert torch.allclose(merged, want, rtol=1e-5, atol=1e-6) and torch.allclose(ds, want_ds, rtol=1e-5, atol=1e-6)


def test_bucket_settings():
    assert parse_buckets("64, 16,16") == (16, 64)
    for bad in ("", "6", "0,16"):
        with pytest.raises(ValueError):
            parse_buckets(bad)
    with pytest.raises(ValueError):
        Settings(cuda_graph_buckets="10,20")


def test_buckets_are_captured_up_to_the_first_that_holds_a_full_pack():
    on = {"cuda_graphs": True, "cuda_graph_buckets": "256,1024,4096,16384"}
    assert Settings(**on, max_batch_patches=1024).graph_buckets() == (256, 1024)
    assert Settings(**on, max_batch_patches=1025).graph_buckets() == (256, 1024, 4096)
    assert Settings(**on, max_batch_patches=65536).graph_buckets() == (256, 1024, 4096, 16384)
    assert Settings(cuda_graphs=False).graph_buckets() == ()
    assert Settings(cuda_graphs=True).graph_buckets()[-1] >= Settings().max_batch_patches


@pytest.mark.parametrize("tokens", [4, 800, 1024, 4608, 32768, 32772])
def test_typical_grids_cover_the_tokens_in_valid_frames(tokens):
    """The pack `EagerChoice.measure` times: frames of 32 x 32 patches and one smaller, every side a multiple of the
    merge size, `tokens` patches in all."""
    from service.model.graphs import typical_grids

    grids = typical_grids(tokens, 2)
    assert sum(t * h * w for t, h, w in grids) == tokens
    assert all(t == 1 and h % 2 == 0 and w % 2 == 0 and h > 0 and w > 0 for t, h, w in grids)
    assert sum(g == (1, 32, 32) for g in grids) == tokens // 1024


def test_eager_choice_follows_the_host_time_of_eager_forwards_as_served(caplog):
    """`EagerChoice`: packs from `EAGER_MARGIN` x the host time over the GPU time per token run eagerly, the host
    time being the median of the last `window` eager forwards' (start-up's at first). Host-bound eager forwards raise
    the limit; every `probe_every`-th pack that start-up's host time would run eagerly still does, so a host that
    frees up lowers it again."""
    from service.model.graphs import EAGER_MARGIN, EagerChoice

    caplog.set_level(logging.INFO, logger="service.model.graphs")
    choice = EagerChoice(host_ms=10.0, gpu_ms=40.0, tokens=32768)  # bf16 on an H200, roughly
    start = int(EAGER_MARGIN * 10.0 * 32768 / 40.0)
    assert choice.limit == start
    assert choice.runs_eagerly(start) and not choice.runs_eagerly(start - 1)
    for _ in range(EagerChoice.window):  # the host, loaded, takes twice as long
        choice.issued(20.0)
    assert choice.host_ms == 20.0 and choice.limit == 2 * start
    moves = [r.getMessage() for r in caplog.records if "run eagerly" in r.getMessage()]
    assert 1 <= len(moves) <= 3 and moves[-1].startswith(f"packs from {2 * start} tokens")  # as it moved
    answers = [choice.runs_eagerly(start) for _ in range(3 * EagerChoice.probe_every)]
    assert sum(answers) == 3 and answers[EagerChoice.probe_every - 1]  # the probes
    assert not choice.runs_eagerly(start // 2)  # below start-up's limit: never probed
    for _ in range(EagerChoice.window // 2 + 1):  # the host freed up
        choice.issued(10.0)
    assert choice.limit == start


def test_the_eager_margin_is_a_setting():
    """`Settings.cuda_graph_eager_margin` reaches `EagerChoice` (its default the model's `EAGER_MARGIN`): the limit
    scales with it; `cuda_graph_eager_above=false` turns the choice off."""
    from service.model.graphs import EAGER_MARGIN, EagerChoice
    from service.settings import Settings

    assert Settings().graph_eager_margin() == EAGER_MARGIN
    assert Settings(cuda_graph_eager_margin=1.5).graph_eager_margin() == 1.5
    assert Settings(cuda_graph_eager_above=False, cuda_graph_eager_margin=1.5).graph_eager_margin() is None
    default, lower = (EagerChoice(host_ms=10.0, gpu_ms=40.0, tokens=32768, margin=m) for m in (EAGER_MARGIN, 1.5))
    assert lower.limit == int(1.5 * 10.0 * 32768 / 40.0) and default.limit == int(EAGER_MARGIN * 10.0 * 32768 / 40.0)
    for _ in range(EagerChoice.window):
        lower.issued(20.0)
    assert lower.limit == int(1.5 * 20.0 * 32768 / 40.0)
    assert BucketedTower(None, (), eager_margin=None).eager_margin is None


def test_each_bucket_is_timed_and_a_pack_costs_its_buckets_time(tower):
    """`BucketedTower.time_buckets` times every bucket's forward (here on the CPU, by the wall clock; start-up does it
    on CUDA, after capture); `forward_ms` gives a pack its bucket's time, and a pack that runs eagerly (beyond every
    bucket, or past the eager choice's limit) its tokens at the eager forward's time a token, else the largest
    bucket's. Nothing before the buckets are timed, nor through `Encoder.forward_ms` without captured graphs."""
    from service.model.encoder import Encoder
    from service.model.graphs import WHOLE_MAX_TOKENS, EagerChoice
    from service.model.preprocess import PreprocessConfig, Preprocessor

    buckets = (64, 256, 1024, 5120, 6144)
    bucketed = BucketedTower(tower, buckets, eager_margin=None)
    bucketed.capture()
    assert bucketed.forward_ms(100) is None and bucketed.bucket_ms == {}
    bucketed.time_buckets(reps=1)
    assert sorted(bucketed.bucket_ms) == list(buckets) and all(ms > 0 for ms in bucketed.bucket_ms.values())
    assert bucketed.bucket_ms[6144] > bucketed.bucket_ms[64]
    assert bucketed.forward_ms(65) == bucketed.forward_ms(256) == bucketed.bucket_ms[256]
    assert bucketed.forward_ms(5121) == bucketed.bucket_ms[6144]
    assert bucketed.forward_ms(12288) == pytest.approx(2 * bucketed.bucket_ms[6144])  # beyond: the largest's rate
    bucketed.eager_choice = EagerChoice(host_ms=1.0, gpu_ms=3.0, tokens=6000)  # a limit of 6000 tokens
    assert bucketed.forward_ms(6100) == pytest.approx(6100 * 3.0 / 6000)  # eager: its time a token
    assert bucketed.forward_ms(5121) == bucketed.bucket_ms[6144] and 5121 > WHOLE_MAX_TOKENS
    for _ in range(EagerChoice.window):  # eager forwards as served took the host twice as long: the limit doubles
        bucketed.eager_choice.issued(2.0)
    assert [bucketed.forward_ms(6100) for _ in range(2 * EagerChoice.probe_every)] == [bucketed.bucket_ms[6144]] * (
        2 * EagerChoice.probe_every)  # asking is not a pack: none of them counts as a probe
    assert bucketed.eager_choice._declined == 0
    enc = Encoder(tower, Preprocessor(PreprocessConfig()), buckets)
    enc.forward.bucket_ms = dict(bucketed.bucket_ms)
    assert not enc.forward.captured and enc.forward_ms(100) is None  # CPU: no graphs, no timings used


def test_an_earlier_starts_bucket_timings_are_taken_for_the_same_tower_and_buckets_and_kept_in_the_cache(
        tower, tmp_path, monkeypatch, caplog):
    """A restart takes the timings an earlier start saved (`time_buckets(known=...)`) instead of timing: every bucket
    gets the saved time, none is run (a forward here would raise); timings for other buckets are not taken, and the
    buckets are timed. The engine's cache file (`build.bucket_timings_file`) is named by what the timings depend on
    (the GPU and versions, the tower's shapes, dtype, options and buckets), round-trips through JSON, and a corrupt or
    unwritable one costs a warning and a timing, never the start."""
    from service.engine import build

    buckets = (64, 256, 1024)
    bucketed = BucketedTower(tower, buckets, eager_margin=None)
    bucketed.capture()
    saved = {64: 1.5, 256: 2.25, 1024: 7.0}
    monkeypatch.setattr(BucketedTower, "_timed", lambda *a: pytest.fail("timed despite known timings"))
    bucketed.time_buckets(known=saved)
    assert bucketed.bucket_ms == saved and bucketed.forward_ms(200) == 2.25
    monkeypatch.undo()
    bucketed.time_buckets(reps=1, known={64: 1.5, 256: 2.25})  # other buckets: timed
    assert sorted(bucketed.bucket_ms) == list(buckets) and bucketed.bucket_ms[1024] != 7.0

    other = BucketedTower(tower, (64, 256, 2048), eager_margin=None)
    half = BucketedTower(random_tower(preset("tiny"), "cpu", torch.float16, seed=2), buckets, eager_margin=None)
    assert len({bucketed.timing_key(), other.timing_key(), half.timing_key()}) == 3
    assert bucketed.timing_key() == BucketedTower(tower, buckets, eager_margin=None).timing_key()
    # named by the buckets asked for, not where start-up placed them, and by the placement's bounds: a file of
    # nominal buckets from a start that placed none (an older release on the same cache volume) is not taken
    from service.model import graphs

    moved, key = BucketedTower(tower, buckets, eager_margin=None), bucketed.timing_key()
    moved.buckets = (64, 272, 1024)
    assert moved.timing_key() == key
    monkeypatch.setattr(graphs, "STEP_SPAN_ROWS", 0)  # placed otherwise (here: not at all)
    assert moved.timing_key() != key
    monkeypatch.undo()

    path = tmp_path / "buckets" / "t.json"
    build.save_bucket_timings(path, saved)
    assert build.load_bucket_timings(path) == saved
    assert build.load_bucket_timings(tmp_path / "none.json") is None and build.load_bucket_timings(None) is None
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert build.load_bucket_timings(path) is None
        (tmp_path / "ro").write_text("")  # a file where the directory should be: not writable
        build.save_bucket_timings(tmp_path / "ro" / "t.json", saved)
    assert "ignoring the bucket timings" in caplog.text and "could not write the bucket timings" in caplog.text

    class Enc:  # what the file's name reads from an encoder
        device, forward = torch.device("cpu"), bucketed

    assert build.bucket_timings_file(Settings(cache_dir=str(tmp_path)), Enc) is None  # no GPU: nothing kept


def test_a_bucket_routes_to_the_fastest_at_or_above_it():
    """`cheapest_buckets` against a brute-force search over fresh random timings, with ties, flat stretches and
    buckets at or below the threshold (never routed, never a destination)."""
    from service.model.graphs import cheapest_buckets

    rng = np.random.default_rng(7)
    for trial in range(200):
        sizes = sorted(rng.choice(np.arange(1, 60), size=int(rng.integers(1, 12)), replace=False) * 512)
        ms = {int(t): float(rng.choice([10.0, 11.0, 12.0, 20.0, 25.0]) + t / 4096) for t in sizes}
        above, gain = int(rng.choice([0, 4096, 8192])), float(rng.choice([0.0, 0.02, 0.2]))
        expected = {}
        for t in (t for t in ms if t > above):
            best = min((b for b in ms if b >= t), key=lambda b: (ms[b], b))
            if best != t and ms[best] < (1 - gain) * ms[t]:
                expected[t] = best
        assert cheapest_buckets(ms, above, gain) == expected, (trial, ms, above, gain)
    assert cheapest_buckets({8192: 10.0, 9216: 9.9}, 4096, 0.02) == {}  # within the noise margin: stays
    assert cheapest_buckets({8192: 10.0, 9216: 9.0, 10240: 8.0}, 4096, 0.02) == {8192: 10240, 9216: 10240}


def test_buckets_move_up_off_a_costly_row_count():
    """`off_steps` against a brute-force search over fresh random costs: each bucket up to the limit goes to the
    cheapest row count from it to `span` above it, in `step`s, below the next bucket and not past the limit, where
    that beats its own by `gain`; the others stay, their costs never asked for. Then the H200's fc2 step
    (gemm_rows.json): 800 rows cost 23.3 us, 848-864 rows 18.1-18.2."""
    from service.model.graphs import off_steps

    rng = np.random.default_rng(11)
    for trial in range(200):
        sizes = rng.choice(np.arange(4, 320), size=int(rng.integers(1, 9)), replace=False) * 16
        buckets = tuple(sorted(int(b) for b in sizes))
        table = {rows: float(rng.choice([1.0, 1.01, 1.3, 2.0])) for rows in range(0, 6000, 16)}
        limit, span = int(rng.choice([0, 1024, 4096])), int(rng.choice([0, 32, 64]))
        gain = float(rng.choice([0.0, 0.02]))
        asked = []

        def cost(rows):
            asked.append(rows)
            return table[rows]

        expected = []
        for i, b in enumerate(buckets):
            if b > limit:
                expected.append(b)
                continue
            top = min(b + span, limit, buckets[i + 1] - 16 if i + 1 < len(buckets) else limit)
            best = min(range(b, top + 1, 16), key=lambda r: (table[r], r))
            expected.append(best if table[best] < (1 - gain) * table[b] else b)
        assert off_steps(buckets, cost, limit, span, 16, gain) == tuple(expected), (trial, buckets, limit, span)
        assert all(r <= limit and r % 16 == 0 for r in asked)
        assert list(expected) == sorted(set(expected))  # still distinct, in order: no bucket reaches the next
    fc2 = {784: 16.74, 800: 23.34, 816: 23.04, 832: 22.94, 848: 18.11, 864: 18.21, 1024: 18.5}
    assert off_steps((640, 800, 1024), lambda r: fc2.get(r, 18.5)) == (640, 848, 1024)
    # 800 may go no further than 816 (the next bucket is 832), 1.3% cheaper: it stays; 832 goes to 848
    assert off_steps((800, 832), lambda r: fc2.get(r, 23.0)) == (800, 848)


def test_a_routed_pack_runs_in_the_larger_bucket_and_equals_the_plain_forward(tower):
    """A pack whose bucket is routed to a larger one (`routes`, set from start-up's timings on CUDA) computes that
    bucket's rows, costs that bucket's time, and still equals the plain forward (the extra rows are padding)."""
    bucketed = BucketedTower(tower, (16, 64, 128), eager_margin=None)
    bucketed.capture()
    bucketed.bucket_ms = {16: 1.0, 64: 3.0, 128: 2.0}
    bucketed.routes = {64: 128}
    assert bucketed.bucket_for(20) == bucketed.bucket_for(100) == 128 and bucketed.bucket_for(10) == 16
    assert bucketed.forward_ms(60) == 2.0
    gen = torch.Generator().manual_seed(1)
    grids = [(1, 4, 14), (1, 2, 2)]  # 60 tokens: bucket 64, routed to 128
    pixels = torch.randn(60, tower.config.patch_dim, generator=gen)
    with torch.inference_mode():
        merged, ds = bucketed(pixels, grids)
        ref_merged, ref_ds = tower(pixels, tower.plan(grids))
    assert rel_err(merged, ref_merged) <= 1e-5 and rel_err(ds, ref_ds) <= 1e-5
    assert bucketed.padded_tokens == 128 - 60 and bucketed.bucketed == 1


def test_packs_the_choice_runs_eagerly_equal_the_plain_forward(tower):
    """A pack within a bucket that `EagerChoice` runs eagerly computes the plain forward (no padding), and its host
    time feeds the choice (last: here that is the whole CPU forward, which moves the limit); a smaller one runs through
    its bucket."""
    from service.model.graphs import EAGER_MARGIN, WHOLE_MAX_TOKENS, EagerChoice

    bucketed = BucketedTower(tower, (16, 4096, 6144))
    bucketed.capture()
    assert bucketed.eager_choice is None  # timed only on CUDA
    # a limit of 5000 tokens: EAGER_MARGIN * host ms / GPU ms per token
    choice = bucketed.eager_choice = EagerChoice(host_ms=5000 / EAGER_MARGIN, gpu_ms=6144.0, tokens=6144)
    choice.probe_every = 10 ** 6
    assert choice.limit == 5000 > WHOLE_MAX_TOKENS
    gen = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        for grids, eager in (([(1, 2, 2)], False), ([(1, 64, 72)], False), ([(1, 64, 80)], True)):
            tokens = sum(t * h * w for t, h, w in grids)
            pixels = torch.randn(tokens, tower.config.patch_dim, generator=gen)
            before = bucketed.eager, len(choice._issued)
            merged, ds = bucketed(pixels, grids)
            ref_merged, ref_ds = tower(pixels, tower.plan(grids))
            assert (bucketed.eager - before[0], len(choice._issued) - before[1]) == (eager, eager), grids
            assert rel_err(merged, ref_merged) <= 1e-5 and rel_err(ds, ref_ds) <= 1e-5, grids
    assert choice._issued[-1] > 0


def test_a_pending_forward_says_whether_it_ran_eagerly():
    """`Pending.eager` (the forward trace's last column): False for a lone image (its whole-forward graph) and a pack
    within a captured bucket, True for one beyond every bucket and for one the eager choice takes."""
    from PIL import Image

    from service.model.encoder import Encoder
    from service.model.graphs import EagerChoice

    enc = Encoder.load("random:tiny", graph_buckets=(256, 512, 8192))
    enc.forward.capture()
    rng = np.random.default_rng(5)

    def item(h, w):
        return enc.preprocess(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))

    one = item(64, 64)  # 256 patches (the preset's smallest image)
    small, large, many = [one], [one] * 40, [one] * 20  # 256, 10,240 (beyond 8192) and 5,120 patches
    with torch.inference_mode():
        assert not enc.launch(small).eager and enc.launch(large).eager
        assert not enc.launch(many).eager  # within 8192: its graphs
        enc.forward.eager_choice = EagerChoice(host_ms=1.0, gpu_ms=3.0, tokens=4096)  # a limit of 4096 tokens
        assert enc.launch(many).eager and not enc.launch(small).eager


def test_a_restart_keeps_the_placement_its_timings_name(monkeypatch):
    """An earlier start's timings (in the file named by the buckets asked for) give the buckets it placed, so a
    restart neither searches again nor times again (`time_buckets` takes timings of exactly its buckets); timings of
    another bucket count are not taken for a placement. On the CPU nothing is placed: no GPU, no cuBLAS steps."""
    tower = random_tower(preset("tiny"), "cpu", torch.float32, seed=2)
    bt = BucketedTower(tower, (64, 256, 1024))
    assert bt._placed({64: 0.5, 304: 1.0, 1024: 2.0}, None) == (64, 304, 1024)
    from service.model import graphs  # a search, costed as a GPU would be: 272 rows cheaper than 256

    monkeypatch.setattr(graphs, "sleep_cycles_per_ms", lambda: 1.0)
    monkeypatch.setattr(bt, "_block_ms", lambda rows, offsets, rate: 1.0 if rows == 272 else 2.0)
    assert bt._placed({64: 0.5, 1024: 2.0}, None) == (64, 272, 1024)
    bt.capture()
    assert bt.buckets == (64, 256, 1024)
