"""The radix tree of token prefixes: nodes, matching, LRU eviction, namespaces, pins, block content hashes,
and the host tier the tree's nodes move to and from."""
