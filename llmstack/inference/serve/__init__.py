"""`llmstack serve`: an OpenAI-compatible HTTP server over a continuous-batching engine.

Needs the [serve] extra (fastapi, uvicorn, prometheus-client); nothing else imports this package.
"""
