"""Student rollouts on an inference engine: the engine client, weight sync and the version check."""
