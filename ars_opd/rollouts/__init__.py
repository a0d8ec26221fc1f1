"""Student rollouts on an inference engine (issue 29): the engine client, weight sync and the version check."""
