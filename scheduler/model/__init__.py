"""The model: a Llama-family decoder over packed batches, its attention dispatch, rope, parallel layers and loaders."""
