"""comfyui-wan-enhanced: Wan2.1 / Wan2.2 video generation in less GPU memory and less time.

ComfyUI loads this folder from custom_nodes/ and reads the two mappings below. Importing it never
needs ComfyUI or a GPU and does no heavy work: models load when a loader node runs.
"""

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
