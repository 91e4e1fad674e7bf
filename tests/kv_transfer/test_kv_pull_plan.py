"""KVPullPlan on synthetic handshake signatures (which producer rank each layer and KV head comes from), the
head-slice copy on synthetic pages, and KVOutputAggregator (a request is finished once every rank said so)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedserve.attention.kv_cache_spec import KVCacheSpec
from pagedserve.core.scheduler_output import KVConnectorOutput
from pagedserve.kv_transfer.kv_output_aggregator import KVOutputAggregator
from pagedserve.kv_transfer.kv_page_regions import KVPageRegions, with_num_heads
from pagedserve.kv_transfer.kv_pull_plan import KVPullPlan, LayerSource
from pagedserve.kv_transfer.zmq_block_transport import KVTransferError

COMMON = {"block_size": 16, "dtype": "torch.float32", "kv_cache_dtype": "auto", "model": "M", "transport": "zmq"}


def dense_layer(name: str, first: int, count: int, total: int) -> list[Any]:
    return [name, [count * 64], [f"kv:{count}"], [first, count, total]]


def signature(tp_rank: int, tp_size: int, layers: list[list[Any]], pp_rank: int = 0, pp_size: int = 1
              ) -> dict[str, Any]:
    return COMMON | {"tp_rank": tp_rank, "tp_size": tp_size, "pp_rank": pp_rank, "pp_size": pp_size,
                     "layers": layers}


def tp_ranks(tp_size: int, total_heads: int, names: list[str]) -> list[dict[str, Any]]:
    """QKVParallelLinear's split of `total_heads` KV heads over `tp_size` ranks."""
    signatures = []
    for rank in range(tp_size):
        if tp_size >= total_heads:
            first, count = rank // (tp_size // total_heads), 1
        else:
            count = total_heads // tp_size
            first = rank * count
        signatures.append(signature(rank, tp_size, [dense_layer(name, first, count, total_heads) for name in names]))
    return signatures


def test_equal_tp_reads_rank_to_rank_whole_pages() -> None:
    producer = tp_ranks(2, 4, ["l0", "l1"])
    plan = KVPullPlan.build(tp_ranks(2, 4, ["l0", "l1"])[1], producer)
    assert plan.sources == [LayerSource(0, 1, 0), LayerSource(1, 1, 1)]
    assert (plan.done_ranks, plan.num_readers, plan.remote_layers) == ([1], 1, {1: [0, 1]})


def test_unequal_tp_maps_head_intervals() -> None:
    """P TP=4 -> D TP=2 over 4 KV heads: D rank 1 holds heads [2, 4), one from each of P ranks 2 and 3."""
    plan = KVPullPlan.build(tp_ranks(2, 4, ["l0"])[1], tp_ranks(4, 4, ["l0"]))
    assert plan.sources == [LayerSource(0, 2, 0, num_heads=1, local_head_start=0, remote_head_start=0,
                                        remote_num_heads=1),
                            LayerSource(0, 3, 0, num_heads=1, local_head_start=1, remote_head_start=0,
                                        remote_num_heads=1)]
    assert plan.done_ranks == [2, 3]


def test_replicated_kv_heads_are_read_once() -> None:
    """2 KV heads over P TP=4 (each head on two ranks) -> D TP=1: head 0 from P rank 0, head 1 from P rank 2."""
    plan = KVPullPlan.build(tp_ranks(1, 2, ["l0"])[0], tp_ranks(4, 2, ["l0"]))
    assert [(source.remote_rank, source.local_head_start, source.num_heads) for source in plan.sources] == \
        [(0, 0, 1), (2, 1, 1)]
    assert plan.done_ranks == [0, 1, 2, 3]  # every P rank hears from D, read or not


def test_mla_is_read_from_one_rank_of_the_group() -> None:
    latent = ["l0", [768], ["kv:latent"], None]
    producer = [signature(rank, 2, [latent]) for rank in range(2)]
    assert KVPullPlan.build(signature(0, 1, [latent]), producer).sources == [LayerSource(0, 0, 0)]
    # Equal TP: each consumer rank reads its own group's producer rank.
    assert KVPullPlan.build(signature(1, 2, [latent]), producer).sources == [LayerSource(0, 1, 0)]


def test_pipeline_stages_serve_their_layers() -> None:
    """P PP=2 (layers [l0, l1] and [l2]) -> D PP=1: each layer from the stage holding it; P PP=1 -> D PP=2: each
    P rank waits for two done notices (one per D stage)."""
    layers = [dense_layer(name, 0, 2, 2) for name in ("l0", "l1", "l2")]
    producer = [signature(0, 1, layers[:2], 0, 2), signature(0, 1, layers[2:], 1, 2)]
    plan = KVPullPlan.build(signature(0, 1, layers), producer)
    assert plan.sources == [LayerSource(0, 0, 0), LayerSource(1, 0, 1), LayerSource(2, 1, 0)]
    assert (plan.done_ranks, plan.num_readers, plan.remote_layers) == ([0, 1], 1, {0: [0, 1], 1: [0]})
    stage = KVPullPlan.build(signature(0, 1, layers[2:], 1, 2), [signature(0, 1, layers)])
    assert (stage.sources, stage.num_readers) == ([LayerSource(0, 0, 2)], 2)


def test_consumer_with_more_tp_ranks_slices_one_producer_rank() -> None:
    """P TP=1 -> D TP=2 over 2 KV heads: D rank r copies head r out of P rank 0's two-head pages; P rank 0 waits for
    a done notice from both D ranks. P TP=2 -> D TP=4 over 4 heads: D rank 3 slices head 1 of P rank 1's [2, 4)."""
    producer = tp_ranks(1, 2, ["l0"])
    for rank in range(2):
        plan = KVPullPlan.build(tp_ranks(2, 2, ["l0"])[rank], producer)
        assert plan.sources == [LayerSource(0, 0, 0, num_heads=1, local_head_start=0, remote_head_start=rank,
                                            remote_num_heads=2)]
        assert (plan.done_ranks, plan.num_readers, plan.remote_layers) == ([0], 2, {0: [0]})
    plan = KVPullPlan.build(tp_ranks(4, 4, ["l0"])[3], tp_ranks(2, 4, ["l0"]))
    assert plan.sources == [LayerSource(0, 1, 0, num_heads=1, local_head_start=0, remote_head_start=1,
                                        remote_num_heads=2)]
    assert (plan.done_ranks, plan.num_readers) == ([1], 2)
    # 2 KV heads over D TP=4 (each head on two D ranks): D rank 3 holds head 1, from P rank 0's head 1.
    plan = KVPullPlan.build(tp_ranks(4, 2, ["l0"])[3], producer)
    assert [(source.remote_rank, source.remote_head_start, source.num_heads) for source in plan.sources] == \
        [(0, 1, 1)]
    assert plan.num_readers == 4
    # With D PP=2 as well, each P rank hears from every D rank of its slice on every D stage.
    stage = KVPullPlan.build(tp_ranks(2, 2, ["l0"])[1] | {"pp_rank": 1, "pp_size": 2}, producer)
    assert stage.num_readers == 4


def test_consumer_with_more_tp_ranks_reads_the_whole_latent() -> None:
    """MLA: every D rank of P TP=1 -> D TP=2 reads P rank 0's latent pages whole."""
    latent = ["l0", [768], ["kv:latent"], None]
    for rank in range(2):
        plan = KVPullPlan.build(signature(rank, 2, [latent]), [signature(0, 1, [latent])])
        assert (plan.sources, plan.done_ranks, plan.num_readers) == ([LayerSource(0, 0, 0)], [0], 2)


def test_tp_mismatch_names_both_sizes() -> None:
    with pytest.raises(KVTransferError, match="tensor_parallel_size: producer 3, consumer 2: one must be a multiple "
                                              "of the other"):
        KVPullPlan.build(tp_ranks(2, 6, ["l0"])[0], tp_ranks(3, 6, ["l0"]))


def test_missing_layer_and_engine_mismatch_are_refused() -> None:
    with pytest.raises(KVTransferError, match="layer 'l1': no producer rank holds it"):
        KVPullPlan.build(tp_ranks(1, 2, ["l0", "l1"])[0], tp_ranks(1, 2, ["l0"]))
    producer = [signature(0, 1, [dense_layer("l0", 0, 2, 2)]) | {"block_size": 32}]
    with pytest.raises(KVTransferError, match="block_size: producer 32, consumer 16"):
        KVPullPlan.build(tp_ranks(1, 2, ["l0"])[0], producer)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_copy_heads_writes_the_heads_slice_of_every_component(kv_cache_dtype: str) -> None:
    """A producer page of 1 KV head (of 2) lands in local head 1 of the chosen blocks, K and V (and int8 scales),
    and nothing else changes."""
    local_layout = KVCacheSpec(per_token_shape=(2, 8), leading_shape=(2,), supports_int8=True).page_layout(
        4, torch.float32, kv_cache_dtype)
    num_blocks = 5
    buffer = torch.zeros(num_blocks, local_layout.page_bytes, dtype=torch.uint8)
    primary = local_layout.views(buffer)[local_layout.components[0].name]
    regions = KVPageRegions.build({"l0": primary}, {"l0": local_layout}, num_blocks, dict(COMMON))
    remote_layout = with_num_heads(local_layout, 1)
    remote = torch.zeros(2, remote_layout.page_bytes, dtype=torch.uint8)
    for view in remote_layout.views(remote).values():  # nonzero values of each component's dtype (no NaN bytes)
        view.copy_(torch.randint(1, 100, view.shape).to(view.dtype))
    remote_regions = [remote] if remote_layout.is_interleaved else [
        remote.view(-1)[2 * start:2 * end].view(2, end - start) for start, end in remote_layout.byte_ranges()]
    regions.copy_heads(0, [3, 1], remote_layout, remote_regions, 0, 1, 1)
    local_views, remote_views = local_layout.views(buffer), remote_layout.views(remote)
    for component in local_layout.components:
        axis = len(component.leading_shape)
        local, source = local_views[component.name], remote_views[component.name]
        for row, block in ((0, 3), (1, 1)):
            assert torch.equal(local.select(axis, block).select(axis + 1, 1),
                               source.select(axis, row).select(axis + 1, 0))
            assert not local.select(axis, block).select(axis + 1, 0).any()
        for block in (0, 2, 4):
            assert not local.select(axis, block).any()


def test_aggregator_waits_for_every_rank() -> None:
    aggregator = KVOutputAggregator(2)
    first = aggregator.aggregate([KVConnectorOutput(finished_sending={"a"}, finished_recving={"r"},
                                                    invalid_block_ids={7}), None])
    assert first.is_empty  # one rank of two
    second = aggregator.aggregate([KVConnectorOutput(finished_sending={"b"}),
                                   KVConnectorOutput(finished_sending={"a"}, finished_recving={"r"})])
    assert (second.finished_sending, second.finished_recving, second.invalid_block_ids) == ({"a"}, {"r"}, {7})
    third = aggregator.aggregate([None, KVConnectorOutput(finished_sending={"b"})])
    assert (third.finished_sending, third.invalid_block_ids) == ({"b"}, set())


def test_step_metadata_survives_the_worker_pipe() -> None:
    """An 'mp' worker gets the connector's orders as the step's msgpack brings them (plain maps): the worker side
    turns them back into PullConnectorMetadata."""
    from pagedserve.core.scheduler_output import CachedRequestData, SchedulerOutput
    from pagedserve.executor.worker_messages import ExecuteModel, WorkerCodec
    from pagedserve.kv_transfer.pull_connector_scheduler import LoadOrder, PullConnectorMetadata
    from pagedserve.config.kv_transfer import KVTransferConfig
    from pagedserve.kv_transfer.pull_connector_worker import PullConnectorWorker

    metadata = PullConnectorMetadata(loads=[LoadOrder("r", [4, 5], [7, 8], "p", "127.0.0.1", 5600, "q",
                                                      [5600, 5601])], sends=["s"], finished_request_ids=["f"])
    codec = WorkerCodec()
    decoded = codec.decode_to_worker(codec.encode(ExecuteModel(scheduler_output=SchedulerOutput(
        [], CachedRequestData(), {}, 0, kv_connector_metadata=metadata))))
    worker = PullConnectorWorker(KVTransferConfig(kv_connector="PullConnector", kv_role="kv_both"), {})
    orders = []
    worker._orders.put = orders.append  # type: ignore[method-assign]  # no loader thread: keep the orders
    worker.start_load_kv(decoded.scheduler_output.kv_connector_metadata)
    assert orders == metadata.loads and set(worker._send_deadlines) == {"s"}
    worker.shutdown()
