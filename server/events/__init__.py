"""Events: what a pool's prefix tree stored and removed, told to watchers.

The event hub (`hub.py`: numbered per namespace, tombstones, writers' block checksums) and vLLM's
KV-events stream (`kv_events*.py`, `kv_replay.py`: its config, ZMQ sockets, wire encoding and replay).
Imports nothing else of the server.
"""
