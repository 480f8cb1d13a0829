"""The engine: packs preprocessed items of concurrent requests into forwards of the model. Nothing here knows about
HTTP.

- `api.py`: the interface the HTTP layer uses (`Engine`) and the typed values that cross it; `factory.open_engine`
  picks the engine the settings name.
- `local.LocalEngine`: the model in this process (`build.py` loads and warms it), its forwards packed by
  `batching.Batcher` (asyncio plus one GPU worker thread).
- `process.py`: an engine process serving a `LocalEngine` over a Unix socket (`protocol.py`, frames through `shm.py`),
  started and restarted by `supervisor.py`; `remote.EnginePool` is the front-ends' `Engine` over those processes.
- `cache.py`: the embedding cache the front-ends share; `sandbox.py`: where videos are decoded.
"""
