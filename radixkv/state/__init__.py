"""The core's state as data: invariants recounted from scratch, snapshots written and adopted."""
