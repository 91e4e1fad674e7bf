"""Expert parallel over two gloo processes: experts partitioned over the EP group, tokens dispatched and
combined with all_to_all; the output equals the single-process layer, also after an EPLB rebalance that
moves experts between the ranks point to point."""
from __future__ import annotations

import socket

import torch
import torch.multiprocessing as multiprocessing

from pagedserve.layers.moe.fused_moe import FusedMoE

NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, NUM_REDUNDANT = 8, 2, 32, 24, 2
TOKEN_COUNTS = (13, 1, 0, 40)


def _expert_tensors() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(INTERMEDIATE, HIDDEN, generator=generator) * 0.3,
             torch.randn(INTERMEDIATE, HIDDEN, generator=generator) * 0.3,
             torch.randn(HIDDEN, INTERMEDIATE, generator=generator) * 0.3) for _ in range(NUM_EXPERTS)]


def _inputs(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + num_tokens)
    return (torch.randn(num_tokens, HIDDEN, generator=generator),
            torch.randn(num_tokens, NUM_EXPERTS, generator=generator))


def _build(**kwargs) -> FusedMoE:
    layer = FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, renormalize=True, **kwargs)
    for expert, (gate, up, down) in enumerate(_expert_tensors()):
        layer.weight_loader(layer.w13_weight, gate, "w1", expert)
        layer.weight_loader(layer.w13_weight, up, "w3", expert)
        layer.weight_loader(layer.w2_weight, down, "w2", expert)
    return layer


def _rank_main(rank: int, port: int, results) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed

    from pagedserve.distributed.parallel_state import GroupCoordinator
    from pagedserve.eplb.rebalancer import move_expert_weights

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = GroupCoordinator(name="ep", rank=rank, world_size=2, ranks=[0, 1],
                                 process_group=torch.distributed.group.WORLD)
        layer = _build(num_redundant_experts=NUM_REDUNDANT, ep_group=group, token_group=group)
        assert layer.num_local_slots == 5 and layer.w13_weight.shape[0] == 5
        outputs = [layer(*_inputs(n)) for n in TOKEN_COUNTS]
        # A rebalance: experts swap ranks, the replicas change; moves go point to point.
        new_placement = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0, 6, 7])
        move_expert_weights(layer, new_placement)
        moved = [layer(*_inputs(n)) for n in TOKEN_COUNTS]
        # numpy copies travel by value (torch tensors would go through shared memory that dies with us).
        results.put((rank, [o.numpy() for o in outputs], [m.numpy() for m in moved], layer.expert_load.numpy()))
    finally:
        torch.distributed.destroy_process_group()


def test_expert_parallel_two_ranks_equals_one_rank_before_and_after_rebalance() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_rank_main, args=(rank, port, results)) for rank in range(2)]
    for process in processes:
        process.start()
    collected = {}
    for _ in range(2):
        rank, outputs, moved, load = results.get(timeout=120)
        collected[rank] = ([torch.from_numpy(o) for o in outputs], [torch.from_numpy(m) for m in moved],
                           torch.from_numpy(load))
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    reference_layer = _build()
    expected = [reference_layer(*_inputs(n)) for n in TOKEN_COUNTS]
    for rank in range(2):
        outputs, moved, _ = collected[rank]
        for got, again, want in zip(outputs, moved, expected):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(again, want, atol=1e-5, rtol=1e-5)
    # Each rank counted the tokens of its own shard: together every routed pair, twice (two passes).
    total_load = collected[0][2] + collected[1][2]
    assert int(total_load.sum()) == 2 * TOP_K * sum(TOKEN_COUNTS)
    assert total_load.tolist() == (2 * reference_layer.expert_load).tolist()
