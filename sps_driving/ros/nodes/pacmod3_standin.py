"""pacmod3_standin: the PACMod 3 driver and the car behind it, for tests, `sps-driving faults` and
bench checks without a car. Same topics, message types and QoS as the AutonomouStuff driver
(namespace /pacmod): it latches each command and re-sends it every period from its own timer, and
publishes global_rpt, steering_rpt, accel_rpt, brake_rpt, turn_rpt, shift_rpt, vehicle_speed_rpt and
enabled. Behaviour: sps_driving.sim.pacmod.

Fault injection, each a std_srvs/SetBool service of this node: ~/override (the safety driver takes
the wheel and pedals; false lets go), ~/fault (a PACMod system fault), ~/can_timeout (CAN timeout
flags in the global report), ~/pause_reports (reports stop while true) and ~/reverse (the gear in
reverse while true). What the driver re-sends to the car every period, as the PACMod reads it
from the driver's CAN frames (sps_driving.sim.pacmod_can), goes out on ~/sent (sent_message),
so a test can see it; the reports are what the driver parses from the car's frames (values in
steps of 0.001, the speed in steps of 0.01 m/s).
"""

from __future__ import annotations

import time

from rclpy.clock import Clock, ClockType
from rclpy.node import Node
from sensor_msgs.msg import JointState
from std_msgs.msg import Bool
from std_srvs.srv import SetBool

from sps_driving.core import topics
from sps_driving.ros import msgs
from sps_driving.ros.nodes.common import Param, declare, now_ns, run
from sps_driving.sim import pacmod_can
from sps_driving.sim.pacmod import SHIFT_FORWARD, SHIFT_REVERSE, TURN_NONE, PacmodStandIn, Sent, SystemReport

PARAMETERS = {
    "rate_hz": Param(30.0, "re-send and report rate (the driver re-sends every 33 ms)", "Hz", above=0.0),
    "max_accel_mps2": Param(2.0, "acceleration at full accelerator", "m/s^2", above=0.0),
    "max_decel_mps2": Param(6.0, "deceleration at full brake", "m/s^2", above=0.0),
    "initial_speed_mps": Param(0.0, "speed at start", "m/s", min=0.0),
}
REPORTS = {"steering": topics.PACMOD_STEERING_RPT, "accel": topics.PACMOD_ACCEL_RPT, "brake": topics.PACMOD_BRAKE_RPT}


def sent_message(sent: Sent, stamp: int) -> JointState:
    """The frame to the car of one period as published on ~/sent: a JointState with names
    "<system>.enable" and "<system>.command", positions their values."""
    names, values = [], []
    for system in sent.enable:
        names += [f"{system}.enable", f"{system}.command"]
        values += [float(sent.enable[system]), float(sent.command[system])]
    return JointState(header=msgs.to_ros(msgs.header_fields(stamp, "pacmod")), name=names, position=values)


def sent_from_message(msg: JointState, time_s: float) -> Sent:
    """The Sent of a ~/sent message, with `time_s` as its time (when it was received)."""
    values = dict(zip(msg.name, msg.position))
    systems = [name[: -len(".enable")] for name in msg.name if name.endswith(".enable")]
    return Sent(time_s, {s: bool(values[f"{s}.enable"]) for s in systems}, {s: float(values[f"{s}.command"]) for s in systems})


class PacmodStandInNode(Node):
    NODE_NAME = "pacmod3_standin"

    def __init__(self):
        super().__init__(self.NODE_NAME)
        p = declare(self, PARAMETERS)
        try:
            from pacmod3_msgs import msg as pacmod
        except ImportError as exc:
            raise ValueError("pacmod3_standin needs pacmod3_msgs (`make setup` builds it on machines without a ROS distro)") from exc
        self.pacmod = pacmod
        self.model = PacmodStandIn(float(p["max_accel_mps2"]), float(p["max_decel_mps2"]))
        self.model.speed_mps = float(p["initial_speed_mps"])
        self.period_s = 1.0 / float(p["rate_hz"])
        driver = msgs.qos("driver")
        types = {"steering": pacmod.SteeringCmd, "accel": pacmod.SystemCmdFloat, "brake": pacmod.SystemCmdFloat,
                 "turn": pacmod.SystemCmdInt}
        for system, topic in topics.PACMOD_COMMANDS.items():
            self.create_subscription(types[system], topic, self._command_callback(system), driver)
        self.report_pubs = {system: self.create_publisher(pacmod.SystemRptFloat, topic, driver) for system, topic in REPORTS.items()}
        self.turn_pub = self.create_publisher(pacmod.SystemRptInt, topics.PACMOD_TURN_RPT, driver)
        self.shift_pub = self.create_publisher(pacmod.SystemRptInt, topics.PACMOD_SHIFT_RPT, driver)
        self.global_pub = self.create_publisher(pacmod.GlobalRpt, topics.PACMOD_GLOBAL_RPT, driver)
        self.speed_pub = self.create_publisher(pacmod.VehicleSpeedRpt, topics.PACMOD_SPEED_RPT, driver)
        from rclpy.qos import DurabilityPolicy, QoSProfile

        latched = QoSProfile(depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL)
        self.enabled_pub = self.create_publisher(Bool, topics.PACMOD_ENABLED, latched)
        self.sent_pub = self.create_publisher(JointState, "~/sent", msgs.qos("status"))
        for name in ("override", "fault", "can_timeout", "pause_reports", "reverse"):
            self.create_service(SetBool, f"~/{name}", self._injection(name))
        self._last_s = None
        self.create_timer(self.period_s, self._tick, clock=Clock(clock_type=ClockType.STEADY_TIME))

    def _command_callback(self, system: str):
        def on_command(msg) -> None:
            self.model.on_command(system, msg.enable, msg.ignore_overrides, msg.clear_override, float(msg.command),
                                  float(getattr(msg, "rotation_rate", 0.0)))

        return on_command

    def inject(self, name: str, active: bool) -> None:
        if name == "override":
            self.model.override(None, active)
        elif name == "fault":
            self.model.fault = active
        elif name == "can_timeout":
            self.model.can_timeout = active
        elif name == "pause_reports":
            self.model.reports_paused = active
        elif name == "reverse":
            self.model.gear = SHIFT_REVERSE if active else SHIFT_FORWARD
        else:
            raise ValueError(f"unknown fault {name!r}")
        self.get_logger().warning(f"injected {name} = {active}")

    def _injection(self, name: str):
        def on_request(request, response):
            self.inject(name, bool(request.data))
            response.success, response.message = True, f"{name} {bool(request.data)}"
            return response

        return on_request

    def _tick(self) -> None:
        now_s = time.monotonic()
        dt = self.period_s if self._last_s is None else min(now_s - self._last_s, 3 * self.period_s)
        self._last_s = now_s
        sent = self.model.step(now_s, dt)
        reports = self.model.reports()
        self.sent_pub.publish(sent_message(sent, now_ns(self)))
        if reports is not None:
            self._publish(reports)

    def _publish(self, reports) -> None:
        """Each report as the driver publishes it: the fields it parses from the car's CAN frame."""
        pacmod = self.pacmod
        header = msgs.to_ros(msgs.header_fields(now_ns(self), "pacmod"))

        def as_driver_reads(frame) -> dict:
            return dict(header=header, **pacmod_can.decode_report(*frame))

        def system_frame(system: str, r: SystemReport, manual_input: float, command: float, output: float):
            return pacmod_can.encode_report(system, manual_input, command, output, enabled=r.enabled,
                                            override_active=r.override_active, pacmod_fault=r.pacmod_fault)

        for system, publisher in self.report_pubs.items():
            r = reports.systems[system]
            publisher.publish(pacmod.SystemRptFloat(**as_driver_reads(system_frame(system, r, r.manual_input, r.command, r.output))))
        turn = reports.systems["turn"]
        self.turn_pub.publish(pacmod.SystemRptInt(**as_driver_reads(system_frame("turn", turn, TURN_NONE, turn.command, turn.output))))
        gear = reports.gear  # the human's: the shift system is never enabled
        self.shift_pub.publish(pacmod.SystemRptInt(**as_driver_reads(system_frame("shift", SystemReport(), gear, gear, gear))))
        t = reports.can_timeout
        self.global_pub.publish(pacmod.GlobalRpt(**as_driver_reads(pacmod_can.encode_global_report(
            enabled=reports.enabled, override_active=reports.override_active, user_can_timeout=t, steering_can_timeout=t,
            brake_can_timeout=t, subsystem_can_timeout=t, vehicle_can_timeout=t,
            pacmod_sys_fault_active=reports.pacmod_sys_fault_active))))
        self.speed_pub.publish(pacmod.VehicleSpeedRpt(**as_driver_reads(
            pacmod_can.encode_speed_report(reports.vehicle_speed, reports.vehicle_speed_valid))))
        self.enabled_pub.publish(Bool(data=reports.enabled))


def main(args=None) -> int:
    return run(PacmodStandInNode, args)


if __name__ == "__main__":
    raise SystemExit(main())
