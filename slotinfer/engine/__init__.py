"""The engine: the step (admit, prefill, decode, process), the Encoder and Decoder that run the
model over the slot table, sampling, constraints, and each request's lifecycle."""
