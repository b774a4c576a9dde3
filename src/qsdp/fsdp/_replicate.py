"""HSDP's replicate (inter-node) gradient all-reduce through FSDP2's all-reduce hook.

[Note: compressed HSDP]
Native HSDP (``fully_shard`` on a 2-D mesh) runs its replicate all-reduce itself, with no hook
to replace it (the hook FSDP2 offers runs after it). So compressed HSDP shards each module on the
1-D intra-node mesh and hands ``compress_fsdp`` the replicate dimension: after FSDP2's
reduce-scatter inside the node, :class:`ReplicateAllReduce` (installed with
``FSDPModule.set_all_reduce_hook``, FSDP2's documented hook, on FSDP2's all-reduce stream) runs
the config's :class:`qsdp.comm.ReducePlan` all-reduce (CGX's two phases, Global-QSGD's integers)
across the nodes on the reduced shard, with the policy's split. The hook sees every
micro-batch's reduction (FSDP2 calls it after each reduce-scatter), so with gradient
accumulation the replicate all-reduce runs per micro-batch; a sum of all-reduces is the
all-reduce of the sum, so the result is the same.

NaN/Inf: a value in one shard reaches only that shard's replicas, so each hook's flag is
MAX-reduced over the shard group and then over the replicate group (every rank then holds the
same flags, even were the replicas ever to differ) and decided once per backward by the model's
:class:`NonfiniteCheck`, as for the reduce-scatter: all modules' flags in one all-reduce per
group when the backward ends ([Note: one flag agreement per backward] in
``qsdp.runtime.nonfinite``). The replicate MAX is one 4-byte-per-module exchange over the slow
link per backward, after the last module's; it is what makes every rank raise together.

Before, each hook agreed its flags itself, on FSDP2's shard communicator after the module's
slow inter-node all-reduce, where that MAX held back the next module's reduce-scatter and the
backward's weight all-gathers; and then on a communicator of its own per shard group (measured
before and after, 4x H200, 2x2: 0.302 and 0.320 s per `cgx` step in runs whose baseline moved
from 0.529 to 0.587 s, no change the runs can resolve). Agreed once when the backward ends,
nothing is left to queue behind and no extra communicator is needed.

[Note: pipelined modules]
FSDP2 runs every module's all-reduce hook on one stream, and qsdp's all-reduce runs both of its
exchanges on the replicate communicator: module ``k``'s later exchange (CGX's all-gather,
Global-QSGD's SUM) and module ``k + 1``'s first (the all-to-all, the scales' MAX) queue behind
each other although the inter-node link is full duplex (the DDP hook's case, [Note: pipelined
buckets] in ``qsdp/ddp/hook.py``). ``Schedule(pipeline=True)`` gives the later exchange
a second communicator over the replicate ranks (``second_group=`` of the plan's all-reduce) and
hands FSDP2 two CUDA streams for the hooks, alternating by module
(``set_all_reduce_hook(hook, stream=...)``, FSDP2's documented argument; it then copies each
module's result on that module's stream and waits for both when the backward ends). Every rank
issues the same collectives in the same order on each communicator; the results are the same
bits (tested on gloo, where there are no streams). Costs one more communicator per replicate
group and two streams.

[Note: the reduce-dtype buffer outlives the hook]
FSDP2 hands the hook its reduce-scatter output, allocated on the reduce-scatter stream, runs the
hook on the all-reduce (hook) stream and then, when the reduce dtype is not the parameters'
(bf16 reduce, fp32 master), casts it on that stream and drops it. The caching allocator then
hands its memory to the next allocation on the reduce-scatter stream, the next module's
reduce-scatter output, of the same size, at once, while the hook stream may still be decoding
this module's all-reduce into it or casting it: the two modules' gradients overwrite each other,
differently on each rank. FSDP2 holds the buffer for its own native all-reduce (PyTorch PR
#140044), not for a hook. The hook marks it as used by its stream (``record_stream``), so the
allocator reuses it only once that stream has passed the work queued on it. Found on 4x H200:
pipelined ``cgx`` HSDP with a bf16 reduce lost replica agreement at step 4 (a non-finite
gradient on one node only); the GPU test trains with that reduce dtype and checks the replicas.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm as qc
from ..runtime.nonfinite import nonfinite_flags
from ._hooks import _Context, _usable
from ._reduce import _Reduction

__all__ = ["ReplicateAllReduce", "ReplicateCounter"]


class ReplicateAllReduce(_Reduction):
    """FSDP2 all-reduce hook: the compressed replicate all-reduce of one module's shard."""

    def __init__(
        self,
        *,
        replicate: dist.ProcessGroup,
        shard: dist.ProcessGroup,
        second_group: dist.ProcessGroup | None = None,
        **kwargs: object,
    ) -> None:
        """Args: ``replicate``, the group it all-reduces over; ``shard``, FSDP's group inside
        the node (where NaN/Inf flags are agreed first); ``second_group``, with
        ``Schedule(pipeline=True)`` the later exchange's communicator ([Note: pipelined
        modules]); the rest as :class:`_Reduction`'s."""
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.replicate, self.shard = replicate, shard
        self.second_group = second_group

    def __call__(self, reduce_output: torch.Tensor) -> None:
        with _Context("replicate all-reduce", self.module_name):
            flat = reduce_output.view(-1)
            if flat.is_cuda:  # [Note: the reduce-dtype buffer outlives the hook]
                reduce_output.record_stream(torch.cuda.current_stream(flat.device))
            if self.stale is not None and self.stale.reduce_now:
                self.stale.check_synchronous(self.slots)
            elif self.stale is not None:  # [Note: one staleness core] in qsdp.runtime.delayed
                send = flat.clone()
                self._apply_previous(flat, (self.shard, self.replicate))
                step = self._steps.next()
                twin = self._twin(self.replicate)
                split = _usable(self.split, flat.numel(), self.stats)
                plan = self._plan_now(send.view(1, -1), split)

                def launch(result: torch.Tensor, _keep) -> None:
                    plan.all_reduce(
                        result,
                        twin,
                        op="avg",
                        split=split,
                        seed=self.seed,
                        step=step,
                        bucket=self.bucket,
                        stats=self.stats,
                    )

                # weight prediction's estimate: the node's average (FSDP2's reduce-scatter ran
                # AVG for float32 and bfloat16; other reduce dtypes divide after this hook)
                self.stale.send(
                    launch,
                    key=self,
                    slots=self.slots,
                    like=flat,
                    input=send,
                    owner=self,
                    op="avg" if flat.dtype in (torch.float32, torch.bfloat16) else "sum",
                    in_place=True,  # (send is the hook's own copy)
                    local=send,
                )
                return
            split = _usable(self.split, flat.numel(), self.stats)
            second = {} if self.second_group is None else {"second_group": self.second_group}
            self._plan_now(flat.view(1, -1), split).all_reduce(
                flat,
                self.replicate,
                op="avg",
                split=split,
                seed=self.seed,
                step=self._steps.next(),
                bucket=self.bucket,
                stats=self.stats,
                **second,
            )
            if self.check is not None:
                # identical on the replicas after the all-reduce; agreed (MAX) over the shard
                # and the replicate group, and acted on, when the backward ends
                flags = nonfinite_flags(flat, None)  # (one flag, one read of flat)
                self._defer(flags, (self.shard, self.replicate))
            if self.stale is not None:  # before staleness 1 starts: the same on the replicas
                self.stale.reduced_now(flat, self.shard)


class ReplicateCounter:
    """FSDP2 all-reduce hook of a native HSDP module: counts the replicate all-reduce FSDP2
    just ran (the hook runs after it, and only when it ran) by qsdp's convention (an
    all-reduce hands over its whole tensor, see ``qsdp.comm._stats``)."""

    def __init__(self, stats: qc.CommStats) -> None:
        self.stats = stats

    def __call__(self, reduce_output: torch.Tensor) -> None:
        self.stats.count_call("all_reduce_replicate")
        self.stats.add_bytes(
            "all_reduce_replicate", reduce_output.numel() * reduce_output.element_size()
        )
