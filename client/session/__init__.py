"""The session client: `RadixKVClient` and what it is built from.

Requests and responses for both clients, the Session stream and its pipeline, retries, channels and
the session's lease.
"""
