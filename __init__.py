"""comfyui-wan-enhanced: Wan2.1 / Wan2.2 video generation in less GPU memory and less time.

ComfyUI loads this folder from custom_nodes/ and reads the two mappings below. Importing it never
needs ComfyUI or a GPU and does no heavy work: models load when a loader node runs.
"""

# ComfyUI and pip import this folder as a package. pytest, run from a clone whose folder name is
# no Python name (`comfyui-wan-enhanced`, what `git clone` gives), imports this file alone as a
# module of no package, for the package-level fixtures it looks for: then there are no node
# mappings to give (the tests import the installed `wan_enhanced`).
if __package__:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
    from .host import comfyui_version, untested_version_note

    _note = untested_version_note(comfyui_version())
    if _note:  # said once, as ComfyUI imports the package; the nodes load all the same
        import logging

        logging.getLogger("wan_enhanced").warning(_note)

    __all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
