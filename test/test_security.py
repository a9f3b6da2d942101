"""The SROS2 access control of the car graph (security/policy.xml):
- the ROS-name -> DDS-topic translation of the generator, on a small policy written by hand;
- the car policy's rules: who may publish the drive-by-wire commands, the stop request, the
  policy command, the camera topics, and call the engage/re-arm services (DDS topic patterns
  matched as DDS Security matches them, with fnmatch);
- the nodes as real processes: every endpoint each creates is allowed to its enclave, else it
  could not start under enforcement;
- the keystore built with openssl by scripts/create_keystore.sh: layout, certificates, S/MIME
  signatures, and each enclave's signed permissions equal to the policy;
- enforcement over real secured rclpy processes, where the installed rmw has DDS Security or
  scripts/build_rmw_cyclonedds.sh has built rmw_cyclonedds_cpp for this venv.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
from ros_helpers import Probe
from samples import tiny_policy

from sps_driving.core import topics
from sps_driving.core.state import STATE_NAMES
from sps_driving.ros import security
from sps_driving.ros.graph import Graph, wait_for_nodes, wait_for_topics

ROOT = Path(__file__).resolve().parent.parent
POLICY = ROOT / "security" / "policy.xml"
SCRIPT = ROOT / "scripts" / "create_keystore.sh"
PEER = Path(__file__).resolve().parent / "security_peer.py"
SPS_NODES = ("camera_driver", "selection", "extractor", "policy", "vehicle_interface", "safety_monitor")


@pytest.fixture(scope="module")
def policy():
    return security.load_policy(POLICY)


def allowed(policy, enclave, direction):
    return security.rules(policy, enclave)["ALLOW"][direction]


def may(policy, enclave, direction, dds_topic):
    """Whether the enclave may publish/subscribe the DDS topic: allowed by a pattern, not denied."""
    grant = security.rules(policy, enclave)
    if any(fnmatchcase(dds_topic, p) for p in grant["DENY"][direction]):
        return False
    return any(fnmatchcase(dds_topic, p) for p in grant["ALLOW"][direction])


def publishers(policy, dds_topic):
    return {e.rsplit("/", 1)[1] for e in security.enclave_paths(policy) if may(policy, e, "publish", dds_topic)}


# --- translation -------------------------------------------------------------------------------


def test_ros_names_become_dds_topics_as_in_rmw(tmp_path):
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "log.xml").write_text(
        '<profile><topics publish="ALLOW"><topic>rosout</topic></topics></profile>'
    )
    (tmp_path / "policy.xml").write_text(
        """<policy version="0.2.0" xmlns:xi="http://www.w3.org/2001/XInclude"><enclaves>
        <enclave path="/car/driver"><profiles><profile ns="/vehicle" node="driver">
          <xi:include href="common/log.xml" xpointer="xpointer(/profile/*)"/>
          <topics publish="ALLOW" subscribe="ALLOW"><topic>cmd</topic><topic>/abs/x</topic></topics>
          <topics subscribe="ALLOW"><topic>~/private</topic></topics>
          <services reply="ALLOW"><service>~/set</service></services>
          <services request="ALLOW"><service>/other/get</service></services>
          <topics publish="DENY"><topic>/abs/*</topic></topics>
        </profile></profiles></enclave></enclaves></policy>"""
    )
    grant = security.rules(security.load_policy(tmp_path / "policy.xml"), "/car/driver")
    assert grant["ALLOW"]["publish"] == {
        "rt/vehicle/rosout", "rt/vehicle/cmd", "rt/abs/x", "rr/vehicle/driver/setReply", "rq/other/getRequest",
        "ros_discovery_info",
    }
    assert grant["ALLOW"]["subscribe"] == {
        "rt/vehicle/cmd", "rt/abs/x", "rt/vehicle/driver/private", "rq/vehicle/driver/setRequest",
        "rr/other/getReply", "ros_discovery_info",
    }
    assert grant["DENY"] == {"publish": {"rt/abs/*"}, "subscribe": set()}

    document = ET.fromstring(security.permissions_xml(security.load_policy(tmp_path / "policy.xml"), "/car/driver", 42, "a", "b"))
    grant_element = document.find("permissions/grant")
    assert grant_element.get("name") == "/car/driver"
    assert grant_element.findtext("subject_name") == "CN=/car/driver"
    # Deny rules come before allow rules, and the default denies.
    assert [child.tag for child in grant_element] == ["subject_name", "validity", "deny_rule", "allow_rule", "default"]
    assert grant_element.findtext("default") == "DENY"
    assert {e.text for e in grant_element.iter("id")} == {"42"}


# --- the car policy ----------------------------------------------------------------------------


def test_every_car_process_has_its_enclave(policy):
    enclaves = security.enclave_paths(policy)
    assert len(enclaves) == len(set(enclaves))
    assert {security.enclave_of(n) for n in (*SPS_NODES, "failsafe", "pacmod3_driver", "operator")} <= set(enclaves)


@pytest.mark.parametrize(
    "dds_topic, allowed_publishers",
    [
        ("rt/pacmod/accel_cmd", {"vehicle_interface", "failsafe"}),
        ("rt/pacmod/brake_cmd", {"vehicle_interface", "failsafe"}),
        ("rt/pacmod/steering_cmd", {"vehicle_interface", "failsafe"}),
        ("rt/pacmod/turn_cmd", {"vehicle_interface", "failsafe"}),
        ("rt/pacmod/shift_cmd", set()),
        ("rt/pacmod/headlight_cmd", set()),
        ("rt/pacmod/to_can_bus", {"pacmod3_driver"}),  # raw CAN frames to the car
        ("rt" + topics.SAFETY_STOP, {"safety_monitor"}),
        ("rt" + topics.POLICY_COMMAND, {"policy"}),
        ("rt" + topics.IMAGE, {"camera_driver"}),
        ("rt" + topics.CAMERA_INFO, {"camera_driver"}),
        ("rt/flir_camera/image_raw", {"camera_vendor"}),
        ("rt/flir_camera/camera_info", {"camera_vendor"}),
        ("rt/pacmod/global_rpt", {"pacmod3_driver"}),
        ("rt" + topics.FAILSAFE_STATUS, {"failsafe"}),
        ("rq/vehicle_interface/engageRequest", {"operator"}),
        ("rq/vehicle_interface/rearmRequest", {"operator"}),
        ("rr/vehicle_interface/engageReply", {"vehicle_interface"}),
        ("rr/vehicle_interface/rearmReply", {"vehicle_interface"}),
        ("rt" + topics.TARGET_SPEED, {"operator"}),  # the cruise target the policy reads
        ("rt" + topics.CRUISE_SCALE, {"safety_monitor"}),  # the OOD rule's slow-down: the speed cap's scale of that target
        ("rt" + topics.OOD_SCORE, {"policy"}),
        ("rq/vehicle_interface/set_parametersRequest", set()),  # no one changes limits at run time
    ],
)
def test_only_the_named_enclaves_may_publish(policy, dds_topic, allowed_publishers):
    assert publishers(policy, dds_topic) == allowed_publishers


def test_the_pacmod3_driver_reads_every_command_and_the_vehicle_interface_reads_the_stop(policy):
    for command in ("accel", "brake", "steering", "turn", "shift", "wiper"):
        assert may(policy, security.enclave_of("pacmod3_driver"), "subscribe", f"rt/pacmod/{command}_cmd")
    assert may(policy, security.enclave_of("vehicle_interface"), "subscribe", "rt" + topics.SAFETY_STOP)
    assert not may(policy, security.enclave_of("policy"), "subscribe", "rq/vehicle_interface/engageRequest")


# --- the nodes as they are ---------------------------------------------------------------------


def node_endpoints(observer, node):
    """{"publish": DDS topics, "subscribe": DDS topics} of a running node, as its DDS writers and readers."""
    endpoints = {"publish": set(), "subscribe": set()}
    endpoints["publish"] |= {"rt" + t for t, _ in observer.get_publisher_names_and_types_by_node(node, "/")}
    endpoints["subscribe"] |= {"rt" + t for t, _ in observer.get_subscriber_names_and_types_by_node(node, "/")}
    for service, _ in observer.get_service_names_and_types_by_node(node, "/"):
        endpoints["publish"].add(f"rr{service}Reply")
        endpoints["subscribe"].add(f"rq{service}Request")
    for client, _ in observer.get_client_names_and_types_by_node(node, "/"):
        endpoints["publish"].add(f"rq{client}Request")
        endpoints["subscribe"].add(f"rr{client}Reply")
    return endpoints


def assert_endpoints_allowed(policy, graph, probe):
    for node in graph.nodes:
        endpoints = node_endpoints(probe.node, node)
        assert "rt/rosout" in endpoints["publish"], f"{node}: not seen on the graph"
        for direction, dds_topics in endpoints.items():
            refused = sorted(t for t in dds_topics if not may(policy, security.enclave_of(node), direction, t))
            assert not refused, f"{node} may not {direction} {refused}: enforcement would stop it"


@pytest.mark.ros
def test_each_node_creates_only_endpoints_its_enclave_allows(policy, tmp_path):
    frames = tmp_path / "frames"
    frames.mkdir()
    import cv2
    import numpy as np

    cv2.imwrite(str(frames / "000.png"), np.zeros((60, 96, 3), np.uint8))
    # A policy with state inputs: it also reads the car's speed (PACMod 3's report) and the cruise target.
    ckpt = tiny_policy(tmp_path / "policy", dim=16, state_inputs=STATE_NAMES)
    graph = Graph(
        ["camera_driver", "selection", "policy", "vehicle_interface", "safety_monitor", "failsafe"],
        parameters={
            "camera_driver": {"source": str(frames), "width": 96, "height": 60, "loop": True},
            "selection": {"checkpoint": str(ckpt)},
            # With its overlay on, it also reads the camera and publishes /policy/overlay.
            "policy": {"checkpoint": str(ckpt), "vehicle_backend": "pacmod3", "publish_overlay": True},
            "vehicle_interface": {"backend": "pacmod3"},
        },
        log_dir=tmp_path / "logs",
    )
    probe = Probe()
    try:
        with graph:
            # Each node subscribes last what it reads; once all are there, every endpoint exists.
            wait_for_topics(
                probe.node,
                {topics.CAMERA_INFO: 2, topics.DESCRIPTORS: 1, topics.POLICY_COMMAND: 1, topics.OBSTACLE_RANGE: 1,
                 topics.SAFETY_STOP: 1, topics.PACMOD_SPEED_RPT: 2, topics.PACMOD_STEERING_RPT: 2,
                 topics.TARGET_SPEED: 1, topics.IMAGE: 1},
                60,
                graph,
            )
            wait_for_nodes(probe.node, graph.nodes, 30, graph)
            probe.spin(1.0)
            assert_endpoints_allowed(policy, graph, probe)
    finally:
        probe.close()


@pytest.mark.ros
def test_the_extractor_creates_only_endpoints_its_enclave_allows(policy, tmp_path):
    # Apart from the others: it subscribes only after loading the embedded DINOv2 (5-20 s here).
    graph = Graph(["extractor"], log_dir=tmp_path / "logs")
    probe = Probe()
    try:
        with graph:
            wait_for_topics(probe.node, {topics.IMAGE: 1}, 120, graph)
            wait_for_nodes(probe.node, graph.nodes, 30, graph)
            probe.spin(1.0)
            assert_endpoints_allowed(policy, graph, probe)
    finally:
        probe.close()


# --- the keystore --------------------------------------------------------------------------------


def create_keystore(path: Path) -> Path:
    env = {**os.environ, "KEYSTORE_TOOL": "openssl", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(SCRIPT), str(path)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return path


@pytest.fixture(scope="module")
def keystore(tmp_path_factory):
    return create_keystore(tmp_path_factory.mktemp("keystore") / "keystore")


def openssl(*args, stdin=None) -> str:
    done = subprocess.run(["openssl", *args], input=stdin, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


def signed_content(p7s: Path, ca: Path) -> str:
    """The document inside an S/MIME file, after checking its signature against the CA."""
    return openssl("smime", "-verify", "-text", "-in", str(p7s), "-CAfile", str(ca)).replace("\r\n", "\n")


def test_keystore_has_the_sros2_layout_and_verifies(keystore, policy):
    for name in ("identity_ca.cert.pem", "permissions_ca.cert.pem"):
        assert (keystore / "public" / name).is_file()
        assert (keystore / "private" / name.replace("cert", "key")).is_file()
    ca = keystore / "public" / "permissions_ca.cert.pem"
    governance = ET.fromstring(signed_content(keystore / "enclaves" / "governance.p7s", ca))
    assert governance.findtext("domain_access_rules/domain_rule/allow_unauthenticated_participants") == "false"
    assert governance.findtext("domain_access_rules/domain_rule/domains/id") == os.environ["ROS_DOMAIN_ID"]
    rule = governance.find("domain_access_rules/domain_rule/topic_access_rules/topic_rule")
    assert rule.findtext("enable_write_access_control") == rule.findtext("enable_read_access_control") == "true"

    for enclave in security.enclave_paths(policy):
        directory = keystore / "enclaves" / enclave.lstrip("/")
        assert (directory / "key.pem").stat().st_mode & 0o077 == 0, f"{enclave}: private key readable by others"
        cert = str(directory / "cert.pem")
        assert openssl("x509", "-in", cert, "-noout", "-subject").strip() == f"subject=CN = {enclave}"
        openssl("verify", "-CAfile", str(directory / "identity_ca.cert.pem"), cert)
        # The key and the certificate belong together.
        assert openssl("pkey", "-in", str(directory / "key.pem"), "-pubout") == openssl("x509", "-in", cert, "-noout", "-pubkey")
        assert (directory / "governance.p7s").read_bytes() == (keystore / "enclaves" / "governance.p7s").read_bytes()

        permissions = signed_content(directory / "permissions.p7s", directory / "permissions_ca.cert.pem")
        assert permissions == (directory / "permissions.xml").read_text()
        grant = ET.fromstring(permissions).find("permissions/grant")
        assert grant.findtext("subject_name") == f"CN={enclave}"
        allow = grant.find("allow_rule")
        for direction in ("publish", "subscribe"):
            assert {t.text for t in allow.iterfind(f"{direction}/topics/topic")} == allowed(policy, enclave, direction)
        # The permissions are valid exactly as long as the certificate.
        not_after = openssl("x509", "-in", cert, "-noout", "-enddate").split("=", 1)[1].strip()
        assert time.strftime("%Y-%m-%dT%H:%M:%S", time.strptime(not_after, "%b %d %H:%M:%S %Y GMT")) == grant.findtext(
            "validity/not_after"
        )


def test_running_again_keeps_keys_and_signs_the_current_policy(tmp_path, policy):
    store = create_keystore(tmp_path / "keystore")
    enclave = store / "enclaves" / "sps_driving" / "policy"
    key, cert = (enclave / "key.pem").read_bytes(), (enclave / "cert.pem").read_bytes()
    (enclave / "permissions.xml").write_text("tampered")
    create_keystore(store)
    assert (enclave / "key.pem").read_bytes() == key and (enclave / "cert.pem").read_bytes() == cert
    assert "rt/sps/command" in signed_content(enclave / "permissions.p7s", enclave / "permissions_ca.cert.pem")


def test_a_tampered_permissions_file_fails_verification(keystore, tmp_path):
    enclave = keystore / "enclaves" / "sps_driving" / "policy"
    forged = tmp_path / "permissions.p7s"
    forged.write_text((enclave / "permissions.p7s").read_text().replace("rt/sps/command", "rt/pacmod/accel_cmd", 1))
    done = subprocess.run(
        ["openssl", "smime", "-verify", "-in", str(forged), "-CAfile", str(enclave / "permissions_ca.cert.pem")],
        capture_output=True, text=True, timeout=30,
    )
    assert done.returncode != 0 and "verification failure" in done.stderr.lower()


# --- enforcement ---------------------------------------------------------------------------------

# The DDS topic the test speaks on: the throttle command, as the policy names it.
ACCEL_CMD = "/pacmod/accel_cmd"


class Peer:
    """One peer process (security_peer.py or dds_security_peer); `lines()` is what it printed."""

    def __init__(self, log_dir: Path, label: str, command: list, env: dict):
        self.label = label
        self.log = log_dir / f"{label}.log"
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()

    def heard(self) -> set[str]:
        return {line.split(" ", 1)[1] for line in self.lines() if line.startswith("received ")}

    def settled(self) -> bool:
        """Up with its endpoint, or gone."""
        return self.process.poll() is not None or "ready" in self.lines()

    def refused(self) -> bool:
        return self.process.poll() == 3 and any(line.startswith("refused") for line in self.lines())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def ros_peer(log_dir, label, mode, node, namespace, enclave, env) -> Peer:
    command = [sys.executable, str(PEER), mode, ACCEL_CMD, node, namespace, label]
    if enclave:
        command += ["--ros-args", "--enclave", enclave]
    return Peer(log_dir, label, command, env)


# rmw_cyclonedds_cpp built by scripts/build_rmw_cyclonedds.sh for this venv (the PyPI Fast DDS has
# no DDS Security): preloaded into the peers when present, else they run on the venv's Fast DDS.
BUILT_RMW = Path(os.environ.get("SPS_RMW_CYCLONEDDS", "/opt/rmw_cyclonedds"))


def built_rmw() -> dict:
    library = BUILT_RMW / "lib" / "librmw_cyclonedds_cpp.so"
    built_for = BUILT_RMW / "venv.txt"
    if not (library.is_file() and built_for.is_file() and CYCLONE_PLUGINS):
        return {}
    if Path(built_for.read_text().strip()).resolve() != Path(sys.prefix).resolve():
        return {}
    library_path = os.pathsep.join(p for p in (str(CYCLONE_PLUGINS[0].parent), os.environ.get("LD_LIBRARY_PATH")) if p)
    return {"LD_PRELOAD": str(library), "LD_LIBRARY_PATH": library_path, "RMW_IMPLEMENTATION": "rmw_cyclonedds_cpp"}


def secured(keystore: Path) -> dict:
    return {**os.environ, **built_rmw(), "ROS_SECURITY_ENABLE": "true", "ROS_SECURITY_STRATEGY": "Enforce",
            "ROS_SECURITY_KEYSTORE": str(keystore), "PYTHONUNBUFFERED": "1"}


def unsecured() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROS_SECURITY_")}
    return {**env, **built_rmw(), "PYTHONUNBUFFERED": "1"}


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.mark.ros
def test_only_the_vehicle_interface_enclave_reaches_the_driver(keystore, tmp_path):
    """The pacmod3 driver's enclave hears the vehicle interface's throttle command; a publisher in
    the policy's enclave is refused, one with a certificate from another CA and one without
    security are never heard; a subscriber without security hears nothing of the secured graph."""
    driver = ros_peer(tmp_path, "driver", "sub", "pacmod3_driver", "/pacmod", security.enclave_of("pacmod3_driver"), secured(keystore))
    peers = [driver]
    try:
        assert wait_for(driver.settled, 30), driver.lines()
        log = driver.log.read_text()
        if "doesn't have the security libraries" in log:
            refusal = " ".join(log[log.index("refused:"):].split())
            pytest.skip("the installed rmw has no DDS Security (scripts/build_rmw_cyclonedds.sh builds one): " + refusal)
        assert "ready" in driver.lines(), driver.lines()

        rogue = create_keystore(tmp_path / "rogue")  # same enclave names, another CA
        vehicle = ros_peer(tmp_path, "vehicle_interface", "pub", "vehicle_interface", "/", security.enclave_of("vehicle_interface"),
                           secured(keystore))
        policy_node = ros_peer(tmp_path, "policy", "pub", "policy", "/", security.enclave_of("policy"), secured(keystore))
        forged = ros_peer(tmp_path, "forged", "pub", "vehicle_interface", "/", security.enclave_of("vehicle_interface"), secured(rogue))
        plain = ros_peer(tmp_path, "plain", "pub", "intruder", "/", None, unsecured())
        eavesdropper = ros_peer(tmp_path, "eavesdropper", "sub", "listener", "/", None, unsecured())
        peers += [vehicle, policy_node, forged, plain, eavesdropper]

        assert wait_for(lambda: "received vehicle_interface" in driver.lines(), 30), (driver.lines(), vehicle.lines())
        # Everyone else has had its chance: every peer is up (or refused), the unsecured pair has
        # met, and a few seconds more.
        assert wait_for(lambda: all(p.settled() for p in peers), 30)
        assert wait_for(lambda: "plain" in eavesdropper.heard(), 30), eavesdropper.lines()
        time.sleep(3.0)
        assert driver.heard() == {"vehicle_interface"}
        assert policy_node.refused(), policy_node.lines()
        assert "ready" in plain.lines() and "ready" in eavesdropper.lines()
        # The unsecured pair hears each other (so the plain writer works), nothing of the secured graph.
        assert eavesdropper.heard() == {"plain"}, eavesdropper.lines()
    finally:
        for peer in peers:
            peer.stop()



# --- the same keystore under another DDS Security implementation -------------------------------

# Cyclone DDS from Debian (cyclonedds-dev, cyclonedds-tools) ships the three DDS Security plugins.
CYCLONE_PLUGINS = sorted(Path("/usr/lib").glob("*/libddsc0debian/libdds_security_auth.so")) + sorted(
    Path("/opt/ros").glob("*/lib/libdds_security_auth.so")
)
CYCLONE_LOOPBACK = (
    "<CycloneDDS><Domain><General><Interfaces><NetworkInterface address=\"127.0.0.1\"/></Interfaces>"
    "<AllowMulticast>false</AllowMulticast></General><Discovery><ParticipantIndex>auto</ParticipantIndex>"
    "<MaxAutoParticipantIndex>30</MaxAutoParticipantIndex><Peers><Peer address=\"127.0.0.1\"/></Peers>"
    "</Discovery></Domain></CycloneDDS>"
)
# ROS 2's std_msgs/String as rmw puts it on the wire.
ROS_STRING_IDL = "module std_msgs { module msg { module dds_ { struct String_ { string data; }; }; }; };\n"


@pytest.fixture(scope="module")
def cyclone_peer(tmp_path_factory):
    """dds_security_peer.c built against Cyclone DDS, or a skip naming what is missing."""
    missing = [tool for tool in ("idlc", "cc") if shutil.which(tool) is None]
    if missing or not CYCLONE_PLUGINS or not Path("/usr/include/dds/dds.h").is_file():
        pytest.skip("Cyclone DDS with DDS Security not installed (apt-get install cyclonedds-dev cyclonedds-tools); "
                    f"missing: {missing or 'plugins or headers'}")
    build = tmp_path_factory.mktemp("cyclone_peer")
    (build / "String.idl").write_text(ROS_STRING_IDL)
    subprocess.run(["idlc", "String.idl"], cwd=build, check=True, capture_output=True, timeout=60)
    binary = build / "dds_security_peer"
    subprocess.run(
        ["cc", "-O1", "-I.", "-o", str(binary), str(Path(__file__).parent / "dds_security_peer.c"), "String.c", "-lddsc"],
        cwd=build, check=True, capture_output=True, timeout=120,
    )
    return binary


def test_cyclone_dds_security_enforces_the_keystore(keystore, cyclone_peer, tmp_path):
    """The keystore's certificates, signed governance and permissions under a real DDS Security
    implementation, on the DDS topic of /pacmod/accel_cmd: the vehicle interface's and the
    failsafe's writes reach the driver's enclave; the driver may not write commands; the policy's
    enclave may not touch the topic; a certificate from another CA fails the handshake; an
    unsecured writer is not heard and an unsecured reader hears nothing of the secured writers."""
    rogue = create_keystore(tmp_path / "rogue")
    env = {**os.environ, "CYCLONEDDS_URI": CYCLONE_LOOPBACK}
    plugins = str(CYCLONE_PLUGINS[0].parent)
    domain = os.environ["ROS_DOMAIN_ID"]

    def peer(label, mode, store=None, enclave=None):
        command = [str(cyclone_peer), mode, "rt" + ACCEL_CMD, label, domain, plugins]
        if store is not None:
            command.append(str(store / "enclaves" / security.enclave_of(enclave).lstrip("/")))
        return Peer(tmp_path, label, command, env)

    driver = peer("driver", "sub", keystore, "pacmod3_driver")
    eavesdropper = peer("eavesdropper", "sub")
    peers = [driver, eavesdropper]
    try:
        assert wait_for(lambda: driver.settled() and eavesdropper.settled(), 20), driver.lines()
        assert "ready" in driver.lines() and "ready" in eavesdropper.lines(), driver.lines() + eavesdropper.lines()
        peers += [
            peer("vehicle_interface", "pub", keystore, "vehicle_interface"),
            peer("failsafe", "pub", keystore, "failsafe"),
            peer("policy", "pub", keystore, "policy"),
            peer("pacmod3_driver", "pub", keystore, "pacmod3_driver"),
            peer("forged", "pub", rogue, "vehicle_interface"),
            peer("plain", "pub"),
        ]
        # A generous wait for a loaded machine: both are heard within half a second when idle.
        assert wait_for(lambda: driver.heard() >= {"vehicle_interface", "failsafe"}, 30), {p.label: p.lines()[-6:] for p in peers}
        assert wait_for(lambda: all(p.settled() for p in peers), 20)
        assert wait_for(lambda: "plain" in eavesdropper.heard(), 30), eavesdropper.lines()
        assert wait_for(lambda: any("Certificate not valid" in line for line in driver.lines()), 30), (
            "the forged identity was not refused at the handshake")
        time.sleep(2.0)
        assert driver.heard() == {"vehicle_interface", "failsafe"}
        # The unsecured pair hears each other (so the plain writer works), nothing of the secured graph.
        assert eavesdropper.heard() == {"plain"}
        by_label = {p.label: p for p in peers}
        assert by_label["policy"].refused() and by_label["pacmod3_driver"].refused()
        assert "ready" in by_label["forged"].lines() and "ready" in by_label["plain"].lines()
    finally:
        for p in peers:
            p.stop()
