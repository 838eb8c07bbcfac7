"""The interleaved (virtual) pipeline's runtime pieces: one data stream for several model chunks, the tied
embedding's copies on one rank, the activation peak in the interleaved order.

A rank of an interleaved pipeline holds V model chunks (layout stages ``rank``, ``rank + PP``, ...:
``PipelineLayout.rank_stages``).  megatron-core's interleaved 1F1B schedule calls ``forward_step`` with
``data_iterator[chunk]`` and runs every chunk over micro-batches 0..M-1 in order, the chunks interleaved; the
rank's one loader (reading what all its chunks' units need) is fanned out so that every chunk sees every
micro-batch once, each loaded once.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection

from omnibal_ext.model.simulate import schedule_order

from megatron.vlm.parallel.tied import allreduce_tied_grad


class ChunkData:
    """Views of one micro-batch stream for ``n`` model chunks: chunk ``c`` reads micro-batch ``i`` when it asks
    for its ``i``-th; each is taken from ``data`` once and kept until every chunk has read it."""

    def __init__(self, data, n: int):
        self.data, self.n = data, n
        self.buffer: list = []  # micro-batches from index self.first on
        self.first = 0
        self.read = [0] * n

    def next_for(self, chunk: int):
        i = self.read[chunk]
        while i - self.first >= len(self.buffer):
            self.buffer.append(next(self.data))
        batch = self.buffer[i - self.first]
        self.read[chunk] = i + 1
        while self.buffer and min(self.read) > self.first:  # read by every chunk: dropped
            self.buffer.pop(0)
            self.first += 1
        return batch


class _ChunkIterator:
    def __init__(self, shared: ChunkData, chunk: int):
        self.shared, self.chunk = shared, chunk

    def __iter__(self):
        return self

    def __next__(self):
        return self.shared.next_for(self.chunk)


def chunk_data(data, n: int):
    """``data`` itself for one chunk, else a list of ``n`` iterators over it (one per chunk), for one call of
    the schedule (each chunk reads the same number of micro-batches in it)."""
    if n == 1:
        return data
    shared = ChunkData(data, n)
    return [_ChunkIterator(shared, c) for c in range(n)]


def sum_tied_grads(stages) -> None:
    """Keep the tied embedding's copies equal: sum the gradients of this rank's copies (the chunks holding E and
    L may both be here) and over the tied group of the ranks holding them (``VLMStage.tied_group``)."""
    weights, seen = [], set()
    for stage in stages:
        w = stage.tied_embedding_weight()
        if w is not None and id(w) not in seen:
            seen.add(id(w))
            weights.append(w)
    if not weights:
        return
    group = next((s.tied_group for s in stages if s.tied_group is not None), None)
    if len(weights) == 1:
        if group is not None:
            allreduce_tied_grad(weights[0], group)
        return
    grads = [w.main_grad if getattr(w, "main_grad", None) is not None else w.grad for w in weights]
    total = torch.stack(grads).sum(0)
    if group is not None:
        torch.distributed.all_reduce(total, group=group)
    for g in grads:
        g.copy_(total)


def interleaved_peak(bytes_in_forward_order: list[int], rank: int, pp: int, vpp: int) -> int:
    """Peak of live saved bytes on pipeline rank ``rank`` under the interleaved 1F1B schedule: the forwards'
    measured bytes (in the order the rank ran them) replayed in that schedule's order of forwards and
    backwards (a chunk's micro-batch lives from its forward to its backward)."""
    m = len(bytes_in_forward_order) // vpp
    order = schedule_order(pp, rank, m, vpp)
    fwd = iter(bytes_in_forward_order)
    live, peak, held = 0, 0, {}
    for kind, mb, chunk in order:
        if kind == "fwd":
            held[(mb, chunk)] = next(fwd)
            live += held[(mb, chunk)]
            peak = max(peak, live)
        else:
            live -= held.pop((mb, chunk))
    return peak


def _shape_ordered_communicator():
    class ShapeOrderedP2P(P2PCommunicator):
        """megatron-core's P2PCommunicator with the shape exchange of variable-shape p2p posted in a fixed order,
        and its sends completed after the tensors', not before.

        Our stage outputs change shape along the pipeline (``variable_seq_lengths``), so every p2p transfer is
        preceded by an exchange of shapes.  Two faults of megatron-core's exchange show under the interleaved
        schedule on gloo, both at PP = 2, where both neighbours are the same rank:

        * order: it posts send-prev, recv-prev, send-next, recv-next on every rank; in the steady state a rank
          sends and receives in both directions at once, and messages between two ranks pair in posting
          order: the activation's shape arrives as the gradient's ("Received data size doesn't match expected
          size").  Here each rank sends (next, then prev) and receives (prev, then next), so the k-th message
          one rank sends the other is the k-th it receives; the tensors themselves go through megatron-core's
          unbatched ``_p2p_ops``, which already orders by even/odd rank.
        * a wait: it waits for its shape sends before posting the tensors' receives.  A gloo send completes
          when the peer receives it, so that wait adds a dependency the one-phase exchange does not have.  With
          as many micro-batches as pipeline ranks (V = 2) rank 0 runs every forward in its warm-up: it sends
          its last activation (blocking until rank 1 posts the receive) and only then asks for a gradient,
          while rank 1's next call sends a gradient shape and receives that activation's: rank 1 waited for
          its gradient shape to be received before posting the activation's receive, and both ranks hung.
          Here a call waits only for the shapes it receives; its shape sends are waited for after its tensors
          (a tensor send completes once the peer posted its receive, after the peer received the shape).
        """

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._shape_sends: list = []  # (request, shape tensor kept alive until sent) of this call

        def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
            received = {"prev": None, "next": None}
            for tensor, peer in ((tensor_send_next, self.next_rank), (tensor_send_prev, self.prev_rank)):
                if tensor is not None:
                    shape = torch.tensor(tensor.size(), device=device, dtype=torch.int64)
                    self._shape_sends.append((dist.isend(shape, peer, group=self.pp_group), shape))
            recvs = []
            for side, wanted, peer in (("prev", recv_prev, self.prev_rank), ("next", recv_next, self.next_rank)):
                if wanted:
                    received[side] = torch.empty((3,), device=device, dtype=torch.int64)
                    recvs.append(dist.irecv(received[side], peer, group=self.pp_group))
            for req in recvs:
                req.wait()
            return tuple([0, 0, 0] if received[s] is None else received[s].tolist() for s in ("prev", "next"))

        def _communicate(self, **kwargs):
            result = super()._communicate(**kwargs)
            if kwargs.get("wait_on_reqs", True):  # else (overlapped p2p, not configured) a later call waits
                for req, _ in self._shape_sends:
                    req.wait()
                self._shape_sends.clear()
            return result

    return ShapeOrderedP2P


def schedule_groups(config) -> dict:
    """The ``p2p_communicator`` and ``pg_collection`` arguments of megatron-core's interleaved schedule: its
    default process groups and a communicator whose shape exchange works when one rank is both neighbours."""
    pgs = ProcessGroupCollection()
    pgs.tp = parallel_state.get_tensor_model_parallel_group()
    pgs.cp = parallel_state.get_context_parallel_group()
    pgs.embd = parallel_state.get_embedding_group(check_initialized=False)
    pgs.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
    pgs.pp = parallel_state.get_pipeline_model_parallel_group()
    pgs.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=False)
    return {"p2p_communicator": _shape_ordered_communicator()(pp_group=pgs.pp, config=config), "pg_collection": pgs}
