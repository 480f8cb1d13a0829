"""The batching engine: packs preprocessed items of concurrent requests into forwards of the model.

`batching.Engine` (asyncio plus one GPU worker thread) runs in the serving process or in its own engine process
(`process.py`), which the HTTP front-ends reach through `remote.RemoteEngine`; `build.py` turns the settings into
an encoder and its engine. Nothing here knows about HTTP.
"""
