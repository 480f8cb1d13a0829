"""`qwen3vl-encoder dataset`: encode a dataset on this node into sharded Parquet, resumably.

Inputs, any mix of:
- a directory, walked recursively for images and videos (by extension);
- a list file (`.txt` / `.lst`): one path per line, relative to the list's directory unless absolute;
- WebDataset shards (`.tar`): every image or video member (a sample's `.json` / `.txt` members are skipped);
- Parquet (`.parquet`): the bytes in `--image-column`, a binary column or a struct with a `bytes` field (how
  Hugging Face `datasets` stores its `Image` feature).

The inputs are listed once, in a fixed order (sorted paths; tar members and Parquet rows in file order), and cut into
shards of `--shard-size` inputs. Each shard becomes `part-NNNNN.parquet` under the output directory, written to a
temporary name and renamed into place when all of its inputs are done, after its `part-NNNNN.errors.jsonl` (the
inputs that could not be encoded, each with its reason). A run finds the shards already there and encodes only the
others: kill it at any moment and run it again, and every input is written exactly once. `manifest.json` records the
job (model, options, inputs, shard size); a second run with other settings into the same directory is refused.

Columns: `id` (the file's path relative to its directory, the list's line, `TAR/MEMBER`, or `PARQUET#ROW`),
`source`, `kind` (image or video), `grid_thw`, `num_tokens`, then what `--outputs` asks for:
- `pooled`: the mean of the merged tokens (float32; `--normalize`: L2-normalised), as `/embed?pooling=mean`;
- `tokens`: the merged tokens, `num_tokens` lists of `out_hidden` float32;
- `vllm`: `image_embeds` and `image_grid_thw` (or `video_...`), each `torch.save` bytes, as `/embed?format=vllm`
  gives them in base64: what vLLM's `image_embeds` input takes (`torch.load`).

The encoding is the server's: one `LocalEngine` per device (`--devices`, default every visible GPU), each with its
batcher, packing the inputs of every shard in flight into forwards; decoding in threads, videos in the sandbox;
the same limits (`Settings`) as the server. A corrupt or hostile input fails alone, into the errors file.
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

from .errors import EncoderError

log = logging.getLogger(__name__)

IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff"}
VIDEO_EXTS = {".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v"}
OUTPUTS = ("pooled", "tokens", "vllm")
FORMAT_VERSION = 1


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
    """Encodes `entries` into `out_dir` with `engines` (started `LocalEngine`s); `run()` returns the counts."""

    def __init__(self, entries: list[Entry], out_dir: Path, engines: list, opts: JobOptions, model: str,
                 progress: bool = True):
        self.entries, self.out_dir, self.engines, self.opts, self.model = entries, out_dir, engines, opts, model
        self.progress = progress
        self.shards = [entries[i:i + opts.shard_size] for i in range(0, len(entries), opts.shard_size)]
        self.loads = [0] * len(engines)  # patches submitted to each engine and not answered
        self._decoded = 0

    def manifest(self) -> dict:
        opts = dataclasses.asdict(self.opts)
        opts["outputs"] = list(opts["outputs"])
        return {"format_version": FORMAT_VERSION, "model": self.model, "options": opts, "inputs": len(self.entries),
                "shards": len(self.shards), "first_id": self.entries[0].id if self.entries else None,
                "last_id": self.entries[-1].id if self.entries else None}

    def check_manifest(self) -> None:
        """Write the job's manifest, or check that the one there is this job's (a rerun continues it)."""
        path = self.out_dir / "manifest.json"
        mine = self.manifest()
        if path.exists():
            theirs = {k: v for k, v in json.loads(path.read_text()).items() if k in mine}
            if theirs != mine:
                raise EncoderError(f"{self.out_dir} holds another job (its manifest.json differs: {theirs} vs "
                                   f"{mine}); give another output directory")
        else:
            _write_atomically(path, json.dumps(mine, indent=1).encode())

    def pending(self) -> list[int]:
        return [k for k in range(len(self.shards)) if not (self.out_dir / f"{shard_name(k)}.parquet").exists()]

    async def run(self) -> dict:
        from tqdm import tqdm

        self.out_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.out_dir.glob(".tmp-*"):  # a killed run's half-written files
            stale.unlink(missing_ok=True)
        self.check_manifest()
        todo = self.pending()
        total = sum(len(self.shards[k]) for k in todo)
        bar = tqdm(total=total, unit="img", disable=not self.progress, smoothing=0.05)
        # inputs in flight at once, across shards: enough to fill every engine's packs twice over
        window = asyncio.Semaphore(max(64, 4 * sum(e.settings.max_batch_items for e in self.engines)))
        counts = {"shards_done_before": len(self.shards) - len(todo), "shards_written": 0, "rows": 0, "errors": 0}
        start = time.perf_counter()

        async def shard(k: int):
            entries = self.shards[k]
            data = await asyncio.to_thread(read_shard, entries)
            results = await asyncio.gather(*(self._one(e, d, window, bar) for e, d in zip(entries, data)))
            rows = [r for r in results if "error" not in r]
            errors = [r for r in results if "error" in r]
            await asyncio.to_thread(self._commit, k, rows, errors)
            counts["shards_written"] += 1
            counts["rows"] += len(rows)
            counts["errors"] += len(errors)

        # shards start in order and overlap: the next one's inputs queue while the last items of one finish
        shards_in_flight = asyncio.Semaphore(4)

        async def bounded(k):
            async with shards_in_flight:
                await shard(k)

        try:
            await asyncio.gather(*(bounded(k) for k in todo))
        finally:
            bar.close()
        counts["seconds"] = round(time.perf_counter() - start, 2)
        return counts

    async def _one(self, entry: Entry, data, window: asyncio.Semaphore, bar) -> dict:
        async with window:
            try:
                if isinstance(data, Exception):
                    raise EncoderError(f"cannot read: {data}")
                return await self._encode(entry, data)
            except EncoderError as e:
                return {"id": entry.id, "source": entry.source, "error": type(e).__name__, "message": str(e)}
            finally:
                bar.update(1)

    async def _encode(self, entry: Entry, data: bytes) -> dict:
        o = self.opts
        self._decoded += 1  # decoding in each engine's threads in turn; then the least loaded engine encodes it
        decoder = self.engines[self._decoded % len(self.engines)]
        item = await decoder.preprocess(data, o.min_pixels, o.max_pixels, o.fps, o.num_frames)
        i = min(range(len(self.engines)), key=self.loads.__getitem__)
        engine = self.engines[i]
        self.loads[i] += item.num_patches
        try:
            done = await engine.submit([item], timeout_s=3600.0, deepstack="vllm" in o.outputs,
                                       tokens="tokens" in o.outputs or "vllm" in o.outputs)
        finally:
            self.loads[i] -= item.num_patches
        return result_row(entry.id, entry.source, item.kind, done.results[0], o)

    def _commit(self, k: int, rows: list[dict], errors: list[dict]) -> None:
        """The shard's errors file, then its Parquet file: each written whole under a temporary name, then renamed."""
        name = shard_name(k)
        _write_atomically(self.out_dir / f"{name}.errors.jsonl",
                          b"".join(json.dumps(e).encode() + b"\n" for e in errors))
        table = _table(rows, self.opts.outputs)
        import pyarrow.parquet as pq

        buf = io.BytesIO()
        pq.write_table(table, buf)
        _write_atomically(self.out_dir / f"{name}.parquet", buf.getvalue())


def result_row(id_: str, source: str, kind: str, r, opts: JobOptions) -> dict:
    """An output row: what `opts.outputs` asks for of the result `r`, computed as `/embed` computes it."""
    from .http.output import llm_features, pooled, torch_saved

    row = {"id": id_, "source": source, "kind": kind, "grid_thw": list(r.grid_thw), "num_tokens": r.num_tokens}
    if "pooled" in opts.outputs:
        row["pooled"] = pooled([r], opts.normalize)[0].numpy()
    if "tokens" in opts.outputs:
        row["tokens"] = r.embeds.float().numpy()
    if "vllm" in opts.outputs:
        import torch

        row[f"{kind}_embeds"] = torch_saved(llm_features(r, torch.bfloat16))
        row[f"{kind}_grid_thw"] = torch_saved(torch.tensor([r.grid_thw], dtype=torch.int64))
    return row


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
    if error_column:
        fields.append(("error", pa.string()))
    schema = pa.schema(fields)
    columns = {}
    for name, typ in fields:
        values = [row.get(name) for row in rows]
        if name in ("pooled", "tokens"):  # numpy arrays
            values = [v.tolist() if v is not None else None for v in values]
        columns[name] = pa.array(values, type=typ)
    return pa.table(columns, schema=schema)


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


async def run_job(entries: list[Entry], out_dir: Path, settings, opts: JobOptions, progress: bool = True) -> dict:
    """Start one engine per device of `settings` (`resolved_devices`), run the job, stop them."""
    from .engine.local import LocalEngine

    devices = settings.resolved_devices()
    engines = [LocalEngine(settings.model_copy(update={"device": d, "devices": None})) for d in devices]
    log.info("encoding %d inputs in %d shards on %s", len(entries), -(-len(entries) // opts.shard_size),
             ", ".join(devices))
    await asyncio.gather(*(e.start() for e in engines))
    try:
        return await DatasetJob(entries, out_dir, engines, opts, settings.model, progress).run()
    finally:
        for e in engines:
            await e.stop()


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

        from .model.encoder import pack_by_budget

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
                results = self.encoder.encode([items[j] for j in pack], deepstack="vllm" in self.opts.outputs,
                                              tokens="tokens" in self.opts.outputs or "vllm" in self.opts.outputs)
                for j, r in zip(pack, results):
                    i = where[j]
                    rows[i] = result_row(rows[i]["id"], rows[i]["source"], items[j].kind, r, self.opts)
        return _table(rows, self.opts.outputs, error_column=True)
