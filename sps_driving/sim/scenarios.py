"""The scenarios of SPS Table 1 and the road actors that populate them.

A scenario name joins its five axes: scene-season-weather-time-actor, e.g.
"rural-summer-dry-day-car" (the in-distribution training scenario). Actor "car" means car
types seen in training; "unseencar" the paper's Car-dagger (car types never seen in training);
"animal" animals on the road.
"""

from __future__ import annotations

from dataclasses import dataclass

SCENES = ("rural", "urban")
SEASONS = ("spring", "summer", "fall", "winter")
WEATHERS = ("dry", "rain", "snow")
TIMES = ("day", "night")
ACTORS = ("car", "unseencar", "animal")


@dataclass(frozen=True)
class Scenario:
    scene: str
    season: str
    weather: str
    time: str
    actor: str

    def __post_init__(self) -> None:
        for axis, allowed in (("scene", SCENES), ("season", SEASONS), ("weather", WEATHERS), ("time", TIMES), ("actor", ACTORS)):
            if getattr(self, axis) not in allowed:
                raise ValueError(f"unknown {axis} {getattr(self, axis)!r}; expected one of {allowed}")

    @property
    def name(self) -> str:
        return f"{self.scene}-{self.season}-{self.weather}-{self.time}-{self.actor}"

    @property
    def label(self) -> str:
        """As Table 1 writes it; the dagger marks car types never seen in training."""
        actor = {"car": "Car", "unseencar": "Car†", "animal": "Animal"}[self.actor]
        return " ".join(a.capitalize() for a in (self.scene, self.season, self.weather, self.time)) + " " + actor

    @property
    def in_distribution(self) -> bool:
        return self == ID_SCENARIO


ID_SCENARIO = Scenario("rural", "summer", "dry", "day", "car")

# Table 1's rows in order: the in-distribution row, then the 14 out-of-distribution rows.
SCENARIOS: tuple[Scenario, ...] = (
    ID_SCENARIO,
    Scenario("rural", "spring", "dry", "day", "unseencar"),
    Scenario("rural", "summer", "dry", "night", "unseencar"),
    Scenario("rural", "fall", "dry", "day", "unseencar"),
    Scenario("rural", "winter", "snow", "day", "unseencar"),
    Scenario("rural", "spring", "dry", "day", "animal"),
    Scenario("rural", "summer", "dry", "night", "animal"),
    Scenario("rural", "fall", "dry", "day", "animal"),
    Scenario("rural", "winter", "snow", "day", "animal"),
    Scenario("urban", "summer", "dry", "day", "unseencar"),
    Scenario("urban", "summer", "rain", "day", "unseencar"),
    Scenario("urban", "summer", "dry", "night", "unseencar"),
    Scenario("urban", "summer", "dry", "day", "animal"),
    Scenario("urban", "summer", "rain", "day", "animal"),
    Scenario("urban", "summer", "dry", "night", "animal"),
)
SCENARIO_NAMES = tuple(s.name for s in SCENARIOS)
OOD_SCENARIO_NAMES = tuple(s.name for s in SCENARIOS if not s.in_distribution)


def get_scenario(name: str) -> Scenario:
    """A scenario by name; any combination of the axes is accepted, not only Table 1's rows."""
    parts = name.split("-")
    if len(parts) != 5:
        raise ValueError(f"scenario {name!r} must read scene-season-weather-time-actor, e.g. {ID_SCENARIO.name!r}")
    return Scenario(*parts)


@dataclass(frozen=True)
class ActorModel:
    """A road actor's body: footprint (m) for the failure rules, shape for the renderer."""

    name: str
    shape: str  # renderer mesh family: sedan, suv, hatchback, pickup, van, boxtruck, bus, deer, cow, dog, moose
    length_m: float
    width_m: float
    height_m: float
    colors: tuple[tuple[float, float, float], ...]  # body colours (RGB 0..1) drawn per actor


_TRAIN_PAINT = ((0.85, 0.85, 0.87), (0.55, 0.57, 0.6), (0.08, 0.08, 0.1), (0.6, 0.08, 0.08), (0.1, 0.2, 0.5))
_UNSEEN_PAINT = ((0.95, 0.75, 0.1), (0.95, 0.45, 0.05), (0.15, 0.5, 0.2), (0.45, 0.15, 0.55), (0.1, 0.6, 0.7))

# Car types of the training scenario.
TRAINING_CARS = (
    ActorModel("sedan", "sedan", 4.7, 1.8, 1.45, _TRAIN_PAINT),
    ActorModel("suv", "suv", 4.8, 1.9, 1.75, _TRAIN_PAINT),
    ActorModel("hatchback", "hatchback", 4.1, 1.75, 1.5, _TRAIN_PAINT),
)
# Car types never seen in training: other silhouettes and paints.
UNSEEN_CARS = (
    ActorModel("pickup", "pickup", 5.6, 2.0, 1.9, _UNSEEN_PAINT),
    ActorModel("van", "van", 5.2, 2.0, 2.3, _UNSEEN_PAINT),
    ActorModel("box_truck", "boxtruck", 7.5, 2.4, 3.2, _UNSEEN_PAINT),
    ActorModel("bus", "bus", 10.5, 2.5, 3.1, _UNSEEN_PAINT),
)
ANIMALS = (
    ActorModel("deer", "deer", 1.6, 0.5, 1.5, ((0.55, 0.35, 0.18), (0.45, 0.3, 0.2))),
    ActorModel("cow", "cow", 2.3, 0.8, 1.5, ((0.12, 0.1, 0.1), (0.55, 0.3, 0.15), (0.9, 0.88, 0.85))),
    ActorModel("moose", "moose", 2.6, 0.9, 2.1, ((0.25, 0.17, 0.1),)),
    ActorModel("dog", "dog", 1.0, 0.35, 0.7, ((0.75, 0.6, 0.35), (0.15, 0.12, 0.1))),
)


def road_actor_models(scenario: Scenario) -> tuple[ActorModel, ...]:
    """Models for the obstacles at the ego lane's edge."""
    return {"car": TRAINING_CARS, "unseencar": UNSEEN_CARS, "animal": ANIMALS}[scenario.actor]


def traffic_models(scenario: Scenario) -> tuple[ActorModel, ...]:
    """Models for oncoming traffic in the other lane (cars even where the obstacles are animals)."""
    return UNSEEN_CARS if scenario.actor == "unseencar" else TRAINING_CARS
