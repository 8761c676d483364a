"""zoopick's Python client: the REST API over HTTP (httpx), for pipelines and scripts.

It imports nothing of the service: it speaks HTTP only, so it works against any zoopick
server, local or remote (an import-linter contract keeps it so).
"""

from .errors import (
    BadRequest,
    Conflict,
    JobFailed,
    NotFound,
    ServerError,
    Unauthorized,
    Unreachable,
    WaitTimeout,
    ZoopickError,
)
from .http import Client
from .models import Dataset, Epoch, Job, RankedModel, Training, ZooModel

__all__ = [
    "BadRequest",
    "Client",
    "Conflict",
    "Dataset",
    "Epoch",
    "Job",
    "JobFailed",
    "NotFound",
    "RankedModel",
    "ServerError",
    "Training",
    "Unauthorized",
    "Unreachable",
    "WaitTimeout",
    "ZooModel",
    "ZoopickError",
]
