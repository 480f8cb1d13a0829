"""Encode through this service, then generate with SGLang carrying the precomputed embeddings.

SGLang serves the language model as usual; precomputed embeddings come in `/generate`'s `image_data` / `video_data`
as `{"format": "precomputed_embedding", "feature": ..., "image_grid_thw": [[t, h, w]]}`, with `input_ids` that
already hold each item's placeholder tokens, one per merged token:

    python -m sglang.launch_server --model-path Qwen/Qwen3-VL-8B-Instruct --port 30000
    python -m examples.sglang_client --encoder http://encoder:8000 --sglang http://sglang:30000 \\
        --model Qwen/Qwen3-VL-8B-Instruct --prompt "What happens in the clip?" cat.jpg clip.mp4

`/embed?format=sglang` returns those items as they are (the features as numbers, bfloat16 values by default;
Qwen3-VL's DeepStack levels after the merged tokens along the last dimension). `--model` is read for the tokenizer
and the special token ids (a local checkpoint directory or a Hub name).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx


def encode(encoder_url: str, inputs: list[bytes], dtype: str = "bfloat16", timeout: float = 120) -> dict:
    """One `/embed?format=sglang` request for all `inputs` (image or video bytes)."""
    files = [("file", (f"input{i}", data, "application/octet-stream")) for i, data in enumerate(inputs)]
    r = httpx.post(f"{encoder_url}/embed", params={"format": "sglang", "dtype": dtype}, files=files, timeout=timeout)
    r.raise_for_status()
    return r.json()


def _placeholders(tokenizer, config, item: dict) -> list[int]:
    """The tokens that stand for one item in the prompt, as the model's processor expands them: an image's merged
    tokens between vision start and end; a Qwen3-VL video frame by frame (each temporal patch after its timestamp,
    as `Qwen3VLProcessor` writes it), a Qwen2.5-VL video as one run."""
    start, end = config.vision_start_token_id, config.vision_end_token_id
    if item["type"] == "image":
        return [start] + [config.image_token_id] * item["num_tokens"] + [end]
    t, h, w = item["grid_thw"]
    if not config.model_type.startswith("qwen3"):
        return [start] + [config.video_token_id] * item["num_tokens"] + [end]
    ids: list[int] = []
    for seconds in item["video"]["timestamps"]:
        ids += tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False)
        ids += [start] + [config.video_token_id] * (h * w // 4) + [end]
    return ids


def input_ids(tokenizer, config, prompt: str, reply: dict) -> list[int]:
    """A one-turn chat prompt (Qwen's template) with every item of `reply` before the text, expanded."""
    ids = tokenizer.encode("<|im_start|>user\n", add_special_tokens=False)
    for item in reply["data"]:
        ids += _placeholders(tokenizer, config, item)
    ids += tokenizer.encode(f"{prompt}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    return ids


def generate_payload(tokenizer, config, prompt: str, reply: dict, max_new_tokens: int = 256) -> dict:
    """SGLang's `/generate` body: the expanded prompt and the precomputed items, in input order per modality."""
    payload: dict = {"input_ids": input_ids(tokenizer, config, prompt, reply),
                     "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    for kind in ("image", "video"):
        items = [item[f"{kind}_data"] for item in reply["data"] if item["type"] == kind]
        if items:
            payload[f"{kind}_data"] = items
    return payload


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoConfig, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--encoder", default="http://localhost:8000", help="this service")
    ap.add_argument("--sglang", default="http://localhost:30000", help="SGLang's server")
    ap.add_argument("--model", required=True, help="the checkpoint SGLang serves (its tokenizer and config)")
    ap.add_argument("--prompt", default="Describe the images.")
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)
    tokenizer, config = AutoTokenizer.from_pretrained(args.model), AutoConfig.from_pretrained(args.model)
    reply = encode(args.encoder, [f.read_bytes() for f in args.files])
    payload = generate_payload(tokenizer, config, args.prompt, reply)
    r = httpx.post(f"{args.sglang}/generate", json=payload, timeout=300)
    r.raise_for_status()
    print(r.json()["text"])
    return 0


if __name__ == "__main__":
    from examples import run

    run(main)
