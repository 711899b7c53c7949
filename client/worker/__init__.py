"""The worker side: a co-located worker's view of a pool's memory, and the block facts it reads.

`PoolView`, what GetPool says (`PoolInfo`), block tables followed from deltas, writers' checksums.
"""
