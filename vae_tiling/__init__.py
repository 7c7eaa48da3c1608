"""Spatially tiled, streamed decoding of Wan video latents (the Wan Tiled Decode node's engine)."""
