"""Loading: model folders, safetensors shards, GGUF files and hub ids to a :class:`~slotinfer.Model`."""
