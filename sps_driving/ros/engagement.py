"""The engagement history a bag records: who drove when, and why autonomy ended.

Read without ROS (sps_driving.ros.bagio) from PACMod 3 reports in the ROS 2 `pacmod3_msgs`
layout (`GlobalRpt`, every `SystemRptFloat` / `SystemRptInt` report, the `std_msgs/Bool` on
/pacmod/enabled) or, on cars run with the `topics` backend, from the vehicle interface's status
(its `vehicle_interface` status on /diagnostics, or /vehicle_interface/status in older bags), by
log time; with the speed from /vehicle/twist or the PACMod vehicle speed report when recorded.
core.monitor.AutonomyLog decides each disengagement's cause. The drive reader (sps_driving.ros.drive)
feeds it; `sps-driving interventions` counts from it, and car-bag labelling
(sps_driving.ros.car_labels) takes who drove from it.
"""

from __future__ import annotations

from sps_driving.core import topics
from sps_driving.core.monitor import AutonomyLog
from sps_driving.core.state import PACMOD_SPEED_REPORT, TWIST

GLOBAL_RPT = "pacmod3_msgs/msg/GlobalRpt"
SYSTEM_RPT_FLOAT = "pacmod3_msgs/msg/SystemRptFloat"
SYSTEM_RPT_INT = "pacmod3_msgs/msg/SystemRptInt"
SYSTEM_RPTS = (SYSTEM_RPT_FLOAT, SYSTEM_RPT_INT)
BOOL = "std_msgs/msg/Bool"
DIAGNOSTICS = "diagnostic_msgs/msg/DiagnosticArray"
VEHICLE_INTERFACE = "vehicle_interface"  # its status name on /diagnostics

# The report flags that show a fault or a timeout, per report type (pacmod3_msgs, ROS 2).
GLOBAL_FAULTS = ("pacmod_sys_fault_active", "config_fault_active")
GLOBAL_TIMEOUTS = ("user_can_timeout", "steering_can_timeout", "brake_can_timeout", "subsystem_can_timeout", "vehicle_can_timeout")
SYSTEM_FAULTS = ("command_output_fault", "input_output_fault", "output_reported_fault", "pacmod_fault", "vehicle_fault")
SYSTEM_TIMEOUTS = ("command_timeout",)
# The vehicle interface's `last_event` values by the cause they show; any other is a disable.
EVENT_CAUSES = {
    "override": "override",
    "fault": "fault",
    "can_timeout": "timeout",
    "engage_timeout": "timeout",
}
# Recordings from before the vehicle interface's status moved to /diagnostics.
OLD_VEHICLE_STATUS = "/vehicle_interface/status"
ENGAGEMENT_ROLES = ("global", "system", "enabled", "vehicle_interface")  # the roles that say who drives


def selected_topics(types: dict[str, str]) -> dict[str, str]:
    """{topic: role} of the topics that carry engagement or speed."""
    roles = {}
    for topic, msgtype in types.items():
        if msgtype == GLOBAL_RPT:
            roles[topic] = "global"
        elif msgtype in SYSTEM_RPTS:
            roles[topic] = "system"
        elif msgtype == PACMOD_SPEED_REPORT:
            roles[topic] = "speed_rpt"
        elif msgtype == BOOL and topic == topics.PACMOD_ENABLED:
            roles[topic] = "enabled"
        elif msgtype == TWIST and topic == topics.VEHICLE_TWIST:
            roles[topic] = "twist"
    if not any(r in ENGAGEMENT_ROLES[:3] for r in roles.values()):
        for topic in (topics.DIAGNOSTICS, OLD_VEHICLE_STATUS):
            if types.get(topic) == DIAGNOSTICS:
                roles[topic] = "vehicle_interface"
    # One speed source: the twist when both are recorded.
    if "twist" in roles.values():
        roles = {t: r for t, r in roles.items() if r != "speed_rpt"}
    return roles


def _set_flags(msg, names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(name for name in names if getattr(msg, name))


def _on_vehicle_interface_status(log: AutonomyLog, time_ns: int, topic: str, msg) -> None:
    """The vehicle interface's own view: `engagement` and the `last_event` that led to it. On
    /diagnostics its status is found by name; its old topic carries nothing else."""
    from sps_driving.ros.msgs import diagnostic_values

    for name, _, _, values in diagnostic_values(msg):
        if "engagement" not in values or (topic == topics.DIAGNOSTICS and name != VEHICLE_INTERFACE):
            continue
        engaged = values["engagement"] == "engaged"
        event = values.get("last_event", "")
        cause = "" if engaged else EVENT_CAUSES.get(event, "")
        label = f"last_event={event}"
        log.on_report(
            time_ns, f"{topic} {name}", engaged, cause == "override",
            faults=(label,) if cause == "fault" else (), timeouts=(label,) if cause == "timeout" else (),
            override_field=label, disabled_field=f"engagement={values['engagement']}, {label}",
        )


class EngagementReader:
    """Builds the engagement history (core.monitor.AutonomyLog) from a bag's messages fed in log-time
    order (sps_driving.ros.drive reads them); `roles` ({topic: role}, `selected_topics`) says which
    topics it takes."""

    def __init__(self, types: dict[str, str]):
        self.roles = selected_topics(types)
        self.log = AutonomyLog()

    @property
    def has_reports(self) -> bool:
        return any(r in ENGAGEMENT_ROLES for r in self.roles.values())

    @staticmethod
    def missing(where) -> str:
        """Why `where` (a bag) has no engagement history."""
        return (f"{where} has no engagement reports: expected {GLOBAL_RPT}, {' or '.join(SYSTEM_RPTS)}, {BOOL} on "
                f"{topics.PACMOD_ENABLED} or the vehicle interface status on {topics.DIAGNOSTICS} or {OLD_VEHICLE_STATUS}")

    def feed(self, topic: str, t: int, msg) -> None:
        role, log = self.roles[topic], self.log
        if role == "global":
            log.on_report(
                t, topic, bool(msg.enabled), bool(msg.override_active),
                _set_flags(msg, GLOBAL_FAULTS), _set_flags(msg, GLOBAL_TIMEOUTS),
            )
        elif role == "system":  # a system's own `enabled` is not the car's: GlobalRpt says any system
            log.on_report(
                t, topic, None, bool(msg.override_active),
                _set_flags(msg, SYSTEM_FAULTS), _set_flags(msg, SYSTEM_TIMEOUTS),
            )
        elif role == "enabled":
            log.on_report(t, topic, bool(msg.data), None, disabled_field="data=false")
        elif role == "vehicle_interface":
            _on_vehicle_interface_status(log, t, topic, msg)
        elif role == "twist":
            log.on_speed(t, float(msg.twist.linear.x))
        elif role == "speed_rpt" and msg.vehicle_speed_valid:
            log.on_speed(t, float(msg.vehicle_speed))

    def finish(self) -> AutonomyLog:
        self.log.finish()
        return self.log
