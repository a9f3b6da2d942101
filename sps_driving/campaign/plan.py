"""A campaign plan (docs/campaign.md): a YAML file of named steps, each one `sps-driving` command
with the paths it reads (`deps`) and writes (`outs`), run in the order written.

    campaign: ood_policy
    results: docs/results/driving/ood_policy/campaign   # kept in the repository (results lines, checkpoints)
    work: runs/ood_policy                               # rebuilt from seeds (drives, feature caches)
    steps:
      drives:
        run: collect --out {work}/expert --episodes 20 --seed 0
        outs: ["{work}/expert"]
        estimate_min: 1          # stated cost before a measured one exists (min)
      cache:
        run: extract {work}/expert/episode_* --out {work}/cache --extractor-config config/road_band.yaml
        deps: ["{work}/expert", config/road_band.yaml]
        outs: ["{work}/cache"]
        estimate_min: 36
        unit_min: 1              # a unit the command resumes from (here a shard), for --budget

Paths are relative to the repository root (the folder holding the plan's `.git`, or `root:`).
`{work}` and `{results}` expand in `run`, `deps` and `outs`. A step's code is the import closure
of its command's module inside the package, and the configuration files that code names
(`code_files`); its key (`Step.code_key`) is their contents' hash with the command line's.

A step runs the checkout's code, or with `code: REVISION` (for the plan, or for one step) that
commit's: a git worktree of it under WORK/code/, which the step runs and is keyed by, so that
commits made while a campaign runs redo none of its steps until the plan's pins move.
"""

from __future__ import annotations

import ast
import hashlib
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from sps_driving.cli import COMMANDS
from sps_driving.core.resources import SOURCE_ROOT

PACKAGE = "sps_driving"
# Commands a plan may run: the steps of a long experiment, each resumable by its own rerun or --resume.
STEP_COMMANDS = ("collect", "extract", "dagger", "train", "eval", "tables", "compare", "choose")
YAML_NAME = re.compile(r"""["']([\w.-]+\.yaml)["']""")


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]  # the sps-driving command line, command first
    deps: tuple[str, ...]
    outs: tuple[str, ...]
    estimate_min: float  # stated cost of the whole step (min), until one is measured
    unit_min: float | None = None  # cost of one unit the command resumes from (min); None: not resumable in units
    code_revision: str | None = None  # the commit whose code it runs (`code:`); None: the checkout's
    code_root: Path = SOURCE_ROOT  # the source tree it runs: the checkout, or a worktree of code_revision

    @property
    def command(self) -> str:
        return self.argv[0]

    def option(self, flag: str) -> str | None:
        """The value given to `flag` on the step's command line (None: not given)."""
        for i, word in enumerate(self.argv[:-1]):
            if word == flag:
                return self.argv[i + 1]
        return None

    def code_key(self) -> str:
        """sha256 of the command line and of the contents of the code it runs (`code_files`)."""
        sha = hashlib.sha256(shlex.join(self.argv).encode())
        for path in code_files(self.command, self.code_root):
            sha.update(str(path.relative_to(self.code_root)).encode() + b"\0" + path.read_bytes())
        return sha.hexdigest()


@dataclass(frozen=True)
class Plan:
    path: Path
    name: str
    root: Path  # where the steps run and their paths start
    results: str  # kept in the repository, relative to root
    work: str  # large outputs, relative to root
    steps: tuple[Step, ...] = field(default_factory=tuple)

    def step(self, name: str) -> Step:
        for step in self.steps:
            if step.name == name:
                return step
        raise KeyError(f"plan {self.path} has no step {name!r}; its steps: {', '.join(s.name for s in self.steps)}")

    def producer(self, path: str) -> Step | None:
        """The step whose output holds `path` (itself or a folder above it)."""
        for step in self.steps:
            if any(path == out or path.startswith(out.rstrip("/") + "/") for out in step.outs):
                return step
        return None

    def upstream(self, step: Step) -> list[Step]:
        """The steps whose outputs `step` reads, in plan order."""
        producers = {self.producer(dep) for dep in step.deps} - {None}
        return [s for s in self.steps if s in producers]

    def downstream(self, step: Step) -> list[Step]:
        """The steps that read what `step` writes, directly or through others, in plan order."""
        found = {step}
        for later in self.steps[self.steps.index(step) + 1:]:
            if found & set(self.upstream(later)):
                found.add(later)
        return [s for s in self.steps if s in found and s is not step]


def load_plan(path) -> Plan:
    """Read and check a plan file; a bad plan is a ValueError naming the step and the field."""
    path = Path(path).resolve()
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict) or not isinstance(raw.get("steps"), dict) or not raw["steps"]:
        raise ValueError(f"{path}: a plan is a mapping with `campaign`, `results`, `work` and a non-empty `steps` mapping")
    for key in ("campaign", "results", "work"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise ValueError(f"{path}: `{key}` must be a non-empty string")
    root = (path.parent / raw["root"]).resolve() if "root" in raw else repository_root(path)
    names = {"work": raw["work"], "results": raw["results"]}
    pins = {}  # revision -> (commit, its worktree)

    def pinned(where: str, revision) -> dict:
        if revision is None:
            return {}
        if revision not in pins:
            pins[revision] = pinned_tree(root, raw["work"].rstrip("/"), revision, where)
        commit, tree = pins[revision]
        return {"code_revision": commit, "code_root": tree}

    plan_pin = pinned(f"{path}: code", raw.get("code"))
    steps, outs_seen = [], {}
    for name, spec in raw["steps"].items():
        code = spec.get("code") if isinstance(spec, dict) else None
        steps.append(_step(path, name, spec, names, pinned(f"{path}: step {name}: code", code) if code else plan_pin))
        for out in steps[-1].outs:
            for other, taken in outs_seen.items():
                if out == taken or out.startswith(taken + "/") or taken.startswith(out + "/"):
                    raise ValueError(f"{path}: step {name}: output {out} overlaps step {other}'s {taken}")
            outs_seen[name if len(steps[-1].outs) == 1 else f"{name}:{out}"] = out
    plan = Plan(path, raw["campaign"], root, raw["results"].rstrip("/"), raw["work"].rstrip("/"), tuple(steps))
    for i, step in enumerate(plan.steps):
        for dep in step.deps:
            producer = plan.producer(dep)
            if producer is not None and plan.steps.index(producer) >= i:
                raise ValueError(f"{path}: step {step.name} reads {dep}, which step {producer.name} writes after it")
    return plan


def _step(path: Path, name: str, spec, names: dict, code: dict) -> Step:
    where = f"{path}: step {name}"
    if not isinstance(spec, dict) or not isinstance(spec.get("run"), str):
        raise ValueError(f"{where}: needs `run`, an sps-driving command line")
    unknown = set(spec) - {"run", "deps", "outs", "estimate_min", "unit_min", "code"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")

    def expand(text: str) -> str:
        try:
            return text.format(**names)
        except (KeyError, IndexError) as exc:
            raise ValueError(f"{where}: {text!r} names {exc}, not one of {{work}}, {{results}}") from None

    argv = tuple(shlex.split(expand(spec["run"])))
    if not argv or argv[0] not in STEP_COMMANDS:
        raise ValueError(f"{where}: `run` must start with one of {', '.join(STEP_COMMANDS)}, got {spec['run']!r}")
    outs = tuple(expand(p).rstrip("/") for p in spec.get("outs") or ())
    if not outs:
        raise ValueError(f"{where}: needs `outs`, the paths it writes")
    estimate = spec.get("estimate_min")
    if not isinstance(estimate, (int, float)) or estimate <= 0:
        raise ValueError(f"{where}: `estimate_min` must be a positive number of minutes")
    unit = spec.get("unit_min")
    if unit is not None and (not isinstance(unit, (int, float)) or not 0 < unit <= estimate):
        raise ValueError(f"{where}: `unit_min` must be a positive number of minutes, at most estimate_min")
    if code and "--graph" in argv:
        raise ValueError(f"{where}: `code` pins what the step runs, and --graph starts ROS nodes from the checkout "
                         "instead: leave this step unpinned")
    return Step(name, argv, tuple(expand(p).rstrip("/") for p in spec.get("deps") or ()), outs, float(estimate),
                None if unit is None else float(unit), **code)


def repository_root(path: Path) -> Path:
    """The nearest folder above `path` that holds `.git`."""
    for folder in path.parents:
        if (folder / ".git").exists():
            return folder
    raise ValueError(f"{path} is not inside a git repository: give the plan a `root:`")


# ---- the code a step runs ---------------------------------------------------------------------


def pinned_tree(root: Path, work: str, revision, where: str) -> tuple[str, Path]:
    """(the commit `revision` names in the repository at `root`, a git worktree of it at
    WORK/code/COMMIT), the worktree made on first use. A worktree, not an export, so that what
    the step records as its code revision (resources.source_revision) is the pinned commit."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)

    if not (root / ".git").exists():
        raise ValueError(f"{where}: pinning code needs the repository's history, and {root} has no .git "
                         "(a copy of the files alone, as on a lent GPU machine, runs unpinned plans only)")
    if not isinstance(revision, str):  # YAML reads an abbreviated hash of digits alone as a number
        raise ValueError(f"{where}: {revision!r} is not text: write the commit quoted, \"{revision}\"")
    found = git("rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}")
    if found.returncode != 0:
        raise ValueError(f"{where}: {revision!r} is no commit of the repository at {root}")
    commit = found.stdout.strip()
    tree = root / work / "code" / commit
    ready = tree.is_dir() and git("-C", str(tree), "rev-parse", "HEAD").stdout.strip() == commit
    if not ready:  # never made, or cut short while made
        tree.parent.mkdir(parents=True, exist_ok=True)
        # Each tree is a whole checkout with its package.xml: a colcon build of the workspace skips them.
        (tree.parent / "COLCON_IGNORE").touch()
        shutil.rmtree(tree, ignore_errors=True)
        git("worktree", "prune")
        added = git("worktree", "add", "--detach", "--force", str(tree), commit)
        if added.returncode != 0:
            raise ValueError(f"{where}: could not check out {commit} at {tree}: {added.stderr.strip()}")
    return commit, tree


def code_files(command: str, root: Path = SOURCE_ROOT) -> list[Path]:
    """The package's source files (in the source tree at `root`) the command's module imports,
    directly or not (at any depth, function-level imports too), with the config/*.yaml files they
    name, sorted."""
    modules, todo = set(), [COMMANDS[command][0]]
    while todo:
        module = todo.pop()
        source = _module_file(module, root)
        if source is None or module in modules:
            continue
        modules.add(module)
        todo.extend(_imports(module, source))
    files = {_module_file(m, root) for m in modules}
    texts = "".join(path.read_text() for path in files)
    configs = {root / "config" / name for name in YAML_NAME.findall(texts)}
    return sorted(files | {p for p in configs if p.is_file()})


def _module_file(module: str, root: Path) -> Path | None:
    if module != PACKAGE and not module.startswith(PACKAGE + "."):
        return None
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(module: str, source: Path) -> list[str]:
    """Modules `source` imports (`from X import Y` also as X.Y, which may be a module); a package's
    own __init__ comes with each of its modules."""
    package = module if source.name == "__init__.py" else module.rpartition(".")[0]
    found = [package] if package else []
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return found
