"""Closed-loop episodes in process: the one episode loop (`drive_episode`) that collection,
evaluation and DAgger rollouts share, the camera frame -> selection -> descriptors -> policy
driver, one evaluation episode in the driving world, and a pool of worker processes (spawn)
that runs many.

An evaluation episode is a pure function of (config, scenario, layout seed, policy): its layout
comes from the seed (sps_driving.sim.world), its frame stamps, and so the policy's patch selection
draws, from the seed too (sim.config.frame_stamp_ns), rain and snow from (seed, frame), and every
worker runs torch and onnxruntime on the same pinned number of threads
(eval.torch_threads_per_worker); on a GPU, cuDNN is held to deterministic algorithms (the tests
check all this on CPUs only). The renderer draws a state the same way in every build of its
scene (sps_driving.sim.render). So the same command gives the same per-episode results whichever
worker (or torchrun process) runs an episode and in which order; only the order in which rows
arrive (imap_unordered) varies, and every reader keys rows, never counts on it.
"""

from __future__ import annotations

import math
import multiprocessing as mp
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sps_driving.core import host
from sps_driving.core.control import capped_throttle
from sps_driving.core.ood import HEAD_DISAGREEMENT, SELECTION_DISAGREEMENT, SelectionDisagreement
from sps_driving.sim.config import frame_stamp_ns
from sps_driving.sim.expert import Command, Expert
from sps_driving.sim.scenarios import get_scenario
from sps_driving.sim.world import StepResult, World, make_episode


@dataclass
class Frame:
    """One control step as the episode loop hands it to the driver and the sinks, before the car moves."""

    step: int
    stamp_ns: int  # the camera frame's stamp (frame_stamp_ns): patch selection is a function of it
    world: World  # the state the frame shows
    image: np.ndarray | None = None  # uint8 HxWx3 RGB camera frame; None when the loop has no renderer
    label: Command | None = None  # the expert's clean command for this state; None when the loop has no expert
    descriptors: np.ndarray | None = None  # float32 [N, D] every patch's descriptor, when the driver computed them


Driver = Callable[[Frame], Command]  # the command that moves the car at this frame
Sink = Callable[[Frame, Command], None]  # gets every frame with the command that moved the car
# Called after a step with a failure (the world's intervention already made): the frame whose
# command preceded it, and the step's result with the failures.
FailureHook = Callable[[Frame, StepResult], None]


def follow_label(frame: Frame) -> Command:
    """The driver that applies the label: the privileged expert drives."""
    return frame.label


def episode_steps(config: dict) -> int:
    return int(round(float(config["episode_s"]) * float(config["control_rate_hz"])))


def drive_episode(config: dict, world: World, episode_index: int, driver: Driver, expert: Expert | None = None,
                  renderer=None, sinks: Sequence[Sink] = (), on_failure: FailureHook | None = None,
                  ends: Callable[[], bool] | None = None) -> dict:
    """Drive `world` for one episode; the loop of collection, evaluation and DAgger rollouts.

    Each step makes the frame (stamp of `episode_index`, camera image when a `renderer` is given,
    the `expert`'s clean command as the label when one is given), asks `driver` for the command,
    hands the frame and that command to every sink, then steps the world (and calls `on_failure`
    after a step with a failure); `ends` true after a step (a requested handover) ends the episode
    there. Returns the world's result with min_gap_m, the smallest free gap to any actor over the
    episode (m).
    """
    steps = episode_steps(config)
    min_gap = math.inf
    for step in range(steps):
        frame = Frame(step, frame_stamp_ns(config, episode_index, step), world,
                      None if renderer is None else renderer.render(world),
                      None if expert is None else expert.command(world))
        command = driver(frame)
        for sink in sinks:
            sink(frame, command)
        step_result = world.step(command.steering, command.throttle)
        min_gap = min(min_gap, step_result.gap_m)
        if step_result.failures and on_failure is not None:
            on_failure(frame, step_result)
        if ends is not None and ends():
            break
    result = world.result(steps * world.dt).as_dict()
    result["min_gap_m"] = min_gap
    return result


def driving_state(world: World) -> dict:
    """The state inputs (sps_driving.core.state) of the world's current state: the car's speed and
    the episode's cruise target speed, as the car's speed report and its safety driver give them."""
    return {"speed_mps": world.state.speed, "target_speed_mps": world.episode.cruise_speed}


@dataclass(frozen=True)
class FrameView:
    """What the policy saw at one frame and what it did (for failure strips)."""

    time_s: float  # s, the world's time at the frame
    image: np.ndarray  # uint8 HxWx3 RGB camera frame
    indices: np.ndarray  # int64 [k] kept patches
    descriptors: np.ndarray  # float32 [k, D] their descriptors
    state: dict | None  # the state inputs it was given
    steering: float  # rad, the command


class PolicyDriver:
    """Camera frame (and the car's state) -> selected patches -> descriptors -> policy command.

    With all_patches, every patch's descriptor is computed and kept (`frame_descriptors`, and
    `Frame.descriptors` through `drive`), and the policy reads its selected subset of them: DAgger
    rollouts write that dense grid to a feature cache without extracting the frame twice.
    A patch policy reads each frame's window from a history (`streaming`) that `reset` clears and
    a dropped frame leaves out, as the policy node's.
    With view_history N, `views` keeps the FrameView of the last N frames `drive` computed (a
    ring buffer; sps_driving.sim.failure_strips draws them).
    With view_width_scale S (frames of the world's wider view, sim.config.widen_view), the
    extraction is widened to match (sps_driving.core.view.widen_extraction) and the policy reads
    its window of the wider grid, or refuses it (ValueError) if it reads absolute cells.
    precision ("fp32" | "int8"; None: the settings') is the extractor's (int8: onnxruntime's int8 graph).
    With `ood` (sps_driving.sim.ood_log.ood_settings; None: scores only), the driver scores every
    frame's kept descriptors with the calibration in the policy's folder when there is one (with
    the rule or a cruise scale, it must be there), and `ood_log` holds the episode's
    (sps_driving.sim.ood_log.OodEpisodeLog; None without a calibration); an ensemble's log holds
    its heads' disagreement too, with or without one, and with `ood["selection_draws"]` K the log
    holds the steering spread over K other selections of each frame (every patch is extracted).
    """

    def __init__(self, policy_dir: str, device: str = "cpu", threads: int | None = None, backbone_config: str | None = None,
                 all_patches: bool = False, view_history: int = 0, view_width_scale: float = 1.0, precision: str | None = None,
                 ood: dict | None = None):
        from sps_driving.core.policies.checkpoint import load_policy, read_policy_config
        from sps_driving.core.policies.ensemble import NAME as ENSEMBLE
        from sps_driving.core.policies.streaming import StreamingPolicy
        from sps_driving.export.extractors import extractor_for_policy

        policy_config = read_policy_config(policy_dir)
        self.extraction = extractor_for_policy(policy_config, {"device": device, "threads": threads, "precision": precision},
                                               backbone_config, view_width_scale=view_width_scale)
        self.extractor = self.extraction.extractor
        if self.extractor.dim != int(policy_config["descriptor_dim"]):
            raise ValueError(f"policy {policy_dir} reads {policy_config['descriptor_dim']} channels per descriptor but the "
                             f"extractor gives {self.extractor.dim}")
        draws = int((ood or {}).get("selection_draws", 0))
        all_patches = all_patches or draws > 0
        if all_patches and getattr(self.extractor, "drops_tokens", False):
            raise ValueError(f"policy {policy_dir} drops tokens (tokens kept): its descriptors depend on the kept patches, so "
                             "a frame has no dense grid to write or to draw other selections from; roll out a dense policy "
                             "and extract its bags with `sps-driving extract --keep-rate`")
        self.policy = load_policy(policy_dir, device=device, grid=self.extractor.grid)
        self.streaming = StreamingPolicy(self.policy)  # a patch policy's history of frames
        self.selector = self.policy.selector
        self.all_patches = np.arange(self.extractor.grid.n) if all_patches else None
        self.frame_descriptors: np.ndarray | None = None
        self.views: deque[FrameView] | None = deque(maxlen=view_history) if view_history > 0 else None
        self._seen: tuple[np.ndarray, np.ndarray] | None = None  # the last computed frame's (indices, descriptors)
        self.last = (0.0, 0.0)
        self.drops = 0
        self.ood_settings = ood
        self.scorer = _ood_scorer(policy_dir, policy_config, ood, view_width_scale)
        self.selection_disagreement = None if draws == 0 else SelectionDisagreement(self.policy, draws)
        self.logged_scores = ((self.scorer.methods if self.scorer is not None else ())
                              + ((HEAD_DISAGREEMENT,) if policy_config.get("architecture") == ENSEMBLE else ())
                              + ((SELECTION_DISAGREEMENT,) if draws else ()))
        self.ood_log = None

    def reset(self) -> None:
        from sps_driving.sim.ood_log import OodEpisodeLog

        self.last = (0.0, 0.0)
        self.streaming.reset()
        self.ood_log = OodEpisodeLog(self.ood_settings, self.logged_scores) if self.logged_scores else None
        if self.views is not None:
            self.views.clear()

    def __call__(self, image: np.ndarray, stamp_ns: int, state: dict | None = None) -> tuple[float, float]:
        """The command for one frame; `state` ({name: value}, `driving_state`) for a policy that reads one."""
        self.frame_descriptors = None
        self._seen = None
        try:
            indices = self.selector.select(stamp_ns)
            encoded = self.extractor.encode(image)
            if self.all_patches is None:
                descriptors = self.extractor.descriptors(encoded, indices)
            else:
                self.frame_descriptors = self.extractor.descriptors(encoded, self.all_patches)
                descriptors = self.frame_descriptors[indices]
            command = self.streaming.step(stamp_ns, descriptors, indices, state)
        except (ValueError, RuntimeError):
            # A frame the stack cannot use is dropped and counted; the car holds the last
            # command, as the vehicle interface does within its staleness timeout.
            self.drops += 1
            return self.last
        if not all(math.isfinite(c) for c in command):
            self.drops += 1
            return self.last
        self.last = command
        self._seen = (indices, descriptors)
        return command

    def drive(self, frame: Frame) -> Command:
        """The episode loop's driver: the command for `frame`'s camera image (with all_patches,
        frame.descriptors gets every patch's descriptor; None for a dropped frame)."""
        state = driving_state(frame.world)
        log = self.ood_log
        cap_mps = None
        if log is not None and log.cruise_scale < 1.0:
            if log.slow_by == "speed_cap":
                cap_mps = log.cruise_scale * state["target_speed_mps"]
            else:
                state["target_speed_mps"] *= log.cruise_scale
        command = Command(*self(frame.image, frame.stamp_ns, state))
        if cap_mps is not None:
            command = Command(command.steering, capped_throttle(command.throttle, state["speed_mps"], cap_mps))
        frame.descriptors = self.frame_descriptors
        if self.ood_log is not None:
            self.ood_log.frame(frame.world.time, None if self._seen is None else self._scores(frame.stamp_ns, state),
                               command.steering, frame.world.lane.lateral, frame.world.lane.heading_error)
        if self.views is not None and self._seen is not None:
            self.views.append(FrameView(frame.world.time, frame.image, *self._seen, state, command.steering))
        return command

    def _scores(self, stamp_ns: int, state: dict) -> dict:
        """The frame's logged scores: the calibrated ones of its kept descriptors, an ensemble's
        heads' disagreement in the forward that made its command (so read first), and the spread
        over other selections of the frame."""
        from sps_driving.core.policies.ensemble import head_disagreement

        scores = {} if self.scorer is None else self.scorer.scores(self._seen[1], self._seen[0])
        if HEAD_DISAGREEMENT in self.logged_scores:
            spread = head_disagreement(self.policy.module)
            scores[HEAD_DISAGREEMENT] = math.nan if spread is None else spread
        if self.selection_disagreement is not None:
            scores[SELECTION_DISAGREEMENT] = self.selection_disagreement(self.frame_descriptors, stamp_ns, state)
        return scores


def _ood_scorer(policy_dir: str, policy_config: dict, ood: dict | None, view_width_scale: float):
    """The policy's OOD calibration; None where it has none and nothing acts on the score (or the
    view is widened: other descriptors than it was calibrated on). CalibrationError when the rule
    or a cruise scale needs it and it is missing or mismatched."""
    from sps_driving.core.ood import CalibrationError, load_calibration
    from sps_driving.core.policies.checkpoint import WEIGHTS_FILE

    acts = ood is not None and (ood.get("rule") is not None or float(ood.get("cruise_scale", 1.0)) != 1.0)
    if view_width_scale != 1.0 and not acts:
        return None
    if acts:
        return load_calibration(policy_dir, policy_config, Path(policy_dir) / WEIGHTS_FILE, method=ood["method"])
    try:
        return load_calibration(policy_dir, policy_config, Path(policy_dir) / WEIGHTS_FILE)
    except CalibrationError:
        return None


def _with_handover(result: dict, log) -> dict:
    """A requested handover ends the episode as a handover: autonomy's success ends there too."""
    if log.handover_s is not None:
        result["success_s"] = min(result["success_s"], log.handover_s)
        result["score"] = result["success_s"] / result["duration_s"]
    result["handover"] = log.handover_s is not None
    result["ood"] = log.as_dict()
    return result


def run_episode(config: dict, scenario_name: str, seed: int, driver=None, renderer=None, strips=None) -> dict:
    """One closed-loop episode on layout `seed` (its frames stamped as episode `seed`); `driver`
    None means the privileged expert (no camera needed). `strips` (sim.failure_strips.FailureStrips
    of this driver) writes a strip of each failure."""
    world = World(config, make_episode(config, get_scenario(scenario_name), seed))
    drops_before = getattr(driver, "drops", 0)
    if driver is None:
        result = drive_episode(config, world, seed, follow_label, expert=Expert(config))
    else:
        driver.reset()
        on_failure = None if strips is None else strips.episode(scenario_name, seed)
        log = getattr(driver, "ood_log", None)
        if log is not None:
            on_failure = _logging_failures(log, on_failure)
        result = drive_episode(config, world, seed, driver.drive, renderer=renderer, on_failure=on_failure,
                               ends=None if log is None else (lambda: log.handed_over))
        if log is not None:
            result = _with_handover(result, log)
    result["episode"] = seed  # as in rows from before layouts were chosen, where the index was the seed
    result["dropped_frames"] = getattr(driver, "drops", 0) - drops_before
    if driver is not None:
        result["host"] = host.describe()  # the kind of CPU decides the trajectory (sps_driving.core.host)
    return result


def _logging_failures(log, then: FailureHook | None) -> FailureHook:
    def on_failure(frame: Frame, step: StepResult) -> None:
        log.failure(frame.world.time)
        if then is not None:
            then(frame, step)
    return on_failure


# ------------------------------------------------------------------------------ workers
_WORKER: dict = {}


def _init_worker(config: dict, policy_dir: str | None, device: str, threads: int, backbone_config: str | None,
                 strips_folder: str | None = None, precision: str | None = None) -> None:
    _WORKER.clear()  # in process (one worker), an earlier run's driver must not drive this one's expert episodes
    _WORKER["config"] = config
    if policy_dir is not None:
        import torch

        from sps_driving.sim.render import get_renderer

        torch.set_num_threads(threads)
        # GPU kernels that may sum in a varying order (autotuned algorithms) are replaced by
        # deterministic ones; on the CPU, the pinned thread count is what keeps sums in order.
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        _WORKER["renderer"] = get_renderer(config)
        scale = float(config["camera"].get("view_width_scale", 1.0))  # sim.config.widen_view
        if strips_folder is None:
            _WORKER["driver"] = PolicyDriver(policy_dir, device, threads, backbone_config, view_width_scale=scale,
                                             precision=precision, ood=config.get("ood"))
        else:
            from sps_driving.sim.failure_strips import FailureStrips, StripSettings

            settings = StripSettings.from_config(config)
            driver = PolicyDriver(policy_dir, device, threads, backbone_config,
                                  view_history=settings.history_frames(float(config["control_rate_hz"])),
                                  view_width_scale=scale, precision=precision, ood=config.get("ood"))
            _WORKER["driver"] = driver
            _WORKER["strips"] = FailureStrips(Path(strips_folder), settings, driver)


def _run_task(task: tuple[str, int]) -> dict:
    scenario_name, seed = task
    return run_episode(_WORKER["config"], scenario_name, seed, _WORKER.get("driver"), _WORKER.get("renderer"),
                       _WORKER.get("strips"))


def run_episodes(config: dict, policy_dir: str | None, tasks: list[tuple[str, int]], workers: int, device: str,
                 record: Callable[[dict], None] | None, backbone_config: str | None = None,
                 strips_folder: Path | None = None, processes=None, precision: str | None = None) -> None:
    """Run (scenario, layout seed) `tasks` with the policy at `policy_dir` (None: the expert) in
    `workers` processes, handing each finished episode's result to `record` as it comes; with
    `strips_folder`, a policy's failures are drawn there (sps_driving.sim.failure_strips);
    `precision` is the extractor's (None: the settings').

    With several `processes` (sps_driving.train.distributed, torchrun; every one calling this with the
    same tasks and its own `device`), each process is one worker: the tasks go round in rounds of
    one per process, and after each round process 0 gets the round's results (only its `record`
    is called; the others may pass None)."""
    threads = int(config.get("eval", {}).get("torch_threads_per_worker", 1))
    init = (config, policy_dir, device, threads, backbone_config, None if strips_folder is None else str(strips_folder), precision)
    if processes is not None and processes.world_size > 1:
        _init_worker(*init)
        for start in range(0, len(tasks), processes.world_size):
            task = tasks[start + processes.rank] if start + processes.rank < len(tasks) else None
            mine = None if task is None else _run_task(task)
            if mine is not None:
                processes.log(f"episode {task[0]} layout {task[1]}: score {mine['score']:.3f}")
            for row in processes.gather(mine):
                if row is not None and processes.main:
                    record(row)
        return
    if workers <= 1:
        _init_worker(*init)
        for task in tasks:
            record(_run_task(task))
        return
    with mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=init) as pool:
        for row in pool.imap_unordered(_run_task, tasks):
            record(row)
