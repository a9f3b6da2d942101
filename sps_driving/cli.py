"""`sps-driving`: one command with subcommands. Each subcommand lives in its own module,
which defines `add_arguments(parser)` and `run(args) -> int`; only the chosen one is imported,
so `sps-driving --help` stays fast."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

DESCRIPTION = ("End-to-end driving for ROS 2 with Stochastic Patch Selection: run the graph on the car, replay and "
               "check recordings, train, evaluate and analyse policies. `sps-driving COMMAND --help` for each command.")
COMMANDS = {
    "demo": ("sps_driving.tools.demo", "the README's main job: replay the bundled drive through the live graph"),
    "extract": ("sps_driving.train.extract", "bags (rosbag2 folders, .mcap, .db3) or image folders -> descriptor feature cache"),
    "train": ("sps_driving.train.trainer", "train a policy on a feature cache (torchrun-ready)"),
    "finetune": ("sps_driving.train.finetune_text", "fine-tune a policy with language-guided latent augmentation"),
    "bench": ("sps_driving.tools.bench", "per-frame extraction timing at several selection rates"),
    "replay": ("sps_driving.tools.replay", "play a bag through the live ROS 2 graph and report"),
    "interventions": ("sps_driving.tools.interventions", "field-test report of bags or a folder: distance and time per intervention"),
    "record": ("sps_driving.tools.record", "record a data drive or field test on the car (ros2 bag record, mcap)"),
    "faults": ("sps_driving.tools.faults", "fault-injection matrix of the drive-by-wire path against the live graph"),
    "collect": ("sps_driving.sim.collect", "record expert drives in the simulator as rosbag2"),
    "eval": ("sps_driving.sim.evaluate", "closed-loop out-of-distribution evaluation"),
    "compare": ("sps_driving.sim.compare", "method A against method B over eval results, paired, with 95% intervals"),
    "tables": ("sps_driving.sim.tables", "Tables 1 and 2 and the per-scenario details from eval results"),
    "choose": ("sps_driving.sim.choose", "a registered selection rule on screen results: the ensembles to make, the policy to ship"),
    "ensemble": ("sps_driving.train.ensemble", "one policy of several trained checkpoints of one method: the mean of their commands"),
    "dagger": ("sps_driving.sim.dagger", "on-policy data: roll out, label with the expert, aggregate, retrain (DAgger)"),
    "campaign": ("sps_driving.campaign.command", "a long experiment as a declared plan: run it (resumes after any stop) or show its state"),
    "analyze": ("sps_driving.analysis.analyze", "redundancy analysis of patch descriptors"),
    "ood": ("sps_driving.analysis.ood", "out-of-distribution score: calibrate on a policy's training frames, bench, report"),
    "export": ("sps_driving.tools.export", "export the extractor to ONNX / TensorRT"),
}


def _quiet_on_interrupt(kind, value, traceback) -> None:
    if not issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, traceback)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="sps-driving", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    for name, (module_name, help_text) in COMMANDS.items():
        # argparse %-formats a help string (not a description): a literal % must be %%.
        cmd_parser = sub.add_parser(name, help=help_text.replace("%", "%%"), description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(cmd_parser)
            cmd_parser.set_defaults(run=module.run)
    args = parser.parse_args(argv)
    try:
        code = int(args.run(args) or 0)
    except KeyboardInterrupt:
        # Ctrl-C: what the command finished is on disk. Python ends the process by SIGINT, so a
        # script's loop stops as well; without a traceback, and a second SIGINT (a campaign's step
        # passes one on) does not cut short what runs at exit.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"sps-driving {args.command}: interrupted", file=sys.stderr)
        sys.excepthook = _quiet_on_interrupt
        raise
    processes = sys.modules.get("sps_driving.train.distributed")  # imported only by commands that run under torchrun
    if processes is not None and processes.left_a_process_group:
        processes.exit_after_group(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
