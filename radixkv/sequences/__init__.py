"""Live sequences and what changes them: open, append, fork, publish and release, the blocks they take,
and the records the core's calls return."""
