"""Memory pressure: admission by token budget, preemption (recompute or swap), scheduling queries, limits."""
