"""The link layer both roles share: the channel between gridd processes and polling over it.

    session     one WebSocket over mutual TLS carrying gridd.wire frames; the error mapping
    serve       the operator's side: accepting connections (TLS, identity, WebSocket, limits)
    dial        the client's side: one connection, or a persistent re-dialing dialer, over a
                stream factory (TCP by default, trio memory streams in tests)
    periodic    the one drift-free periodic loop and its one overrun policy
    supervisor  restartable, scoped tasks keyed by peer
    poller      one poller: budget, answer, up/down transitions and their log lines

What is sent to whom (authorization, the endpoint answering polls, admission of what a peer
sends) is the roles' business: gridd/operator/relay.py, gridd/operator/peers.py and
gridd/gateway/service.py. docs/signals-channel.md has the whole lifecycle.
"""
