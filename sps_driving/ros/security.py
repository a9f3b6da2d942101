"""SROS2 access-control policy -> the DDS Security documents of a keystore, without sros2.

`ros2 security` (sros2) builds keystores on machines with a ROS 2 distro; this module writes the
same two documents from the same policy file (security/policy.xml) where sros2 is missing, for
scripts/create_keystore.sh, which signs them with openssl:
- governance.xml: one for the keystore. Unauthenticated participants are refused, discovery and
  data are encrypted, and read and write access are checked on every topic.
- permissions.xml: one per enclave. The enclave's certificate subject (CN=<enclave path>) may
  publish and subscribe exactly the DDS topics its profiles allow; anything else is denied.

ROS names become DDS topic names as in rmw: topic /a/b -> rt/a/b; service /s -> requests on
rq/sRequest and replies on rr/sReply. A policy name is absolute (/x), private to its profile's
node (~/x -> <ns>/<node>/x) or relative to the profile's namespace (x -> <ns>/x); fnmatch
patterns (* ? [...]) pass through, as DDS Security matches topic names with them.

Command line: python -m sps_driving.ros.security {enclaves POLICY | governance | permissions POLICY ENCLAVE}
"""

from __future__ import annotations

import argparse
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# Every node of the car graph runs in its own enclave, /sps_driving/<node name>.
ENCLAVE_ROOT = "/sps_driving"
XINCLUDE = "{http://www.w3.org/2001/XInclude}include"
# What a service or topic rule allows, per direction, as (DDS prefix, DDS suffix) of its topics.
SERVICE_ROLES = {
    "request": {"publish": [("rq", "Request")], "subscribe": [("rr", "Reply")]},
    "reply": {"publish": [("rr", "Reply")], "subscribe": [("rq", "Request")]},
}
# rmw's own graph topic: every participant publishes and reads it.
ROS_DISCOVERY_TOPIC = "ros_discovery_info"
QUALIFIERS = ("DENY", "ALLOW")  # deny rules come first: the first rule that matches decides


def enclave_of(node: str) -> str:
    return f"{ENCLAVE_ROOT}/{node}"


def load_policy(path: str | Path) -> ET.Element:
    """The policy's root element, with its XIncludes (xpointer(/profile/*)) resolved."""
    path = Path(path)
    root = ET.parse(path).getroot()
    _resolve_includes(root, path.parent)
    if root.tag != "policy" or root.get("version") != "0.2.0":
        raise ValueError(f"{path}: not an SROS2 policy of version 0.2.0")
    return root


def _resolve_includes(element: ET.Element, base: Path) -> None:
    for index, child in reversed(list(enumerate(element))):
        if child.tag != XINCLUDE:
            _resolve_includes(child, base)
            continue
        if child.get("xpointer") != "xpointer(/profile/*)":
            raise ValueError(f"unsupported XInclude {child.attrib}: only xpointer(/profile/*) is understood")
        href = base / child.get("href")
        included = ET.parse(href).getroot()
        _resolve_includes(included, href.parent)
        element[index : index + 1] = list(included)


def enclave_paths(policy: ET.Element) -> list[str]:
    return [enclave.get("path") for enclave in policy.iterfind("enclaves/enclave")]


def fully_qualified(name: str, ns: str, node: str) -> str:
    ns = ns if ns.endswith("/") else ns + "/"
    if name.startswith("/"):
        return name
    if name.startswith("~"):
        return ns + node + name[1:]
    return ns + name


def rules(policy: ET.Element, enclave: str) -> dict[str, dict[str, set[str]]]:
    """{qualifier: {"publish": DDS topics, "subscribe": DDS topics}} of one enclave's profiles."""
    found = policy.find(f"enclaves/enclave[@path='{enclave}']")
    if found is None:
        raise KeyError(f"no enclave {enclave} in the policy")
    result = {q: {"publish": set(), "subscribe": set()} for q in QUALIFIERS}
    for profile in found.iterfind("profiles/profile"):
        ns, node = profile.get("ns"), profile.get("node")
        for group in profile:
            for item in group:
                name = fully_qualified(item.text.strip(), ns, node)
                if group.tag == "topics":
                    for direction in ("publish", "subscribe"):
                        if group.get(direction) in QUALIFIERS:
                            result[group.get(direction)][direction].add("rt" + name)
                elif group.tag == "services":
                    for role, directions in SERVICE_ROLES.items():
                        if group.get(role) in QUALIFIERS:
                            for direction, affixes in directions.items():
                                result[group.get(role)][direction].update(p + name + s for p, s in affixes)
                else:
                    raise ValueError(f"enclave {enclave}: <{group.tag}> rules are not supported")
    for direction in ("publish", "subscribe"):
        result["ALLOW"][direction].add(ROS_DISCOVERY_TOPIC)
    return result


def _text(parent: ET.Element, tag: str, text: str) -> ET.Element:
    element = ET.SubElement(parent, tag)
    element.text = text
    return element


def _document(root: ET.Element, schema: str) -> str:
    root.set("xmlns:xsi", "http://www.w3.org/2001/XMLSchema-instance")
    root.set("xsi:noNamespaceSchemaLocation", f"http://www.omg.org/spec/DDS-SECURITY/20170901/{schema}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def permissions_xml(policy: ET.Element, enclave: str, domain_id: int, not_before: str, not_after: str) -> str:
    """The enclave's permissions document; the validity (ISO 8601, UTC) is its certificate's."""
    dds = ET.Element("dds")
    grant = ET.SubElement(ET.SubElement(dds, "permissions"), "grant", name=enclave)
    _text(grant, "subject_name", f"CN={enclave}")
    validity = ET.SubElement(grant, "validity")
    _text(validity, "not_before", not_before)
    _text(validity, "not_after", not_after)
    for qualifier, topics in rules(policy, enclave).items():
        if not topics["publish"] and not topics["subscribe"]:
            continue
        rule = ET.SubElement(grant, f"{qualifier.lower()}_rule")
        _text(ET.SubElement(rule, "domains"), "id", str(domain_id))
        for direction in ("publish", "subscribe"):
            if topics[direction]:
                listed = ET.SubElement(ET.SubElement(rule, direction), "topics")
                for topic in sorted(topics[direction]):
                    _text(listed, "topic", topic)
    _text(grant, "default", "DENY")
    return _document(dds, "omg_shared_ca_permissions.xsd")


def governance_xml(domain_id: int) -> str:
    dds = ET.Element("dds")
    rule = ET.SubElement(ET.SubElement(dds, "domain_access_rules"), "domain_rule")
    _text(ET.SubElement(rule, "domains"), "id", str(domain_id))
    for tag, value in (
        ("allow_unauthenticated_participants", "false"),
        ("enable_join_access_control", "true"),
        ("discovery_protection_kind", "ENCRYPT"),
        ("liveliness_protection_kind", "ENCRYPT"),
        ("rtps_protection_kind", "SIGN"),
    ):
        _text(rule, tag, value)
    topic_rule = ET.SubElement(ET.SubElement(rule, "topic_access_rules"), "topic_rule")
    for tag, value in (
        ("topic_expression", "*"),
        ("enable_discovery_protection", "true"),
        ("enable_liveliness_protection", "true"),
        ("enable_read_access_control", "true"),
        ("enable_write_access_control", "true"),
        ("metadata_protection_kind", "ENCRYPT"),
        ("data_protection_kind", "ENCRYPT"),
    ):
        _text(topic_rule, tag, value)
    return _document(dds, "omg_shared_ca_governance.xsd")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sps_driving.ros.security", description=__doc__.split("\n\n")[0])
    parser.add_argument("--domain", type=int, default=int(os.environ.get("ROS_DOMAIN_ID") or 0),
                        help="ROS domain id (default: $ROS_DOMAIN_ID or 0)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("enclaves", help="list the policy's enclave paths").add_argument("policy")
    commands.add_parser("governance", help="print governance.xml")
    permissions = commands.add_parser("permissions", help="print one enclave's permissions.xml")
    permissions.add_argument("policy")
    permissions.add_argument("enclave")
    permissions.add_argument("--not-before", required=True, help="ISO 8601 UTC, the certificate's notBefore")
    permissions.add_argument("--not-after", required=True, help="ISO 8601 UTC, the certificate's notAfter")
    args = parser.parse_args(argv)
    if args.command == "enclaves":
        print("\n".join(enclave_paths(load_policy(args.policy))))
    elif args.command == "governance":
        sys.stdout.write(governance_xml(args.domain))
    else:
        sys.stdout.write(permissions_xml(load_policy(args.policy), args.enclave, args.domain, args.not_before, args.not_after))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
