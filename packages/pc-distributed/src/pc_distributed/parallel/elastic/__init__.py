"""Elastic data parallelism: training that goes on when members die or join, with no restart.

Public: :class:`ElasticDataParallel`, :class:`StepContext`, :class:`QuorumEntry` (``trainer.py``) and
:class:`ElasticSampler` (``sampler.py``). The underscored modules are the store connections (``_connect``),
membership and heartbeats (``_membership``), the per-attempt quorum and commit decision (``_quorum``), the
state hand-over to joining members (``_state``) and the quorum groups' engines, gloo or NCCL (``_engine``).
"""

from pc_distributed.parallel.elastic.sampler import ElasticSampler
from pc_distributed.parallel.elastic.trainer import ElasticDataParallel, QuorumEntry, StepContext

__all__ = ["ElasticDataParallel", "ElasticSampler", "QuorumEntry", "StepContext"]
