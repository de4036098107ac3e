"""The retrieval service: FastAPI under uvicorn, micro-batching, API keys, limits, metrics, a web page."""
