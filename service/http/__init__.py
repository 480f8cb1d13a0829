"""The HTTP API: the FastAPI app (`app.py`), request parsing (`parsing.py`), request models (`schemas.py`), response
encoding (`output.py`), the metrics middleware (`middleware.py`) and the Prometheus metrics (`metrics.py`). The
only layer that knows HTTP status codes, FastAPI and Prometheus."""
