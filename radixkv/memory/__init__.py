"""Blocks and the memory behind them: the block pool's ref counts, block tables, the pool's layout, and the
storage layer (torch tensors, shared memory, sizing, the plain-field handle; never imported by the core)."""
