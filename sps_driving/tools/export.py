"""`sps-driving export`: ONNX graphs and TensorRT engines of a per-patch extractor, and a parity check.

  sps-driving export onnx --backbone blip2 --model-path models/blip2-itm-vit-g --out models/export/blip2
  sps-driving export onnx --backbone dinov2_vits14 --out models/export/dinov2_vits14
  sps-driving export tensorrt --export-dir models/export/blip2          (GPU machines, needs tensorrt)
  sps-driving export int8 --export-dir models/export/dinov2_vits14     (onnxruntime's dynamic int8 backbone)
  sps-driving export parity --export-dir models/export/blip2 --backend onnxruntime --backbone blip2 ...
  sps-driving export parity --bag data/demo_drive --policy models/sps50_dinov2 --precision int8
      (the policy's descriptors and commands on each frame of a drive: token and steering error)

`--random-weights tiny|real` builds BLIP-2 with random weights (for timing and checks without a
checkpoint; the same --seed gives the same weights in every command).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import yaml
from tqdm import tqdm


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="export_command", metavar="WHAT", required=True)
    onnx = sub.add_parser("onnx", help="export the backbone and per-patch graphs to ONNX")
    _add_extractor_arguments(onnx)
    onnx.add_argument("--out", required=True, help="export directory (e.g. models/export/blip2)")
    trt = sub.add_parser("tensorrt", help="build TensorRT engines from an ONNX export (GPU only)")
    trt.add_argument("--export-dir", required=True)
    trt.add_argument("--fp32", action="store_true", help="fp32 engines (default fp16 with fp32 LayerNorm/softmax)")
    trt.add_argument("--patches", type=int, nargs=3, metavar=("MIN", "OPT", "MAX"),
                     help="optimization profile of the patch batch (default 1, N/2, N for the export's N patches, "
                          "at least 1, 128, 256)")
    trt.add_argument("--workspace-gb", type=float, default=4.0, help="builder workspace [GiB]")
    trt.add_argument("--force", action="store_true", help="rebuild even if a cached engine exists")
    int8 = sub.add_parser("int8", help="quantize an export's backbone graph to int8 (onnxruntime, dynamic)")
    int8.add_argument("--export-dir", required=True)
    parity = sub.add_parser("parity", help="compare an exported runtime with the fp32 torch extractor")
    _add_extractor_arguments(parity)
    parity.add_argument("--export-dir", help="export directory (onnxruntime, tensorrt); DINOv2 on onnxruntime: "
                        "default the export cache's, made on first use")
    parity.add_argument("--precision", choices=("fp32", "int8"), default="fp32", help="onnxruntime: the int8 backbone graph")
    parity.add_argument("--bag", type=Path,
                        help="compare on every camera frame of this bag (rosbag2 folder, .mcap or .db3 file; default: one random frame)")
    parity.add_argument("--backend", choices=("onnxruntime", "tensorrt", "torch"), default="onnxruntime",
                        help="torch: the torch extractor itself at --device/--dtype (e.g. cuda float16)")
    parity.add_argument("--device", default="auto", help="device of the runtime under test (auto | cpu | cuda)")
    parity.add_argument("--dtype", default="float16", help="torch backend weights: float32 | float16 | bfloat16")
    parity.add_argument("--tolerance", type=float, default=1e-4, help="max abs descriptor difference allowed")
    parity.add_argument("--policy", type=Path,
                        help="with --bag: the policy's extraction settings, and through it, on each frame, the patches it selects: "
                             "their descriptors and its steering and throttle from the runtime's against those from torch fp32")
    parity.add_argument("--json", action="store_true", help="print the result as JSON")


def _add_extractor_arguments(parser) -> None:
    parser.add_argument("--backbone", choices=("dinov2_vits14", "blip2"), default="dinov2_vits14")
    parser.add_argument("--config", help="extraction YAML (default config/extraction.yaml)")
    parser.add_argument("--model-path", help="local model folder (BLIP-2) or ONNX file (DINOv2)")
    parser.add_argument("--random-weights", choices=("tiny", "real"),
                        help="random weights at tiny or real dims (BLIP-2: ViT-g + Q-Former; DINOv2: ViT-S/14)")
    parser.add_argument("--seed", type=int, default=0, help="seed of --random-weights")
    parser.add_argument("--dim", type=int, default=64, help="BLIP-2 descriptor channels D")
    parser.add_argument("--tokens", choices=("all", "kept"),
                        help="DINOv2: the ViT on every patch (all) or on CLS and the kept patches only (kept: token dropping); "
                             "default --config's, else config/extraction.yaml's")


def given_settings(args) -> dict:
    """The extraction settings under test: --policy's over --config's (a --tokens that is not the
    policy's is an error), else --config's; with --tokens."""
    if getattr(args, "policy", None):
        from sps_driving.export.extractors import extraction_settings

        settings = extraction_settings({"tokens": args.tokens}, args.policy, args.config, parameter_source="option")
        return {key: value for key, value in settings.config.items() if key in settings.sources}
    given = yaml.safe_load(Path(args.config).read_text()) if args.config else {}
    return {**given, **({"tokens": args.tokens} if args.tokens else {})}


def torch_extractor(args, device: str = "cpu", dtype: str = "float32"):
    """The torch extractor the exports are made from and compared with (fp32 on the CPU by default)."""
    from sps_driving.core.backbones import resolve_config
    from sps_driving.core.backbones.dinov2 import random_dinov2
    from sps_driving.core.backbones.loader import load_extractor

    config = {**given_settings(args), "backbone": args.backbone, "backend": "torch", "device": device, "dtype": dtype}
    if args.model_path:
        config["model_path"] = args.model_path
    if args.backbone == "blip2":
        config.setdefault("dim", args.dim)
    if args.random_weights and args.backbone == "dinov2_vits14":
        return random_dinov2(args.random_weights, resolve_config(config), args.seed)
    if args.random_weights:
        from sps_driving.core.backbones.blip2 import DEFAULTS, Blip2Extractor, real_blip2_config, tiny_blip2_config

        blip2 = real_blip2_config() if args.random_weights == "real" else tiny_blip2_config()
        options = {key: value for key, value in resolve_config(config).items() if key in DEFAULTS}
        if args.random_weights == "tiny":
            options["dim"] = min(options["dim"], blip2.image_text_hidden_size)
        return Blip2Extractor.from_hf_config(blip2, options, seed=args.seed)
    return load_extractor(config)


def run(args) -> int:
    if args.export_command == "onnx":
        return _run_onnx(args)
    if args.export_command == "tensorrt":
        return _run_tensorrt(args)
    if args.export_command == "int8":
        return _run_int8(args)
    return _run_parity(args)


def _run_onnx(args) -> int:
    from sps_driving.export.onnx_export import export_onnx

    with tqdm(total=2, desc="export onnx", unit="step") as bar:
        bar.set_postfix_str("loading the extractor")
        extractor = torch_extractor(args)
        bar.update()
        bar.set_postfix_str("tracing backbone and per-patch graphs")
        start = time.perf_counter()
        meta = export_onnx(extractor, args.out)
        bar.update()
    sizes = {p.name: p.stat().st_size for p in sorted(Path(args.out).iterdir()) if p.is_file()}
    print(f"exported {extractor.name} to {args.out} in {time.perf_counter() - start:.1f} s: "
          + ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in sizes.items()))
    print(f"metadata: {meta}")
    return 0


def _run_tensorrt(args) -> int:
    from sps_driving.core.backbones.runtimes import BACKBONE_FILE, PATCHES_FILE, RuntimeMissing, read_export
    from sps_driving.export.tensorrt import build_engine, default_profile

    try:
        import tensorrt  # noqa: F401
    except ImportError:
        print("TensorRT is not installed: `pip install tensorrt` on a machine with an NVIDIA GPU", file=sys.stderr)
        return 2
    export_dir = Path(args.export_dir)
    try:
        meta = read_export(export_dir, {"export_dir": str(export_dir)})
    except RuntimeMissing as error:
        print(error, file=sys.stderr)
        return 2
    patches = tuple(args.patches) if args.patches else default_profile(meta)
    for graph in tqdm((BACKBONE_FILE, PATCHES_FILE), desc="build TensorRT engines", unit="engine"):
        start = time.perf_counter()
        path = build_engine(export_dir / graph, fp16=not args.fp32, patches=patches,
                            workspace_gb=args.workspace_gb, force=args.force)
        print(f"{graph}: {path} ({time.perf_counter() - start:.1f} s)")
    return 0


def _run_int8(args) -> int:
    from sps_driving.core.backbones.runtimes import RuntimeMissing, read_export
    from sps_driving.export.cache import ensure_int8

    try:
        read_export(args.export_dir, {"export_dir": args.export_dir})
    except RuntimeMissing as error:
        print(error, file=sys.stderr)
        return 2
    start = time.perf_counter()
    path = ensure_int8(Path(args.export_dir))
    print(f"{path} ({path.stat().st_size / 2**20:.1f} MiB, {time.perf_counter() - start:.1f} s); "
          "run it with precision: int8 and export_dir: " + args.export_dir)
    return 0


def runtime_config(args) -> dict:
    """The exported runtime under test: --export-dir, else (DINOv2, onnxruntime) the export cache's."""
    from sps_driving.core.backbones import resolve_config

    config = {**given_settings(args), "backbone": args.backbone, "backend": args.backend, "device": args.device,
              "precision": args.precision}
    if args.model_path:
        config["model_path"] = args.model_path
    if args.export_dir:
        config["export_dir"] = args.export_dir
    elif args.backend == "onnxruntime" and args.backbone == "dinov2_vits14" and not args.random_weights:
        from sps_driving.export.cache import ensure_export

        config["export_dir"] = str(ensure_export(resolve_config({**config, "device": "cpu"})))
    else:
        raise SystemExit(f"--export-dir is needed for backend {args.backend} of {args.backbone}")
    return config


def rgb_frames(bag: Path) -> list:
    """uint8 RGB frames of the camera topic of a rosbag2 (raw or compressed: sps_driving.ros.drive)."""
    from sps_driving.ros.drive import camera_frames

    return [frame.rgb() for frame in camera_frames(bag)]


def _run_parity(args) -> int:
    from sps_driving.core.backbones.runtimes import load_runtime_extractor
    from sps_driving.export.cache import parity

    if args.policy and not args.bag:
        raise SystemExit("export parity: --policy compares the policy's commands on a drive's frames: give --bag")

    if args.backend == "torch":
        import torch

        device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
        runtime = torch_extractor(args, device=device, dtype=args.dtype)
    else:
        config = runtime_config(args)
        if args.precision == "int8":
            from sps_driving.export.cache import ensure_int8

            ensure_int8(Path(config["export_dir"]))
        runtime = load_runtime_extractor(config)
    reference = torch_extractor(args)
    images = rgb_frames(args.bag) if args.bag else [np.random.default_rng(args.seed).integers(0, 256, (600, 960, 3), dtype=np.uint8)]
    backend = f"torch {args.dtype} {runtime.device}" if args.backend == "torch" else f"{args.backend} {args.precision}"
    result = {"backbone": reference.name, "backend": backend, **parity(reference, runtime, images, args.tolerance)}
    if args.policy:
        result["policy"] = policy_parity(reference, runtime, args.policy, args.bag)
    print(json.dumps(result) if args.json else
          f"{reference.name} {backend} vs torch fp32 cpu on {result['frames']} frame(s): max |diff| {result['max_abs_diff']:.3g} "
          f"(tolerance {args.tolerance:g}), relative error {result['relative_error']:.3g} (max {result['max_relative_error']:.3g}), "
          f"cosine min {result['min_cosine']:.6f} mean {result['mean_cosine']:.6f}, descriptor scale "
          f"{result['descriptor_scale']:.3g} -> {'OK' if result['ok'] else 'FAIL'}"
          + ("" if not args.policy else "\n" + format_policy_parity(result["policy"])))
    return 0 if result["ok"] else 1


def policy_parity(reference, runtime, policy_dir: Path, bag: Path) -> dict:
    """On each camera frame of `bag`: the patches the policy selects at the frame's stamp, their
    descriptors from `reference` and `runtime`, and the policy's command from each (with the bag's
    state inputs, matched by stamp as `extract` matches them); the differences of the descriptors
    (token error) and of the commands (steering rad, throttle), and each command's error against
    the command the bag logged (None where it logged none)."""
    from sps_driving.core.policies.checkpoint import load_policy
    from sps_driving.core.policies.streaming import StreamingPolicy
    from sps_driving.ros.drive import camera_frames, read_drive
    from sps_driving.tools.replay import reference_commands
    from sps_driving.train.extract import ExtractSettings, bag_states, matched_state

    policy = load_policy(policy_dir, grid=reference.grid)
    drivers = {"reference": StreamingPolicy(policy), "runtime": StreamingPolicy(load_policy(policy_dir, grid=reference.grid))}
    drive = read_drive(bag)
    states, logged = bag_states(drive), reference_commands(drive)
    tolerance_ns = int(ExtractSettings().match_tolerance_s * 1e9)
    token, cosine, commands, against_log = [], [], {"reference": [], "runtime": []}, {"reference": [], "runtime": []}
    for frame in camera_frames(bag):
        stamp, image = frame.stamp_ns, frame.rgb()
        indices = policy.selector.select(stamp)
        expected = reference.descriptors(reference.encode(image), indices)
        got = runtime.descriptors(runtime.encode(image), indices)
        token.append(float(np.linalg.norm(got - expected) / np.linalg.norm(expected)))
        cosine.append(float(np.mean(np.sum(got * expected, 1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1)))))
        state = matched_state(states, stamp, tolerance_ns)
        for name, descriptors in (("reference", expected), ("runtime", got)):
            command = drivers[name].step(stamp, descriptors, indices, state)
            commands[name].append(command)
            if stamp in logged:
                against_log[name].append(np.subtract(command, logged[stamp]))
    difference = np.abs(np.subtract(commands["runtime"], commands["reference"]))

    def spread(values) -> dict:
        return {"mean": float(np.mean(values)), "p95": float(np.percentile(values, 95)), "max": float(np.max(values))}

    return {"checkpoint": str(policy_dir), "frames": len(token), "kept_patches": int(policy.selector.count),
            "token_relative_error": spread(token), "token_mean_cosine": float(np.mean(cosine)),
            "steering_abs_diff_rad": spread(difference[:, 0]), "throttle_abs_diff": spread(difference[:, 1]),
            "steering_mae_vs_logged_rad": {name: (float(np.mean(np.abs(np.asarray(errors)[:, 0]))) if errors else None)
                                           for name, errors in against_log.items()}}


def format_policy_parity(result: dict) -> str:
    steering, throttle, token = result["steering_abs_diff_rad"], result["throttle_abs_diff"], result["token_relative_error"]
    logged = result["steering_mae_vs_logged_rad"]
    return (f"through {result['checkpoint']} on {result['frames']} frame(s), {result['kept_patches']} patches selected each: "
            f"token relative error mean {token['mean']:.3g} (p95 {token['p95']:.3g}, max {token['max']:.3g}), mean cosine "
            f"{result['token_mean_cosine']:.4f}; steering |diff| mean {steering['mean']:.4g} rad (p95 {steering['p95']:.4g}, max "
            f"{steering['max']:.4g}), throttle |diff| mean {throttle['mean']:.4g} (max {throttle['max']:.4g})"
            + ("" if logged["reference"] is None else
               f"; steering error against the logged commands: torch fp32 {logged['reference']:.4g} rad, "
               f"the runtime {logged['runtime']:.4g} rad"))
