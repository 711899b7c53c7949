"""Before serving: model shapes, capacity plans, and a synthetic workload replayed through the core."""
