"""The disk tier: objects of whole blocks under a directory (`object_format`), aligned I/O (`block_io`), the store
with its index, byte cap and integrity checks (`store`), and when reading beats recomputing (`load_cost`)."""
