"""The keeper's side of the server: attach pools to a keeper, the frames both speak, what a keeper owns.

The keeper process itself is `server/process/keeper.py`. Imports nothing else of the server.
"""
