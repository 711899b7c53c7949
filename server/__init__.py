"""The radixkv gRPC server: pools served over `radixkv.v1.KVCache`, with sessions, tenants, health,
reflection and metrics.

Entry points: `radixkv.server.process.app.create_server(config, address) -> (server, port)` and
`radixkv.server.process.app.main(argv)` (`radixkv serve`). Importing this package imports nothing else.
"""
