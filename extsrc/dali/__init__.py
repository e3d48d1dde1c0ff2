"""The DALI layer: ``fn`` and ``pipeline_def`` as in ``nvidia.dali``, served by extsrc.

``from extsrc import fn, pipeline_def`` (or ``from extsrc.dali import ...``)
replaces ``from nvidia.dali import fn, pipeline_def``: the pipeline and every
operator are DALI's; ``fn.external_source(..., parallel=True)`` runs its
source on extsrc worker processes. Importing this package imports DALI.
"""

from extsrc.dali import fn
from extsrc.dali.external_source import external_source
from extsrc.dali.pipeline import Pipeline, pipeline_def

__all__ = ["Pipeline", "external_source", "fn", "pipeline_def"]
