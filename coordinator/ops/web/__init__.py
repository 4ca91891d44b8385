"""``ray-profiler serve``: web pages and a JSON API for a running coordinator (``server.py``),
with the token checks (``auth.py``) and input checks (``params.py``) as pure functions, and the
pages and their vendored Chart.js under ``static/``."""
