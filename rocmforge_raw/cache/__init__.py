"""Paged KV cache: config, one block pool, sequences, sharing, preemption, lifecycle."""

from ..errors import CacheFullError, QueueFullError
from .blocks.block_pool import NULL_BLOCK, BlockPool
from .config import CacheConfig
from .events import AllCleared, BlockRemoved, BlockStored, EventBatch
from .kv_cache import KvCache
from .reservation import Reservation
from .scheduler.requests import Chunk, FinishedRequest, Request, StepPlan
from .scheduler.scheduler import Scheduler
from .step.graph import StepGraph
from .step.metadata import BatchMetadata

__all__ = ["NULL_BLOCK", "AllCleared", "BatchMetadata", "BlockPool", "BlockRemoved",
           "BlockStored", "CacheConfig", "CacheFullError", "Chunk", "EventBatch",
           "FinishedRequest", "KvCache", "QueueFullError", "Request", "Reservation", "Scheduler",
           "StepGraph", "StepPlan"]
