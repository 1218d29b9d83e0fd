"""Paged KV cache: config, one block pool, sequences, sharing, preemption, lifecycle."""

from ..errors import CacheFullError, QueueFullError
from .block_pool import NULL_BLOCK, BlockPool
from .config import CacheConfig
from .events import AllCleared, BlockRemoved, BlockStored, EventBatch
from .graph import StepGraph
from .kv_cache import KvCache, Reservation
from .scheduler import FinishedRequest, Request, Scheduler, StepPlan
from .step import BatchMetadata

__all__ = ["NULL_BLOCK", "AllCleared", "BatchMetadata", "BlockPool", "BlockRemoved",
           "BlockStored", "CacheConfig", "CacheFullError", "EventBatch", "FinishedRequest",
           "KvCache", "QueueFullError", "Request", "Reservation", "Scheduler", "StepGraph",
           "StepPlan"]
