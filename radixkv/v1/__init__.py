"""Generated protobuf and gRPC modules of the `radixkv.v1` wire contract (see proto/radixkv/v1/).

Produced by proto/generate.sh and committed; a test fails when they are stale. Import the modules
you need (`from radixkv.v1 import kvcache_pb2`); this package imports nothing itself.
"""
