"""The OpenAI-compatible HTTP server on the continuous batching engine: `gpuformers serve MODEL`.

protocol.py validates requests and shapes errors, server.py is the FastAPI app and the uvicorn runner,
detokenizer.py turns growing token lists into text with bounded work per token, metrics.py the Prometheus text of
/metrics, cli.py the `serve` verb. FastAPI and uvicorn come with the `serve` extra.
"""
