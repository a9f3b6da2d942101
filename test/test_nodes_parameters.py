"""Node parameters over real DDS: values typed the way launch arguments and YAML type them start the
node, a value that is not allowed stops it with one line, and every parameter is described and
read-only to `ros2 param` (its services, called from a test node)."""

import pytest
from rcl_interfaces.msg import Parameter as ParameterMsg
from rcl_interfaces.msg import ParameterType, ParameterValue
from rcl_interfaces.srv import DescribeParameters, GetParameters, SetParameters
from ros_helpers import Probe

from sps_driving.ros.graph import Graph, wait_for_nodes
from sps_driving.ros.nodes.common import Param
from sps_driving.ros.process import CANNOT_START

pytestmark = pytest.mark.ros


@pytest.fixture
def probe():
    p = Probe("parameter_probe")
    yield p
    p.close()


def call(probe: Probe, srv_type, service: str, request):
    client = probe.node.create_client(srv_type, service)
    assert client.wait_for_service(timeout_sec=20), f"no {service}"
    future = client.call_async(request)
    assert probe.spin_until(future.done, 20), f"{service} did not answer"
    probe.node.destroy_client(client)
    return future.result()


def test_an_int_for_a_number_and_for_a_string_start_the_node_and_every_parameter_is_read_only(tmp_path, probe):
    overrides = {"selection": {"rate": 1}, "camera_driver": {"source": 0, "reconnect_interval_s": 5.0}}
    with Graph(["selection", "camera_driver"], parameters=overrides, log_dir=tmp_path) as graph:
        wait_for_nodes(probe.node, graph.nodes, 30, graph)
        rate, = call(probe, GetParameters, "/selection/get_parameters", GetParameters.Request(names=["rate"])).values
        assert (rate.type, rate.double_value) == (ParameterType.PARAMETER_DOUBLE, 1.0)
        # "0" is a V4L2 index: the driver opens it (or retries while there is no camera).
        source, = call(probe, GetParameters, "/camera_driver/get_parameters", GetParameters.Request(names=["source"])).values
        assert (source.type, source.string_value) == (ParameterType.PARAMETER_STRING, "0")

        described, = call(probe, DescribeParameters, "/selection/describe_parameters",
                          DescribeParameters.Request(names=["rate"])).descriptors
        assert described.read_only and described.type == ParameterType.PARAMETER_DOUBLE
        assert described.description.endswith("[fraction]") and described.additional_constraints == "a finite number > 0 and <= 1"
        assert (described.floating_point_range[0].from_value, described.floating_point_range[0].to_value) == (0.0, 1.0)

        change = ParameterMsg(name="rate", value=ParameterValue(type=ParameterType.PARAMETER_DOUBLE, double_value=0.25))
        result, = call(probe, SetParameters, "/selection/set_parameters", SetParameters.Request(parameters=[change])).results
        assert not result.successful and "read-only" in result.reason
        rate, = call(probe, GetParameters, "/selection/get_parameters", GetParameters.Request(names=["rate"])).values
        assert rate.double_value == 1.0
        assert graph.alive("selection") and graph.alive("camera_driver")
    assert "sps rate 1.0 seed 0 on 16x16 (parameters)" in graph.log("selection")
    for name in graph.nodes:
        assert "Traceback" not in graph.log(name), graph.log(name)


@pytest.mark.parametrize("node,overrides,line", [
    ("selection", {"rate": 1.5}, "[selection] cannot start: parameter rate of /selection is 1.5; allowed: a finite number > 0 and <= 1"),
    ("selection", {"variant": "random"},
     "[selection] cannot start: parameter variant of /selection is 'random'; allowed: one of 'sps', 'threshold', 'spps', 'mspps'"),
    ("camera_driver", {"width": "wide"},
     "[camera_driver] cannot start: parameter width of /camera_driver is 'wide' (a string); allowed: an integer >= 1"),
])
def test_a_value_not_allowed_stops_the_node_with_one_line(tmp_path, node, overrides, line):
    with Graph([node], parameters={node: overrides}, log_dir=tmp_path) as graph:
        assert graph.returncode(node, wait_s=30) == CANNOT_START, graph.log(node)
    log = graph.log(node)
    assert line in log.splitlines() and "Traceback" not in log, log


def test_declare_converts_refuses_and_describes_in_process():
    """The same declaration without processes, for a table of Params and one of plain defaults."""
    import rclpy
    from rclpy.node import Node
    from rclpy.parameter import Parameter

    from sps_driving.ros.nodes.common import declare

    table = {"gain": Param(0.5, "how much", "m/s", min=0.0), "name": "a", "count": 3, "inputs": ["lane"], "on": False}
    context = rclpy.Context()
    rclpy.init(context=context)
    try:
        def declared(**overrides):
            node = Node("declare_test", context=context, parameter_overrides=[Parameter(k, value=v) for k, v in overrides.items()])
            try:
                return declare(node, table), {name: node.describe_parameter(name) for name in table}
            finally:
                node.destroy_node()

        values, descriptors = declared(gain=2, name=7)
        assert values == {"gain": 2.0, "name": "7", "count": 3, "inputs": ["lane"], "on": False}
        assert type(values["gain"]) is float
        assert descriptors["gain"].description == "how much [m/s]" and descriptors["gain"].floating_point_range[0].to_value == float("inf")
        assert all(d.read_only for d in descriptors.values())
        assert descriptors["inputs"].type == ParameterType.PARAMETER_STRING_ARRAY
        for overrides, message in [
            ({"gain": -1.0}, "parameter gain of /declare_test is -1.0; allowed: a finite number >= 0"),
            ({"gain": float("nan")}, "parameter gain of /declare_test is nan; allowed: a finite number >= 0"),
            ({"count": 2.5}, "parameter count of /declare_test is 2.5 (a number); allowed: an integer"),
            ({"on": 1}, "parameter on of /declare_test is 1 (an integer); allowed: a boolean (true or false)"),
            ({"inputs": [1, 2]}, "parameter inputs of /declare_test is [1, 2] (a list of integers); allowed: a list of strings"),
        ]:
            with pytest.raises(ValueError) as error:
                declared(**overrides)
            assert str(error.value) == message
    finally:
        rclpy.try_shutdown(context=context)


def test_a_param_must_allow_its_own_default_and_bounds_fit_its_type():
    with pytest.raises(ValueError, match="allowed: one of 'a', 'b'"):
        Param("c", choices=("a", "b"))
    with pytest.raises(TypeError):
        Param("x", min=0)
    with pytest.raises(TypeError):
        Param(3, above=0)
