"""Host-side scheduling: block pool, prefix cache, KV cache manager, continuous-batching scheduler.

Plain Python (ARCHITECTURE.md rule 2): request ids, token counts and block ids, never JAX.
"""

from deepinfer_jax.scheduler.block_pool import NULL_BLOCK_ID, BlockPool
from deepinfer_jax.scheduler.kv_cache_manager import KVCacheManager
from deepinfer_jax.scheduler.prefix_cache import PrefixCache, hash_block_tokens
from deepinfer_jax.scheduler.scheduler import ScheduledSeq, Scheduler, SchedulerStats, StepPlan

__all__ = [
    "NULL_BLOCK_ID",
    "BlockPool",
    "KVCacheManager",
    "PrefixCache",
    "hash_block_tokens",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerStats",
    "StepPlan",
]
