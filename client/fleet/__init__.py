"""The fleet side: routing over many instances by what each has cached.

The `Router`, its per-instance prefix index fed by the event stream, and the hash-contract check.
"""
