"""The Ray Serve router: kvserve's OpenAI-compatible HTTP API (the only code that parses untrusted input).

    protocol.py       request bodies (pydantic): types, ranges, what is not supported
    serving.py        the endpoints' logic: validate, tokenize, dispatch, assemble replies and SSE
    formatting.py     OpenAI response and chunk bodies, usage, logprobs
    api.py            the FastAPI app: routes, API key, body limit, error JSON
    ingress.py        the Serve ingress deployment (and the handle to the engine replicas)
    engine_server.py  the engine replica deployment: a thin shim around an injected engine
    errors.py, settings.py, testing.py (a fake engine and a local server for tests)
"""
