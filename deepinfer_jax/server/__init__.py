"""The OpenAI-compatible HTTP server and the `deepinfer` subcommands built on it.

    app.py                 routes, middleware, start-up / shutdown (`start_server`, `serve`)
    protocol.py            request parsing into SamplingParams, response shapes (no JAX, no aiohttp)
    serving*.py            the chat and completions handlers over the AsyncEngine
    metrics.py             Prometheus metrics (vLLM names, `deepinfer:` prefix)
    args.py                flags and the YAML config; terminal.py (chat / generate); bench.py (Protocol B/C)
"""
