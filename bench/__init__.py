"""GPU benchmarks against the peers (ComfyUI's own Wan model, diffusers) and of our own parts;
harness.py is what they share. bench/results/ keeps every committed figure."""
