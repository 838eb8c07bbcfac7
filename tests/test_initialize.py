"""``initialize_distributed`` in a world of one (a plain ``python pretrain_vlm.py``, the in-process tests)."""

import os


def test_a_world_of_one_rendezvous_in_memory(megatron_world):
    # A port picked free and bound later can be taken by another process in between (CI met EADDRINUSE so);
    # a world of one needs no rendezvous over TCP: its store is in memory and it sets no MASTER_PORT.
    import torch.distributed as dist

    assert dist.is_initialized() and dist.get_world_size() == 1
    assert "MASTER_PORT" not in os.environ
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    assert isinstance(store, dist.HashStore), type(store)
