"""`qwen3vl-encoder dataset` on the CPU with random:tiny: every kind of input, the outputs the server gives for the
same bytes and options, bad inputs in the errors files, and a run killed at any moment and run again writing every
input exactly once."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import random_pngs
from servers import serve
from service.dataset import JobOptions, list_inputs, run_job
from service.errors import EncoderError
from service.settings import Settings

ROOT = Path(__file__).parents[1]


def _read(out: Path) -> pa.Table:
    return pa.concat_tables([pq.read_table(f) for f in sorted(out.glob("part-*.parquet"))])


def _errors(out: Path) -> list[dict]:
    return [json.loads(line) for f in sorted((out / "__job__" / "errors").glob("part-*.jsonl"))
            for line in f.read_text().splitlines()]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, list[str], dict[str, bytes]]:
    """A directory tree, a list file, a WebDataset shard and a Parquet file (datasets' Image struct), with one
    corrupt file; and the bytes of each input by its id."""
    root = tmp_path_factory.mktemp("dataset")
    images = random_pngs(14, seed=41)
    by_id: dict[str, bytes] = {}
    tree = root / "tree"
    (tree / "sub").mkdir(parents=True)
    for i, img in enumerate(images[:4]):
        name = f"{i}.png" if i < 2 else f"sub/{i}.png"
        (tree / name).write_bytes(img)
        by_id[name] = img
    (tree / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    (tree / "notes.txt").write_text("not an input: skipped by extension")
    listed = root / "listed"
    listed.mkdir()
    for i, img in enumerate(images[4:7]):
        (listed / f"l{i}.png").write_bytes(img)
    (root / "list.txt").write_text("# a comment\n" + "".join(f"listed/l{i}.png\n" for i in range(3)))
    for i, img in enumerate(images[4:7]):
        by_id[f"listed/l{i}.png"] = img
    with tarfile.open(root / "shard-000.tar", "w") as tar:
        for i, img in enumerate(images[7:10]):
            for name, data in ((f"sample{i}.png", img), (f"sample{i}.json", b'{"caption": "x"}')):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            by_id[f"shard-000.tar/sample{i}.png"] = img
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    rows = [{"bytes": img, "path": f"p{i}.png"} for i, img in enumerate(images[10:14])]
    pq.write_table(pa.table({"image": pa.array(rows, type=struct), "caption": ["a", "b", "c", "d"]}),
                   root / "data.parquet", row_group_size=3)  # rows across two row groups
    for i, img in enumerate(images[10:14]):
        by_id[f"data.parquet#{i}"] = img
    return root, [str(tree), str(root / "list.txt"), str(root / "shard-000.tar"), str(root / "data.parquet")], by_id


def _run(paths, out, opts, **settings):
    cfg = Settings(model="random:tiny", device="cpu", **settings)
    return asyncio.run(run_job(list_inputs(paths, opts.image_column), out, cfg, opts, progress=False))


CLI_ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _cli_job_with_shards_written(tmp_path, images: int, seed: int, args: list[str], shards: int):
    """`qwen3vl-encoder dataset` on `images` random PNGs (one image a forward, so that it is slow enough to kill),
    running once `shards` of its shards are written: (its process, the output directory, its command)."""
    folder = tmp_path / "images"
    folder.mkdir()
    for i, img in enumerate(random_pngs(images, seed=seed)):
        (folder / f"{i:03d}.png").write_bytes(img)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "service.cli", "dataset", str(folder), "-o", str(out), "--model", "random:tiny",
           *args, "--quiet", "--max-batch-items", "1", "--warmup", "false"]
    proc = subprocess.Popen(cmd, env=CLI_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while len(list(out.glob("part-*.parquet"))) < shards:
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read().decode()[-2000:]
        time.sleep(0.01)
    return proc, out, cmd


def test_every_kind_of_input_gives_what_embed_gives_for_the_same_bytes(inputs, tmp_path):
    _, paths, by_id = inputs
    out = tmp_path / "out"
    counts = _run(paths, out, JobOptions(outputs=("pooled", "tokens", "vllm", "sglang"), normalize=True, shard_size=5))
    assert counts["rows"] == len(by_id) and counts["errors"] == 1
    table = _read(out)
    assert sorted(table.column("id").to_pylist()) == sorted(by_id)  # each input once, the broken one not at all
    [error] = _errors(out)
    assert error["id"] == "broken.jpg" and error["error"] == "UnsupportedImage", error
    assert len(list(out.glob("part-*.parquet"))) == 3  # 15 inputs in shards of 5
    manifest = json.loads((out / "__job__" / "manifest.json").read_text())
    assert manifest["inputs"] == 15 and manifest["shards"] == 3 and manifest["model"] == "random:tiny"

    rows = {r["id"]: r for r in table.to_pylist()}
    with serve() as (url, _):
        for id_, data in by_id.items():
            row = rows[id_]
            r = httpx.post(f"{url}/embed", content=data, params={"pooling": "mean", "normalize": "true"},
                           headers={"content-type": "image/png"}, timeout=60).json()["data"][0]
            assert row["grid_thw"] == r["grid_thw"] and row["num_tokens"] == r["num_tokens"]
            np.testing.assert_allclose(row["pooled"], r["pooled"], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(np.array(row["tokens"]), np.array(r["embeddings"]), rtol=1e-5, atol=1e-6)
            v = httpx.post(f"{url}/embed", content=data, params={"format": "vllm"},
                           headers={"content-type": "image/png"}, timeout=60).json()["data"][0]["image_embeds"]
            ours = torch.load(io.BytesIO(row["image_embeds"]), weights_only=True)
            theirs = torch.load(io.BytesIO(base64.b64decode(v["image_embeds"])), weights_only=True)
            assert ours.dtype == theirs.dtype == torch.bfloat16 and ours.shape == theirs.shape
            assert (ours.float() - theirs.float()).abs().max() <= 1e-2 * theirs.float().abs().max()
            grid = torch.load(io.BytesIO(row["image_grid_thw"]), weights_only=True)
            assert grid.tolist() == [r["grid_thw"]]
            g = httpx.post(f"{url}/embed", content=data, params={"format": "sglang"},
                           headers={"content-type": "image/png"}, timeout=60).json()["data"][0]["image_data"]
            theirs = np.array(g["feature"], dtype=np.float32)
            assert np.array(row["sglang_feature"]).shape == theirs.shape == (ours.shape[0], ours.shape[1])
            np.testing.assert_array_equal(np.array(row["sglang_feature"], dtype=np.float32),
                                          ours.float().numpy())  # the vLLM features, as float32
            np.testing.assert_allclose(np.array(row["sglang_feature"]), theirs,
                                       atol=1e-2 * float(np.abs(theirs).max()))
            assert g["image_grid_thw"] == [row["grid_thw"]] and g["format"] == "precomputed_embedding"


def test_one_process_per_device_writes_what_one_process_writes(inputs, tmp_path):
    """Two devices (two CPU engines: the GPU layout, a process per device taking shards from one queue): the same
    rows as one engine in this process, every input once."""
    _, paths, by_id = inputs
    opts = JobOptions(outputs=("pooled", "tokens"), shard_size=2)
    one = _run(paths, tmp_path / "one", opts)
    two = _run(paths, tmp_path / "two", opts, devices="cpu,cpu", warmup=False)
    assert two["rows"] == one["rows"] == len(by_id) and two["errors"] == one["errors"] == 1
    assert two["shards_written"] == one["shards_written"] == 8
    # the processes' start-up and exit apart from the encoding (from every decoding process up to every shard in)
    assert two["startup_s"] > 0 and two["encode_s"] > 0 and two["stop_s"] >= 0
    # the CPU the decoding process and the engines (their forwards here) used while encoding: within what the
    # machine's cores give in that time
    bound = os.cpu_count() * two["encode_s"] + 0.5
    assert 0 < two["decode_cpu_s"] <= bound and 0 < two["engine_cpu_s"] <= bound, two
    a = {r["id"]: r for r in _read(tmp_path / "one").to_pylist()}
    b = {r["id"]: r for r in _read(tmp_path / "two").to_pylist()}
    assert sorted(a) == sorted(b) == sorted(by_id) and len(_read(tmp_path / "two")) == len(by_id)
    for id_ in a:
        np.testing.assert_allclose(b[id_]["pooled"], a[id_]["pooled"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.array(b[id_]["tokens"]), np.array(a[id_]["tokens"]), rtol=1e-5, atol=1e-6)
    assert _errors(tmp_path / "two") == _errors(tmp_path / "one")


def test_the_device_processes_stop_when_the_job_is_killed(tmp_path):
    """SIGKILL to the job's process alone: its device processes notice and exit (they would hold the GPUs)."""
    proc, out, _ = _cli_job_with_shards_written(tmp_path, 64, 44, ["--devices", "cpu,cpu", "--shard-size", "2"], 1)
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(children) >= 2, children  # the device processes (and spawn's resource tracker)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 15
    while any(Path(f"/proc/{c}").exists() and "Z" not in Path(f"/proc/{c}/stat").read_text().split()[2]
              for c in children):
        assert time.time() < deadline, "a device process outlived the job"
        time.sleep(0.1)


def test_an_engine_killed_mid_job_is_restarted_and_its_inputs_retried(tmp_path):
    """SIGKILL to one of the job's two engine processes once shards are being written: its supervisor starts another
    and the inputs it held are sent again, none of them to the errors file; the job ends with exit code 0."""
    import psutil

    proc, out, _ = _cli_job_with_shards_written(tmp_path, 40, 46, ["--devices", "cpu,cpu", "--shard-size", "2"], 1)
    kids = sorted((c for c in psutil.Process(proc.pid).children() if "resource_tracker" not in " ".join(c.cmdline())),
                  key=lambda c: c.create_time())
    kids[0].kill()  # the first engine (engines start before their standbys and the decoding processes)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr.decode()[-2000:]
    assert "starting a new one" in stderr.decode()  # the supervisor's restart, not a job that ended first
    ids = _read(out).column("id").to_pylist()
    assert sorted(ids) == [f"{i:03d}.png" for i in range(40)] and not _errors(out)


def test_parquet_readers_read_the_output_directory_as_it_is(inputs, tmp_path):
    """pandas, pyarrow's datasets, `pq.read_table` and Hugging Face `datasets` given the directory (the job's manifest
    and errors beside the shards): every row once, the columns typed. (Ray's `read_parquet`: the Ray test.)"""
    import pandas as pd
    import pyarrow.dataset as pads

    _, paths, by_id = inputs
    out = tmp_path / "out"
    _run(paths, out, JobOptions(outputs=("pooled", "tokens"), shard_size=4))
    frame = pd.read_parquet(out)
    width = pq.read_table(sorted(out.glob("part-*.parquet"))[0]).column("pooled")[0].as_py()
    assert sorted(frame["id"]) == sorted(by_id) and len(frame["pooled"].iloc[0]) == len(width)
    assert sorted(pads.dataset(out, format="parquet").to_table().column("id").to_pylist()) == sorted(by_id)
    table = pq.read_table(out)
    assert table.schema.field("tokens").type == pa.list_(pa.list_(pa.float32())) and len(table) == len(by_id)
    hf = pytest.importorskip("datasets")  # installed in CI with the dev extra
    loaded = hf.load_dataset("parquet", data_dir=str(out), split="train", cache_dir=str(tmp_path / "hf-cache"))
    assert sorted(loaded["id"]) == sorted(by_id)


def test_a_rerun_encodes_only_the_shards_not_written(inputs, tmp_path):
    _, paths, by_id = inputs
    out = tmp_path / "out"
    opts = JobOptions(shard_size=4)
    _run(paths, out, opts)
    shards = sorted(out.glob("part-*.parquet"))
    before = {f.name: f.stat().st_mtime_ns for f in shards}
    shards[1].unlink()  # as if killed before this shard was committed
    (out / ".tmp-part-00001.parquet-999").write_bytes(b"half a file")
    counts = _run(paths, out, opts)
    assert counts["shards_written"] == 1 and counts["shards_done_before"] == len(shards) - 1
    after = {f.name: f.stat().st_mtime_ns for f in sorted(out.glob("part-*.parquet"))}
    assert [n for n in after if after[n] != before.get(n)] == [shards[1].name]
    assert not list(out.glob(".tmp-*"))
    ids = _read(out).column("id").to_pylist()
    assert sorted(ids) == sorted(by_id) and len(ids) == len(set(ids))


def test_a_job_with_other_options_is_refused_in_the_same_directory(inputs, tmp_path):
    _, paths, _ = inputs
    out = tmp_path / "out"
    _run(paths[:1], out, JobOptions(shard_size=4))
    with pytest.raises(EncoderError, match="holds another job"):
        _run(paths[:1], out, JobOptions(shard_size=4, outputs=("tokens",)))


def test_killed_at_any_moment_then_run_again_every_input_is_written_once(tmp_path):
    """The CLI, SIGKILLed after its first shards are written, then run again to the end."""
    proc, out, cmd = _cli_job_with_shards_written(tmp_path, 48, 43, ["--device", "cpu", "--shard-size", "4"], 2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = len(list(out.glob("part-*.parquet")))
    assert written < 12, "the run finished before it was killed: nothing was tested"
    done = subprocess.run(cmd, env=CLI_ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ids = _read(out).column("id").to_pylist()
    assert sorted(ids) == [f"{i:03d}.png" for i in range(48)]  # every input, once
    assert not list(out.glob(".tmp-*"))


def test_bad_arguments_are_one_line_errors(tmp_path):
    env = CLI_ENV
    for args, message in (([str(tmp_path / "missing")], "no such file or directory"),
                          ([str(tmp_path), "--outputs", "pooled,logits"], "not among"),
                          ([str(tmp_path)], "no images or videos")):
        done = subprocess.run([sys.executable, "-m", "service.cli", "dataset", *args, "-o", str(tmp_path / "o"),
                               "--model", "random:tiny", "--device", "cpu"], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode != 0 and message in done.stderr, done.stderr[-1500:]
    (tmp_path / "a.png").write_bytes(random_pngs(1, seed=45)[0])
    for model, devices, message in (
            ("random:nope", "cpu,cpu", "unknown preset"),  # told before any engine starts
            # a device whose engine cannot start: the job stops
            ("random:tiny", "cpu,cuda:7", "the engine on cuda:7 could not start: cuda:0: CUDA is not available"),
    ):
        done = subprocess.run([sys.executable, "-m", "service.cli", "dataset", str(tmp_path / "a.png"), "-o",
                               str(tmp_path / "o2"), "--model", model, "--devices", devices, "--quiet"],
                              env={**env, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=120)
        errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
        assert done.returncode == 2 and len(errors) == 1 and message in errors[0], done.stderr[-1500:]
        assert "Traceback" not in done.stderr


def test_ray_data_map_batches_gives_the_cli_s_rows(tmp_path):
    """A local Ray runtime: read_binary_files, then map_batches(RayEncoder) on an actor, then write_parquet; the same
    pooled vectors and tokens as the CLI's job on the same files, and the broken file as a row with its error."""
    ray = pytest.importorskip("ray")  # the ray extra: installed in CI with the dev extra
    images = tmp_path / "images"
    images.mkdir()
    for i, img in enumerate(random_pngs(9, seed=44)):
        (images / f"{i}.png").write_bytes(img)
    (images / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n but no more")
    opts = JobOptions(outputs=("pooled", "tokens"), normalize=True, shard_size=4)
    _run([str(images)], tmp_path / "cli", opts)
    cli = {r["id"]: r for r in _read(tmp_path / "cli").to_pylist()}

    from service.dataset import RayEncoder

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ds = ray.data.read_binary_files(str(images), include_paths=True)
        ds = ds.map_batches(RayEncoder, fn_constructor_kwargs={"model": "random:tiny", "device": "cpu",
                                                               "outputs": ("pooled", "tokens"), "normalize": True},
                            batch_size=4, batch_format="pyarrow", concurrency=1)
        ds.write_parquet(str(tmp_path / "ray"))
        read_back = ray.data.read_parquet(str(tmp_path / "cli")).take_all()  # the CLI's directory as it is
    finally:
        ray.shutdown()
    assert sorted(r["id"] for r in read_back) == sorted(cli)
    rows = pa.concat_tables([pq.read_table(f) for f in sorted((tmp_path / "ray").glob("*.parquet"))]).to_pylist()
    by_name = {Path(r["id"]).name: r for r in rows}
    assert sorted(by_name) == sorted([f"{i}.png" for i in range(9)] + ["broken.png"])
    assert by_name["broken.png"]["error"].startswith("UnsupportedImage"), by_name["broken.png"]["error"]
    assert "broken.png" not in cli  # the CLI put it in its errors file
    for name, ours in by_name.items():
        if name == "broken.png":
            continue
        assert ours["error"] is None and ours["grid_thw"] == cli[name]["grid_thw"]
        np.testing.assert_allclose(ours["pooled"], cli[name]["pooled"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.array(ours["tokens"]), np.array(cli[name]["tokens"]), rtol=1e-5, atol=1e-6)
