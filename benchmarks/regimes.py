"""The network regimes of ``docs/gpu.md`` on one host, shared by the multi-GPU benchmarks."""

from __future__ import annotations

import os

#: Set in every multi-GPU run: NVLink multicast can take the shared host's GPUs out of service.
ALWAYS = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
#: regime -> NCCL variables (2x2 also sets NCCL_HOSTID per process, see :func:`apply`).
#: Each regime runs at any world size; "2x2" means 2 nodes of world_size / 2 GPUs.
REGIMES = {
    "nvlink": {},
    "socket": {  # every GPU its own node over TCP on loopback (~25 GbE)
        "NCCL_P2P_DISABLE": "1",
        "NCCL_SHM_DISABLE": "1",
        "NCCL_IB_DISABLE": "1",
        "NCCL_NET": "Socket",
        "NCCL_SOCKET_IFNAME": "lo",
    },
    # 2 nodes of world_size / 2 GPUs each (2 x 2 on 4 GPUs; 2 x 1 on 2)
    "2x2": {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"},
}


#: Link knobs a run may set beside its regime (benchmarks/run_crossover.sh); recorded with it.
KNOBS = ("NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD")


def apply(regime: str, local_rank: int, device: str) -> dict[str, str]:
    """Enforce the regime's variables in this process, before ``init_process_group``: set them
    when absent, refuse a conflicting value. Returns what the regime asks for, with the
    :data:`KNOBS` the environment sets."""
    want = dict(ALWAYS) | REGIMES[regime]
    if regime == "2x2":
        per_node = max(1, int(os.environ.get("WORLD_SIZE", "4")) // 2)
        want["NCCL_HOSTID"] = f"node{local_rank // per_node}"
    for k, v in want.items():
        have = os.environ.get(k)
        if have is not None and have != v:
            raise SystemExit(f"regime {regime!r} needs {k}={v}, but the environment has {have!r}")
        os.environ[k] = v
    if regime != "socket" and os.environ.get("NCCL_P2P_DISABLE") == "1" and device == "cuda":
        raise SystemExit(f"NCCL_P2P_DISABLE=1 is set: that is the 'socket' regime, not {regime!r}")
    return want | {k: os.environ[k] for k in KNOBS if k in os.environ}
