"""What /proc/self/smaps says about the mapping that holds an address (huge-page tests)."""
from __future__ import annotations


def smaps_field_of_mapping(address: int, field: str) -> list[str]:
    """The words after `field:` (e.g. 'AnonHugePages', 'VmFlags') in the /proc/self/smaps entry of the mapping
    holding `address`."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == f"{field}:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds address {address:#x}, or it has no {field}")

