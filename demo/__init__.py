"""`radixkv demo`: a Llama-family model served through radixkv (orchestrator, worker, server, kernels)."""
