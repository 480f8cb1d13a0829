"""Qwen3-VL vision encoder service: model -> engine -> API (see README.md)."""

__version__ = "0.1.0"
