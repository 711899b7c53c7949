"""The processes: `radixkv serve` (app), `radixkv keeper`, and how tests and the demo spawn them.

Flags, logs, metrics, the online audit, the Debug service and building a served pool at start.
"""
