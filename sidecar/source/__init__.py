"""Where the engine's cache transitions come from: the shm ring, or a vLLM/SGLang ZMQ stream."""
