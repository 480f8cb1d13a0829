"""`qwen3vl-encoder dataset`: encode a dataset on this node into sharded Parquet, resumably.

Inputs, any mix of:
- a directory, walked recursively for images and videos (by extension);
- a list file (`.txt` / `.lst`): one path per line, relative to the list's directory unless absolute;
- WebDataset shards (`.tar`): every image or video member (a sample's `.json` / `.txt` members are skipped);
- Parquet (`.parquet`): the bytes in `--image-column`, a binary column or a struct with a `bytes` field (how
  Hugging Face `datasets` stores its `Image` feature).

The inputs are listed once, in a fixed order (sorted paths; tar members and Parquet rows in file order), and cut into
shards of `--shard-size` inputs. Each shard becomes `part-NNNNN.parquet` under the output directory, written to a
temporary name and renamed into place when all of its inputs are done, after its `__job__/errors/part-NNNNN.jsonl`
(the inputs that could not be encoded, each with its reason). A run finds the shards already there and encodes only
the others: kill it at any moment and run it again, and every input is written exactly once.
`__job__/manifest.json` records the job (model, options, inputs, shard size); a second run with other settings into
the same directory is refused.

Columns: `id` (the file's path relative to its directory, the list's line, `TAR/MEMBER`, or `PARQUET#ROW`),
`source`, `kind` (image or video), `grid_thw`, `num_tokens`, then what `--outputs` asks for:
- `pooled`: the mean of the merged tokens (float32; `--normalize`: L2-normalised), as `/embed?pooling=mean`;
- `tokens`: the merged tokens, `num_tokens` lists of `out_hidden` float32;
- `vllm`: `image_embeds` and `image_grid_thw` (or `video_...`), each `torch.save` bytes, as `/embed?format=vllm`
  gives them in base64: what vLLM's `image_embeds` input takes (`torch.load`);
- `sglang`: `sglang_feature`, the `feature` of SGLang's `precomputed_embedding` item as `/embed?format=sglang` gives
  it (`num_tokens` lists of float32: the merged tokens, then each DeepStack level); its `image_grid_thw` is
  `[grid_thw]`.

The encoding is the server's, in the server's processes without HTTP: an engine process per device (`--devices`,
default every visible GPU), each with its batcher, packing the inputs of every shard in flight into forwards, and
restarted if it dies; as many decoding processes as the server has front-ends (`--http-workers`), each decoding in
threads (videos in the sandbox) and sending each input to the least loaded engine; the same limits (`Settings`) as
the server. On one CPU device, as `serve` there, the engine runs in the job's process. A corrupt or hostile input
fails alone, into the errors file.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import logging
import os
import tarfile
import time
from pathlib import Path
from typing import Iterator

from .errors import EncoderError, EngineUnavailable, InferenceFailed, InvalidInput, Overloaded, ShuttingDown
from .runtime import configure_process, process_cpu_s

log = logging.getLogger(__name__)

IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff"}
VIDEO_EXTS = {".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v"}
OUTPUTS = ("pooled", "tokens", "vllm", "sglang")
LLM_OUTPUTS = ("vllm", "sglang")  # a language model's precomputed features: the tokens and DeepStack
FORMAT_VERSION = 1
# the job's own files, beside the shards in a directory that Parquet readers skip (pyarrow: a leading "_"; Hugging
# Face `datasets`: a leading "__"): pandas, pyarrow, Ray and `datasets` read the output directory as it is
JOB_DIR = "__job__"
MANIFEST, ERRORS = f"{JOB_DIR}/manifest.json", f"{JOB_DIR}/errors"
RETRIES = 3  # an input's tries after the first where a forward failed or the queue was full (`DatasetJob._retried`)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One input: its id in the output, where it comes from, and how to read its bytes (`container`: file, tar or
    parquet; `where`: the tar member's data offset and size, or the Parquet row)."""

    id: str
    source: str
    container: str
    path: str
    where: tuple = ()


def list_inputs(paths: list[str], image_column: str = "image") -> list[Entry]:
    """Every input of `paths`, in a fixed order."""
    entries: list[Entry] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_EXTS | VIDEO_EXTS)
            entries += [Entry(f.relative_to(p).as_posix(), str(f), "file", str(f)) for f in files]
        elif p.suffix == ".tar":
            entries += list(_tar_entries(p))
        elif p.suffix == ".parquet":
            entries += list(_parquet_entries(p, image_column))
        elif p.suffix in (".txt", ".lst"):
            for line in p.read_text().splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    f = Path(line) if Path(line).is_absolute() else p.parent / line
                    entries.append(Entry(line, str(f), "file", str(f)))
        elif p.is_file():
            entries.append(Entry(p.name, str(p), "file", str(p)))
        else:
            raise EncoderError(f"{raw}: no such file or directory")
    ids = set()
    for e in entries:
        if e.id in ids:
            raise EncoderError(f"two inputs have the id {e.id!r}: give each directory, list or shard once")
        ids.add(e.id)
    return entries


def _tar_entries(path: Path) -> Iterator[Entry]:
    with tarfile.open(path) as tar:
        for m in tar:
            if m.isfile() and Path(m.name).suffix.lower() in IMAGE_EXTS | VIDEO_EXTS:
                yield Entry(f"{path.name}/{m.name}", f"{path}#{m.name}", "tar", str(path), (m.offset_data, m.size))


def _parquet_entries(path: Path, column: str) -> Iterator[Entry]:
    pq = _pyarrow_parquet()
    meta = pq.ParquetFile(path)
    if column not in meta.schema_arrow.names:
        raise EncoderError(f"{path}: no column {column!r} (columns: {meta.schema_arrow.names}); see --image-column")
    for row in range(meta.metadata.num_rows):
        yield Entry(f"{path.name}#{row}", f"{path}#{row}", "parquet", str(path), (row, column))


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise EncoderError("Parquet needs pyarrow: pip install 'qwen3vl-encoder[dataset]'") from None
    return pq


def read_shard(entries: list[Entry]) -> list[bytes | Exception]:
    """The bytes of each entry (or why they could not be read), Parquet rows read by row group, not one by one."""
    out: list[bytes | Exception] = []
    tables: dict[str, object] = {}
    for e in entries:
        try:
            if e.container == "file":
                out.append(Path(e.path).read_bytes())
            elif e.container == "tar":
                offset, size = e.where
                with open(e.path, "rb") as f:
                    f.seek(offset)
                    out.append(f.read(size))
            else:
                row, column = e.where
                out.append(_parquet_value(tables, e.path, row, column))
        except (OSError, EncoderError, ValueError, KeyError) as err:
            out.append(err)
    return out


def _parquet_value(tables: dict, path: str, row: int, column: str) -> bytes:
    pq = _pyarrow_parquet()
    key = (path, column)
    if key not in tables:
        tables[key] = pq.ParquetFile(path)
    f = tables[key]
    group, start = 0, 0
    while start + f.metadata.row_group(group).num_rows <= row:
        start += f.metadata.row_group(group).num_rows
        group += 1
    cached = tables.get((path, column, group))
    if cached is None:
        cached = tables[(path, column, group)] = f.read_row_group(group, columns=[column]).column(0).to_pylist()
    value = cached[row - start]
    if isinstance(value, dict):  # datasets' Image feature: {"bytes": ..., "path": ...}
        value = value.get("bytes")
    if not isinstance(value, (bytes, bytearray)):
        raise ValueError(f"row {row} of {column!r} holds no bytes ({type(value).__name__})")
    return bytes(value)


# -- the job -----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class JobOptions:
    outputs: tuple[str, ...] = ("pooled",)
    normalize: bool = False
    shard_size: int = 1000
    min_pixels: int | None = None
    max_pixels: int | None = None
    fps: float | None = None
    num_frames: int | None = None
    image_column: str = "image"


def shard_name(k: int) -> str:
    return f"part-{k:05d}"


class DatasetJob:
    """Encodes shards of `entries` into `out_dir` with `engine` (a started `api.Engine`: a `LocalEngine`, or a
    decoding process's `EnginePool`; None for `prepare` alone); `run()` returns the counts.
    `shards`: the shard numbers to encode, by default every one not written yet; an async iterator of them (a work
    queue shared by processes) is taken as it comes. `report(n)`: called as inputs finish, instead of a progress bar.
    `window`: inputs in flight at once, across shards."""

    def __init__(self, entries: list[Entry], out_dir: Path, engine, opts: JobOptions, model: str,
                 progress: bool = True, report=None, window: int = 256):
        self.entries, self.out_dir, self.engine, self.opts, self.model = entries, out_dir, engine, opts, model
        self.progress, self.report, self.window = progress, report, window
        self.shards = [entries[i:i + opts.shard_size] for i in range(0, len(entries), opts.shard_size)]

    def manifest(self) -> dict:
        opts = dataclasses.asdict(self.opts)
        opts["outputs"] = list(opts["outputs"])
        return {"format_version": FORMAT_VERSION, "model": self.model, "options": opts, "inputs": len(self.entries),
                "shards": len(self.shards), "first_id": self.entries[0].id if self.entries else None,
                "last_id": self.entries[-1].id if self.entries else None}

    def prepare(self) -> list[int]:
        """Make the output directory, remove a killed run's half-written files, write the manifest or check that the
        one there is this job's (a rerun continues it); the shards not written yet."""
        (self.out_dir / ERRORS).mkdir(parents=True, exist_ok=True)
        for stale in [*self.out_dir.glob(".tmp-*"), *(self.out_dir / JOB_DIR).glob("**/.tmp-*")]:
            stale.unlink(missing_ok=True)
        path = self.out_dir / MANIFEST
        mine = self.manifest()
        if path.exists():
            theirs = {k: v for k, v in json.loads(path.read_text()).items() if k in mine}
            if theirs != mine:
                raise EncoderError(f"{self.out_dir} holds another job (its {MANIFEST} differs: {theirs} vs "
                                   f"{mine}); give another output directory")
        else:
            _write_atomically(path, json.dumps(mine, indent=1).encode())
        return [k for k in range(len(self.shards)) if not (self.out_dir / f"{shard_name(k)}.parquet").exists()]

    async def run(self, shards=None) -> dict:
        from tqdm import tqdm

        if shards is None:
            shards = self.prepare()
        total = sum(len(self.shards[k]) for k in shards) if isinstance(shards, list) else None
        bar = tqdm(total=total, unit="img", disable=not self.progress, smoothing=0.05)
        done = self.report or bar.update
        window = asyncio.Semaphore(self.window)
        counts = {"shards_done_before": len(self.shards) - len(shards) if total is not None else 0, "shards_written": 0,
                  "rows": 0, "errors": 0}
        start = time.perf_counter()

        async def shard(k: int):
            entries = self.shards[k]
            data = await asyncio.to_thread(read_shard, entries)
            results = await asyncio.gather(*(self._one(e, d, window, done) for e, d in zip(entries, data)))
            rows = [r for r in results if "error" not in r]
            errors = [r for r in results if "error" in r]
            await asyncio.to_thread(self._commit, k, rows, errors)
            counts["shards_written"] += 1
            counts["rows"] += len(rows)
            counts["errors"] += len(errors)

        # shards start in order and overlap: the next one is read and its inputs queue while the last items of one
        # finish (two at once: a node's dozens of decoding processes each hold their shards' bytes in memory)
        running: set[asyncio.Task] = set()
        try:
            async for k in _aiter(shards):
                while len(running) >= 2:
                    finished, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                    for t in finished:
                        t.result()
                running.add(asyncio.create_task(shard(k)))
            for t in asyncio.as_completed(running):
                await t
        finally:
            for t in running:
                t.cancel()
            bar.close()
        counts["encode_s"] = round(time.perf_counter() - start, 2)
        return counts

    async def _one(self, entry: Entry, data, window: asyncio.Semaphore, done) -> dict:
        async with window:
            try:
                if isinstance(data, Exception):
                    raise EncoderError(f"cannot read: {data}")
                return await self._retried(entry, data)
            except EncoderError as e:
                message = e.message if isinstance(e, InvalidInput) else str(e)  # (not "input 0: ...")
                return {"id": entry.id, "source": entry.source, "error": type(e).__name__, "message": message}
            finally:
                done(1)

    async def _retried(self, entry: Entry, data: bytes) -> dict:
        """`_encode`, again after its `retry_after` where the engine could not take it: while no engine process is
        up (one restarting: its supervisor restarts it or stops the job) for as long as that lasts; a full queue or
        a failed forward up to `RETRIES` times, then the input goes to the errors file with the reason."""
        failures = 0
        while True:
            try:
                return await self._encode(entry, data)
            except (EngineUnavailable, ShuttingDown, Overloaded, InferenceFailed) as e:
                if not isinstance(e, (EngineUnavailable, ShuttingDown)):
                    failures += 1
                    if failures > RETRIES:
                        raise
                await asyncio.sleep(e.retry_after)

    async def _encode(self, entry: Entry, data: bytes) -> dict:
        o = self.opts
        (item,) = await self.engine.preprocess([data], o.min_pixels, o.max_pixels, o.fps, o.num_frames)
        done = await self.engine.submit([item], time.monotonic() + 3600.0, deepstack=_wants_llm(o.outputs),
                                        tokens="tokens" in o.outputs or _wants_llm(o.outputs))
        return result_row(entry.id, entry.source, item.kind, done.results[0], o)

    def _commit(self, k: int, rows: list[dict], errors: list[dict]) -> None:
        """The shard's errors file, then its Parquet file: each written whole under a temporary name, then renamed."""
        name = shard_name(k)
        _write_atomically(self.out_dir / ERRORS / f"{name}.jsonl",
                          b"".join(json.dumps(e).encode() + b"\n" for e in errors))
        table = _table(rows, self.opts.outputs)
        import pyarrow.parquet as pq

        buf = io.BytesIO()
        pq.write_table(table, buf)
        _write_atomically(self.out_dir / f"{name}.parquet", buf.getvalue())


def result_row(id_: str, source: str, kind: str, r, opts: JobOptions) -> dict:
    """An output row: what `opts.outputs` asks for of the result `r`, computed as `/embed` computes it."""
    from .http.output import llm_features, llm_features_saved, pooled, torch_saved

    row = {"id": id_, "source": source, "kind": kind, "grid_thw": list(r.grid_thw), "num_tokens": r.num_tokens}
    if "pooled" in opts.outputs:
        row["pooled"] = pooled([r], opts.normalize)[0].numpy()
    if "tokens" in opts.outputs:
        row["tokens"] = r.embeds.float().numpy()
    if _wants_llm(opts.outputs):
        import torch

        if "vllm" in opts.outputs:
            row[f"{kind}_embeds"] = llm_features_saved(r, torch.bfloat16).tobytes()
            row[f"{kind}_grid_thw"] = torch_saved(torch.tensor([r.grid_thw], dtype=torch.int64))
        if "sglang" in opts.outputs:  # the `feature` of SGLang's precomputed_embedding item, as /embed gives it
            row["sglang_feature"] = llm_features(r, torch.bfloat16).float().numpy()
    return row


def _wants_llm(outputs) -> bool:
    return any(o in outputs for o in LLM_OUTPUTS)


def _table(rows: list[dict], outputs: tuple[str, ...], error_column: bool = False):
    """A shard's rows as an Arrow table, the columns' types fixed (an all-error shard still has its schema);
    `error_column`: with each row's error (null where it was encoded), for `RayEncoder`."""
    import pyarrow as pa

    fields = [("id", pa.string()), ("source", pa.string()), ("kind", pa.string()), ("grid_thw", pa.list_(pa.int32())),
              ("num_tokens", pa.int32())]
    if "pooled" in outputs:
        fields.append(("pooled", pa.list_(pa.float32())))
    if "tokens" in outputs:
        fields.append(("tokens", pa.list_(pa.list_(pa.float32()))))
    if "vllm" in outputs:
        fields += [(f"{k}_{p}", pa.binary()) for k in ("image", "video") for p in ("embeds", "grid_thw")]
    if "sglang" in outputs:
        fields.append(("sglang_feature", pa.list_(pa.list_(pa.float32()))))
    if error_column:
        fields.append(("error", pa.string()))
    schema = pa.schema(fields)
    columns = {}
    for name, typ in fields:
        values = [row.get(name) for row in rows]
        columns[name] = (_float_lists(values, typ) if name in ("pooled", "tokens", "sglang_feature")
                         else pa.array(values, type=typ))
    return pa.table(columns, schema=schema)


def _float_lists(arrays: list, typ):
    """float32 numpy arrays (1-D: a list each; 2-D: a list of lists each; None: null) as one Arrow column of type
    `typ`, built from their buffers rather than from Python floats (a token matrix is 400,000 of them)."""
    import numpy as np
    import pyarrow as pa

    present = [a for a in arrays if a is not None]
    if not present:
        return pa.nulls(len(arrays), type=typ)
    mask = pa.array([a is None for a in arrays]) if len(present) < len(arrays) else None
    flat = pa.array(np.concatenate([a.reshape(-1) for a in present]), type=pa.float32())
    if present[0].ndim == 2:  # rows of length width: the inner lists, then the outer lists by row count
        width = present[0].shape[1]
        inner_count = sum(a.shape[0] for a in present)
        flat = pa.ListArray.from_arrays(pa.array(np.arange(inner_count + 1, dtype=np.int32) * width), flat)
    sizes = [0 if a is None else a.shape[0] for a in arrays]
    offsets = pa.array(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32))
    return pa.ListArray.from_arrays(offsets, flat, mask=mask)


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


async def _aiter(shards):
    if hasattr(shards, "__aiter__"):
        async for k in shards:
            yield k
    else:
        for k in shards:
            yield k


async def run_job(entries: list[Entry], out_dir: Path, settings, opts: JobOptions, progress: bool = True) -> dict:
    """Encode `entries` as `serve` would on `settings`' devices (`resolved_devices`). Where the server runs its
    model in its own process (`resolved_http_workers` 0: one CPU device), the engine runs here. Otherwise the
    server's process layout (`_run_processes`): an engine process per device, restarted if it dies, and as many
    decoding processes as the server has front-ends, each routing its inputs to the least loaded engine and taking
    shards from one queue as it has room; this process keeps the manifest and the progress bar."""
    devices = settings.resolved_devices()
    workers = settings.resolved_http_workers()
    log.info("encoding %d inputs in %d shards on %s, %d decoding processes of %d threads", len(entries),
             -(-len(entries) // opts.shard_size), ", ".join(devices), max(1, workers), settings.preprocess_workers)
    if not workers:
        from .engine.local import LocalEngine

        began = time.perf_counter()
        engine = LocalEngine(settings.model_copy(update={"device": devices[0], "devices": None}))
        await engine.start()
        started = time.perf_counter()
        try:
            counts = await DatasetJob(entries, out_dir, engine, opts, settings.model, progress,
                                      window=in_flight(settings, 1, 1)).run()
        finally:
            await engine.stop()
        return {**counts, "startup_s": round(started - began, 2)}
    return await asyncio.to_thread(_run_processes, entries, out_dir, settings, opts, devices, workers, progress)


def _engines_cpu_s(engines, marks: list[tuple[int | None, float | None]]) -> float | None:
    """The CPU seconds `engines` used since `marks` (each one's process and its CPU seconds then); None where one is
    unknown (no /proc, no process) or the engine was restarted since (another process)."""
    spent = 0.0
    for engine, (pid, before) in zip(engines, marks):
        now = process_cpu_s(pid) if pid is not None and engine.pid == pid else None
        if now is None or before is None:
            return None
        spent += now - before
    return spent


def in_flight(settings, devices: int, workers: int) -> int:
    """Inputs a decoding process keeps in flight: between them, enough to fill each engine's largest pack four times
    over (the next packs queue while one computes), at least 16 each."""
    return max(16, -(-4 * settings.max_batch_items * devices // workers))


def _run_processes(entries, out_dir: Path, settings, opts: JobOptions, devices: list[str], workers: int,
                   progress: bool) -> dict:
    """The server's layout without HTTP: `EngineSupervisor`s over one engine process per device, `workers` decoding
    processes (`_worker_main`) connected to all of them as the front-ends are (`EnginePool`), shards from one
    queue. An engine that dies is restarted and its inputs retried (`DatasetJob._retried`); one that cannot start or
    keeps dying stops the job, the shards written kept. The counts add the CPU seconds the decoding processes and
    the engines used while encoding (`decode_cpu_s`, `engine_cpu_s`; the engines' where /proc gives them and none
    was restarted), their start-ups left out."""
    import multiprocessing as mp
    import queue as queues
    import shutil
    import tempfile

    from tqdm import tqdm

    from .engine.supervisor import LOAD_ERROR_EXIT, EngineSupervisor, engine_environment, started_marker
    from .engine.wiring import Wiring

    try:
        device_envs = [engine_environment(device) for device in devices]
    except ValueError as e:
        raise EncoderError(f"invalid setting devices: {e}") from None
    job = DatasetJob(entries, out_dir, None, opts, settings.model)
    todo = job.prepare()
    start = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="qwen3vl-dataset-")
    sockets = [os.path.join(workdir, f"engine-{i}.sock") for i in range(len(devices))]
    settings = settings.for_processes(devices)
    wiring = Wiring(engine_sockets=tuple(sockets))
    env = {**settings.as_env(), **wiring.to_env()}
    engines = [EngineSupervisor.of(settings, env, device, device_env, sock, retry_start=False)
               for device, sock, device_env in zip(devices, sockets, device_envs)]
    ctx = mp.get_context("spawn")
    work, reports = ctx.Queue(), ctx.Queue()
    procs: list = []
    counts = {"shards_done_before": len(job.shards) - len(todo), "shards_written": 0, "rows": 0, "errors": 0,
              "decode_cpu_s": 0.0}
    engine_cpu: list[tuple[int | None, float | None]] = []  # each engine's process and its CPU seconds at `ready`
    bar = tqdm(total=sum(len(job.shards[k]) for k in todo), unit="img", disable=not progress, smoothing=0.05)
    finished, failure = set(), None

    def given_up() -> str | None:
        dead = next((e for e in engines if e.exit_code is not None), None)
        if dead is None:
            return None
        how = "could not start" if dead.exit_code == LOAD_ERROR_EXIT else "kept dying"
        return f"the engine on {dead.name} {how}: {dead.last_error}"

    try:
        for engine in engines:
            engine.start()
        while not all(e.ready.is_set() for e in engines) and (failure := given_up()) is None:
            time.sleep(0.1)
        ready = time.perf_counter()  # then once every decoding process is up (`up`)
        up: set[int] = set()
        if failure is None:
            with open(started_marker(sockets[0]), "w"):
                pass
            for k in todo:
                work.put((k, job.shards[k]))
            for i in range(workers):
                procs.append(ctx.Process(target=_worker_main, args=(i, settings, wiring, out_dir, opts, work, reports,
                                                                    in_flight(settings, len(devices), workers)),
                                         name=f"qwen3vl-dataset-{i}", daemon=True))
                work.put(None)  # one end marker per process
            for proc in procs:
                proc.start()
        while len(finished) < len(procs) and failure is None:
            try:
                i, kind, value = reports.get(timeout=1.0)
            except queues.Empty:
                dead = [i for i, p in enumerate(procs) if i not in finished and not p.is_alive()]
                if dead:
                    failure = f"decoding process {dead[0]} exited with code {procs[dead[0]].exitcode}"
                failure = failure or given_up()
                continue
            if kind == "up":
                up.add(i)
                if len(up) == len(procs):
                    ready = time.perf_counter()
                    engine_cpu = [(e.pid, process_cpu_s(e.pid) if e.pid is not None else None) for e in engines]
            elif kind == "done":
                bar.update(value)
            elif kind == "counts":
                finished.add(i)
                for key in ("shards_written", "rows", "errors", "decode_cpu_s"):
                    counts[key] += value[key]
            else:
                failure = f"decoding process {i}: {value}"
        encoded = time.perf_counter()  # every shard committed: what follows is the processes' exit
        if engine_cpu and (spent := _engines_cpu_s(engines, engine_cpu)) is not None:
            counts["engine_cpu_s"] = round(spent, 2)
    finally:
        bar.close()
        for proc in procs:
            if failure is not None and proc.is_alive():
                proc.terminate()
            proc.join()
        for engine in engines:
            engine.stop(settings.graceful_shutdown_s + 30)
        shutil.rmtree(workdir, ignore_errors=True)
    if failure is not None:
        raise EncoderError(f"{failure}; the shards written are kept: run the same command again to go on")
    counts["startup_s"] = round(ready - start, 2)
    counts["encode_s"] = round(encoded - ready, 2)
    counts["stop_s"] = round(time.perf_counter() - encoded, 2)
    return counts


def _worker_main(index: int, settings, wiring, out_dir: Path, opts: JobOptions, work, reports, window: int) -> None:
    """A decoding process: the engine processes as a front-end sees them (`open_engine`), then shards from `work`
    until its end marker; reports the inputs done, then its counts (or its error)."""
    import threading

    parent = os.getppid()

    def watch():  # the parent killed: stop (its engines stop as their pipes to it close)
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
    done = [0]

    def report(n: int) -> None:
        done[0] += n

    async def main():
        from .engine.factory import open_engine

        configure_process("frontend")
        engine = open_engine(settings, wiring)
        await engine.start()
        while not engine.started:  # connected to every engine (all ready before this process started)
            await asyncio.sleep(0.02)
        reports.put((index, "up", None))
        cpu = time.process_time()  # every thread's; the imports and connecting left out
        job = DatasetJob([], out_dir, engine, opts, settings.model, progress=False, report=report, window=window)
        job.shards = {}

        async def shards():
            while True:
                item = await asyncio.to_thread(work.get)
                if item is None:
                    return
                k, entries = item
                job.shards[k] = entries
                yield k

        async def flush():
            while True:
                await asyncio.sleep(0.25)
                n, done[0] = done[0], 0
                if n:
                    reports.put((index, "done", n))

        flusher = asyncio.create_task(flush())
        try:
            counts = await job.run(shards())
        finally:
            flusher.cancel()
            await engine.stop()
        if done[0]:
            reports.put((index, "done", done[0]))
        reports.put((index, "counts", {**counts, "decode_cpu_s": time.process_time() - cpu}))

    try:
        asyncio.run(main())
    except Exception as e:  # noqa: BLE001 -- told to the parent in one line, which stops the job
        reports.put((index, "error", f"{type(e).__name__}: {e}"))
        reports.close()
        reports.join_thread()
        raise SystemExit(1)
    reports.close()
    reports.join_thread()


class RayEncoder:
    """A callable class for Ray Data's `map_batches`: each actor loads the tower once, on its GPU where Ray gave it
    one, with the server's limits (`Settings`: the keyword arguments and the QWEN3VL_* variables), and turns a batch
    of rows holding image or video bytes into the rows `qwen3vl-encoder dataset` writes, plus an `error` column
    (null where the row was encoded; else why not: a bad input never fails the job). The batch is packed into
    forwards by the server's patch budget.

        ds = ray.data.read_binary_files("s3://bucket/photos/", include_paths=True)
        ds = ds.map_batches(RayEncoder, fn_constructor_kwargs={"model": "/models/Qwen3-VL-2B-Instruct"},
                            batch_size=256, batch_format="pyarrow", num_gpus=1, concurrency=8)
        ds.write_parquet("s3://bucket/embeddings/")

    `bytes_column` / `id_column`: where the bytes and the ids are (`read_binary_files`: bytes, path; Parquet from
    `datasets`: a struct column with `bytes`; `read_webdataset(..., decoder=None)`: the image's extension, __key__).
    """

    def __init__(self, model: str, outputs: tuple[str, ...] = ("pooled",), normalize: bool = False,
                 bytes_column: str = "bytes", id_column: str = "path", min_pixels: int | None = None,
                 max_pixels: int | None = None, **settings):
        from .engine.build import apply_limits, load_encoder
        from .settings import Settings

        self.settings = Settings(model=model, **settings)
        self.encoder = load_encoder(self.settings)
        apply_limits(self.encoder, self.settings)
        self.opts = JobOptions(outputs=tuple(outputs), normalize=normalize, min_pixels=min_pixels,
                               max_pixels=max_pixels)
        self.bytes_column, self.id_column = bytes_column, id_column

    def __call__(self, batch):
        import torch

        from .engine.api import pack_by_budget

        table = batch if hasattr(batch, "column_names") else None
        column = (lambda name: table.column(name).to_pylist()) if table is not None else (
            lambda name: list(batch[name]))
        datas, ids = column(self.bytes_column), column(self.id_column)
        rows: list[dict] = [{} for _ in datas]
        items, where = [], []
        for i, (data, id_) in enumerate(zip(datas, ids)):
            id_ = str(id_)
            if isinstance(data, dict):
                data = data.get("bytes")
            try:
                if not isinstance(data, (bytes, bytearray)):
                    raise EncoderError(f"no bytes in {self.bytes_column!r} ({type(data).__name__})")
                items.append(self.encoder.preprocess(bytes(data), self.opts.min_pixels, self.opts.max_pixels))
                where.append(i)
                rows[i] = {"id": id_, "source": id_}
            except EncoderError as e:
                rows[i] = {"id": id_, "source": id_, "error": f"{type(e).__name__}: {e}"}
        o = self.settings
        with torch.inference_mode():
            for pack in pack_by_budget([it.num_patches for it in items], o.max_batch_patches, o.max_batch_items):
                results = self.encoder.encode([items[j] for j in pack], deepstack=_wants_llm(self.opts.outputs),
                                              tokens="tokens" in self.opts.outputs or _wants_llm(self.opts.outputs))
                for j, r in zip(pack, results):
                    i = where[j]
                    rows[i] = result_row(rows[i]["id"], rows[i]["source"], items[j].kind, r, self.opts)
        return _table(rows, self.opts.outputs, error_column=True)
