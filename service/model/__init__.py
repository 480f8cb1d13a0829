"""The model: checkpoint and config loading, preprocessing (images and videos, as transformers' processors do it),
the vision tower written for serving, CUDA graphs of its forwards, and `encoder.Encoder`, which turns preprocessed
items into per-item embeddings through packed forwards. No queueing and no HTTP here."""
