"""The Ray Serve router: kvserve's OpenAI-compatible HTTP API (the only code that parses untrusted input).

Free of Ray and HTTP (unit-testable with a fake engine client):
    protocol.py       request bodies (pydantic): types, ranges, what is not supported
    serving.py        the endpoints' logic: validate, tokenize, dispatch, assemble replies and SSE
    formatting.py     OpenAI response and chunk bodies, usage, logprobs
    errors.py         OpenAI error JSON, and the one mapping from engine errors to statuses
    settings.py       the ingress's configuration
Facing HTTP and Ray:
    api.py            the FastAPI app: routes, API key, body limit, error JSON
    ingress.py        the Serve ingress deployment (and the handle to the engine replicas,
                      which are workers.server.EngineServer)
"""
