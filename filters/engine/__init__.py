"""The engine: pure and synchronous WS-Security and XML processing, one pipeline per route; knows nothing of
gRPC, Redis, the network or the frame (filters/worker.py, filters/stores/ hand it what it needs)."""
