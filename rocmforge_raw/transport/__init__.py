"""Transports: how a KV cache's bytes move between caches in other processes, devices or hosts.

``IpcTransport`` (processes of one host: IPC handles), ``PeerTransport`` (caches of one
process, on one device or two: peer copies) and ``MooncakeTransport`` (hosts: Mooncake's
Transfer Engine, TCP or RDMA) share one interface, ``Transport`` (see ``base``); a NIXL
transport would be one more file beside them. ``KvCache.export_sequence`` /
``import_sequence`` use them.
"""

from ..cache.transfer.transport import Transport, published
from .ipc import IpcTransport
from .mooncake import MooncakeEndpoint, MooncakeTransport
from .peer import PeerEndpoint, PeerTransport

__all__ = ["IpcTransport", "MooncakeEndpoint", "MooncakeTransport", "PeerEndpoint",
           "PeerTransport", "Transport", "published"]
