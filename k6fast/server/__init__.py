"""`k6fast serve`: an OpenAI-compatible `/v1/videos` server that keeps its jobs across restarts.

Modules: `app` (routes, errors, auth: `create_app`), `jobs` (SQLite store and job files), `worker` (the GPU
thread), `validation` (request parsing and limits), `metrics` (Prometheus text), `config` (`ServerConfig`), `cli`
(`register`, `main`). Importing this package is cheap and needs neither FastAPI nor torch: `k6fast --help` must work
without the `serve` extra installed.
"""

from .cli import register
from .config import ServerConfig

__all__ = ["ServerConfig", "register"]
