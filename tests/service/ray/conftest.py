"""One real local Ray cluster (``ray.cluster_utils.Cluster``) for every Ray test: a head with
no CPUs and 1-CPU worker nodes, so every training worker sits on a node of its own, as on a
pool of one-GPU machines.

The cluster is package-scoped: the training-backend tests and the service's pool tests share
it (starting one costs seconds of CPU on two cores) and it stops after the last of them. A
test that removes a node adds its replacement (:func:`add_node`), so each test finds two free
worker nodes.

Each worker node has a ``ZOOPICK_DATA_DIR`` of its own (:func:`add_node`), as the machines of
a pool do: no folder is shared between them, nor with the service's processes."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.service.procs import free_port


def add_node(cluster: Any) -> Path:
    """A 1-CPU worker node with a private ``ZOOPICK_DATA_DIR`` (its scratch and object cache,
    removed with the cluster); returns that folder (``cluster.data_dirs`` lists them all)."""
    folder = Path(tempfile.mkdtemp(prefix="zoopick-ray-node-"))
    cluster.data_dirs.append(folder)
    cluster.add_node(num_cpus=1, env_vars={"ZOOPICK_DATA_DIR": str(folder)})
    return folder


def tenant_id(cfg: Any, name: str) -> str:
    """The id of the tenant called ``name`` in ``cfg``'s database: the tests' keys in the store
    sit under ``tenants/<id>/`` and the API hands out no tenant ids."""
    from sqlalchemy import create_engine, text

    engine = create_engine(cfg.database_url)
    try:
        with engine.connect() as conn:
            query = text("select id from tenants where name = :name")
            return str(conn.execute(query, {"name": name}).scalar())
    finally:
        engine.dispose()


@contextmanager
def local_cluster(nodes: int = 2) -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    # a lost node is seen dead within seconds, not Ray's default half a minute; a dashboard
    # port of its own (another cluster on this machine may hold the default one)
    fast = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
    head = {"num_cpus": 0, "dashboard_port": free_port(), "_system_config": fast}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    cluster.data_dirs = []
    try:
        for _ in range(nodes):
            add_node(cluster)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()
        for folder in cluster.data_dirs:
            shutil.rmtree(folder, ignore_errors=True)


POLL_SECONDS = "0.5"
"""How often a run's Ray Train controller polls its workers (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``,
2 s by default; Ray hands it from the driver's environment to the controller): the end of
a run, a lost worker and a restart are seen sooner, about 4 s less a run on two cores."""


@pytest.fixture(scope="package")
def cluster() -> Iterator[Any]:
    pytest.importorskip("ray", reason="the ray extra is not installed")
    # the drivers the tests start (zoopick train, a gpu worker's) inherit this process'
    # environment (a worker's through Settings.env)
    with pytest.MonkeyPatch.context() as patch, local_cluster() as c:
        patch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", POLL_SECONDS)
        yield c
