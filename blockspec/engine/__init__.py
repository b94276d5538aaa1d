"""The engine: Engine (the offline API), worker building, start-up and warm-up, the server-info snapshot, the
tensor-parallel rank processes, and the engine process with its ZeroMQ wire."""
