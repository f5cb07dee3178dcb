"""Layers shared by the model files: paged attention, rotary embeddings."""
