"""Serving gridd's ASGI apps (simulator, providers API, OpenAI front, /metrics).

serve.serve_asgi is the entry point; it runs one of two backends:

- h11_server: the default, a small HTTP/1.1 server on h11 + trio (one task per connection);
  h11_request holds one request's ASGI receive/send, listeners the listening sockets and the
  connection cap's bookkeeping, limits the bounds both backends apply.
- hypercorn_backend: hypercorn's trio worker, wrapped to keep the same contract.

asgi: the ASGI types, ClientDisconnected and the small helpers apps share (docs/http-serving.md).
"""
