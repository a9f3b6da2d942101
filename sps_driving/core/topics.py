"""Default topic names and message types: the one place that knows them.

Nodes take every topic as a remappable name (`--ros-args -r old:=new`); recorded bags from
the car and from the simulator use these names so the same tools read both.

Conventions (units, signs):
- steering: front road-wheel angle in rad, positive turns left (REP 103). The vehicle
  interface converts it to a steering-wheel angle through the configured steering ratio.
- throttle: longitudinal effort in [-1, 1]; positive is accelerator pedal, negative is brake.
- commands travel as sensor_msgs/JointState with name = COMMAND_NAMES and position = values,
  stamped with the camera frame's stamp they were computed from.
- lane state travels as geometry_msgs/PoseStamped: the vehicle's pose in the lane frame
  (position.y = lateral offset from the lane centre in m, left positive; yaw = heading error).
- nearest obstacle travels as sensor_msgs/Range: range = free gap to the nearest obstacle in m.
"""

IMAGE = "/camera/image_raw"  # sensor_msgs/Image
# sensor_msgs/CompressedImage (format "rgb8; jpeg compressed bgr8"): the camera as `record` keeps it, the name
# image_transport's compressed republisher gives IMAGE; every bag command reads it where IMAGE is not recorded
IMAGE_COMPRESSED = IMAGE + "/compressed"
CAMERA_INFO = "/camera/camera_info"  # sensor_msgs/CameraInfo, one per image, same stamp
SELECTION = "/sps/selection"  # sensor_msgs/Image mono8 H'xW', 255 = patch computed
DESCRIPTORS = "/sps/descriptors"  # computed descriptors with their patch indices
POLICY_COMMAND = "/sps/command"  # sensor_msgs/JointState: the policy's output
# sensor_msgs/Image rgb8: the camera frame with the policy's kept patches outlined, the dropped ones dimmed and
# each kept patch tinted by its attribution; the frame's stamp; only when the policy node's publish_overlay is true
POLICY_OVERLAY = "/policy/overlay"
REFERENCE_COMMAND = "/vehicle/command"  # sensor_msgs/JointState: the command that drove the car (driver/expert)
VEHICLE_TWIST = "/vehicle/twist"  # geometry_msgs/TwistStamped, linear.x = speed m/s
# geometry_msgs/TwistStamped, linear.x = the cruise target speed in m/s that the safety driver set (as for
# adaptive cruise control); republished while it holds (the policy node's max_target_speed_age_s)
TARGET_SPEED = "/vehicle/target_speed"
LANE_POSE = "/lane/pose"  # geometry_msgs/PoseStamped in the lane frame
OBSTACLE_RANGE = "/obstacles/nearest"  # sensor_msgs/Range
DIAGNOSTICS = "/diagnostics"  # diagnostic_msgs/DiagnosticArray: every node's status (rqt_robot_monitor, aggregator)
SAFETY_STOP = "/safety/stop_request"  # stop request (msgs.stop_request_message) from the safety monitor
FAILSAFE_STATUS = "/failsafe/status"  # stop request (msgs.stop_request_message) from the failsafe: stop = it took over
ACTUATION = "/vehicle_interface/command"  # sensor_msgs/JointState every control period: the limited command to the car
ENGAGE_SERVICE = "/vehicle_interface/engage"  # std_srvs/SetBool: true engages drive-by-wire, false disengages
REARM_SERVICE = "/vehicle_interface/rearm"  # std_srvs/Trigger: clears the lockout after an override
VEHICLE_OVERRIDE = "/vehicle/override"  # std_msgs/Bool: driver override on a car without PACMod ("topics" backend)
SAFETY_EVENTS = "/safety/events"  # diagnostic_msgs/DiagnosticArray: one message per failure onset
# std_msgs/String: the safety driver's short note on what just happened ("precautionary", "system", ...),
# published during a field test and recorded; `interventions` shows it beside the event it follows
DRIVER_NOTE = "/safety_driver/note"
# diagnostic_msgs/DiagnosticArray, level ERROR: one message per handover the safety monitor requests (message
# HANDOVER_EVENT; values score, handovers = requests so far); a request, not a failure
HANDOVER_EVENTS = "/safety/handover_events"
HANDOVER_EVENT = "requested_handover"
# sensor_msgs/JointState, name = [the score's method], position = [score]: the OOD score of the kept patches
# (sps_driving.core.ood; 1.0 = the 99th percentile of held-out training frames), the camera frame's stamp
OOD_SCORE = "/sps/ood_score"
# std_msgs/Float32 in (0, 1]: the safety monitor's OOD rule; the vehicle interface caps the speed at this fraction of the cruise target
CRUISE_SCALE = "/safety/cruise_scale"
# std_msgs/Bool at the safety monitor's rate: true while it asks the safety driver to take over (for the HMI to sound)
HANDOVER_REQUEST = "/safety/handover_request"
STAGE_TIMING = "/sps/timing"  # diagnostic_msgs/DiagnosticArray per frame and stage: compute time, frame's stamp

# PACMod 3 drive-by-wire (astuff/pacmod3 driver in namespace "pacmod"; pacmod3_msgs, ROS 2 layout).
PACMOD_STEERING_CMD = "/pacmod/steering_cmd"  # SteeringCmd: steering-wheel angle rad, rotation_rate rad/s
PACMOD_ACCEL_CMD = "/pacmod/accel_cmd"  # SystemCmdFloat: accelerator pedal 0..1
PACMOD_BRAKE_CMD = "/pacmod/brake_cmd"  # SystemCmdFloat: brake pedal 0..1
PACMOD_TURN_CMD = "/pacmod/turn_cmd"  # SystemCmdInt: TURN_HAZARDS during a controlled stop
PACMOD_GLOBAL_RPT = "/pacmod/global_rpt"  # GlobalRpt: enabled (any system), override, faults, CAN timeouts
PACMOD_STEERING_RPT = "/pacmod/steering_rpt"  # SystemRptFloat: output = measured steering-wheel angle rad
PACMOD_ACCEL_RPT = "/pacmod/accel_rpt"  # SystemRptFloat: output = accelerator pedal 0..1
PACMOD_BRAKE_RPT = "/pacmod/brake_rpt"  # SystemRptFloat: output = brake pedal 0..1
PACMOD_TURN_RPT = "/pacmod/turn_rpt"  # SystemRptInt
PACMOD_SHIFT_RPT = "/pacmod/shift_rpt"  # SystemRptInt: output = gear (SHIFT_REVERSE, SHIFT_FORWARD, ...)
PACMOD_SPEED_RPT = "/pacmod/vehicle_speed_rpt"  # VehicleSpeedRpt: vehicle_speed m/s, vehicle_speed_valid
PACMOD_ENABLED = "/pacmod/enabled"  # std_msgs/Bool
PACMOD_COMMANDS = {
    "steering": PACMOD_STEERING_CMD, "accel": PACMOD_ACCEL_CMD, "brake": PACMOD_BRAKE_CMD, "turn": PACMOD_TURN_CMD,
}
PACMOD_SYSTEM_REPORTS = {"steering": PACMOD_STEERING_RPT, "accel": PACMOD_ACCEL_RPT, "brake": PACMOD_BRAKE_RPT}

COMMAND_NAMES = ("steering", "throttle")
