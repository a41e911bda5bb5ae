"""The model service: the Grok-1 network (model/), its checkpoints and sharding, and the serving engine."""
