"""The OpenAI-compatible HTTP server on the continuous batching engine: `gpuformers serve MODEL`.

protocol.py validates requests and shapes errors, server.py is the FastAPI app and the uvicorn runner, job.py a
request's way through the engine (whole or streamed), responses.py the Responses API's answer and events,
detokenizer.py turns growing token lists into text with bounded work per token (byte_pieces.py: a byte-level BPE
tokenizer's bytes per token), sse_response.py writes a stream's chunks straight to the connection, metrics.py the
Prometheus text of /metrics, cli.py the `serve` verb. FastAPI and uvicorn come with the `serve` extra.
"""
