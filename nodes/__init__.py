"""The node classes and their registration names. A node id never changes once released."""

from .attention import WanAttentionPatch
from .decode import WanTiledDecode
from .decode_video import WanDecodeSaveVideo
from .latent import WanEmptyLatent, WanImageToVideoLatent
from .loaders import WanCLIPVisionLoader, WanModelLoader, WanTextEncoderLoader, WanVAELoader
from .lora import WanLoRALoader
from .memory import WanMemoryProbe
from .sampler import WanSampler
from .text import WanTextEncode
from .video import WanSaveVideo

# Prefixed ids: other packs already use WanSampler / WanModelLoader, and the last pack loaded
# wins a name clash.
_NODES = {
    "WanEnhancedModelLoader": WanModelLoader,
    "WanEnhancedTextEncoderLoader": WanTextEncoderLoader,
    "WanEnhancedVAELoader": WanVAELoader,
    "WanEnhancedCLIPVisionLoader": WanCLIPVisionLoader,
    "WanEnhancedTextEncode": WanTextEncode,
    "WanEnhancedEmptyLatent": WanEmptyLatent,
    "WanEnhancedImageToVideoLatent": WanImageToVideoLatent,
    "WanEnhancedSampler": WanSampler,
    "WanEnhancedTiledDecode": WanTiledDecode,
    "WanEnhancedMemoryProbe": WanMemoryProbe,
    "WanEnhancedSaveVideo": WanSaveVideo,
    "WanEnhancedDecodeSaveVideo": WanDecodeSaveVideo,
    "WanEnhancedLoRALoader": WanLoRALoader,
    "WanEnhancedAttentionPatch": WanAttentionPatch,
}

NODE_CLASS_MAPPINGS = dict(_NODES)
NODE_DISPLAY_NAME_MAPPINGS = {node_id: cls.DISPLAY for node_id, cls in _NODES.items()}
