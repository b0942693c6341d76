"""The rendezvous of a generator that spans nodes, bound to the address its nodes meet at.

vLLM's workers of a server over several nodes (`scalerl serve --nnodes N`) form their torch.distributed world group
at `tcp://MASTER_ADDR:MASTER_PORT`: the first worker of node 0 hosts a TCPStore there, which torch binds on every
interface of the node whatever the address (`torch.distributed.rendezvous._create_c10d_store`; the store has no
authentication). `bind_to_master_address`, called in every worker as our worker extension is imported, makes that
store listen on the master address alone (a socket bound to it and handed to TCPStore, `master_listen_fd`, as torch
allows): the cluster's interface, not every network the node is on. It changes nothing else: a client that reaches
that address can still connect (docs/design.md, "Trust model").
"""

from __future__ import annotations

import importlib
import socket
from datetime import timedelta

from torch.distributed import TCPStore

# the module (torch.distributed's `rendezvous` attribute is its function of that name)
torch_rendezvous = importlib.import_module("torch.distributed.rendezvous")


def bound_c10d_store(hostname: str, port: int, rank: int, world_size: int, timeout: timedelta,
                     use_libuv: bool = True) -> TCPStore:
    """torch's `_create_c10d_store` of a tcp:// rendezvous, its rank 0 listening on `hostname`'s address alone."""
    if rank != 0 or torch_rendezvous._torchelastic_use_agent_store():
        return _TORCH_STORE(hostname, port, rank, world_size, timeout, use_libuv)
    family, _, _, _, address = socket.getaddrinfo(hostname, port, type=socket.SOCK_STREAM)[0]
    listener = socket.create_server(address, family=family)
    return TCPStore(host_name=hostname, port=port, world_size=world_size, is_master=True, timeout=timeout,
                    multi_tenant=True, use_libuv=use_libuv, master_listen_fd=listener.detach())


_TORCH_STORE = torch_rendezvous._create_c10d_store


def bind_to_master_address() -> None:
    """Route torch's tcp:// rendezvous through `bound_c10d_store` in this process (idempotent)."""
    torch_rendezvous._create_c10d_store = bound_c10d_store
