"""Saving IMAGE frames as an H.264 MP4; shown in ComfyUI's UI, and works headless."""

from __future__ import annotations

from .. import host
from ..pipeline.video_io import (claim_output_path, expand_filename_variables, save_mp4,
                                 video_name_problem)
from .checks import constant_problems, output_file_problem, verdict
from .common import CATEGORY, memory_event, node_errors


class WanSaveVideo:
    DISPLAY = "Wan Save Video"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "images": ("IMAGE",),
            "filename_prefix": ("STRING", {"default": "wan/video", "tooltip": (
                "the video's name before its number, inside the output folder; ComfyUI's "
                "variables are expanded: %width%, %height%, %year%, %month%, %day%, %hour%, "
                "%minute%, %second%")}),
            "fps": ("FLOAT", {"default": 16.0, "min": 1.0, "max": 120.0, "step": 1.0}),
            "crf": ("INT", {"default": 19, "min": 0, "max": 51,
                            "tooltip": "H.264 quality: lower is better, 17-23 is typical"}),
        }, "hidden": {"unique_id": "UNIQUE_ID"}}

    RETURN_TYPES = ()
    FUNCTION = "save"
    CATEGORY = CATEGORY
    OUTPUT_NODE = True

    @classmethod
    def VALIDATE_INPUTS(cls, filename_prefix, fps):
        """The prefix stays inside a writable output folder; fps is a finite number in range."""
        problem = output_file_problem("filename_prefix", filename_prefix)
        if problem is None:
            problem = video_name_problem(host.output_directory(), filename_prefix)
        return verdict([*constant_problems(cls, fps=fps), problem])

    def save(self, images, filename_prefix, fps, crf, unique_id=None):
        root = host.output_directory()
        with node_errors(self.DISPLAY):
            height, width = (images.shape[1], images.shape[2]) if images.dim() == 4 else (0, 0)
            prefix = expand_filename_variables(filename_prefix, width, height)
            claimed = claim_output_path(root, prefix)  # no other writer takes it
            try:
                path = claimed.path
                # recorded before it exists (sweeps), with the token the file will carry
                host.announce_output(unique_id, path, claimed.token)
                save_mp4(images, path, fps=fps, crf=crf, tag=claimed.token, replace=False)
            finally:
                claimed.release()
        memory_event(f"saved {path.name}", "save", unique_id)
        return {"ui": saved_video_ui(root, path)}


def saved_video_ui(root, path) -> dict:
    """What ComfyUI's editor shows of a video written to `path` inside the output folder."""
    relative = path.relative_to(root)
    entry = {"filename": relative.name, "subfolder": relative.parent.as_posix()
             if relative.parent.as_posix() != "." else "", "type": "output"}
    return {"images": [entry], "animated": (True,)}
