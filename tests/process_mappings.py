"""What /proc/self/smaps and /proc/self/maps say about a process's mappings (huge-page and offload-tier tests)."""
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



def mapped_file_paths(prefix: str) -> list[str]:
    """The paths (with " (deleted)" for unlinked files) of this process's file mappings that start with `prefix`."""
    with open("/proc/self/maps") as maps:
        fields = [line.split(maxsplit=5) for line in maps]
    return sorted({entry[5].strip() for entry in fields if len(entry) == 6 and entry[5].startswith(prefix)})
