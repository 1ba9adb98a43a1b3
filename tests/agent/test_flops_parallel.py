"""FLOPs per rank under FSDP2 and tensor parallelism, two CPU ranks over gloo (torch.distributed on 127.0.0.1)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mfuwatch.agent.distributed import end_process_group
from tests.helpers.net import free_port

transformers = pytest.importorskip("transformers")

B, T = 2, 8


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="eager"))


def _components(arch):
    from mfuwatch.agent.flops.architectures import Lengths

    model, _, comps = arch.step_flops(Lengths(T), B)
    return model, {c.name: c.model_flops for c in comps}


def _worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for mode in ("fsdp2", "tp", "fsdp2_tp"):  # one pair of processes for both: imports dominate the time
            _check(rank, mode)
        out[rank] = 1
    finally:
        end_process_group()


def _check(rank, mode):
    """One parallelism scheme on this rank: the FLOP model's components against the unsharded model."""
    from torch.distributed.device_mesh import init_device_mesh

    from mfuwatch.agent.flops import architectures as A

    ref_total, ref = _components(A.from_model(_llama()))
    m = _llama()
    if mode == "fsdp2":
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        assert type(m.model.layers[0].mlp.up_proj.weight).__name__ == "DTensor"
        total, comps = _components(A.from_model(m))
        assert total == ref_total  # global sizes: sharding for memory changes no one's FLOPs
        x = torch.randint(0, 64, (B, T))
        m(input_ids=x, labels=x).loss.backward()  # the sharded model really trains here
    elif mode == "fsdp2_tp":
        # FSDP2 over a (dp=1, tp=2) mesh around TP'd MLPs: every parameter is a DTensor, but only the MLP's are
        # sharded on "tp"; the head and the attention projections live on the dp submesh and run whole on each rank
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        for layer in m.model.layers:
            parallelize_module(layer.mlp, mesh["tp"], {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                                                       "down_proj": RowwiseParallel()})
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(m, mesh=mesh["dp"])
        assert type(m.lm_head.weight).__name__ == "DTensor"
        total, comps = _components(A.from_model(m))
        assert comps["mlp"] == ref["mlp"] / 2
        assert comps["attention projections"] == ref["attention projections"]
        assert comps["head"] == ref["head"]  # before the fix: divided by 2 like every DTensor
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        for layer in m.model.layers:
            parallelize_module(layer.mlp, mesh, {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                                                 "down_proj": RowwiseParallel()})
        arch = A.from_model(m)
        total, comps = _components(arch)
        assert A.tp_size_from_params(m) == 2
        assert comps["mlp"] == ref["mlp"] / 2  # a rank computes half of each TP-sharded matmul
        assert comps["attention projections"] == ref["attention projections"]  # not sharded: counted whole
        assert comps["attention scores"] == ref["attention scores"] / 2  # heads split over the TP ranks
        assert comps["head"] == ref["head"]


def test_flops_per_rank_under_fsdp2_and_tensor_parallelism():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch build has no gloo backend")
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(free_port(), out), nprocs=2, join=True)
    assert dict(out) == {0: 1, 1: 1}
