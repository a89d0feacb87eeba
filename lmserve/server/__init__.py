"""The OpenAI-compatible HTTP server: a thin layer over Engine (FastAPI + uvicorn, imported lazily)."""
