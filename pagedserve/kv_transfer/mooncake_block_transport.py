"""The mooncake transport of the pull connector: a consumer reads a producer's blocks straight from the producer's
KV cache into its own over Mooncake's Transfer Engine (PyPI mooncake-transfer-engine-non-cuda on a CPU host; TCP
here, RDMA where the machine has it), with no gather on the producer and no scatter on the consumer.

Handshakes and done notices stay on the zmq control socket (zmq_block_transport.py): a producer's handshake answer
carries its MooncakeEndpoint.descriptor() (its Transfer Engine session and, per page region, the cache's address
and the bytes one block takes), which the consumer uses to address its reads. Both sides register their page
regions with their engine once, at start.

Mooncake's handshake RPC and TCP transport listen on every interface whatever host they are given (measured with
0.3.13.post1): a producer using this transport is reachable from the network the machine is on. Use it on trusted
networks only; the zmq transport binds only the configured host.
"""
from __future__ import annotations

import logging
from typing import Any

from pagedserve.kv_transfer.kv_page_regions import KVPageRegions
from pagedserve.kv_transfer.zmq_block_transport import KVTransferError

logger = logging.getLogger(__name__)


def _transfer_engine_class() -> type:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as error:
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config.transport='mooncake' needs Mooncake's "
                         f"Transfer Engine: pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 (and, on "
                         f"Debian, apt-get install libibverbs1); import failed: {error}") from None
    return TransferEngine


class MooncakeEndpoint:
    """One engine's Transfer Engine with its page regions registered."""

    def __init__(self, regions: KVPageRegions, host: str, protocol: str = "tcp") -> None:
        self.engine = _transfer_engine_class()()
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config.transport='mooncake': the Transfer "
                             f"Engine did not start on host={host!r} over {protocol}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        # Flat in KVPageRegions.region_bytes() order: (address of block 0, bytes one block takes).
        self.regions = [(region.data_ptr(), int(region.shape[1]))
                        for layer_regions in regions.regions for region in layer_regions]
        self._registered: list[int] = []
        for region in (region for layer_regions in regions.regions for region in layer_regions):
            if self.engine.register_memory(region.data_ptr(), region.numel()) != 0:
                self.close()
                raise ValueError(f"transport='mooncake': could not register {region.numel()} bytes of KV cache "
                                 f"with the Transfer Engine")
            self._registered.append(region.data_ptr())

    def descriptor(self) -> dict[str, Any]:
        """What a consumer needs to read this engine's blocks (sent in the handshake answer)."""
        return {"session": self.session, "regions": [list(region) for region in self.regions]}

    def read(self, remote: dict[str, Any], remote_block_ids: list[int], local_block_ids: list[int],
             region_pairs: list[tuple[int, int]] | None = None) -> int:
        """Copy the producer's `remote_block_ids` into this engine's `local_block_ids`, every region (or the
        (local region, remote region) index pairs `region_pairs`: a producer rank holding some of the layers);
        returns the bytes moved. KVTransferError when the descriptor does not match or the engine reports a
        failure."""
        remote_regions = remote.get("regions")
        if region_pairs is None:
            if not isinstance(remote_regions, list) or len(remote_regions) != len(self.regions):
                raise KVTransferError(f"the producer describes {len(remote_regions or [])} page regions for the "
                                      f"mooncake transport, this engine has {len(self.regions)}")
            region_pairs = [(index, index) for index in range(len(self.regions))]
        elif not isinstance(remote_regions, list) or any(not 0 <= remote_index < len(remote_regions)
                                                         for _, remote_index in region_pairs):
            raise KVTransferError(f"the producer describes {len(remote_regions or [])} page regions for the "
                                  f"mooncake transport, fewer than the layers it holds")
        local_addresses: list[int] = []
        remote_addresses: list[int] = []
        lengths: list[int] = []
        runs = _joint_runs(remote_block_ids, local_block_ids)
        for local_index, remote_index in region_pairs:
            local_base, block_bytes = self.regions[local_index]
            remote_base, remote_block_bytes = remote_regions[remote_index]
            if remote_block_bytes != block_bytes:
                raise KVTransferError(f"a page region takes {remote_block_bytes} bytes a block on the producer and "
                                      f"{block_bytes} here")
            for remote_first, local_first, length in runs:
                local_addresses.append(local_base + local_first * block_bytes)
                remote_addresses.append(remote_base + remote_first * block_bytes)
                lengths.append(length * block_bytes)
        status = self.engine.batch_transfer_sync_read(remote["session"], local_addresses, remote_addresses, lengths)
        if status != 0:
            raise KVTransferError(f"the Transfer Engine failed to read {len(lengths)} spans from "
                                  f"{remote['session']} (status {status})")
        return sum(lengths)

    def close(self) -> None:
        for address in self._registered:
            self.engine.unregister_memory(address)
        self._registered.clear()


def _joint_runs(remote_block_ids: list[int], local_block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first remote id, first local id, length) of each run where both sides' ids are consecutive: one span
    each per region."""
    runs: list[tuple[int, int, int]] = []
    for remote_id, local_id in zip(remote_block_ids, local_block_ids, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == remote_id and runs[-1][1] + runs[-1][2] == local_id:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((remote_id, local_id, 1))
    return runs


__all__ = ["MooncakeEndpoint"]
