"""The wire edge: gRPC requests in, responses and statuses out.

The servicer and the Session stream, decoding and error statuses, interceptors, bearer-token auth,
the stream gate and the read-only calls. Decides nothing a rule decides (`server/rules/`).
"""
