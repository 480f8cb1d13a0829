"""`qwen3vl-encoder`: `encode` files to a safetensors file, `serve` the HTTP API, or `quant-check` what FP8 does to a
checkpoint's embeddings."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .errors import EncoderError
from .settings import Settings

log = logging.getLogger("qwen3vl_encoder")


def encode_main(args) -> int:
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    from .engine.build import load_encoder
    from .model.results import pack_by_budget, result_tensors

    settings = Settings(model=args.model, device=args.device, dtype=args.dtype, cuda_graphs=False)
    encoder = load_encoder(settings)
    items = []
    for path in tqdm(args.files, desc="preprocess", unit="img", disable=args.quiet):
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise EncoderError(f"{path}: cannot read ({e.strerror})") from e
        try:
            items.append(encoder.preprocess(data, args.min_pixels, args.max_pixels, args.fps, args.num_frames))
        except EncoderError as e:
            raise type(e)(f"{path}: {e}") from e
    packs = pack_by_budget([it.num_patches for it in items], args.max_batch_patches, args.max_batch_items)
    tensors: dict[str, torch.Tensor] = {}
    for pack in tqdm(packs, desc="encode", unit="batch", disable=args.quiet):
        results = encoder.encode([items[i] for i in pack])
        for i, r in zip(pack, results):
            tensors.update(result_tensors([r], start=i))
    save_file(tensors, str(args.output), metadata={"model": args.model, "dtype": args.dtype})
    log.info("wrote %d inputs to %s", len(items), args.output)
    return 0


def dataset_main(args) -> int:
    import asyncio

    from .dataset import OUTPUTS, JobOptions, list_inputs, run_job

    outputs = tuple(o.strip() for o in args.outputs.split(",") if o.strip())
    unknown = [o for o in outputs if o not in OUTPUTS]
    if unknown or not outputs:
        raise EncoderError(f"--outputs: {unknown or 'none'} not among {', '.join(OUTPUTS)}")
    from pydantic import ValidationError

    from .server import settings_from_args

    try:
        settings = settings_from_args(args)
    except ValidationError as e:
        raise EncoderError(f"invalid settings: {e.errors()[0]['loc'][0]}: {e.errors()[0]['msg']}") from None
    from .model.config import model_tower_config

    model_tower_config(settings.model)  # a bad --model is one line and exit code 2 before any engine starts
    entries = list_inputs(args.inputs, args.image_column)
    if not entries:
        raise EncoderError(f"no images or videos in {' '.join(args.inputs)}")
    opts = JobOptions(outputs=outputs, normalize=args.normalize, shard_size=args.shard_size,
                      min_pixels=args.min_pixels, max_pixels=args.max_pixels, fps=args.fps,
                      num_frames=args.num_frames, image_column=args.image_column)
    from .runtime import configure_process

    configure_process("local")
    counts = asyncio.run(run_job(entries, Path(args.output), settings, opts, progress=not args.quiet))
    done = counts["rows"] + counts["errors"]
    stopped = f"; stopped in {counts['stop_s']:.1f} s" if "stop_s" in counts else ""  # the processes' exit
    log.info("%s: %d shards written now (%d were already), %d rows, %d errors (__job__/errors/); started in %.1f s, "
             "then encoded in %.1f s: %.1f inputs/s%s", args.output, counts["shards_written"],
             counts["shards_done_before"], counts["rows"], counts["errors"], counts["startup_s"], counts["encode_s"],
             done / max(counts["encode_s"], 1e-9), stopped)
    if done and "engine_cpu_s" in counts:  # the processes' layout (`dataset._run_processes`)
        log.info("CPU per input: %.2f ms decoding, %.2f ms in the engines (%.1f cores in all at that rate)",
                 1e3 * counts["decode_cpu_s"] / done, 1e3 * counts["engine_cpu_s"] / done,
                 (counts["decode_cpu_s"] + counts["engine_cpu_s"]) / max(counts["encode_s"], 1e-9))
    return 0


def quant_check_main(args) -> int:
    import json

    from .model.encoder import Encoder
    from .model.quant_check import all_tokens, compare, fp8_copy

    if args.device == "auto":
        args.device = Settings(device="auto").resolved_device()
    encoder = Encoder.load(args.model, args.device, args.dtype)
    inputs = []
    for path in args.files:
        try:
            inputs.append((str(path), encoder.preprocess(Path(path).read_bytes(), max_pixels=args.max_pixels)))
        except OSError as e:
            raise EncoderError(f"{path}: cannot read ({e.strerror})") from e
        except EncoderError as e:
            raise type(e)(f"{path}: {e}") from e
    report = compare(encoder, fp8_copy(encoder.tower), [item for _, item in inputs])
    report.update(model=args.model, dtype=args.dtype, device=args.device, files=[p for p, _ in inputs],
                  all_tokens=all_tokens(report))
    print(f"FP8 against {args.dtype}, {len(inputs)} inputs, per-token cosine (mean / min):")
    print(f"  merged tokens   {report['merged']['mean_token_cosine']:.5f} / {report['merged']['min_token_cosine']:.5f}")
    for level, d in enumerate(report["deepstack"]):
        print(f"  DeepStack {level}     {d['mean_token_cosine']:.5f} / {d['min_token_cosine']:.5f}")
    for layer, d in enumerate(report["layers"]):
        print(f"  after block {layer:<3} {d['mean_token_cosine']:.5f} / {d['min_token_cosine']:.5f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    worst = report["all_tokens"]
    ok = worst["mean_token_cosine"] >= 0.999 and worst["min_token_cosine"] >= 0.99
    print(("within" if ok else "OUTSIDE") + " the targets (mean >= 0.999, worst token >= 0.99)")
    return 0 if ok else 1


def serve_main(args) -> int:
    from .server import run

    return run(args)


def _default(name: str):
    return Settings.model_fields[name].default


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen3vl-encoder", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    enc = sub.add_parser("encode", help="encode image and video files into a safetensors file")
    enc.add_argument("--model", required=True, help="checkpoint directory or random:<preset>")
    enc.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    enc.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    enc.add_argument("--output", "-o", required=True, type=Path)
    enc.add_argument("--min-pixels", type=int, default=None)
    enc.add_argument("--max-pixels", type=int, default=None)
    frames = enc.add_mutually_exclusive_group()
    frames.add_argument("--fps", type=float, default=None, help="videos: frames sampled per second (default: the "
                        "checkpoint's video processor, 2 for Qwen3-VL)")
    frames.add_argument("--num-frames", type=int, default=None, help="videos: frames sampled in all")
    enc.add_argument("--max-batch-patches", type=int, default=_default("max_batch_patches"),
                     help="patch budget of one forward")
    enc.add_argument("--max-batch-items", type=int, default=_default("max_batch_items"))
    enc.add_argument("--quiet", action="store_true", help="no progress bars")
    enc.add_argument("files", nargs="+", type=Path)
    enc.set_defaults(func=encode_main)

    qc = sub.add_parser("quant-check", help="what FP8 does to a checkpoint's embeddings, per token and layer by layer",
                        description="Compare the FP8 tower (QUANTIZATION=fp8) with the tower in --dtype on your own "
                        "images and videos: per-token cosine of the merged tokens, each DeepStack level and each "
                        "block's output. Exit 1 outside the targets (mean >= 0.999, worst token >= 0.99).")
    qc.add_argument("--model", required=True, help="checkpoint directory or random:<preset>")
    qc.add_argument("--device", default="auto", help="auto (cuda where there is a GPU), cuda, cuda:N or cpu (cpu "
                    "computes the FP8 GEMMs in float32)")
    qc.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    qc.add_argument("--max-pixels", type=int, default=None, help="resize larger inputs down to this many pixels")
    qc.add_argument("--json", default=None, help="also write the report here")
    qc.add_argument("files", nargs="+", type=Path)
    qc.set_defaults(func=quant_check_main)

    ds = sub.add_parser("dataset", help="encode a dataset (directories, list files, WebDataset tars, Parquet) into "
                        "sharded Parquet on every GPU, resumably", description="Encode a dataset into sharded Parquet "
                        "under --output, on every GPU of this node (one engine per device, as the server), resumably: "
                        "run it again after an interruption and it encodes only the shards not written yet. Every "
                        "server setting is a flag and a QWEN3VL_* variable (limits, batching, devices).")
    ds.add_argument("inputs", nargs="+", help="directories, list files (.txt/.lst), WebDataset shards (.tar), Parquet "
                    "files (.parquet), or single files")
    ds.add_argument("--output", "-o", required=True,
                    help="the output directory (part-NNNNN.parquet; the manifest and the errors in __job__/)")
    ds.add_argument("--outputs", default="pooled",
                    help="comma-separated: pooled, tokens, vllm, sglang (default: pooled)")
    ds.add_argument("--normalize", action="store_true", help="L2-normalise the pooled vectors")
    ds.add_argument("--shard-size", type=int, default=1000, help="inputs per output shard (default: 1000)")
    ds.add_argument("--image-column", default="image", help="Parquet inputs: the column of image bytes")
    ds.add_argument("--min-pixels", type=int, default=None)
    ds.add_argument("--max-pixels", type=int, default=None)
    ds_frames = ds.add_mutually_exclusive_group()
    ds_frames.add_argument("--fps", type=float, default=None, help="videos: frames sampled per second")
    ds_frames.add_argument("--num-frames", type=int, default=None, help="videos: frames sampled in all")
    ds.add_argument("--quiet", action="store_true", help="no progress bar")
    add_settings_flags(ds)
    ds.set_defaults(func=dataset_main)

    srv = sub.add_parser("serve", help="run the HTTP service", description="Run the HTTP service. Every setting is a "
                         "flag and a QWEN3VL_* environment variable (the flag wins); both are validated alike.")
    add_settings_flags(srv)
    srv.set_defaults(func=serve_main)
    return parser


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """A flag per field of `Settings` (`max_batch_patches` -> `--max-batch-patches`), its help the field's
    description, values and environment variable; values are strings here and validated by `Settings` itself."""
    import typing

    for name, field in Settings.model_fields.items():
        description = field.description or ""
        if description.startswith("internal:"):
            continue
        default = field.get_default(call_default_factory=True)
        if hasattr(default, "get_secret_value"):
            default = "(set)"
        values = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is typing.Literal else ()
        metavar = "|".join(values) if values else name.upper()
        text = f"{description}; " if description else ""
        text += f"env QWEN3VL_{name.upper()}, default: {default if default is not None else '-'}"
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, default=argparse.SUPPRESS, metavar=metavar,
                            help=text.replace("%", "%%"))


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except EncoderError as e:
        log.error("%s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
