"""comfyui-wan-enhanced: Wan2.1 / Wan2.2 video generation in less GPU memory and less time.

Importing this package never needs ComfyUI or a GPU. ComfyUI reads the node mappings below;
the engine lives in the subpackages (wan/, checkpoints/, sampling/, ...).
"""

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
