"""BLIP-2 per-patch descriptors (SPS sec. 3.1; Drive-Anywhere masked attention) in BLIP-2's shared
vision-language (ITC) space.

Pipeline for one frame and patch j:
1. the EVA ViT (Blip2VisionModel) encodes the frame once: T = 1 + N image tokens (CLS first);
2. the Q-Former's cross-attention to the image tokens gets the additive bias (1 - m^(j)) r of
   SPS eq. 1 (`core.grid.patch_masks` / `attention_bias`); the CLS token's mask value is
   `cls_mask` (default 1: always visible, so an alpha covering the whole grid is exactly the
   unmasked Q-Former);
3. each of the 32 query outputs goes through the ITC vision projection and is L2-normalized
   (as Blip2ForImageTextRetrieval does); the patch's descriptor is their mean, renormalized:
   a unit vector that scores against `text_descriptors` like BLIP-2's image-text similarity;
4. a fixed linear head reduces the P ITC channels (256 for the real model) to D (default 64):
   y = W x + b, loaded from a safetensors file with tensors "weight" [D, P] and "bias" [D]
   (`fit_pca_head` fits a PCA basis on descriptors; `save_head` writes it). Without a head
   file the first D ITC channels are kept (identity truncation).

Text goes through the same space and head: Q-Former text path (text embeddings, no queries),
text_projection of the first token, L2-normalized, then the head.

Weights come from a local Hugging Face folder (`model_path`, e.g. models/blip2-itm-vit-g holding
a Blip2ForImageTextRetrieval checkpoint and its tokenizer); nothing is downloaded.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from sps_driving.core.backbones import resolve_device
from sps_driving.core.backbones.fp32_norm import keep_layer_norms_fp32
from sps_driving.core.backbones.qformer import PatchQFormer, QFormerFrame, itc_embeddings
from sps_driving.core.backbones.qformer_naive import naive_query_outputs
from sps_driving.core.backbones.vit_masked import resolve_dtype
from sps_driving.core.grid import FALLOFFS, PatchGrid, token_bias
from sps_driving.core.image import check_roi, normalized_pixels

# BLIP-2's image processor: bicubic resize to the model's square input, CLIP mean/std.
PIXEL_MEAN = (0.48145466, 0.4578275, 0.40821073)
PIXEL_STD = (0.26862954, 0.26130258, 0.27577711)

# Defaults for keys a config may leave out; config/*.yaml states the deployed values and units.
DEFAULTS = {
    "dim": 64,  # descriptor channels D
    "roi": None,  # region of the frame resized to the model's input: None = all of it (see core/image.py)
    "head_path": None,  # safetensors linear head; None -> identity truncation to D channels
    "falloff": "hard",  # mask m^(j) = f(d_ij): "hard" | "exp2" | "inverse"
    "alpha": 1.5,  # hard cutoff radius [patches]: 1.5 keeps the 3x3 neighbourhood
    "suppression": float("-inf"),  # r [attention logit units], < 0; -inf excludes masked tokens
    "cls_mask": 1.0,  # mask value of the ViT's CLS token in [0, 1]
    "implementation": "fast",  # "fast" | "naive" (the reference, for tests and the benchmark)
    "dtype": "auto",  # "float32" | "float16" | "bfloat16" | "auto" (float16 on CUDA, float32 on CPU)
    "device": "auto",  # "cpu" | "cuda" | "cuda:N" | "auto"
    "memory_budget_mb": 512,  # per-patch activations of one batch of patches [MiB]
    "max_text_tokens": 35,  # text prompt length cap [tokens] (BLIP-2 ITM's own)
}

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


class Blip2WeightsMissing(FileNotFoundError):
    pass


def resolve_weights_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return resolve_dtype(name)


class DescriptorHead(nn.Module):
    """The fixed linear map from P ITC channels to D descriptor channels."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        if weight.ndim != 2 or bias.shape != (weight.shape[0],):
            raise ValueError(f"head weight must be [D, P] and bias [D], got {tuple(weight.shape)}, {tuple(bias.shape)}")
        self.register_buffer("weight", weight.float().contiguous())
        self.register_buffer("bias", bias.float().contiguous())

    @classmethod
    def truncation(cls, in_dim: int, dim: int) -> DescriptorHead:
        if dim > in_dim:
            raise ValueError(f"descriptor dim {dim} exceeds the {in_dim} ITC channels")
        return cls(torch.eye(in_dim)[:dim], torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight, self.bias)


def fit_pca_head(embeddings: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """PCA basis of [n, P] ITC embeddings: (weight [D, P], bias [D]) with y = W x + b the first D
    principal coordinates of x (centred on the embeddings' mean)."""
    x = np.asarray(embeddings, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2 or dim > x.shape[1]:
        raise ValueError(f"need [n >= 2, P >= {dim}] embeddings to fit a {dim}-d head, got {x.shape}")
    mean = x.mean(axis=0)
    _, _, vt = np.linalg.svd(x - mean, full_matrices=False)
    weight = vt[:dim]
    if weight.shape[0] < dim:
        raise ValueError(f"only {weight.shape[0]} principal directions for a {dim}-d head: use more embeddings")
    return weight.astype(np.float32), (-weight @ mean).astype(np.float32)


def save_head(path: str | Path, weight: np.ndarray, bias: np.ndarray) -> None:
    from safetensors.numpy import save_file

    save_file({"weight": np.ascontiguousarray(weight, np.float32), "bias": np.ascontiguousarray(bias, np.float32)}, str(path))


def load_head(path: str | Path) -> DescriptorHead:
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"descriptor head {path} not found: fit one with fit_pca_head/save_head, or drop head_path")
    tensors = load_file(str(path))
    return DescriptorHead(tensors["weight"], tensors["bias"])


@dataclass
class Blip2FrameState:
    image_tokens: torch.Tensor  # [T, E]
    qformer_frame: QFormerFrame | None  # shared per-frame Q-Former work (fast path only)


class Blip2BackboneModule(nn.Module):
    """pixel_values [1, 3, S, S] -> image tokens [T, E] (exported as the backbone graph)."""

    def __init__(self, vision_model: nn.Module):
        super().__init__()
        self.vision_model = vision_model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        dtype = self.vision_model.embeddings.patch_embedding.weight.dtype
        return self.vision_model(pixel_values=pixel_values.to(dtype)).last_hidden_state[0]


class Blip2PatchModule(nn.Module):
    """(image tokens [T, E], bias [k, T]) -> descriptors [k, D] (exported as the per-patch graph).

    The frame's shared work runs once per call, whatever k is."""

    def __init__(self, patch_qformer: PatchQFormer, vision_projection: nn.Linear, head: DescriptorHead):
        super().__init__()
        self.patch_qformer = patch_qformer
        self.vision_projection = vision_projection
        self.head = head

    def forward(self, image_tokens: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        frame = self.patch_qformer.frame(image_tokens)
        query_outputs = self.patch_qformer(frame, bias, skip_excluded_keys=False)
        return self.head(itc_embeddings(query_outputs, self.vision_projection))


class Blip2Extractor:
    """PatchExtractor over a transformers Blip2ForImageTextRetrieval model."""

    def __init__(self, model: nn.Module, options: dict | None = None, tokenizer=None, name: str = "blip2"):
        opts = {**DEFAULTS, **(options or {})}
        unknown = set(opts) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"unknown BLIP-2 extractor options {sorted(unknown)}; known: {sorted(DEFAULTS)}")
        _validate(opts)
        opts["roi"] = check_roi(opts["roi"])
        self.options = opts
        self.name = name
        self.device = resolve_device(opts["device"])
        self.dtype = resolve_weights_dtype(opts["dtype"], self.device)
        self._tokenizer = tokenizer
        self._model_path: Path | None = None  # the folder a tokenizer is read from, when loaded from one
        self.model = model.eval().requires_grad_(False).to(self.device, self.dtype)
        if self.dtype != torch.float32:
            keep_layer_norms_fp32(self.model)
        vision_config = self.model.config.vision_config
        self.image_size = int(vision_config.image_size)
        side = self.image_size // int(vision_config.patch_size)
        self.grid = PatchGrid(side, side)
        projection_dim = self.model.vision_projection.out_features
        head = load_head(opts["head_path"]) if opts["head_path"] else DescriptorHead.truncation(projection_dim, int(opts["dim"]))
        if head.weight.shape[1] != projection_dim:
            raise ValueError(f"head expects {head.weight.shape[1]} input channels, the model has {projection_dim}")
        self.head = head.to(self.device)
        self.dim = int(self.head.weight.shape[0])
        self.patch_qformer = PatchQFormer(self.model.qformer, self.model.query_tokens)
        self.backbone_module = Blip2BackboneModule(self.model.vision_model)
        self.patch_module = Blip2PatchModule(self.patch_qformer, self.model.vision_projection, self.head)

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: dict) -> Blip2Extractor:
        """Load from `config["model_path"]`, a local Hugging Face Blip2ForImageTextRetrieval folder."""
        from transformers import Blip2ForImageTextRetrieval

        if not config.get("model_path"):
            raise ValueError("BLIP-2 backbone needs `model_path`: a local Hugging Face folder such as models/blip2-itm-vit-g")
        path = Path(config["model_path"])
        if not (path / "config.json").is_file() or not any((path / f).is_file() for f in WEIGHT_FILES):
            raise Blip2WeightsMissing(
                f"BLIP-2 weights not found in {path}/: put a Hugging Face Blip2ForImageTextRetrieval checkpoint "
                f"there (config.json, one of {', '.join(WEIGHT_FILES)}, and the tokenizer files, e.g. "
                f"Salesforce/blip2-itm-vit-g saved with save_pretrained on a machine with network access)"
            )
        model = Blip2ForImageTextRetrieval.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
        options = {key: config[key] for key in DEFAULTS if key in config}
        extractor = cls(model, options, name=config.get("name", "blip2"))
        extractor._model_path = path
        return extractor

    @classmethod
    def from_hf_config(cls, blip2_config, options: dict | None = None, seed: int = 0, tokenizer=None) -> Blip2Extractor:
        """Random weights for an in-memory transformers Blip2Config (tiny tests, timing at real dims)."""
        from transformers import Blip2ForImageTextRetrieval

        torch.manual_seed(seed)
        model = Blip2ForImageTextRetrieval(blip2_config)
        # Zero-initialized query tokens would make all queries identical: give them a spread.
        with torch.no_grad():
            model.query_tokens.normal_(0.0, blip2_config.initializer_range)
        return cls(model, options, tokenizer=tokenizer)

    # ---- PatchExtractor -----------------------------------------------------------------------

    @torch.inference_mode()
    def image_tokens(self, image_rgb: np.ndarray) -> torch.Tensor:
        """The vision backbone on one frame: [T, E] image tokens."""
        pixels = torch.from_numpy(
            normalized_pixels(image_rgb, (self.image_size, self.image_size), "cubic", PIXEL_MEAN, PIXEL_STD,
                              self.options["roi"])
        ).to(self.device)
        return self.backbone_module(pixels)

    @torch.inference_mode()
    def prepare_frame(self, image_tokens: torch.Tensor) -> Blip2FrameState:
        frame = self.patch_qformer.frame(image_tokens) if self.options["implementation"] == "fast" else None
        return Blip2FrameState(image_tokens, frame)

    def encode(self, image_rgb: np.ndarray) -> Blip2FrameState:
        return self.prepare_frame(self.image_tokens(image_rgb))

    def token_bias(self, indices: np.ndarray) -> torch.Tensor:
        """[k, T] float32 attention bias over the image tokens (CLS first) for patch `indices`."""
        opts = self.options
        bias = token_bias(
            self.grid, self._check_indices(indices), opts["falloff"], opts["alpha"], opts["suppression"],
            prefix_mask=float(opts["cls_mask"]),
        )
        return torch.from_numpy(bias).to(self.device)

    @torch.inference_mode()
    def query_outputs(self, state: Blip2FrameState, bias: torch.Tensor) -> torch.Tensor:
        """The per-patch Q-Former stage: [k, T] bias -> [k, Q, H] query outputs."""
        if state.qformer_frame is None:
            return naive_query_outputs(self.model.qformer, self.model.query_tokens, state.image_tokens, bias)
        return self.patch_qformer(state.qformer_frame, bias)

    @torch.inference_mode()
    def project(self, query_outputs: torch.Tensor) -> torch.Tensor:
        """Projection and normalization: [k, Q, H] -> [k, D] float32."""
        return self.head(itc_embeddings(query_outputs, self.model.vision_projection))

    def descriptors(self, state: Blip2FrameState, indices: np.ndarray, timings: dict | None = None) -> np.ndarray:
        """float32 [k, D]; `timings`, if given, accumulates the seconds spent in projection_s
        (projection, normalization and head) so a benchmark can split the stages."""
        bias = self.token_bias(indices)
        chunk = self.patches_per_batch(state.qformer_frame is None)
        out = []
        for start in range(0, len(bias), chunk):
            query_outputs = self.query_outputs(state, bias[start : start + chunk])
            began = _synchronized_clock(self.device)
            out.append(self.project(query_outputs))
            if timings is not None:
                timings["projection_s"] = timings.get("projection_s", 0.0) + _synchronized_clock(self.device) - began
        if timings is not None:
            timings.setdefault("projection_s", 0.0)
        if not out:
            return np.zeros((0, self.dim), np.float32)
        result = torch.cat(out).float().cpu().numpy()
        if not np.isfinite(result).all():
            raise FloatingPointError(f"non-finite BLIP-2 descriptors ({self.dtype}): check dtype and suppression")
        return result

    def position_table(self) -> np.ndarray:
        table = self.model.vision_model.embeddings.position_embedding[0, 1:]
        return table.detach().float().cpu().numpy()

    # ---- text ---------------------------------------------------------------------------------

    def text_descriptors(self, texts: list[str]) -> np.ndarray:
        """float32 [T, D]: each text through the Q-Former text path, text_projection of its first
        token, L2-normalized, then the same head as the patch descriptors."""
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        tokens = self.tokenizer(
            list(texts), padding=True, truncation=True, max_length=int(self.options["max_text_tokens"]), return_tensors="pt"
        )
        return self.text_descriptors_from_ids(tokens["input_ids"], tokens["attention_mask"])

    @torch.inference_mode()
    def text_descriptors_from_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> np.ndarray:
        model = self.model
        embeddings = model.embeddings(input_ids=input_ids.to(self.device)).to(self.dtype)
        hidden = model.qformer(query_embeds=embeddings, query_length=0, attention_mask=attention_mask.to(self.device))
        first = hidden.last_hidden_state[:, 0, :]
        text = F.normalize(model.text_projection(first).float(), dim=-1)
        return self.head(text).cpu().numpy()

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            path = getattr(self, "_model_path", None)
            if path is None:
                raise ValueError("no tokenizer: pass one to Blip2Extractor or load the model with from_config")
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            except OSError as error:
                raise Blip2WeightsMissing(
                    f"no tokenizer files in {path}/: save the checkpoint's tokenizer there (tokenizer.json or vocab.txt)"
                ) from error
        return self._tokenizer

    # ---- sizing -------------------------------------------------------------------------------

    def patches_per_batch(self, naive: bool = False) -> int:
        """How many patches fit the memory budget in one batch of the per-patch stage."""
        q_cfg = self.model.config.qformer_config
        queries = self.model.config.num_query_tokens
        tokens = self.grid.n + 1
        item = torch.finfo(self.dtype).bits // 8
        # fp32 logits and probabilities, plus the widest activations (FFN intermediate, a few [Q, H])
        per_patch = 2 * 4 * q_cfg.num_attention_heads * queries * tokens
        per_patch += item * queries * (q_cfg.intermediate_size + 6 * q_cfg.hidden_size)
        if naive:  # the image tokens' keys and values, made again for every patch
            per_patch += item * tokens * 2 * q_cfg.hidden_size
        return max(1, int(self.options["memory_budget_mb"]) * 2**20 // per_patch)

    def _check_indices(self, indices) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and (indices.min() < 0 or indices.max() >= self.grid.n):
            raise IndexError(f"patch indices must lie in [0, {self.grid.n}), got {indices.min()}..{indices.max()}")
        return indices


def _validate(opts: dict) -> None:
    if opts["implementation"] not in ("fast", "naive"):
        raise ValueError(f"implementation must be 'fast' or 'naive', got {opts['implementation']!r}")
    if opts["falloff"] not in FALLOFFS:
        raise ValueError(f"unknown mask falloff {opts['falloff']!r}; expected one of {FALLOFFS}")
    if not (math.isfinite(float(opts["alpha"])) and float(opts["alpha"]) >= 0):
        raise ValueError(f"alpha must be a finite distance >= 0 patches, got {opts['alpha']}")
    if not float(opts["suppression"]) < 0:  # also rejects nan
        raise ValueError(f"suppression strength r must be negative (or -inf), got {opts['suppression']}")
    if not 0.0 <= float(opts["cls_mask"]) <= 1.0:
        raise ValueError(f"cls_mask must lie in [0, 1], got {opts['cls_mask']}")
    if not float(opts["memory_budget_mb"]) >= 0:
        raise ValueError(f"memory_budget_mb must be >= 0, got {opts['memory_budget_mb']}")


def _synchronized_clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def tiny_blip2_config():
    """A tiny random BLIP-2 of the real architecture (same classes, tiny dims) for tests and quick
    runs. Its weights are drawn wider than real checkpoints (std 0.1) so that patches differ clearly."""
    return blip2_config(
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=56, patch_size=14),
        qformer=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, vocab_size=100,
                     max_position_embeddings=40),
        num_query_tokens=4,
        image_text_hidden_size=24,
        init_std=0.1,
    )


def real_blip2_config():
    """BLIP-2 ITM dims (EVA ViT-g/14, 224 px; Q-Former 768-d, 12 layers, 32 queries) for random weights."""
    return blip2_config(vision={}, qformer={}, num_query_tokens=32, image_text_hidden_size=256)


def blip2_config(vision: dict, qformer: dict, init_std: float = 0.02, **top):
    """A transformers Blip2Config for random weights (transformers' own vision default, 1e-10, is only
    meant for loading checkpoints). The Q-Former has the text path, as the ITM checkpoint has."""
    from transformers import Blip2Config

    vision = {"initializer_range": init_std, **vision}
    qformer = {"use_qformer_text_input": True, "initializer_range": init_std, **qformer}
    qformer.setdefault("encoder_hidden_size", vision.get("hidden_size", 1408))
    return Blip2Config(vision_config=vision, qformer_config=qformer, initializer_range=init_std, **top)
