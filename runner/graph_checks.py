"""Checks across this package's nodes that validation decides from the files the loaders name,
before any model loads (a node's own VALIDATE_INPUTS sees only its own constants):

- the VAE of a Wan Tiled Decode or Wan Image to Video Latent is the one the model's latents
  belong to (TI2V-5B: the Wan2.2 VAE; every other Wan model: the Wan2.1 VAE);
- the LoRA of a Wan LoRA Loader fits the model it is given (the same sizes: every key placed,
  every shape equal);
- the width and height of a Wan Empty Latent / Image to Video Latent divide by the model's pixel
  stride (32 for TI2V-5B, 16 for the others), and sampling that size fits the compute device's
  memory in all (pipeline/memory_guard.py counts the latent copies and one forward's
  activations).

What the files are is read from their headers (pipeline/model_files.py). A check that cannot be
decided (a name that is linked rather than written, an unreadable file: its loader reports that)
is left to the node, which refuses the same mistake when it runs.
"""

from __future__ import annotations

from typing import Mapping

from ..wan.configs import VAES, pixel_stride, vae_kind
from .graph_types import Issue, Registry, is_link, node_title

VAE_NAMES = {kind: spec.name for kind, spec in VAES.items()}
PASS_THROUGH = {"WanEnhancedMemoryProbe": "value", "WanEnhancedLoRALoader": "model"}
LATENT_MAKERS = ("WanEnhancedEmptyLatent", "WanEnhancedImageToVideoLatent")
MAX_HOPS = 64
# The classes whose inputs these checks read; an input of any other node is judged by its own
# checks alone (what lets a sweep check its seeds one by one: sweep_checks.py).
READ_CLASSES = frozenset({"WanEnhancedModelLoader", "WanEnhancedVAELoader",
                          "WanEnhancedTiledDecode", "WanEnhancedLoRALoader", *LATENT_MAKERS,
                          *PASS_THROUGH})


def check_graph(nodes: Mapping[str, dict], registry: Registry, order: list[str]) -> list[Issue]:
    """Every cross-node problem of the needed nodes (`order`)."""
    from .. import NODE_CLASS_MAPPINGS as OURS

    ours = {cls for name, cls in OURS.items() if registry.get(name) is cls}
    if not ours:
        return []
    graph = _Graph(nodes)
    issues: list[Issue] = []
    for node_id in order:
        class_type = nodes[node_id]["class_type"]
        if registry.get(class_type) not in ours:
            continue
        if class_type == "WanEnhancedTiledDecode":
            issues += graph.decode_vae_issues(node_id)
        elif class_type in LATENT_MAKERS:
            issues += graph.latent_issues(node_id)
        elif class_type == "WanEnhancedLoRALoader":
            issues += graph.lora_issues(node_id)
    return issues


class _Graph:
    def __init__(self, nodes: Mapping[str, dict]):
        self.nodes = nodes

    # -- following links -----------------------------------------------------------------

    def source(self, value) -> str | None:
        """The node a link comes from, through pass-through probes."""
        for _ in range(MAX_HOPS):
            if not is_link(value) or value[0] not in self.nodes:
                return None
            node = self.nodes[value[0]]
            through = PASS_THROUGH.get(node.get("class_type"))
            if through is None:
                return value[0]
            value = node["inputs"].get(through)
        return None

    def loaded(self, value, loader: str, field: str, folder: str):
        """(file name, header info) of the file a linked loader names, or None."""
        node_id = self.source(value)
        if node_id is None or self.nodes[node_id]["class_type"] != loader:
            return None
        name = self.nodes[node_id]["inputs"].get(field)
        if not isinstance(name, str):
            return None
        from .. import host
        from ..pipeline.model_files import inspect_model_file
        try:
            return name, inspect_model_file(host.resolve_model(folder, name))
        except Exception:  # unreadable or misnamed: the loader's own validation says so
            return None

    def model(self, value):
        found = self.loaded(value, "WanEnhancedModelLoader", "model_name", "diffusion_models")
        return found if found and found[1].component == "dit" else None

    def vae(self, value):
        found = self.loaded(value, "WanEnhancedVAELoader", "vae_name", "vae")
        return found if found and found[1].component in VAE_NAMES else None

    def latent_model(self, value):
        """The model whose latents a LATENT link carries: the sampler's, or the latent node's."""
        node_id = self.source(value)
        if node_id is None:
            return None
        node = self.nodes[node_id]
        if node["class_type"] == "WanEnhancedSampler" or node["class_type"] in LATENT_MAKERS:
            return self.model(node["inputs"].get("model"))
        return None

    # -- the checks ----------------------------------------------------------------------

    def decode_vae_issues(self, node_id: str) -> list[Issue]:
        inputs = self.nodes[node_id]["inputs"]
        return self._pairing(node_id, self.latent_model(inputs.get("latent")),
                             self.vae(inputs.get("vae")), "the latent comes from")

    def latent_issues(self, node_id: str) -> list[Issue]:
        inputs = self.nodes[node_id]["inputs"]
        model = self.model(inputs.get("model"))
        issues = []
        if self.nodes[node_id]["class_type"] == "WanEnhancedImageToVideoLatent":
            issues += self._pairing(node_id, model, self.vae(inputs.get("vae")), "the model is")
        if model is not None:
            stride = pixel_stride(model[1].config)
            issues += self._sampling_memory_issues(node_id, model, stride)
            for side in ("width", "height"):
                value = inputs.get(side)
                if isinstance(value, int) and value % stride:
                    low = max(stride, value // stride * stride)
                    issues.append(self._issue(node_id, side, (
                        f"{value} is not a multiple of {stride}, the pixel stride of "
                        f"{model[0]!r} ({_known(model[1])}) (nearest valid: {low} or "
                        f"{low + stride})")))
        return issues

    def lora_issues(self, node_id: str) -> list[Issue]:
        """The LoRA file does not fit the model the loader is given (read from both headers)."""
        import warnings

        from .. import host
        from ..lora.file import LoraError, check_lora_keys, open_lora
        from ..lora.keymap import dit_shapes

        inputs = self.nodes[node_id]["inputs"]
        model, name = self.model(inputs.get("model")), inputs.get("lora_name")
        if model is None or not isinstance(name, str):
            return []
        try:
            path = host.resolve_model("loras", name)
            check_lora_keys(path)
        except Exception:  # unreadable, misnamed, not a LoRA: the node's validation says so
            return []
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # unmatched modules: the node warns when it runs
                open_lora(path, dit_shapes(model[1].config)).close()
        except LoraError as error:
            return [self._issue(node_id, "lora_name", (
                f"{name!r} does not fit {model[0]!r} ({_known(model[1])}): "
                f"{host.hide_server_paths(str(error))}"))]
        except Exception:
            return []
        return []

    def _sampling_memory_issues(self, node_id: str, model, stride: int) -> list[Issue]:
        """Sampling this latent needs more memory than the compute device has in all."""
        from .. import host
        from ..pipeline import memory_guard as guard

        inputs = self.nodes[node_id]["inputs"]
        values = [inputs.get(k) for k in ("width", "height", "frames", "batch")]
        if not all(isinstance(v, int) and v > 0 for v in values) or \
                values[0] % stride or values[1] % stride:
            return []
        config, vae = model[1].config, vae_kind(model[1].config)
        itemsize = 4 if self._weight_dtype(inputs.get("model")) == "fp32" else 2
        device = host.compute_device()
        problem = guard.refusal_or_none(
            f"sampling {model[0]!r} (latent copies and one forward's activations)",
            guard.VideoSize(*values), stride,
            lambda s: guard.sampling_bytes(config, vae, s, itemsize),
            guard.total_bytes(device), f"{guard.describe_device(device)} has {{available}} in all")
        return [self._issue(node_id, "frames", problem)] if problem else []

    def _weight_dtype(self, value):
        node_id = self.source(value)
        return self.nodes[node_id]["inputs"].get("weight_dtype") if node_id else None

    def _pairing(self, node_id: str, model, vae, relation: str) -> list[Issue]:
        if model is None or vae is None:
            return []
        wanted, have = vae_kind(model[1].config), vae[1].component
        if wanted == have:
            return []
        return [self._issue(node_id, "vae", (
            f"{vae[0]!r} is a {VAE_NAMES[have]}; {relation} {model[0]!r} ({_known(model[1])}), "
            f"whose latents only the {VAE_NAMES[wanted]} decodes"))]

    def _issue(self, node_id: str, input_name: str, message: str) -> Issue:
        node = self.nodes[node_id]
        return Issue(message, node_id, node["class_type"], node_title(node), input_name)


def _known(info) -> str:
    return info.known_as or "a custom size"
