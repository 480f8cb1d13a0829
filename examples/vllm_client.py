"""Encode through this service, then chat with vLLM carrying the precomputed embeddings.

vLLM serves the language model with `--enable-mm-embeds` (and `--limit-mm-per-prompt` for several images):

    vllm serve Qwen/Qwen3-VL-8B-Instruct --enable-mm-embeds --limit-mm-per-prompt '{"image": 4}'
    python -m examples.vllm_client --encoder http://encoder:8000 --vllm http://vllm:8000 \\
        --model Qwen/Qwen3-VL-8B-Instruct --prompt "What is in these pictures?" cat.jpg dog.png

`/embed?format=vllm` returns, per image, the dict of a vLLM `image_embeds` content part: base64 of `torch.save` of
the features `[num_tokens, out_hidden]` (Qwen2.5-VL) or `[num_tokens, 4 * out_hidden]` (Qwen3-VL: the merged tokens,
then the three DeepStack levels) and of the grid `[1, 3]` int64. vLLM's chat API has no part for video embeddings:
a video's `video_embeds` / `video_grid_thw` go to its Python API, `LLM.generate({"prompt": ..., "multi_modal_data":
{"video": {"video_embeds": ..., "video_grid_thw": ...}}})`, each read back with `torch.load(..., weights_only=True)`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx


def encode(encoder_url: str, inputs: list[bytes], dtype: str = "bfloat16", timeout: float = 120) -> dict:
    """One `/embed?format=vllm` request for all `inputs` (image or video bytes)."""
    files = [("file", (f"input{i}", data, "application/octet-stream")) for i, data in enumerate(inputs)]
    r = httpx.post(f"{encoder_url}/embed", params={"format": "vllm", "dtype": dtype}, files=files, timeout=timeout)
    r.raise_for_status()
    return r.json()


def embedding_parts(reply: dict) -> dict[str, list[dict]]:
    """Per modality, in input order, the dicts vLLM takes: `{"image_embeds": B64, "image_grid_thw": B64}` (an
    `image_embeds` content part's value) and `{"video_embeds": B64, "video_grid_thw": B64}`."""
    parts: dict[str, list[dict]] = {"image": [], "video": []}
    for item in reply["data"]:
        parts[item["type"]].append(item[f"{item['type']}_embeds"])
    return parts


def chat_request(model: str, prompt: str, reply: dict, max_tokens: int = 256) -> dict:
    """An OpenAI chat request whose one user message carries each image as an `image_embeds` part, then the
    prompt (vLLM accepts embedding parts in one message)."""
    parts = embedding_parts(reply)
    if parts["video"]:
        raise ValueError("vLLM's chat API takes image embeddings only: send videos' embeddings through its Python "
                         "API (multi_modal_data={'video': {...}})")
    content = [{"type": "image_embeds", "image_embeds": p} for p in parts["image"]]
    content.append({"type": "text", "text": prompt})
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--encoder", default="http://localhost:8000", help="this service")
    ap.add_argument("--vllm", default="http://localhost:8001", help="vLLM's OpenAI-compatible server")
    ap.add_argument("--model", required=True, help="the model name vLLM serves")
    ap.add_argument("--prompt", default="Describe the images.")
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)
    reply = encode(args.encoder, [f.read_bytes() for f in args.files])
    r = httpx.post(f"{args.vllm}/v1/chat/completions", json=chat_request(args.model, args.prompt, reply), timeout=300)
    r.raise_for_status()
    print(r.json()["choices"][0]["message"]["content"])
    return 0


if __name__ == "__main__":
    from examples import run

    run(main)
