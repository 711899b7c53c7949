"""The rules: what a call may do and what it changes, decided once for the unary calls and the Session.

Configuration and limits, tenants and their shares and token budgets, sessions and request ids, the
ledger beside the core, the served pool and its lock, the checks every mutating call passes, the
`Step` that applies them, `KVService`, restart snapshots, miss explanations and WatchEvents bounds.
No gRPC servicer code: below the wire (`server/wire/`).
"""
